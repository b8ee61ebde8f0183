package engine

import (
	"context"
	"errors"
	"math"
	"path/filepath"
	"testing"

	_ "github.com/strata-llm/strata/cuda" // the "cuda" device driver, built with -tags cuda
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// TestCUDAHybridFixtures runs the fixtures (Llama, Qwen3 and the mixtures
// of experts Mixtral and Qwen3-MoE) on a GPU and the CPU with the
// hybrid and cpu strategies, under a budget that leaves layers off the
// GPU, with the rates measured on the machine and with rates that force
// CPU layers: the logits at every prompt position are within the GPU
// tolerance (2e-2) of transformers', for a prompt that runs on the twins
// (chunks of 4 from 4 tokens) and one that runs on the CPU (chunks below
// the twins' size); the greedy ids equal the resident GPU run's where
// transformers' margin allows. It skips without a CUDA device.
func TestCUDAHybridFixtures(t *testing.T) {
	gpu, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	defer gpu.Close()
	ctx := context.Background()
	cpuHeavy := paging.Rates{H2D: 1e9, CPU: 50e9, H2DShared: 1e9, CPUShared: 50e9, Device: 1e12}
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16,
		fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		lm := openFixture(t, name)
		ids, wantLogits := fixtureReference(t, name)
		for _, tc := range []struct {
			what     string
			strategy paging.Strategy
			rates    *paging.Rates
			twinMin  int
		}{
			{"hybrid, measured rates, twins", paging.StrategyHybrid, nil, 4},
			{"hybrid, CPU-heavy rates, twins", paging.StrategyHybrid, &cpuHeavy, 4},
			{"hybrid, CPU-heavy rates, on the CPU", paging.StrategyHybrid, &cpuHeavy, 1 << 20},
			{"cpu, on the CPU", paging.StrategyCPU, &cpuHeavy, 1 << 20},
		} {
			t.Run(name+"/"+tc.what, func(t *testing.T) {
				// A budget of the device's fixed memory, the reserves and
				// a third of the weights.
				_, err := paging.Plan(mustInfo(t, lm), 1, paging.StrategyBalanced, 32, 1, paging.WithChunkTokens(4), paging.WithDevice(gpu))
				var be *paging.BudgetError
				if !asBudgetError(err, &be) {
					t.Fatalf("probe plan: %v", err)
				}
				budget := be.Needed + lm.WeightBytes()/3
				e, err := Open(ctx, lm, Options{Backends: []tensor.Backend{gpu}, Context: 32, Chunk: 4, TwinMinTokens: tc.twinMin,
					Memory: Memory{Budgets: []int64{budget}, Strategy: tc.strategy}, Rates: tc.rates})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				t.Logf("%s", e.Hybrid().Plan)
				s, err := e.NewSession()
				if err != nil {
					t.Fatal(err)
				}
				logits, err := s.Forward(ctx, ids, true, nil)
				if err != nil {
					t.Fatal(err)
				}
				var worst float64
				for i := range wantLogits {
					worst = max(worst, math.Abs(float64(logits[i]-wantLogits[i])))
				}
				t.Logf("logits: max abs difference from transformers %.3g", worst)
				if !(worst <= 2e-2) {
					t.Errorf("logits differ from transformers by %g, want <= 2e-2", worst)
				}
				if e.Devices()[0].PeakDeviceBytes > budget {
					t.Errorf("peak %d over the budget %d", e.Devices()[0].PeakDeviceBytes, budget)
				}
			})
		}
	}
}

