package tensor

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkKernels measures single kernels on data in the L1 cache: the
// arithmetic peak of each table, free of memory effects.
func BenchmarkKernels(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, k := range allKernels() {
		b.Run(k.name+"/dot4F32_64", func(b *testing.B) {
			x, w := randF32(r, 64), randF32(r, 256)
			var s float32
			for b.Loop() {
				s0, s1, s2, s3 := k.dot4F32(x, w[:64], w[64:128], w[128:192], w[192:])
				s += s0 + s1 + s2 + s3
			}
			b.ReportMetric(2*256*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		b.Run(k.name+"/scores_d64_n1024", func(b *testing.B) {
			q, c, out := randF32(r, 64), randF32(r, 1024*256), make([]float32, 1024)
			for b.Loop() {
				k.scores(out, q, c, 256)
			}
			b.ReportMetric(2*64*1024*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		b.Run(k.name+"/wsum_d64_n1024", func(b *testing.B) {
			p, c, o := randF32(r, 1024), randF32(r, 1024*256), make([]float32, 64)
			for b.Loop() {
				k.wsum(o, c, 256, p)
			}
			b.ReportMetric(2*64*1024*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		b.Run(k.name+"/expSum_1024", func(b *testing.B) {
			s := randF32(r, 1024)
			for b.Loop() {
				k.expSum(s, 1)
			}
			b.ReportMetric(1024*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gexp/s")
		})
		b.Run(k.name+"/siluMul_5632", func(b *testing.B) {
			g, u := randF32(r, 5632), randF32(r, 5632)
			o := make([]float32, 5632)
			for b.Loop() {
				k.siluMul(o, g, u)
			}
			b.ReportMetric(5632*float64(b.N)/b.Elapsed().Seconds()/1e9, "G/s")
		})
		if k.gemm != nil {
			b.Run(k.name+"/gemm", func(b *testing.B) {
				kc := k.kc
				a, bb, c := randF32(r, k.mr*kc), randF32(r, kc*k.nr), randF32(r, k.mr*k.nr)
				for b.Loop() {
					k.gemm(a, kc, bb, c, kc)
				}
				b.ReportMetric(2*float64(k.mr*k.nr*kc)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
			})
		}
		b.Run(k.name+"/gemvF16_L2", func(b *testing.B) {
			x := randF32(r, 2048)
			w := make([]uint16, 64*2048)
			F32ToF16(w, randF32(r, len(w)))
			out := make([]float32, 64)
			for b.Loop() {
				k.gemvF16(out, x, w)
			}
			b.ReportMetric(float64(2*len(w))*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
