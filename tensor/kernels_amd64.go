//go:build amd64

package tensor

import "golang.org/x/sys/cpu"

// Assembly kernels, in kernels_amd64.s. Each takes pointers and an element
// count; the Go wrappers below check the slice lengths, pass the part the
// assembly handles (n a multiple of 8, or the blocking the kernel needs) and
// finish the tail with the plain Go code.

//go:noescape
func dotF32AVX2(x, w *float32, n int) float32

//go:noescape
func dotF16AVX2(x *float32, w *uint16, n int) float32

//go:noescape
func dotBF16AVX2(x *float32, w *uint16, n int) float32

//go:noescape
func dot4F32AVX2(x, w0, w1, w2, w3 *float32, n int) (s0, s1, s2, s3 float32)

//go:noescape
func dot4F16AVX2(x *float32, w0, w1, w2, w3 *uint16, n int) (s0, s1, s2, s3 float32)

//go:noescape
func dot4BF16AVX2(x *float32, w0, w1, w2, w3 *uint16, n int) (s0, s1, s2, s3 float32)

// gemv* compute out[j] = Σ_i x[i]·w[j*ldw+i] for i < k, j < rows; rows is
// a multiple of 4 and k of 16 (AVX2) or 32 (AVX-512), both positive.

//go:noescape
func gemvF32AVX2(out, x *float32, w *float32, k, ldw, rows int)

//go:noescape
func gemvF16AVX2(out, x *float32, w *uint16, k, ldw, rows int)

//go:noescape
func gemvBF16AVX2(out, x *float32, w *uint16, k, ldw, rows int)

//go:noescape
func gemvF32AVX512(out, x *float32, w *float32, k, ldw, rows int)

//go:noescape
func gemvF16AVX512(out, x *float32, w *uint16, k, ldw, rows int)

//go:noescape
func gemvBF16AVX512(out, x *float32, w *uint16, k, ldw, rows int)

//go:noescape
func cvtF16AVX2(dst *float32, src *uint16, n int)

//go:noescape
func cvtBF16AVX2(dst *float32, src *uint16, n int)

//go:noescape
func cvtF16AVX512(dst *float32, src *uint16, n int)

//go:noescape
func cvtBF16AVX512(dst *float32, src *uint16, n int)

// wsumAVX2 computes o[i] = Σ_j p[j]·v[j*ldv+i] for i < d (a multiple of 8),
// j < n.
//
//go:noescape
func wsumAVX2(o, v *float32, ldv int, p *float32, n, d int)

//go:noescape
func expSumAVX2(s *float32, n int, mx float32) float32

//go:noescape
func siluMulAVX2(o, gate, up *float32, n int)

// gemm6x16AVX2 and gemm12x32AVX512 are the prefill micro-kernels:
// c[i*nr+j] += Σ_k a[i*lda+k]·b[k*nr+j] for i < mr, j < nr, k < kc >= 1.

//go:noescape
func gemm6x16AVX2(a *float32, lda int, b, c *float32, kc int)

//go:noescape
func gemm12x32AVX512(a *float32, lda int, b, c *float32, kc int)

// avx2Kernels need AVX2, FMA and F16C (Intel Haswell, AMD Zen and later).
var avx2Kernels = kernels{
	name:     "avx2",
	dotF32:   avx2DotF32,
	dotF16:   avx2DotF16,
	dotBF16:  avx2DotBF16,
	dot4F32:  avx2Dot4F32,
	dot4F16:  avx2Dot4F16,
	dot4BF16: avx2Dot4BF16,
	cvtF16:   avx2CvtF16,
	cvtBF16:  avx2CvtBF16,
	gemvF32:  avx2GemvF32,
	gemvF16:  avx2GemvF16,
	gemvBF16: avx2GemvBF16,
	scores:   avx2Scores,
	wsum:     avx2Wsum,
	expSum:   avx2ExpSum,
	siluMul:  avx2SiluMul,
	gemm:     func(a []float32, lda int, b, c []float32, kc int) { gemmCall(gemm6x16AVX2, 6, 16, a, lda, b, c, kc) },
	mr:       6,
	nr:       16,
	kc:       256,
}

// avx512Kernels need AVX-512F as well; they replace the kernels that
// stream weights or keys (gemv, scores), convert or multiply blocks (cvt,
// gemm), and keep the AVX2 ones elsewhere.
var avx512Kernels = func() kernels {
	k := avx2Kernels
	k.name = "avx512"
	k.cvtF16, k.cvtBF16 = avx512CvtF16, avx512CvtBF16
	k.gemvF32, k.gemvF16, k.gemvBF16 = avx512GemvF32, avx512GemvF16, avx512GemvBF16
	k.scores = avx512Scores
	k.gemm = func(a []float32, lda int, b, c []float32, kc int) {
		gemmCall(gemm12x32AVX512, 12, 32, a, lda, b, c, kc)
	}
	k.mr, k.nr, k.kc = 12, 32, 128
	return k
}()