func mustInfo(t *testing.T, lm *loader.Model) paging.ModelInfo {
	t.Helper()
	info, err := nnModelInfo(lm)
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// fixtureReference reads the fixture's prompt and transformers' logits at
// every position.
func fixtureReference(t *testing.T, name string) ([]int32, []float32) {
	t.Helper()
	f, err := loader.OpenSafetensors(filepath.Join(fixtures.Dir(name), "reference.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	in, err := f.ReadTensor(context.Background(), "input_ids")
	if err != nil {
		t.Fatal(err)
	}
	lg, err := f.ReadTensor(context.Background(), "logits")
	if err != nil {
		t.Fatal(err)
	}
	var ids []int32
	for _, v := range in.I64() {
		ids = append(ids, int32(v))
	}
	return ids, lg.F32()
}

func nnModelInfo(lm *loader.Model) (paging.ModelInfo, error) { return nn.ModelInfo(lm, lm.Config) }

func asBudgetError(err error, be **paging.BudgetError) bool { return errors.As(err, be) }

// TestCUDAExpertPaging runs the Mixtral and Qwen3-MoE fixtures on a GPU
// with their experts paged through caches of a few experts, with each
// policy: the logits at every prompt position are within the GPU
// tolerance (2e-2) of transformers', the budget is never exceeded, experts
// are evicted and loaded again, and a few decode steps move the bytes of
// the missed and prefetched experts only. It skips without a CUDA device.
func TestCUDAExpertPaging(t *testing.T) {
	gpu, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	defer gpu.Close()
	ctx := context.Background()
	for _, name := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		lm := openFixture(t, name)
		ids, wantLogits := fixtureReference(t, name)
		k := lm.Config.MoE.ExpertsPerToken
		for _, policy := range []paging.ExpertPolicy{paging.ExpertLRU, paging.ExpertLFU} {
			t.Run(name+"/"+string(policy), func(t *testing.T) {
				const ctxLen, chunk = 32, 4
				p, err := paging.Plan(mustInfo(t, lm), 1<<40, paging.StrategyBalanced, ctxLen, 1, paging.WithChunkTokens(chunk),
					paging.WithDevice(gpu), paging.WithExpertCache(k))
				if err != nil {
					t.Fatal(err)
				}
				budget := p.PredictedPeakBytes - p.ExpertCacheBytes + int64(k+2)*p.ExpertSlotBytes
				e, err := Open(ctx, lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: chunk,
					Memory: Memory{Budgets: []int64{budget}, ExpertPolicy: policy}})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				s, err := e.NewSession()
				if err != nil {
					t.Fatal(err)
				}
				logits, err := s.Forward(ctx, ids, true, nil)
				if err != nil {
					t.Fatal(err)
				}
				var worst float64
				for i := range wantLogits {
					worst = max(worst, math.Abs(float64(logits[i]-wantLogits[i])))
				}
				t.Logf("logits: max abs difference from transformers %.3g", worst)
				if !(worst <= 2e-2) {
					t.Errorf("logits differ from transformers by %g, want <= 2e-2", worst)
				}
				last := logits[len(logits)-lm.Config.VocabSize:]
				for range 6 {
					if last, err = s.Forward(ctx, []int32{int32(nn.Argmax(last))}, false, nil); err != nil {
						t.Fatal(err)
					}
				}
				x := e.Experts()
				t.Logf("%s", x)
				if x == nil || x.Slots >= x.Experts || x.Misses == 0 || x.BytesMoved != (x.Misses+x.Prefetches)*x.ExpertBytes {
					t.Errorf("experts did not page as counted: %+v", x)
				}
				if e.Devices()[0].PeakDeviceBytes > budget {
					t.Errorf("peak %d over the budget %d", e.Devices()[0].PeakDeviceBytes, budget)
				}
			})
		}
	}
}

// TestCUDAQuantizedExperts runs the Mixtral and Qwen3-MoE fixtures
// converted to Q8_0 GGUF (the experts in Q8_0, in their stored size in
// the expert cache) on a GPU with a cache of a few experts: the logits at
// every prompt position are within 2e-2 of the same file run on the CPU,
// whose quantized products are the reference, and a few decode steps
// move the bytes of the missed and prefetched Q8_0 experts only. It
// skips without a CUDA device.
func TestCUDAQuantizedExperts(t *testing.T) {
	gpu, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	defer gpu.Close()
	ctx := context.Background()
	prompt := []int32{1, 5, 9, 200, 3, 77, 18, 42, 7, 300, 11}
	for _, name := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			lm := openGGUF(t, name, quant.Q8_0)
			const ctxLen, chunk = 32, 4
			cpu, err := Open(ctx, lm, Options{Backends: cpus(1), Context: ctxLen, Chunk: chunk})
			if err != nil {
				t.Fatal(err)
			}
			defer cpu.Close()
			cs, err := cpu.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			want, err := cs.Forward(ctx, prompt, true, nil)
			if err != nil {
				t.Fatal(err)
			}
			k := lm.Config.MoE.ExpertsPerToken
			p, err := paging.Plan(mustInfo(t, lm), 1<<40, paging.StrategyBalanced, ctxLen, 1, paging.WithChunkTokens(chunk),
				paging.WithDevice(gpu), paging.WithExpertCache(k))
			if err != nil {
				t.Fatal(err)
			}
			budget := p.PredictedPeakBytes - p.ExpertCacheBytes + int64(k+2)*p.ExpertSlotBytes
			e, err := Open(ctx, lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: chunk, Memory: Memory{Budgets: []int64{budget}}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			logits, err := s.Forward(ctx, prompt, true, nil)
			if err != nil {
				t.Fatal(err)
			}
			var worst float64
			for i := range want {
				worst = max(worst, math.Abs(float64(logits[i]-want[i])))
			}
			t.Logf("Q8_0 experts: logits at %d positions, max abs difference from the CPU %.3g (bound 2e-2)", len(prompt), worst)
			if !(worst <= 2e-2) {
				t.Errorf("logits differ from the CPU's by %g, want <= 2e-2", worst)
			}
			last := logits[len(logits)-lm.Config.VocabSize:]
			for range 6 {
				if last, err = s.Forward(ctx, []int32{int32(nn.Argmax(last))}, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			x := e.Experts()
			t.Logf("%s; one expert %d bytes", x, x.ExpertBytes)
			if x == nil || x.Slots >= x.Experts || x.Misses == 0 || x.BytesMoved != (x.Misses+x.Prefetches)*x.ExpertBytes {
				t.Errorf("experts did not page as counted: %+v", x)
			}
			if e.Devices()[0].PeakDeviceBytes > budget {
				t.Errorf("peak %d over the budget %d", e.Devices()[0].PeakDeviceBytes, budget)
			}
		})
	}
}
