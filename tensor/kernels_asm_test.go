package tensor

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// allKernels are the kernel tables this machine runs: the assembly ones
// (none off x86-64 or on old processors) and the portable Go one.
func allKernels() []*kernels { return append(archKernels(), &genericKernels) }

// specialF16 are half-precision words that stress conversions: signed
// zeros, the smallest and largest subnormals, the smallest normal, the
// largest finite value, infinities and NaNs (quiet and signalling).
var specialF16 = []uint16{0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe00}

// specialBF16 are the same for bfloat16, with large finite values in place
// of the largest (whose sums overflow float32, as they may).
var specialBF16 = []uint16{0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080, 0x7a00, 0xfa00, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffc0}

// kernelInputs are the operands of one round of kernel checks: x and four
// weight rows in every type, starting off elements into their backing
// arrays so that the assembly sees unaligned data.
type kernelInputs struct {
	x          []float32
	w32        [4][]float32
	w16, wb16  [4][]uint16
	f16, fbf16 [4][]float32 // the F16 and BF16 rows as float32
}

func newKernelInputs(r *rand.Rand, n, off int, special bool) *kernelInputs {
	in := &kernelInputs{x: randF32(r, n+off)[off:]}
	for q := range 4 {
		v := randF32(r, n+off)
		in.w32[q] = v[off:]
		h, b := make([]uint16, n+off), make([]uint16, n+off)
		F32ToF16(h, v)
		F32ToBF16(b, v)
		if special {
			for i := off; i < n+off; i++ {
				switch r.IntN(4) {
				case 0:
					h[i] = specialF16[r.IntN(len(specialF16))]
				case 1:
					b[i] = specialBF16[r.IntN(len(specialBF16))]
				}
			}
		}
		in.w16[q], in.wb16[q] = h[off:], b[off:]
		in.f16[q], in.fbf16[q] = make([]float32, n), make([]float32, n)
		F16ToF32(in.f16[q], in.w16[q])
		BF16ToF32(in.fbf16[q], in.wb16[q])
	}
	return in
}

func randF32(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = r.Float32()*2 - 1
	}
	return v
}

// expectDot checks got against the float64 dot product of x and w; where
// w holds infinities or NaN, only the class of the result is checked (NaN,
// or the infinity the reference gives).
func expectDot(t *testing.T, what string, got float32, x, w []float32) {
	t.Helper()
	want, scale := refDot(x, w)
	g := float64(got)
	switch {
	case math.IsNaN(want):
		if !math.IsNaN(g) {
			t.Fatalf("%s: got %v, want NaN", what, got)
		}
	case math.IsInf(want, 0) || math.IsInf(scale, 0):
		if !math.IsInf(want, 0) {
			// Infinite terms that cancel: any non-finite result is right.
			if !math.IsNaN(g) && !math.IsInf(g, 0) {
				t.Fatalf("%s: got %v, want a non-finite value", what, got)
			}
		} else if g != want && !math.IsNaN(g) {
			t.Fatalf("%s: got %v, want %v", what, got, want)
		}
	default:
		n := float64(len(x))
		tol := 4*math.Sqrt(n+1)*0x1p-24*scale + 1e-30
		if d := math.Abs(g - want); !(d <= tol) {
			t.Fatalf("%s: got %v, want %v (error %.3g > %.3g)", what, got, want, d, tol)
		}
	}
}

// sameBits reports whether a and b are the same float32, any NaN matching
// any NaN (the assembly quiets signalling NaNs, the table keeps them).
func sameBits(a, b float32) bool {
	if a != a || b != b {
		return a != a && b != b
	}
	return math.Float32bits(a) == math.Float32bits(b)
}

