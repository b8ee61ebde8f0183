package engine

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// presetBlock is block 0 of a preset shape as the planner sees it, in dt.
func presetBlock(tb testing.TB, name string, dt tensor.DType) (*arch.Config, []paging.TensorSpec) {
	tb.Helper()
	cfg, err := arch.Preset(name)
	if err != nil {
		tb.Fatal(err)
	}
	var block []paging.TensorSpec
	for _, s := range cfg.LayerTensors(cfg.BlockLayer(0)) {
		n, err := dt.ShapeBytes(s.Shape)
		if err != nil {
			tb.Fatal(err)
		}
		block = append(block, paging.TensorSpec{Name: s.Name, DType: dt, Shape: s.Shape, Bytes: n})
	}
	return cfg, block
}

// BenchmarkCPUBlock measures what CalibrateCPU gives the planner for a
// preset shape's F16 block on this machine's CPU (STRATA_THREADS threads,
// default all): the block's time at 16 positions (ms/block), its products
// alone over the same weights (ms/products, one MatMul a matrix, as
// MeasureRates times the CPU rate), the fixed cost a block beyond its bytes
// at that rate (ms/fixed) and the attention's read rate (attn_GB/s). On a
// GPU host this is the CPU stage of the hybrid strategy, without a GPU:
// e.g. bin/engine.test -test.run '^$' -test.bench CPUBlock/llama2-7b
// -test.benchtime 3x.
func BenchmarkCPUBlock(b *testing.B) {
	threads, _ := strconv.Atoi(os.Getenv("STRATA_THREADS"))
	for _, preset := range []string{"tinyllama-1.1b", "llama2-7b"} {
		b.Run(preset, func(b *testing.B) {
			cfg, block := presetBlock(b, preset, tensor.F16)
			cpu := tensor.NewCPU(threads)
			defer cpu.Close()
			var blockBytes int64
			for _, ts := range block {
				blockBytes += ts.Bytes
			}
			// The products alone, over copies that take cpuRateMinBytes,
			// as MeasureRates times them.
			type product struct{ w, x, y *tensor.Tensor }
			var ps []product
			for n := int64(0); n < cpuRateMinBytes; n += blockBytes {
				for _, ts := range block {
					if len(ts.Shape) != 2 {
						continue
					}
					w := tensor.New(ts.DType, ts.Shape)
					fillRandom(w.Bytes(), ts.DType)
					ps = append(ps, product{w, tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[1]}), tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[0]})})
				}
			}
			var productBytes int64
			for _, p := range ps {
				productBytes += p.w.NumBytes()
			}
			copies := float64(productBytes) / float64(blockBytes)
			for b.Loop() {
				d, err := best(3, func() error {
					for _, p := range ps {
						if err := cpu.MatMul(p.y, p.x, p.w, nil); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
				r := paging.Rates{CPU: float64(productBytes) / d.Seconds()}
				t0 := time.Now()
				if err := CalibrateCPU(context.Background(), cpu, cfg, block, tensor.F16, 4097, &r); err != nil {
					b.Fatal(err)
				}
				blockTime := time.Duration(float64(blockBytes)/r.CPU*1e9) + r.CPULayer
				b.ReportMetric(float64(blockTime)/1e6, "ms/block")
				b.ReportMetric(float64(d)/1e6/copies, "ms/products")
				b.ReportMetric(float64(r.CPULayer)/1e6, "ms/fixed")
				b.ReportMetric(r.CPUAttention/1e9, "attn_GB/s")
				b.ReportMetric(r.CPU/1e9, "cpu_GB/s")
				b.Logf("%s, %d threads: CPU %.1f GB/s over separate products, a block %.2f ms of which %.2f fixed, attention %.1f GB/s (KV F16); calibration took %v",
					preset, cpu.Threads(), r.CPU/1e9, float64(blockTime)/1e6, float64(r.CPULayer)/1e6, r.CPUAttention/1e9, time.Since(t0).Round(time.Millisecond))
			}
		})
	}
}
