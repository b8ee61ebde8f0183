package gorgonia_test

import (
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
	gtensor "gorgonia.org/tensor"
)

// BenchmarkF32MatMulGorgonia compares, for F32 operands (the interop path
// with gorgonia.org/tensor), gorgonia's matrix product (gonum's pure-Go
// BLAS) with the CPU backend's MatMul on the same data: a decode shape and
// a prefill shape of TinyLlama's attention projection.
func BenchmarkF32MatMulGorgonia(b *testing.B) {
	for _, c := range []struct {
		name    string
		m, k, n int
	}{{"decode/M1_K2048_N2048", 1, 2048, 2048}, {"prefill/M128_K2048_N2048", 128, 2048, 2048}} {
		r := rand.New(rand.NewPCG(1, 2))
		xs, ws := make([]float32, c.m*c.k), make([]float32, c.n*c.k)
		for i := range xs {
			xs[i] = r.Float32()*2 - 1
		}
		for i := range ws {
			ws[i] = r.Float32()*2 - 1
		}
		report := func(b *testing.B) {
			s := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(2*float64(c.m*c.n*c.k)/s/1e9, "GFLOP/s")
		}
		b.Run(c.name+"/gorgonia", func(b *testing.B) {
			x := gtensor.New(gtensor.WithShape(c.m, c.k), gtensor.WithBacking(xs))
			w := gtensor.New(gtensor.WithShape(c.n, c.k), gtensor.WithBacking(ws))
			if err := w.T(); err != nil { // x · wᵀ, as MatMul computes
				b.Fatal(err)
			}
			out := gtensor.New(gtensor.WithShape(c.m, c.n), gtensor.Of(gtensor.Float32))
			for b.Loop() {
				if _, err := gtensor.MatMul(x, w, gtensor.WithReuse(out)); err != nil {
					b.Fatal(err)
				}
			}
			report(b)
		})
		b.Run(c.name+"/strata", func(b *testing.B) {
			cpu := tensor.NewCPU(0)
			defer cpu.Close()
			x, _ := tensor.FromF32(tensor.Shape{c.m, c.k}, xs)
			w, _ := tensor.FromF32(tensor.Shape{c.n, c.k}, ws)
			out := tensor.New(tensor.F32, tensor.Shape{c.m, c.n})
			for b.Loop() {
				if err := cpu.MatMul(out, x, w, nil); err != nil {
					b.Fatal(err)
				}
			}
			report(b)
		})
	}
}
