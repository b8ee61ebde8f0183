package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// x16 is the Go reference of the integer GEMV's activations
// (kernels/quantx.cuh, quantx16): per 32 elements of each row the scale
// d = max|x|/32767 and the levels rint(x * (32767/max|x|)), rounded in
// float32 as the kernel rounds them, and the sums of each 16 levels.
type x16 struct {
	q []int16
	d []float32
	s []int32
}

// quantX16 rounds x (rows back to back, a multiple of 32 elements) to X16.
func quantX16(x []float32) x16 { return quantXLevels(x, 32767) }

// quantX8 rounds x to X8, the activations of the direct dp4a kernels
// (kernels/quantd.cuh, quantx8): X16 with 127 for 32767, the levels int8
// (kept in int16 here).
func quantX8(x []float32) x16 { return quantXLevels(x, 127) }

// quantXLevels rounds x to levels of at most lmax in magnitude per 32
// elements, as quantx_warp does.
func quantXLevels(x []float32, lmax float32) x16 {
	nb := len(x) / 32
	r := x16{q: make([]int16, len(x)), d: make([]float32, nb), s: make([]int32, 2*nb)}
	for i := range nb {
		v := x[32*i : 32*i+32]
		var amax float32
		finite := true
		for _, f := range v {
			a := float32(math.Abs(float64(f)))
			if !(a <= math.MaxFloat32) {
				finite = false
			}
			if a > amax {
				amax = a
			}
		}
		var inv float32
		if amax > 0 && finite {
			inv = lmax / amax
		}
		for j, f := range v {
			var q int32 // 0 in a block of zeros or with a NaN or an infinity
			if inv != 0 {
				q = int32(math.RoundToEven(float64(f * inv)))
			}
			r.q[32*i+j] = int16(q)
			r.s[2*i+j/16] += q
		}
		r.d[i] = amax / lmax
		if !finite {
			r.d[i] = float32(math.NaN())
		}
	}
	return r
}

// values returns the activations X16 stands for, d*q, in float64.
func (a x16) values() []float64 {
	v := make([]float64, len(a.q))
	for i, q := range a.q {
		v[i] = float64(a.d[i/32]) * float64(q)
	}
	return v
}

// x8Values is x rounded to 8-bit levels per 32 elements (d = max|x|/127),
// as ggml's integer dot products round activations (Q8_0, Q8_1): what
// 8-bit activations with dp4a would cost in accuracy.
func x8Values(x []float32) []float64 {
	v := make([]float64, len(x))
	for i := 0; i < len(x); i += 32 {
		var amax float64
		for _, f := range x[i : i+32] {
			amax = max(amax, math.Abs(float64(f)))
		}
		d := amax / 127
		for j, f := range x[i : i+32] {
			if d > 0 {
				v[i+j] = d * math.RoundToEven(float64(f)/d)
			}
		}
	}
	return v
}

// f16Values is x rounded to F16, the activations of an F16 (HFMA2) product.
func f16Values(x []float32) []float64 {
	h := make([]uint16, len(x))
	tensor.F32ToF16(h, x)
	f := make([]float32, len(x))
	tensor.F16ToF32(f, h)
	v := make([]float64, len(x))
	for i, g := range f {
		v[i] = float64(g)
	}
	return v
}

// productRef returns out[m*n+i] = sum_k w[i*k+kk] * x[m*k+kk] in float64.
func productRef(w []float64, x []float64, m, n, k int) []float64 {
	out := make([]float64, m*n)
	for mi := range m {
		for i := range n {
			var s float64
			for kk := range k {
				s += w[i*k+kk] * x[mi*k+kk]
			}
			out[mi*n+i] = s
		}
	}
	return out
}

// hostDequant returns n values of the quantized dt in b as
// quant.Dequantize reads them.
func hostDequant(t testing.TB, dt tensor.DType, b []byte, n int) []float64 {
	t.Helper()
	qt, _ := dt.Quant()
	f := make([]float32, n)
	if err := qt.Dequantize(f, b); err != nil {
		t.Fatal(err)
	}
	v := make([]float64, n)
	for i, x := range f {
		v[i] = float64(x)
	}
	return v
}