// checkKernels runs every kernel of k on one set of inputs.
func checkKernels(t *testing.T, k *kernels, r *rand.Rand, n, off int, special bool) {
	t.Helper()
	in := newKernelInputs(r, n, off, special)
	name := func(op string) string {
		return fmt.Sprintf("%s %s n=%d off=%d special=%v", k.name, op, n, off, special)
	}
	x := in.x
	expectDot(t, name("dotF32"), k.dotF32(x, in.w32[0]), x, in.w32[0])
	expectDot(t, name("dotF16"), k.dotF16(x, in.w16[0]), x, in.f16[0])
	expectDot(t, name("dotBF16"), k.dotBF16(x, in.wb16[0]), x, in.fbf16[0])

	var s [4]float32
	s[0], s[1], s[2], s[3] = k.dot4F32(x, in.w32[0], in.w32[1], in.w32[2], in.w32[3])
	for q := range 4 {
		expectDot(t, name(fmt.Sprintf("dot4F32[%d]", q)), s[q], x, in.w32[q])
	}
	s[0], s[1], s[2], s[3] = k.dot4F16(x, in.w16[0], in.w16[1], in.w16[2], in.w16[3])
	for q := range 4 {
		expectDot(t, name(fmt.Sprintf("dot4F16[%d]", q)), s[q], x, in.f16[q])
	}
	s[0], s[1], s[2], s[3] = k.dot4BF16(x, in.wb16[0], in.wb16[1], in.wb16[2], in.wb16[3])
	for q := range 4 {
		expectDot(t, name(fmt.Sprintf("dot4BF16[%d]", q)), s[q], x, in.fbf16[q])
	}

	// Conversions: exact, and nothing written past len(src).
	for _, c := range []struct {
		op   string
		cvt  func([]float32, []uint16)
		src  []uint16
		want []float32
	}{{"cvtF16", k.cvtF16, in.w16[1], in.f16[1]}, {"cvtBF16", k.cvtBF16, in.wb16[1], in.fbf16[1]}} {
		dst := make([]float32, off+n+9)
		guard := float32(12345)
		for i := range dst {
			dst[i] = guard
		}
		c.cvt(dst[off:off+n], c.src)
		for i := range n {
			if !sameBits(dst[off+i], c.want[i]) {
				t.Fatalf("%s: element %d of %#04x = %v, want %v", name(c.op), i, c.src[i], dst[off+i], c.want[i])
			}
		}
		for i := off + n; i < len(dst); i++ {
			if dst[i] != guard {
				t.Fatalf("%s: wrote element %d past the end", name(c.op), i-off)
			}
		}
	}

}

// TestKernelTables checks every kernel of every table this machine runs
// against float64 references: every length from 0 to 300 (all tails of
// the 8-, 16- and 32-element steps), data starting at unaligned offsets,
// and F16/BF16 weights with subnormals, infinities and NaNs.
func TestKernelTables(t *testing.T) {
	for _, k := range allKernels() {
		t.Run(k.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(9, uint64(len(k.name))))
			for n := 0; n <= 300; n++ {
				checkKernels(t, k, r, n, n%5, false)
				checkKernels(t, k, r, n, (n+2)%7, true)
			}
			for _, n := range []int{1000, 2048, 4099} {
				checkKernels(t, k, r, n, 1, false)
			}
		})
	}
}

// FuzzKernels checks every kernel table on fuzzed lengths, offsets and
// inputs (go test -fuzz FuzzKernels).
func FuzzKernels(f *testing.F) {
	f.Add(uint16(17), uint8(3), int64(1), false)
	f.Add(uint16(64), uint8(0), int64(2), true)
	f.Add(uint16(300), uint8(7), int64(3), true)
	f.Fuzz(func(t *testing.T, n uint16, off uint8, seed int64, special bool) {
		r := rand.New(rand.NewPCG(uint64(seed), 1))
		for _, k := range allKernels() {
			checkKernels(t, k, r, int(n)%5000, int(off)%16, special)
		}
	})
}

// TestGemvKernels checks the decode kernels on whole matrices: rows not a
// multiple of 4, inner dimensions on and off the assembly's step, and
// weights that start at an unaligned address.
func TestGemvKernels(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	for _, k := range allKernels() {
		for _, rows := range []int{0, 1, 3, 4, 5, 8, 13, 64} {
			for _, kd := range []int{1, 7, 16, 24, 32, 48, 64, 96, 100, 160, 256, 512, 2048} {
				x := randF32(r, kd)
				w32 := randF32(r, rows*kd+1)[1:]
				w16, wb16 := make([]uint16, rows*kd+3)[3:], make([]uint16, rows*kd+1)[1:]
				F32ToF16(w16, w32)
				F32ToBF16(wb16, w32)
				f16, fb16 := make([]float32, len(w32)), make([]float32, len(w32))
				F16ToF32(f16, w16)
				BF16ToF32(fb16, wb16)
				for _, c := range []struct {
					dt   string
					run  func(out []float32)
					want []float32
				}{
					{"F32", func(out []float32) { k.gemvF32(out, x, w32) }, w32},
					{"F16", func(out []float32) { k.gemvF16(out, x, w16) }, f16},
					{"BF16", func(out []float32) { k.gemvBF16(out, x, wb16) }, fb16},
				} {
					out := make([]float32, rows+1)
					out[rows] = 777
					c.run(out[:rows])
					for j := range rows {
						expectDot(t, fmt.Sprintf("%s gemv%s rows=%d k=%d row %d", k.name, c.dt, rows, kd, j), out[j], x, c.want[j*kd:(j+1)*kd])
					}
					if out[rows] != 777 {
						t.Fatalf("%s gemv%s rows=%d k=%d wrote past the output", k.name, c.dt, rows, kd)
					}
				}
			}
		}
	}
}

