//go:build amd64 && !purego

package quant

// archKernels returns the assembly kernel tables this machine runs,
// fastest first.
func archKernels() []*vecKernels { return nil }
