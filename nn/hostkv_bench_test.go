package nn

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// BenchmarkHostKVAttention times one decode step's attention of a 7B-shape
// block (32 heads of 128, no grouping) over a host KV cache on the CPU
// backend, at contexts from 512 to 32,768 positions and 1, 4 and all
// threads: what a block with its cache in host memory costs a decode step
// (beside the two hand-overs). It reports the KV cache bytes read per
// second, to set against the CPU rate engine.MeasureRates measures (the
// planner predicts host KV with that rate).
func BenchmarkHostKVAttention(b *testing.B) {
	const heads, headDim = 32, 128
	dim := heads * headDim
	for _, threads := range []int{1, 4, runtime.NumCPU()} {
		for _, pos := range []int{512, 4096, 8192, 32768} {
			b.Run(fmt.Sprintf("threads=%d/pos=%d", threads, pos), func(b *testing.B) {
				cpu := tensor.Checked(tensor.NewCPU(threads))
				defer cpu.Close()
				alloc := func(rows int) *tensor.Tensor {
					t, err := cpu.Alloc(tensor.F32, tensor.Shape{rows, dim})
					if err != nil {
						b.Fatal(err)
					}
					f := t.F32()
					for i := range f {
						f[i] = float32(i%7) * 0.01
					}
					return t
				}
				q, out, k, v := alloc(1), alloc(1), alloc(pos), alloc(pos)
				at := tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: heads, HeadDim: headDim, Pos0: pos - 1, Scale: 0.088}
				bytes := float64(2 * 4 * pos * dim)
				for b.Loop() {
					if err := cpu.Attention(out, at); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(bytes*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
			})
		}
	}
}
