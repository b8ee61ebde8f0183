//go:build !amd64

package tensor

// archKernels returns the kernel tables this machine can run, fastest
// first: none beyond the portable Go kernels off x86-64.
func archKernels() []*kernels { return nil }

// hasAVX2 and hasAVX512 are false off x86-64.
const hasAVX2, hasAVX512 = false, false

func cvtF32ToF16AVX2(dst *uint16, src *float32, n int) { panic("tensor: no F16C off x86-64") }