// TestAttentionKernels checks scores and wsum against float64 over cached
// rows ld apart: head sizes on and off the assembly's steps, any number of
// positions.
func TestAttentionKernels(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	for _, k := range allKernels() {
		for _, d := range []int{1, 5, 8, 16, 24, 32, 40, 64, 72, 128} {
			for _, n := range []int{0, 1, 2, 3, 4, 5, 7, 8, 33, 100} {
				ld := d + 3*(n%3) + 8*(d%2) // strided, sometimes not a multiple of 8
				// The cache ends with the last position's head, as in
				// Attention, so that a read past it fails.
				cache := randF32(r, max(n-1, 0)*ld+d)
				q := randF32(r, d)
				p := randF32(r, n)
				what := fmt.Sprintf("%s d=%d n=%d ld=%d", k.name, d, n, ld)

				out := make([]float32, n+1)
				out[n] = 777
				k.scores(out[:n], q, cache, ld)
				for j := range n {
					expectDot(t, what+fmt.Sprintf(" scores[%d]", j), out[j], q, cache[j*ld:j*ld+d])
				}
				if out[n] != 777 {
					t.Fatalf("%s: scores wrote past the output", what)
				}

				o := randF32(r, d+1) // wsum overwrites o
				o[d] = 777
				k.wsum(o[:d], cache, ld, p)
				col := make([]float32, n)
				for i := range d {
					for j := range n {
						col[j] = cache[j*ld+i]
					}
					expectDot(t, what+fmt.Sprintf(" wsum[%d]", i), o[i], p, col)
				}
				if o[d] != 777 {
					t.Fatalf("%s: wsum wrote past the output", what)
				}
			}
		}
	}
}

// TestGemmKernels checks the prefill micro-kernels against float64: every
// chunk length up to 40 and a long one, a row stride wider than the chunk.
func TestGemmKernels(t *testing.T) {
	r := rand.New(rand.NewPCG(6, 6))
	for _, k := range allKernels() {
		if k.gemm == nil {
			continue
		}
		mr, nr := k.mr, k.nr
		for _, kc := range append([]int{1, 2, 3, 5, 8, 17, 40}, k.kc) {
			lda := kc + 3
			a := randF32(r, mr*lda)
			b := randF32(r, kc*nr)
			c := randF32(r, mr*nr+1)
			c[mr*nr] = 555
			want := make([]float64, mr*nr)
			for i := range mr {
				for j := range nr {
					s := float64(c[i*nr+j])
					for q := range kc {
						s += float64(a[i*lda+q]) * float64(b[q*nr+j])
					}
					want[i*nr+j] = s
				}
			}
			k.gemm(a, lda, b, c[:mr*nr], kc)
			for i, w := range want {
				if d := math.Abs(float64(c[i]) - w); d > 1e-5*float64(kc+1) {
					t.Fatalf("%s gemm kc=%d: c[%d] = %v, want %v", k.name, kc, i, c[i], w)
				}
			}
			if c[mr*nr] != 555 {
				t.Fatalf("%s gemm kc=%d wrote past c", k.name, kc)
			}
		}
	}
}

// TestExpF32 checks the polynomial exponential against math.Exp over the
// whole range where the result is a normal float32, and its edges.
func TestExpF32(t *testing.T) {
	worst := 0.0
	check := func(x float32) {
		got := float64(expF32(x))
		want := math.Exp(float64(x))
		if math.IsInf(want, 1) || want > math.MaxFloat32 {
			if !math.IsInf(got, 1) {
				t.Fatalf("expF32(%v) = %v, want +Inf", x, got)
			}
			return
		}
		e := math.Abs(got-want) / want
		if want < 0x1p-126 { // subnormal result: absolute error
			e = math.Abs(got-want) / 0x1p-126
		}
		worst = max(worst, e)
		if !(e <= 1e-6) {
			t.Fatalf("expF32(%v) = %v, want %v (relative error %.3g)", x, got, want, e)
		}
	}
	for x := float32(-90); x <= 89; x += 1.0 / 1024 {
		check(x)
	}
	r := rand.New(rand.NewPCG(8, 8))
	for range 200000 {
		check(float32(r.Float64()*(88+87) - 87))
		check(float32(r.NormFloat64()))
	}
	for _, x := range []float32{0, -0.0, 1, -1, -87, 88, float32(math.Inf(-1)), float32(math.Inf(1))} {
		check(x)
	}
	if v := expF32(float32(math.NaN())); v == v {
		t.Fatalf("expF32(NaN) = %v", v)
	}
	t.Logf("worst relative error %.3g", worst)
}

