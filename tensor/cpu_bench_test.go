package tensor_test

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// benchThreads are the thread counts of the benchmarks: one core and all.
func benchThreads() []struct {
	name string
	n    int
} {
	return []struct {
		name string
		n    int
	}{{"threads=1", 1}, {fmt.Sprintf("threads=all(%d)", runtime.NumCPU()), runtime.NumCPU()}}
}

func benchTensor(b *testing.B, c *tensor.CPU, dt tensor.DType, shape tensor.Shape, r *rand.Rand) *tensor.Tensor {
	v := make([]float32, shape.NumElements())
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	t, err := tensortest.FromF32(c, dt, shape, v)
	if err != nil {
		b.Fatal(err)
	}
	return t
}

// BenchmarkMatMul measures the matrix product in the decode shape (one row:
// memory-bound, weight bytes read per second is the figure of merit) and a
// prefill shape (compute-bound).
func BenchmarkMatMul(b *testing.B) {
	cases := []struct {
		name    string
		m, k, n int
		dt      tensor.DType
	}{
		{"decode/M1_K4096_N4096_F16", 1, 4096, 4096, tensor.F16},
		{"decode/M1_K4096_N4096_BF16", 1, 4096, 4096, tensor.BF16},
		{"decode/M1_K4096_N4096_F32", 1, 4096, 4096, tensor.F32},
		{"prefill/M128_K2048_N2048_F16", 128, 2048, 2048, tensor.F16},
	}
	for _, c := range cases {
		for _, th := range benchThreads() {
			b.Run(c.name+"/"+th.name, func(b *testing.B) {
				cpu := tensor.NewCPU(th.n)
				defer cpu.Close()
				r := rand.New(rand.NewPCG(1, 2))
				x := benchTensor(b, cpu, tensor.F32, tensor.Shape{c.m, c.k}, r)
				w := benchTensor(b, cpu, c.dt, tensor.Shape{c.n, c.k}, r)
				out, _ := cpu.Alloc(tensor.F32, tensor.Shape{c.m, c.n})
				for b.Loop() {
					if err := cpu.MatMul(out, x, w, nil); err != nil {
						b.Fatal(err)
					}
				}
				s := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(2*float64(c.m*c.n*c.k)/s/1e9, "GFLOP/s")
				b.ReportMetric(float64(w.NumBytes())/s/1e9, "GB/s")
			})
		}
	}
}

// BenchmarkAttention measures one decode step of attention over a 1024- and
// 4096-position cache (TinyLlama's layout: 32 query heads, 4 KV heads of 64).
func BenchmarkAttention(b *testing.B) {
	const heads, kvHeads, headDim = 32, 4, 64
	for _, pos := range []int{1023, 4095} {
		for _, th := range benchThreads() {
			b.Run(fmt.Sprintf("decode/pos%d/%s", pos+1, th.name), func(b *testing.B) {
				cpu := tensor.NewCPU(th.n)
				defer cpu.Close()
				r := rand.New(rand.NewPCG(3, 4))
				q := benchTensor(b, cpu, tensor.F32, tensor.Shape{1, heads * headDim}, r)
				k := benchTensor(b, cpu, tensor.F32, tensor.Shape{pos + 1, kvHeads * headDim}, r)
				v := benchTensor(b, cpu, tensor.F32, tensor.Shape{pos + 1, kvHeads * headDim}, r)
				out, _ := cpu.Alloc(tensor.F32, tensor.Shape{1, heads * headDim})
				for b.Loop() {
					if err := cpu.Attention(out, q, k, v, heads, kvHeads, headDim, pos, 0.125); err != nil {
						b.Fatal(err)
					}
				}
				s := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(float64(k.NumBytes()+v.NumBytes())/s/1e9, "GB/s")
			})
		}
	}
}
