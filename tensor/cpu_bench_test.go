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
		for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0} {
			for _, th := range benchThreads() {
				b.Run(fmt.Sprintf("decode/pos%d/%v/%s", pos+1, dt, th.name), func(b *testing.B) {
					cpu := tensor.NewCPU(th.n)
					defer cpu.Close()
					r := rand.New(rand.NewPCG(3, 4))
					q := benchTensor(b, cpu, tensor.F32, tensor.Shape{1, heads * headDim}, r)
					k := benchTensor(b, cpu, dt, tensor.Shape{pos + 1, kvHeads * headDim}, r)
					v := benchTensor(b, cpu, dt, tensor.Shape{pos + 1, kvHeads * headDim}, r)
					out, _ := cpu.Alloc(tensor.F32, tensor.Shape{1, heads * headDim})
					for b.Loop() {
						if err := cpu.Attention(out, tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Pos0: pos, Scale: 0.125}); err != nil {
							b.Fatal(err)
						}
					}
					s := b.Elapsed().Seconds() / float64(b.N)
					b.ReportMetric(float64(k.NumBytes()+v.NumBytes())/s/1e9, "GB/s")
				})
			}
		}
	}
}

// BenchmarkMatMulGrad measures the backward of a linear layer in a training
// shape: MatMulGradX (dy · w, w in its stored type) and MatMulGradW (dyᵀ · x).
func BenchmarkMatMulGrad(b *testing.B) {
	const m, n, k = 256, 2048, 2048
	for _, c := range []struct {
		name string
		dt   tensor.DType // weight type (GradX)
	}{{"X/F16", tensor.F16}, {"X/BF16", tensor.BF16}, {"X/F32", tensor.F32}, {"W", tensor.F32}} {
		for _, th := range benchThreads() {
			b.Run(fmt.Sprintf("%s/M%d_N%d_K%d/%s", c.name, m, n, k, th.name), func(b *testing.B) {
				cpu := tensor.NewCPU(th.n)
				defer cpu.Close()
				r := rand.New(rand.NewPCG(5, 6))
				dy := benchTensor(b, cpu, tensor.F32, tensor.Shape{m, n}, r)
				var run func() error
				if c.name == "W" {
					x := benchTensor(b, cpu, tensor.F32, tensor.Shape{m, k}, r)
					dw, _ := cpu.Alloc(tensor.F32, tensor.Shape{n, k})
					run = func() error { return cpu.MatMulGradW(dw, dy, x) }
				} else {
					w := benchTensor(b, cpu, c.dt, tensor.Shape{n, k}, r)
					dx, _ := cpu.Alloc(tensor.F32, tensor.Shape{m, k})
					run = func() error { return cpu.MatMulGradX(dx, dy, w) }
				}
				for b.Loop() {
					if err := run(); err != nil {
						b.Fatal(err)
					}
				}
				s := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(2*float64(m*n*k)/s/1e9, "GFLOP/s")
			})
		}
	}
}

// BenchmarkAttentionGrad measures the attention backward over a 512-token
// training sequence in TinyLlama's layout (32 query heads, 4 KV heads of 64).
func BenchmarkAttentionGrad(b *testing.B) {
	const t, heads, kvHeads, headDim = 512, 32, 4, 64
	for _, th := range benchThreads() {
		b.Run(fmt.Sprintf("T%d/%s", t, th.name), func(b *testing.B) {
			cpu := tensor.NewCPU(th.n)
			defer cpu.Close()
			r := rand.New(rand.NewPCG(7, 8))
			q := benchTensor(b, cpu, tensor.F32, tensor.Shape{t, heads * headDim}, r)
			dout := benchTensor(b, cpu, tensor.F32, tensor.Shape{t, heads * headDim}, r)
			k := benchTensor(b, cpu, tensor.F32, tensor.Shape{t, kvHeads * headDim}, r)
			v := benchTensor(b, cpu, tensor.F32, tensor.Shape{t, kvHeads * headDim}, r)
			out, _ := cpu.Alloc(tensor.F32, tensor.Shape{t, heads * headDim})
			if err := cpu.Attention(out, tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Scale: 0.125}); err != nil {
				b.Fatal(err)
			}
			dq, _ := cpu.Alloc(tensor.F32, tensor.Shape{t, heads * headDim})
			dk, _ := cpu.Alloc(tensor.F32, tensor.Shape{t, kvHeads * headDim})
			dv, _ := cpu.Alloc(tensor.F32, tensor.Shape{t, kvHeads * headDim})
			for b.Loop() {
				if err := cpu.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: out}, tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Scale: 0.125}); err != nil {
					b.Fatal(err)
				}
			}
			s := b.Elapsed().Seconds() / float64(b.N)
			// Scores, dp, dq, dk and dv: five products over the causal half.
			b.ReportMetric(5*float64(heads*t*(t+1)*headDim)/s/1e9, "GFLOP/s")
		})
	}
}
