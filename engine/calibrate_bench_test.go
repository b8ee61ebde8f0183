package engine

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/nn"
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

// opTimer is a CPU backend that adds up the time of each op a decoder
// block calls on the CPU, the fused ones included.
type opTimer struct {
	*tensor.CPU
	mu sync.Mutex
	t  map[string]time.Duration
	n  map[string]int
}

func (o *opTimer) time(name string, t0 time.Time) {
	o.mu.Lock()
	o.t[name] += time.Since(t0)
	o.n[name]++
	o.mu.Unlock()
}

func (o *opTimer) MatMul(out, x, w, bias *tensor.Tensor) error {
	defer o.time("MatMul", time.Now())
	return o.CPU.MatMul(out, x, w, bias)
}

func (o *opTimer) SiLUMul(out, a, b *tensor.Tensor) error {
	defer o.time("SiLUMul", time.Now())
	return o.CPU.SiLUMul(out, a, b)
}

func (o *opTimer) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	defer o.time("RMSNorm", time.Now())
	return o.CPU.RMSNorm(out, x, w, eps)
}

func (o *opTimer) AddRMSNorm(out, x, d, w *tensor.Tensor, eps float32) error {
	defer o.time("AddRMSNorm", time.Now())
	return o.CPU.AddRMSNorm(out, x, d, w, eps)
}

func (o *opTimer) RopeKV(q, k, v, kc, vc *tensor.Tensor, r tensor.Rotary) error {
	defer o.time("RopeKV", time.Now())
	return o.CPU.RopeKV(q, k, v, kc, vc, r)
}

func (o *opTimer) Attention(out *tensor.Tensor, a tensor.Attn) error {
	defer o.time("Attention", time.Now())
	return o.CPU.Attention(out, a)
}

func (o *opTimer) Add(out, a, b *tensor.Tensor) error {
	defer o.time("Add", time.Now())
	return o.CPU.Add(out, a, b)
}

// BenchmarkCPUBlock measures what CalibrateCPU gives the planner for a
// preset shape's F16 block on this machine's CPU (STRATA_THREADS threads,
// default every core), and where a block's time goes: the products alone
// over copies of the block's matrices that take cpuRateMinBytes
// (ms/products a block, cpu_GB/s: MeasureRates' CPU rate), the block as
// the planner now predicts it alone (ms/block: its bytes at that rate plus
// the fixed cost, ms/fixed), the attention's rate (attn_GB/s), and a
// block at 16 positions timed op by op over the same copies (logged: each
// op's ms a step, and the time between ops). On a GPU host this is the
// CPU stage of the hybrid strategy without a GPU: bin/engine.test
// -test.run '^$' -test.bench CPUBlock -test.benchtime 1x.
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
			// The products alone, over copies of the block that take
			// cpuRateMinBytes, as MeasureRates times them; the copies
			// serve the block's timings too.
			type product struct{ w, x, y *tensor.Tensor }
			var ps []product
			var copies []nn.LayerWeights
			var productBytes int64
			shared := nn.LayerWeights{}
			for productBytes < cpuRateMinBytes {
				lw := nn.LayerWeights{}
				for _, ts := range block {
					if len(ts.Shape) != 2 {
						if shared[ts.Name] == nil {
							shared[ts.Name] = tensor.New(ts.DType, ts.Shape)
							fillRandom(shared[ts.Name].Bytes(), ts.DType)
						}
						lw[ts.Name] = shared[ts.Name]
						continue
					}
					w := tensor.New(ts.DType, ts.Shape)
					fillRandom(w.Bytes(), ts.DType)
					ps = append(ps, product{w, tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[1]}), tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[0]})})
					productBytes += w.NumBytes()
					lw[ts.Name] = w
				}
				copies = append(copies, lw)
			}
			copies = copies[:min(len(copies), calibrateMaxCopies)]
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
				if err := calibrateWith(context.Background(), cpu, cfg, block, tensor.F16, 4097, &r, slices.Clone(copies)); err != nil {
					b.Fatal(err)
				}
				took := time.Since(t0)
				blockTime := time.Duration(float64(blockBytes)/r.CPU*1e9) + r.CPULayer
				b.ReportMetric(float64(blockTime)/1e6, "ms/block")
				b.ReportMetric(float64(d)/1e6*float64(blockBytes)/float64(productBytes), "ms/products")
				b.ReportMetric(float64(r.CPULayer)/1e6, "ms/fixed")
				b.ReportMetric(r.CPUAttention/1e9, "attn_GB/s")
				b.ReportMetric(r.CPU/1e9, "cpu_GB/s")
				b.Logf("%s, %d threads: CPU %.1f GB/s over separate products, a block %.2f ms of which %.2f fixed, attention %.1f GB/s (KV F16); calibration took %v",
					preset, cpu.Threads(), r.CPU/1e9, float64(blockTime)/1e6, float64(r.CPULayer)/1e6, r.CPUAttention/1e9, took.Round(time.Millisecond))
				// Op by op: every step's ops (the untimed first step over
				// each copy included) against the fastest step.
				ot := &opTimer{CPU: cpu, t: map[string]time.Duration{}, n: map[string]int{}}
				const steps = 8
				step, err := nn.TimeBlock(context.Background(), cfg, ot, copies, 0, 16, steps, nn.SessionOptions{KVDType: tensor.F16})
				if err != nil {
					b.Fatal(err)
				}
				per := float64(len(copies) + steps)
				var sum time.Duration
				var parts []string
				for _, name := range slices.Sorted(func(yield func(string) bool) {
					for k := range ot.t {
						if !yield(k) {
							return
						}
					}
				}) {
					sum += ot.t[name]
					parts = append(parts, fmt.Sprintf("%s %.3f ms (%d)", name, float64(ot.t[name])/1e6/per, int(float64(ot.n[name])/per)))
				}
				b.Logf("%s: a step at 16 positions %.2f ms (fastest of %d); per step on average: %s; ops %.2f ms in all", preset, float64(step)/1e6, steps,
					strings.Join(parts, ", "), float64(sum)/1e6/per)
			}
		})
	}
}
