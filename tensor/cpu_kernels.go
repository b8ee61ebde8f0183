package tensor

import (
	"math"
	"os"
	"strings"
)

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
	// each element of x once for the four: the building block of the Go
	// gemv and scores kernels and of the assembly ones' leftover rows, and
	// (F32) of the Go prefill.
	dot4F32  func(x, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32)
	dot4F16  func(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32)
	dot4BF16 func(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32)

	// gemv* compute out[j] = x·w[j*k:(j+1)*k] for every j < len(out), with
	// k = len(x): the decode product, one pass over the weights.
	gemvF32  func(out, x, w []float32)
	gemvF16  func(out, x []float32, w []uint16)
	gemvBF16 func(out, x []float32, w []uint16)

	// cvtF16 and cvtBF16 convert len(src) words into dst (a block of
	// weight rows, for the prefill).
	cvtF16  func(dst []float32, src []uint16)
	cvtBF16 func(dst []float32, src []uint16)

	// scores computes out[j] = q·k[j*ldk:j*ldk+len(q)] for j < len(out):
	// the attention scores of one query head against the cached keys.
	scores func(out, q, k []float32, ldk int)

	// wsum computes o[i] = Σ_j p[j]·v[j*ldv+i] for i < len(o), j < len(p):
	// the attention's weighted sum of the cached values.
	wsum func(o, v []float32, ldv int, p []float32)

	// expSum replaces s[i] by exp(s[i]-mx) and returns the sum: the
	// softmax numerators. mx >= every s[i]; relative error below 1e-6,
	// results below e^-87 may be flushed to zero.
	expSum func(s []float32, mx float32) float32

	// siluMul computes o[i] = silu(g[i])·u[i] = g[i]/(1+e^-g[i])·u[i] for
	// i < len(o); o may be g or u.
	siluMul func(o, g, u []float32)

	// gemm, when set, is the register-blocked prefill micro-kernel:
	// c[i*nr+j] += Σ_k a[i*lda+k]·b[k*nr+j] for i < mr, j < nr, k < kc,
	// with a a group of mr weight rows converted to F32 (lda apart) and b a
	// panel of nr rows of x packed k-major; c, the mr×nr tile, stays in
	// registers. The table's kc is the chunk of the inner dimension per
	// call, so that a chunk of a panel stays in the L1 cache. Without gemm,
	// prefill uses dot4F32.
	gemm       func(a []float32, lda int, b, c []float32, kc int)
	mr, nr, kc int
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
	gemvF32:  func(out, x, w []float32) { gemvWith32(out, x, w, dot4F32Go, dotF32Go) },
	gemvF16:  func(out, x []float32, w []uint16) { gemvWith16(out, x, w, dot4F16Go, dotF16Go) },
	gemvBF16: func(out, x []float32, w []uint16) { gemvWith16(out, x, w, dot4BF16Go, dotBF16Go) },
	cvtF16:   F16ToF32,
	cvtBF16:  BF16ToF32,
	scores:   func(out, q, k []float32, ldk int) { scoresWith(out, q, k, ldk, dot4F32Go, dotF32Go) },
	wsum:     wsumGo,
	expSum:   expSumGo,
	siluMul:  siluMulGo,
}

// KernelsEnv is the environment variable that overrides the choice of CPU
// kernels: "go" for the portable Go kernels, "avx2" or "avx512" for the
// assembly ones (where the processor has them; otherwise the best it has
// below the one named). Unset or empty means the fastest this machine runs.
const KernelsEnv = "STRATA_CPU_KERNELS"

// selectKernels returns the kernel table for a new backend: the fastest this
// machine runs, unless KernelsEnv names another.
func selectKernels() *kernels { return kernelsNamed(os.Getenv(KernelsEnv)) }

// kernelsNamed returns the kernel table called name, or the best one below
// it that this machine runs; "" means the fastest.
func kernelsNamed(name string) *kernels {
	name = strings.ToLower(strings.TrimSpace(name))
	avail := append(archKernels(), &genericKernels)
	if name == "" {
		return avail[0]
	}
	rank := map[string]int{"go": 0, "avx2": 1, "avx512": 2}
	want, ok := rank[name]
	if !ok {
		return avail[0]
	}
	for _, k := range avail {
		if rank[k.name] <= want {
			return k
		}
	}
	return &genericKernels
}

// Kernels names the inner loops this backend runs: "avx512", "avx2" (x86-64
// assembly) or "go" (portable). See KernelsEnv.
func (c *CPU) Kernels() string { return c.k.name }

