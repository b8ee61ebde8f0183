package tensor

import (
	"math"
	"math/rand/v2"
	"testing"
)

// kernelCase is one dot product: x against weights given as float32 values
// and as their F16 and BF16 words.
type kernelCase struct {
	x    []float32
	f32  []float32 // the weights, exactly representable in F16 and in BF16 below
	f16  []uint16
	bf16 []uint16
	w16  []float32 // F16 weights as float32
	wb16 []float32 // BF16 weights as float32
}

func newKernelCase(r *rand.Rand, n int) kernelCase {
	c := kernelCase{x: make([]float32, n), f32: make([]float32, n), f16: make([]uint16, n), bf16: make([]uint16, n),
		w16: make([]float32, n), wb16: make([]float32, n)}
	for i := range n {
		c.x[i] = r.Float32()*2 - 1
		c.f32[i] = r.Float32()*2 - 1
		if i%7 == 3 { // F16 subnormals and tiny values
			c.f32[i] = float32(r.IntN(1024)-512) * 0x1p-24
		}
	}
	F32ToF16(c.f16, c.f32)
	F32ToBF16(c.bf16, c.f32)
	F16ToF32(c.w16, c.f16)
	BF16ToF32(c.wb16, c.bf16)
	return c
}

// refDot returns the float64 dot product and the sum of absolute products,
// the scale of float32 rounding error.
func refDot(x, w []float32) (dot, scale float64) {
	for i := range x {
		p := float64(x[i]) * float64(w[i])
		dot += p
		scale += math.Abs(p)
	}
	return dot, scale
}

func checkDot(t *testing.T, what string, n int, got float32, x, w []float32) {
	t.Helper()
	want, scale := refDot(x, w)
	// float32 summation error is at most about n·2⁻²⁴·scale; the kernels'
	// split accumulators do much better, so 4·sqrt(n)·2⁻²⁴ is a real bound
	// for random data and still catches a wrong or missed element.
	tol := 4*math.Sqrt(float64(n)+1)*0x1p-24*scale + 1e-30
	if d := math.Abs(float64(got) - want); !(d <= tol) {
		t.Fatalf("%s, n=%d: got %v, want %v (error %.3g > %.3g)", what, n, got, want, d, tol)
	}
}

func kernelLengths() []int {
	ns := []int{}
	for n := 0; n <= 40; n++ {
		ns = append(ns, n)
	}
	return append(ns, 63, 64, 65, 172, 255, 256, 257, 1000, 4096)
}

func TestKernels(t *testing.T) {
	k := &genericKernels
	r := rand.New(rand.NewPCG(7, 7))
	for _, n := range kernelLengths() {
		var c [4]kernelCase
		for i := range c {
			c[i] = newKernelCase(r, n)
		}
		x := c[0].x
		checkDot(t, "dotF32", n, k.dotF32(x, c[0].f32), x, c[0].f32)
		checkDot(t, "dotF16", n, k.dotF16(x, c[0].f16), x, c[0].w16)
		checkDot(t, "dotBF16", n, k.dotBF16(x, c[0].bf16), x, c[0].wb16)

		s := [4]float32{}
		s[0], s[1], s[2], s[3] = k.dot4F32(x, c[0].f32, c[1].f32, c[2].f32, c[3].f32)
		for i := range 4 {
			checkDot(t, "dot4F32", n, s[i], x, c[i].f32)
		}
		s[0], s[1], s[2], s[3] = k.dot4F16(x, c[0].f16, c[1].f16, c[2].f16, c[3].f16)
		for i := range 4 {
			checkDot(t, "dot4F16", n, s[i], x, c[i].w16)
		}
		s[0], s[1], s[2], s[3] = k.dot4BF16(x, c[0].bf16, c[1].bf16, c[2].bf16, c[3].bf16)
		for i := range 4 {
			checkDot(t, "dot4BF16", n, s[i], x, c[i].wb16)
		}
		got := make([]float32, n)
		k.cvtF16(got, c[0].f16)
		for i := range got {
			if got[i] != c[0].w16[i] {
				t.Fatalf("cvtF16 n=%d: element %d = %v, want %v", n, i, got[i], c[0].w16[i])
			}
		}
		k.cvtBF16(got, c[0].bf16)
		for i := range got {
			if got[i] != c[0].wb16[i] {
				t.Fatalf("cvtBF16 n=%d: element %d = %v, want %v", n, i, got[i], c[0].wb16[i])
			}
		}
	}
}

// TestKernelsSpecial checks that infinities and NaN in F16 and BF16 weights
// come through the conversions (a weight file with them is broken, and the
// result must show it).
func TestKernelsSpecial(t *testing.T) {
	k := &genericKernels
	for _, n := range []int{1, 5, 8, 13, 64} {
		x := make([]float32, n)
		for i := range x {
			x[i] = 0.5
		}
		for _, tc := range []struct {
			name    string
			f16, bf uint16
			want    float64
		}{
			{"+Inf", 0x7c00, 0x7f80, math.Inf(1)},
			{"-Inf", 0xfc00, 0xff80, math.Inf(-1)},
			{"NaN", 0x7e00, 0x7fc0, math.NaN()},
		} {
			for pos := range n {
				h := make([]uint16, n)
				b := make([]uint16, n)
				h[pos], b[pos] = tc.f16, tc.bf
				z := make([]uint16, n)
				results := map[string]float32{"dotF16": k.dotF16(x, h), "dotBF16": k.dotBF16(x, b)}
				s0, _, _, s3 := k.dot4F16(x, h, z, z, h)
				results["dot4F16"], results["dot4F16 row 3"] = s0, s3
				s0, _, _, _ = k.dot4BF16(x, b, z, z, z)
				results["dot4BF16"] = s0
				for name, got := range results {
					g := float64(got)
					if math.IsNaN(tc.want) && !math.IsNaN(g) || !math.IsNaN(tc.want) && g != tc.want {
						t.Fatalf("%s n=%d with %s at %d: got %v, want %v", name, n, tc.name, pos, got, tc.want)
					}
				}
			}
		}
	}
}
