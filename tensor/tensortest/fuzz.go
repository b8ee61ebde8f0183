package tensortest

import (
	"math"
	"slices"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// FuzzMatMul fuzzes b's MatMul against RefMatMul over shapes M in [1, 40],
// N and K in [1, 700], every weight type, with and without bias. Quantized
// weights (the types of QuantTypes) are random blocks, K rounded up to
// whole blocks, held to QuantTolerance (and with QuantizedActivations to
// Tolerance against the rounded activations). Call it from a Fuzz function
// of the backend's package:
//
//	func FuzzCPUMatMul(f *testing.F) { tensortest.FuzzMatMul(f, tensor.NewCPU(0)) }
//
// Because a single dot product can cancel to nearly nothing, the error is
// measured against the product of the absolute values, |x|·|w|ᵀ + |bias|,
// the scale of float32 rounding error in a sum.
func FuzzMatMul(f *testing.F, b tensor.Backend, opts ...Option) {
	cfg := newConfig(opts)
	b = tensor.Checked(b)
	for _, seed := range []struct {
		m        uint8
		n, k     uint16
		dt       uint8
		bias     bool
		seedBits int64
	}{
		{1, 513, 172, 1, false, 1}, {12, 513, 172, 1, true, 2}, {1, 1, 1, 0, false, 3},
		{3, 7, 5, 2, true, 4}, {33, 130, 300, 1, false, 5}, {2, 9, 699, 2, false, 6},
		{1, 513, 300, 3, false, 7}, {7, 100, 600, 8, true, 8}, {1, 64, 256, 10, false, 9}, // Q8_0, Q4_K, Q6_K
	} {
		f.Add(seed.m, seed.n, seed.k, seed.dt, seed.bias, seed.seedBits)
	}
	f.Fuzz(func(t *testing.T, m uint8, n, k uint16, dt uint8, withBias bool, seed int64) {
		M, N, K := 1+int(m)%40, 1+int(n)%700, 1+int(k)%700
		types := append(slices.Clone(weightTypes), cfg.quantTypes...)
		wdt := types[int(dt)%len(types)]
		s := &suite{b: b, cfg: cfg}
		r := newRand(uint64(seed))
		var xs []float32
		var w *tensor.Tensor
		var wv []float64
		bdt, tol := wdt, cfg.tol
		if wdt.IsQuantized() {
			bs := wdt.BlockSize()
			K = (K + bs - 1) / bs * bs
			xs = normal(r, M*K)
			w, wv = s.putBlocks(t, r, wdt, tensor.Shape{N, K})
			bdt, tol = tensor.F32, cfg.quantTol
		} else {
			xs = uniform(r, M*K, -1, 1)
			w, wv = s.put(t, wdt, tensor.Shape{N, K}, uniform(r, N*K, -1, 1))
		}
		x, xv := s.put(t, tensor.F32, tensor.Shape{M, K}, xs)
		var bias *tensor.Tensor
		var bv []float64
		if withBias {
			bias, bv = s.put(t, bdt, tensor.Shape{N}, uniform(r, N, -1, 1))
		}
		out := s.poisoned(t, tensor.Shape{M, N})
		if err := b.MatMul(out, x, w, bias); err != nil {
			t.Fatalf("MatMul M=%d N=%d K=%d %v: %v", M, N, K, wdt, err)
		}
		got := s.get(t, out)
		scale := RefMatMul(abs(xv), abs(wv), abs(bv), M, N, K)
		for i, g := range got {
			if math.IsNaN(float64(g)) || math.IsInf(float64(g), 0) {
				t.Fatalf("MatMul M=%d N=%d K=%d %v: element %d is %v", M, N, K, wdt, i, g)
			}
		}
		check := func(what string, want []float64, tol float64) {
			if e := errScaled(got, want, scale); !(e <= tol) {
				t.Fatalf("MatMul M=%d N=%d K=%d %v bias=%v: error %.3g > %.3g relative to |x|·|w|%s", M, N, K, wdt, withBias, e, tol, what)
			}
		}
		want := RefMatMul(xv, wv, bv, M, N, K)
		check("", want, tol)
		if wdt.IsQuantized() && cfg.quantizesX && errScaled(got, want, scale) > cfg.tol {
			xr, err := RoundActivations(wdt, xs, M, K)
			if err != nil {
				t.Fatal(err)
			}
			check(" with the rounded activations", RefMatMul(xr, wv, bv, M, N, K), cfg.tol)
		}
	})
}

// errScaled is the RMS error of got against want relative to the RMS of
// scale.
func errScaled(got []float32, want, scale []float64) float64 {
	var num, den float64
	for i, g := range got {
		d := float64(g) - want[i]
		num += d * d
		den += scale[i] * scale[i]
	}
	return math.Sqrt(num / den)
}