func to32(v []float64) []float32 {
	f := make([]float32, len(v))
	for i, x := range v {
		f[i] = float32(x)
	}
	return f
}

// TestActivationRounding measures what rounding the activations costs a
// quantized product, on the 7B MLP's row lengths (K = 4096, 11008) with
// weights quantized from Gaussian values and Gaussian x (plain, and with
// an outlier feature a block as real activations have): the relative
// error against the product over the same dequantized weights and exact
// x, for x rounded to 16 bits a 32 (X16, the integer GEMV's choice),
// 8 bits a 32 (dp4a, ggml's choice) and F16 (HFMA2). It asserts the
// ordering the choice rests on: X16 within 1e-4 and at least 20 times
// closer than 8 bits.
func TestActivationRounding(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, dt := range []tensor.DType{tensor.Q8_0, tensor.Q4_K, tensor.Q6_K} {
		for _, k := range []int{4096, 11008} {
			for _, outlier := range []bool{false, true} {
				const n, m = 16, 2
				w := hostDequant(t, dt, hostWeights(t, r, dt, n, k, false), n*k)
				x := make([]float32, m*k)
				for i := range x {
					x[i] = float32(r.NormFloat64())
					if outlier && i%32 == 7 {
						x[i] *= 20
					}
				}
				exact := make([]float64, len(x))
				for i, f := range x {
					exact[i] = float64(f)
				}
				want := productRef(w, exact, m, n, k)
				e16 := tensortest.RelErr(to32(productRef(w, quantX16(x).values(), m, n, k)), want)
				e8 := tensortest.RelErr(to32(productRef(w, x8Values(x), m, n, k)), want)
				eh := tensortest.RelErr(to32(productRef(w, f16Values(x), m, n, k)), want)
				t.Logf("%v K=%d outlier=%v: relative error of the product with x in 16 bits %.2g, 8 bits %.2g, F16 %.2g", dt, k, outlier, e16, e8, eh)
				if !(e16 <= 1e-4) || !(20*e16 <= e8) {
					t.Errorf("%v K=%d outlier=%v: 16-bit x error %.3g (want <= 1e-4 and 20x below the 8-bit %.3g)", dt, k, outlier, e16, e8)
				}
			}
		}
	}
}

// TestX16Layout checks the integer GEMV's launch arithmetic: the kernel
// for 1..8 rows of x, and the X16 arrays of up to 8 rows of real and odd
// row lengths placed 256-byte aligned, without overlap, each as large as
// its rows need.
func TestX16Layout(t *testing.T) {
	for m, want := range []int{0, 1, 2, 4, 4, 8, 8, 8, 8} {
		if m == 0 {
			continue
		}
		if got := gemvxRows(m); got != want {
			t.Errorf("gemvxRows(%d) = %d, want %d", m, got, want)
		}
		for _, f := range quantFormats {
			if r := f.xRows(gemvxRows(m)); r*gemvxRows(m) > 8 || r < 1 || r > 4 {
				t.Errorf("%v: xRows(%d) = %d: want 1 to 4 rows and at most 8 sums a lane (the host harness's red)", f.dt, gemvxRows(m), r)
			}
		}
	}
	for _, s := range []struct{ rows, k int }{{1, 32}, {1, 4096}, {3, 11008}, {8, 11008}, {8, 96}} {
		g := x16Layout(s.rows, s.k)
		n := int64(s.rows * s.k)
		if g.d%256 != 0 || g.s%256 != 0 || g.d < 2*n || g.s-g.d < n/32*4 || g.bytes-g.s < n/16*4 {
			t.Errorf("x16Layout(%d, %d) = %+v: levels need %d bytes, scales %d, sums %d, each 256-byte aligned", s.rows, s.k, g, 2*n, n/8, n/4)
		}
	}
}
