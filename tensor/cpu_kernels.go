package tensor

import "math"

// kernels holds the inner loops of the CPU backend. The operations call
// them through this table, chosen once per backend by selectKernels, so that
// an assembly implementation (AVX2, AVX-512) can replace any entry without
// touching the blocking and threading code around it. Every entry has the
// plain Go version in genericKernels as its reference.
//
// Weight rows are passed in their stored form: []float32 for F32 and raw
// []uint16 words for F16 and BF16. All kernels read len(x) elements of each
// row and accumulate in float32.
type kernels struct {
	name string

	dotF32  func(x, w []float32) float32
	dotF16  func(x []float32, w []uint16) float32
	dotBF16 func(x []float32, w []uint16) float32

	// dot4* return the dot products of x with four weight rows, loading
	// each element of x once for the four: the decode kernels, and (F32)
	// the prefill kernel on converted chunks of weight rows.
	dot4F32  func(x, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32)
	dot4F16  func(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32)
	dot4BF16 func(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32)

	// cvtF16 and cvtBF16 convert len(src) words into dst (a short chunk of
	// a weight row, in a stack buffer).
	cvtF16  func(dst []float32, src []uint16)
	cvtBF16 func(dst []float32, src []uint16)
}

// genericKernels are the pure-Go kernels, correct on every platform.
var genericKernels = kernels{
	name:     "go",
	dotF32:   dotF32Go,
	dotF16:   dotF16Go,
	dotBF16:  dotBF16Go,
	dot4F32:  dot4F32Go,
	dot4F16:  dot4F16Go,
	dot4BF16: dot4BF16Go,
	cvtF16:   F16ToF32,
	cvtBF16:  BF16ToF32,
}

// selectKernels returns the fastest kernel table for this machine.
func selectKernels() *kernels { return &genericKernels }

func bf16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

func dotF32Go(x, w []float32) float32 {
	n := len(x)
	w = w[:n]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+8 <= n; i += 8 {
		xx := x[i : i+8 : i+8]
		ww := w[i : i+8 : i+8]
		s0 += xx[0]*ww[0] + xx[4]*ww[4]
		s1 += xx[1]*ww[1] + xx[5]*ww[5]
		s2 += xx[2]*ww[2] + xx[6]*ww[6]
		s3 += xx[3]*ww[3] + xx[7]*ww[7]
	}
	for ; i < n; i++ {
		s0 += x[i] * w[i]
	}
	return (s0 + s1) + (s2 + s3)
}

func dotF16Go(x []float32, w []uint16) float32 {
	t := f16ToF32Table
	n := len(x)
	w = w[:n]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+8 <= n; i += 8 {
		xx := x[i : i+8 : i+8]
		ww := w[i : i+8 : i+8]
		s0 += xx[0]*t[ww[0]] + xx[4]*t[ww[4]]
		s1 += xx[1]*t[ww[1]] + xx[5]*t[ww[5]]
		s2 += xx[2]*t[ww[2]] + xx[6]*t[ww[6]]
		s3 += xx[3]*t[ww[3]] + xx[7]*t[ww[7]]
	}
	for ; i < n; i++ {
		s0 += x[i] * t[w[i]]
	}
	return (s0 + s1) + (s2 + s3)
}

func dotBF16Go(x []float32, w []uint16) float32 {
	n := len(x)
	w = w[:n]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+8 <= n; i += 8 {
		xx := x[i : i+8 : i+8]
		ww := w[i : i+8 : i+8]
		s0 += xx[0]*bf16ToF32(ww[0]) + xx[4]*bf16ToF32(ww[4])
		s1 += xx[1]*bf16ToF32(ww[1]) + xx[5]*bf16ToF32(ww[5])
		s2 += xx[2]*bf16ToF32(ww[2]) + xx[6]*bf16ToF32(ww[6])
		s3 += xx[3]*bf16ToF32(ww[3]) + xx[7]*bf16ToF32(ww[7])
	}
	for ; i < n; i++ {
		s0 += x[i] * bf16ToF32(w[i])
	}
	return (s0 + s1) + (s2 + s3)
}

func dot4F32Go(x, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32) {
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	for i, xv := range x {
		s0 += xv * w0[i]
		s1 += xv * w1[i]
		s2 += xv * w2[i]
		s3 += xv * w3[i]
	}
	return
}

func dot4F16Go(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32) {
	t := f16ToF32Table
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	for i, xv := range x {
		s0 += xv * t[w0[i]]
		s1 += xv * t[w1[i]]
		s2 += xv * t[w2[i]]
		s3 += xv * t[w3[i]]
	}
	return
}

func dot4BF16Go(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32) {
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	for i, xv := range x {
		s0 += xv * bf16ToF32(w0[i])
		s1 += xv * bf16ToF32(w1[i])
		s2 += xv * bf16ToF32(w2[i])
		s3 += xv * bf16ToF32(w3[i])
	}
	return
}