// hasAVX2 and hasAVX512 report what this processor and OS support (x/sys/cpu
// checks that the OS saves the YMM and ZMM state).
var (
	hasAVX2   = cpu.X86.HasAVX2 && cpu.X86.HasFMA && cpu.X86.HasF16C
	hasAVX512 = hasAVX2 && cpu.X86.HasAVX512F
)

// archKernels returns the kernel tables this machine can run, fastest first.
func archKernels() []*kernels {
	var ks []*kernels
	if hasAVX512 {
		ks = append(ks, &avx512Kernels)
	}
	if hasAVX2 {
		ks = append(ks, &avx2Kernels)
	}
	return ks
}

func avx2DotF32(x, w []float32) float32 {
	n := len(x)
	w = w[:n]
	m := n &^ 7
	var s float32
	if m > 0 {
		s = dotF32AVX2(&x[0], &w[0], m)
	}
	for i := m; i < n; i++ {
		s += x[i] * w[i]
	}
	return s
}

func avx2DotF16(x []float32, w []uint16) float32 {
	n := len(x)
	w = w[:n]
	m := n &^ 7
	var s float32
	if m > 0 {
		s = dotF16AVX2(&x[0], &w[0], m)
	}
	for i := m; i < n; i++ {
		s += x[i] * f16ToF32Table[w[i]]
	}
	return s
}

func avx2DotBF16(x []float32, w []uint16) float32 {
	n := len(x)
	w = w[:n]
	m := n &^ 7
	var s float32
	if m > 0 {
		s = dotBF16AVX2(&x[0], &w[0], m)
	}
	for i := m; i < n; i++ {
		s += x[i] * bf16ToF32(w[i])
	}
	return s
}

func avx2Dot4F32(x, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32) {
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	m := n &^ 7
	if m > 0 {
		s0, s1, s2, s3 = dot4F32AVX2(&x[0], &w0[0], &w1[0], &w2[0], &w3[0], m)
	}
	for i := m; i < n; i++ {
		xv := x[i]
		s0 += xv * w0[i]
		s1 += xv * w1[i]
		s2 += xv * w2[i]
		s3 += xv * w3[i]
	}
	return
}

func avx2Dot4F16(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32) {
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	m := n &^ 7
	if m > 0 {
		s0, s1, s2, s3 = dot4F16AVX2(&x[0], &w0[0], &w1[0], &w2[0], &w3[0], m)
	}
	t := f16ToF32Table
	for i := m; i < n; i++ {
		xv := x[i]
		s0 += xv * t[w0[i]]
		s1 += xv * t[w1[i]]
		s2 += xv * t[w2[i]]
		s3 += xv * t[w3[i]]
	}
	return
}

func avx2Dot4BF16(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32) {
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	m := n &^ 7
	if m > 0 {
		s0, s1, s2, s3 = dot4BF16AVX2(&x[0], &w0[0], &w1[0], &w2[0], &w3[0], m)
	}
	for i := m; i < n; i++ {
		xv := x[i]
		s0 += xv * bf16ToF32(w0[i])
		s1 += xv * bf16ToF32(w1[i])
		s2 += xv * bf16ToF32(w2[i])
		s3 += xv * bf16ToF32(w3[i])
	}
	return
}

// cvtWith runs an 8-aligned conversion kernel and converts the tail with
// the Go code.
func cvtWith(asm func(dst *float32, src *uint16, n int), tail func(dst []float32, src []uint16), dst []float32, src []uint16) {
	n := len(src)
	dst = dst[:n]
	m := n &^ 7
	if m > 0 {
		asm(&dst[0], &src[0], m)
	}
	tail(dst[m:], src[m:])
}

// cvtF32ToF16AVX2 converts n floats (a multiple of 8) to IEEE half
// precision with F16C, rounding to nearest even.
//
//go:noescape
func cvtF32ToF16AVX2(dst *uint16, src *float32, n int)

func avx2CvtF16(dst []float32, src []uint16)    { cvtWith(cvtF16AVX2, F16ToF32, dst, src) }
func avx2CvtBF16(dst []float32, src []uint16)   { cvtWith(cvtBF16AVX2, BF16ToF32, dst, src) }
func avx512CvtF16(dst []float32, src []uint16)  { cvtWith(cvtF16AVX512, F16ToF32, dst, src) }
func avx512CvtBF16(dst []float32, src []uint16) { cvtWith(cvtBF16AVX512, BF16ToF32, dst, src) }