// TestExpSum checks every table's softmax numerators against math.Exp.
func TestExpSum(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 4))
	for _, k := range allKernels() {
		for n := 0; n <= 70; n++ {
			s := make([]float32, n)
			for i := range s {
				s[i] = float32(r.NormFloat64() * 20)
			}
			if n > 3 {
				s[1], s[2] = -200, -87.5 // results below the smallest normal float32
			}
			mx := float32(math.Inf(-1))
			for _, v := range s {
				mx = max(mx, v)
			}
			want := make([]float64, n)
			var wsum float64
			for i, v := range s {
				want[i] = math.Exp(float64(v - mx))
				wsum += want[i]
			}
			sum := k.expSum(s, mx)
			for i, v := range s {
				tol := 1e-6*want[i] + 1.7e-38 // results below e^-87 may flush to 0
				if d := math.Abs(float64(v) - want[i]); !(d <= tol) {
					t.Fatalf("%s expSum n=%d: element %d = %v, want %v", k.name, n, i, v, want[i])
				}
			}
			if d := math.Abs(float64(sum) - wsum); !(d <= 1e-6*wsum+1e-30) {
				t.Fatalf("%s expSum n=%d: sum %v, want %v", k.name, n, sum, wsum)
			}
		}
		s := []float32{0, 1, float32(math.NaN()), 2, 0, 0, 0, 0, 0}
		k.expSum(s, 2)
		if s[2] == s[2] {
			t.Fatalf("%s expSum: exp(NaN) = %v", k.name, s[2])
		}
	}
}

// TestSiluMul checks every table's SiLU product against float64, out of
// place and in place, over gates from -120 to 120 and NaN.
func TestSiluMul(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 2))
	for _, k := range allKernels() {
		for n := 0; n <= 70; n++ {
			g, u := make([]float32, n), randF32(r, n)
			for i := range g {
				g[i] = float32(r.NormFloat64() * 10)
			}
			if n > 4 {
				g[0], g[1], g[2], g[3] = -120, 120, -87.5, 88.5
			}
			want := make([]float64, n)
			for i, v := range g {
				x := float64(v)
				want[i] = x / (1 + math.Exp(-x)) * float64(u[i])
			}
			check := func(what string, o []float32) {
				for i, v := range o {
					if d := math.Abs(float64(v) - want[i]); !(d <= 2e-6*math.Abs(want[i])+1e-30) {
						t.Fatalf("%s siluMul %s n=%d: element %d (gate %v) = %v, want %v", k.name, what, n, i, g[i], v, want[i])
					}
				}
			}
			o := make([]float32, n)
			k.siluMul(o, g, u)
			check("out of place", o)
			gc := append([]float32(nil), g...)
			k.siluMul(gc, gc, u)
			check("in place", gc)
		}
		g := []float32{1, 2, float32(math.NaN()), 3, 4, 5, 6, 7, 8}
		o := make([]float32, len(g))
		k.siluMul(o, g, g)
		if o[2] == o[2] {
			t.Fatalf("%s siluMul: NaN gate gives %v", k.name, o[2])
		}
	}
}

// TestKernelsNamed checks the choice of kernels by name.
func TestKernelsNamed(t *testing.T) {
	best := allKernels()[0]
	for _, c := range []struct{ name, want string }{
		{"", best.name}, {"go", "go"}, {"GO", "go"}, {"nonsense", best.name},
	} {
		if got := kernelsNamed(c.name).name; got != c.want {
			t.Errorf("kernelsNamed(%q) = %q, want %q", c.name, got, c.want)
		}
	}
	if hasAVX2 {
		if got := kernelsNamed("avx2").name; got != "avx2" {
			t.Errorf("kernelsNamed(avx2) = %q on a machine with AVX2", got)
		}
		want := "avx2"
		if hasAVX512 {
			want = "avx512"
		}
		if got := kernelsNamed("avx512").name; got != want {
			t.Errorf("kernelsNamed(avx512) = %q, want %q", got, want)
		}
	}
}
