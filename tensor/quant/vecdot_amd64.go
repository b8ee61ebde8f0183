//go:build amd64 && !purego

package quant

import (
	"fmt"

	"golang.org/x/sys/cpu"
)

// Assembly kernels of the integer products, in vecdot_amd64.s. Each
// computes rows products of nb blocks: weight rows one after the other
// from w, activation blocks at x.

//go:noescape
func gemvQ8_0AVX2(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ4_0AVX2(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ4_KAVX2(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ5_KAVX2(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ6_KAVX2(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ4_0VNNI(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ8_0AVX512(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ4_KVNNI(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ5_KVNNI(out *float32, w, x *byte, rows, nb int)

//go:noescape
func gemvQ6_KVNNI(out *float32, w, x *byte, rows, nb int)

// asmGemv wraps an assembly kernel for weights of type t; it checks the
// lengths the callers have checked, so that a mistake inside the package
// panics instead of reading past a slice.
func asmGemv(t Type, f func(out *float32, w, x *byte, rows, nb int)) gemvFunc {
	a, _ := actOf(t)
	xbb := a.blockBytes()
	wbb := t.BlockBytes() // a weight block matches an activation block
	return func(out []float32, w, xq []byte) {
		nb := len(xq) / xbb
		if len(out) == 0 || nb == 0 || len(xq) != nb*xbb || len(w) != len(out)*nb*wbb {
			panic(fmt.Sprintf("quant: %v gemv: %d rows, %d weight bytes, %d activation bytes", t, len(out), len(w), len(xq)))
		}
		f(&out[0], &w[0], &xq[0], len(out), nb)
	}
}

// avx2Kernels need AVX2 and F16C (Intel Haswell, AMD Zen and later).
var avx2Kernels = func() vecKernels {
	k := goKernels
	k.name = "avx2"
	k.gemv[Q8_0] = asmGemv(Q8_0, gemvQ8_0AVX2)
	k.gemv[Q4_0] = asmGemv(Q4_0, gemvQ4_0AVX2)
	k.gemv[Q4_K] = asmGemv(Q4_K, gemvQ4_KAVX2)
	k.gemv[Q5_K] = asmGemv(Q5_K, gemvQ5_KAVX2)
	k.gemv[Q6_K] = asmGemv(Q6_K, gemvQ6_KAVX2)
	return k
}()

// avx512Kernels need AVX512_VNNI, AVX512BW and AVX512VL as well: the AVX2
// kernels with VNNI's multiply-adds on 256-bit registers, and Q8_0's on
// 512-bit registers (see vecdot_amd64.s).
var avx512Kernels = func() vecKernels {
	k := avx2Kernels
	k.name = "avx512"
	k.gemv[Q8_0] = asmGemv(Q8_0, gemvQ8_0AVX512)
	k.gemv[Q4_0] = asmGemv(Q4_0, gemvQ4_0VNNI)
	k.gemv[Q4_K] = asmGemv(Q4_K, gemvQ4_KVNNI)
	k.gemv[Q5_K] = asmGemv(Q5_K, gemvQ5_KVNNI)
	k.gemv[Q6_K] = asmGemv(Q6_K, gemvQ6_KVNNI)
	return k
}()

// hasAVX2 reports whether this processor and OS run the AVX2 kernels
// (x/sys/cpu checks that the OS saves the YMM state).
var (
	hasAVX2   = cpu.X86.HasAVX2 && cpu.X86.HasF16C
	hasAVX512 = hasAVX2 && cpu.X86.HasAVX512F && cpu.X86.HasAVX512BW && cpu.X86.HasAVX512VL && cpu.X86.HasAVX512VNNI
)

// archKernels returns the assembly kernel tables this machine runs,
// fastest first.
func archKernels() []*vecKernels {
	var ks []*vecKernels
	if hasAVX512 {
		ks = append(ks, &avx512Kernels)
	}
	if hasAVX2 {
		ks = append(ks, &avx2Kernels)
	}
	return ks
}