// gemvRows checks the operands of a gemv kernel over rows of k = len(x)
// elements ldw apart and returns how many rows (a multiple of 4) the
// assembly computes; 0 when k is not a multiple of the kernel's step, so
// that the caller falls back to the dot kernels.
func gemvRows(out, x []float32, wlen, ldw, step int) int {
	k, rows := len(x), len(out)
	if k == 0 || k%step != 0 || rows == 0 || ldw < k || wlen < (rows-1)*ldw+k {
		return 0
	}
	return rows &^ 3
}

func avx2GemvF32(out, x, w []float32) {
	k := len(x)
	r := gemvRows(out, x, len(w), k, 16)
	if r > 0 {
		gemvF32AVX2(&out[0], &x[0], &w[0], k, k, r)
	}
	gemvWith32(out[r:], x, w[r*k:], avx2Dot4F32, avx2DotF32)
}

func avx2GemvF16(out, x []float32, w []uint16) {
	k := len(x)
	r := gemvRows(out, x, len(w), k, 16)
	if r > 0 {
		gemvF16AVX2(&out[0], &x[0], &w[0], k, k, r)
	}
	gemvWith16(out[r:], x, w[r*k:], avx2Dot4F16, avx2DotF16)
}

func avx2GemvBF16(out, x []float32, w []uint16) {
	k := len(x)
	r := gemvRows(out, x, len(w), k, 16)
	if r > 0 {
		gemvBF16AVX2(&out[0], &x[0], &w[0], k, k, r)
	}
	gemvWith16(out[r:], x, w[r*k:], avx2Dot4BF16, avx2DotBF16)
}

func avx512GemvF32(out, x, w []float32) {
	k := len(x)
	r := gemvRows(out, x, len(w), k, 32)
	if r > 0 {
		gemvF32AVX512(&out[0], &x[0], &w[0], k, k, r)
	}
	avx2GemvF32(out[r:], x, w[r*k:])
}

func avx512GemvF16(out, x []float32, w []uint16) {
	k := len(x)
	r := gemvRows(out, x, len(w), k, 32)
	if r > 0 {
		gemvF16AVX512(&out[0], &x[0], &w[0], k, k, r)
	}
	avx2GemvF16(out[r:], x, w[r*k:])
}

func avx512GemvBF16(out, x []float32, w []uint16) {
	k := len(x)
	r := gemvRows(out, x, len(w), k, 32)
	if r > 0 {
		gemvBF16AVX512(&out[0], &x[0], &w[0], k, k, r)
	}
	avx2GemvBF16(out[r:], x, w[r*k:])
}

func avx2Scores(out, q, k []float32, ldk int) {
	r := gemvRows(out, q, len(k), ldk, 16)
	if r > 0 {
		gemvF32AVX2(&out[0], &q[0], &k[0], len(q), ldk, r)
		if r == len(out) {
			return
		}
	}
	scoresWith(out[r:], q, k[r*ldk:], ldk, avx2Dot4F32, avx2DotF32)
}

func avx512Scores(out, q, k []float32, ldk int) {
	r := gemvRows(out, q, len(k), ldk, 32)
	if r > 0 {
		gemvF32AVX512(&out[0], &q[0], &k[0], len(q), ldk, r)
		if r == len(out) {
			return
		}
	}
	avx2Scores(out[r:], q, k[r*ldk:], ldk)
}

func avx2Wsum(o, v []float32, ldv int, p []float32) {
	d, n := len(o), len(p)
	if n == 0 || d == 0 {
		clear(o)
		return
	}
	_ = v[(n-1)*ldv+d-1]
	m := d &^ 7
	if m > 0 {
		wsumAVX2(&o[0], &v[0], ldv, &p[0], n, m)
	}
	if m < d {
		wsumGo(o[m:], v[m:], ldv, p)
	}
}

func avx2ExpSum(s []float32, mx float32) float32 {
	m := len(s) &^ 7
	var sum float32
	if m > 0 {
		sum = expSumAVX2(&s[0], m, mx)
	}
	return sum + expSumGo(s[m:], mx)
}

func avx2SiluMul(o, g, u []float32) {
	n := len(o)
	g, u = g[:n], u[:n]
	m := n &^ 7
	if m > 0 {
		siluMulAVX2(&o[0], &g[0], &u[0], m)
	}
	siluMulGo(o[m:], g[m:], u[m:])
}

// gemmCall checks the operand lengths of a micro-kernel call.
func gemmCall(f func(a *float32, lda int, b, c *float32, kc int), mr, nr int, a []float32, lda int, b, c []float32, kc int) {
	if kc <= 0 {
		return
	}
	_ = a[(mr-1)*lda+kc-1]
	_ = b[kc*nr-1]
	_ = c[mr*nr-1]
	f(&a[0], lda, &b[0], &c[0], kc)
}