// gemvWith32 is a gemv built from a dot4 and a dot kernel.
func gemvWith32(out, x, w []float32, dot4 func(x, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32), dot func(x, w []float32) float32) {
	k := len(x)
	j := 0
	for ; j+4 <= len(out); j += 4 {
		out[j], out[j+1], out[j+2], out[j+3] = dot4(x,
			w[j*k:(j+1)*k], w[(j+1)*k:(j+2)*k], w[(j+2)*k:(j+3)*k], w[(j+3)*k:(j+4)*k])
	}
	for ; j < len(out); j++ {
		out[j] = dot(x, w[j*k:(j+1)*k])
	}
}

// gemvWith16 is gemvWith32 for F16 or BF16 weights.
func gemvWith16(out, x []float32, w []uint16, dot4 func(x []float32, w0, w1, w2, w3 []uint16) (s0, s1, s2, s3 float32), dot func(x []float32, w []uint16) float32) {
	k := len(x)
	j := 0
	for ; j+4 <= len(out); j += 4 {
		out[j], out[j+1], out[j+2], out[j+3] = dot4(x,
			w[j*k:(j+1)*k], w[(j+1)*k:(j+2)*k], w[(j+2)*k:(j+3)*k], w[(j+3)*k:(j+4)*k])
	}
	for ; j < len(out); j++ {
		out[j] = dot(x, w[j*k:(j+1)*k])
	}
}

// scoresWith is a scores kernel built from a dot4 and a dot kernel.
func scoresWith(out, q, k []float32, ldk int, dot4 func(x, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32), dot func(x, w []float32) float32) {
	d := len(q)
	j := 0
	for ; j+4 <= len(out); j += 4 {
		out[j], out[j+1], out[j+2], out[j+3] = dot4(q,
			k[j*ldk:j*ldk+d], k[(j+1)*ldk:(j+1)*ldk+d], k[(j+2)*ldk:(j+2)*ldk+d], k[(j+3)*ldk:(j+3)*ldk+d])
	}
	for ; j < len(out); j++ {
		out[j] = dot(q, k[j*ldk:j*ldk+d])
	}
}

// wsumGo is the portable wsum: four positions per pass over o.
func wsumGo(o, v []float32, ldv int, p []float32) {
	clear(o)
	d, n := len(o), len(p)
	j := 0
	for ; j+4 <= n; j += 4 {
		p0, p1, p2, p3 := p[j], p[j+1], p[j+2], p[j+3]
		v0, v1 := v[j*ldv:j*ldv+d], v[(j+1)*ldv:(j+1)*ldv+d]
		v2, v3 := v[(j+2)*ldv:(j+2)*ldv+d], v[(j+3)*ldv:(j+3)*ldv+d]
		for i := range o {
			o[i] += p0*v0[i] + p1*v1[i] + p2*v2[i] + p3*v3[i]
		}
	}
	for ; j < n; j++ {
		pj, vj := p[j], v[j*ldv:j*ldv+d]
		for i := range o {
			o[i] += pj * vj[i]
		}
	}
}

func expSumGo(s []float32, mx float32) float32 {
	var sum float32
	for i, v := range s {
		e := expF32(v - mx)
		s[i] = e
		sum += e
	}
	return sum
}

func siluMulGo(o, g, u []float32) {
	n := len(o)
	g, u = g[:n], u[:n]
	for i, v := range g {
		o[i] = v / (1 + expF32(-v)) * u[i]
	}
}

// Constants of expF32 (and of the assembly in kernels_amd64.s).
const (
	expLog2e = 1.4426950408889634 // log2(e)
	expLn2Hi = 0.693359375        // ln 2, high part: n·expLn2Hi is exact for |n| < 2^15
	expLn2Lo = -2.1219444005469057e-4
)

// expF32 returns e^x in float32 with a relative error below 1e-6: x = n·ln 2
// + r with |r| <= ln2/2, e^r from its degree-6 Taylor polynomial (truncation
// error below 1.3e-7), and 2^n put into the exponent. Arguments whose result
// is not a normal float32 (x < -87 or x > 88, NaN) go to math.Exp.
func expF32(x float32) float32 {
	if !(x >= -87 && x <= 88) {
		return float32(math.Exp(float64(x)))
	}
	n := float32(math.Floor(float64(x*expLog2e) + 0.5))
	r := x - n*expLn2Hi
	r -= n * expLn2Lo
	p := float32(1.0 / 720)
	p = p*r + 1.0/120
	p = p*r + 1.0/24
	p = p*r + 1.0/6
	p = p*r + 0.5
	p = p*r + 1
	p = p*r + 1
	return math.Float32frombits(math.Float32bits(p) + uint32(int32(n))<<23)
}

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
