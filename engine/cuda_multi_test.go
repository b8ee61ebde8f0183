package engine

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// openTwoCUDA opens cuda:0 and cuda:1; on a machine of one GPU, cuda:0
// twice, two backends of their own (streams, allocator, pager) standing in
// for two GPUs, which hand over through host memory. It skips without a
// GPU (or without the cuda build tag).
func openTwoCUDA(t *testing.T) (tensor.Backend, tensor.Backend) {
	t.Helper()
	g0, err := tensor.OpenDevice("cuda:0", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	t.Cleanup(func() { g0.Close() })
	g1, err := tensor.OpenDevice("cuda:1", tensor.DeviceOptions{})
	if err != nil {
		t.Logf("one GPU (%v): cuda:0 opened twice stands in for two, without peer copies", err)
		if g1, err = tensor.OpenDevice("cuda:0", tensor.DeviceOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { g1.Close() })
	_, peer := tensor.PeerCopy(g0, g1)
	t.Logf("%s and %s: peer copies %v", g0.Name(), g1.Name(), peer)
	return g0, g1
}

// teacherForced runs prompt and then the given ids one by one on a new
// session of e, and returns the logits before each id and after the last,
// and the mean time of a decode step.
func teacherForced(t *testing.T, e *Engine, prompt, ids []int32) ([][]float32, time.Duration) {
	t.Helper()
	s, err := e.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	l, err := s.Forward(context.Background(), prompt, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := [][]float32{append([]float32(nil), l...)}
	t0 := time.Now()
	for _, id := range ids {
		if l, err = s.Forward(context.Background(), []int32{id}, false, nil); err != nil {
			t.Fatal(err)
		}
		out = append(out, append([]float32(nil), l...))
	}
	return out, time.Since(t0) / time.Duration(max(len(ids), 1))
}

// TestCUDATwoGPUs: on two GPUs, the F16 fixture, its Q8_0 GGUF
// conversion, a 256-wide Q4_K GGUF model and the Qwen3-MoE fixture give
// the logits of one GPU (within 1e-3, 3e-2 with the hybrid plan's CPU
// layers; the greedy ids equal wherever one GPU's top two logits are twice
// that apart or more), split across the GPUs
// resident, streamed under a budget each (the experts paged per device),
// with the hidden state handed device to device and through host memory
// (NoPeerCopies: the same logits bit for bit), and with the hybrid
// strategy (the GPUs and the CPU in one plan); each GPU's peak stays within
// its budget. It logs each run's decode time per token and the expert
// report per device. On one GPU, two backends of it stand in for two GPUs
// (openTwoCUDA).
func TestCUDATwoGPUs(t *testing.T) {
	g0, g1 := openTwoCUDA(t)
	ctx := context.Background()
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 40, 8, 91, 17}
	const steps = 8
	for _, m := range []struct {
		name string
		open func(t *testing.T) *loader.Model
	}{
		{"f16", func(t *testing.T) *loader.Model { return openFixture(t, fixtures.TinyLlamaF16Sharded) }},
		{"q8_0", func(t *testing.T) *loader.Model { return openGGUF(t, fixtures.TinyLlamaF16Sharded, quant.Q8_0) }},
		{"q4_k", func(t *testing.T) *loader.Model { return synthGGUF(t, quant.Q4_K) }},
		{"qwen3-moe", func(t *testing.T) *loader.Model { return openFixture(t, fixtures.TinyQwen3MoEF16) }},
	} {
		t.Run(m.name, func(t *testing.T) {
			lm := m.open(t)
			ctxLen := len(prompt) + steps + 1
			one, err := Open(ctx, lm, Options{Backends: []tensor.Backend{g0}, Context: ctxLen, Chunk: 4})
			if err != nil {
				t.Fatal(err)
			}
			s, err := one.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			ref := decode(t, s, prompt, steps)
			s.Close()
			var ids []int32
			for _, l := range ref[:steps] {
				ids = append(ids, int32(argmax(l)))
			}
			_, oneTime := teacherForced(t, one, prompt, ids)
			one.Close()
			t.Logf("one GPU, resident: %v a token, ids %v", oneTime, ids)

			_, err = paging.Plan(mustInfo(t, lm), 1, paging.StrategyBalanced, ctxLen, 1, paging.WithChunkTokens(4), paging.WithDevice(g0))
			var be *paging.BudgetError
			if !asBudgetError(err, &be) {
				t.Fatalf("probe plan: %v", err)
			}
			streamBudget := be.Needed + lm.WeightBytes()/4
			var peerLogits [][]float32
			for _, tc := range []struct {
				name     string
				budget   int64
				strategy paging.Strategy
				noPeer   bool
			}{
				{"resident", 0, "", false},
				{"resident, through host memory", 0, "", true},
				{"streamed", streamBudget, paging.StrategyBalanced, false},
				{"hybrid", streamBudget, paging.StrategyHybrid, false},
			} {
				t.Run(tc.name, func(t *testing.T) {
					o := Options{Backends: []tensor.Backend{g0, g1}, Context: ctxLen, Chunk: 4, NoPeerCopies: tc.noPeer, Memory: Memory{Strategy: tc.strategy}}
					if tc.budget > 0 {
						o.Memory.Budgets = []int64{tc.budget}
					}
					e, err := Open(ctx, lm, o)
					if err != nil {
						t.Fatal(err)
					}
					defer e.Close()
					if h := e.Hybrid(); h != nil {
						t.Logf("hybrid: CPU layers %v, predicted %.1f tok/s", h.CPULayers(), h.Totals().PredictedTokS)
					}
					got, per := teacherForced(t, e, prompt, ids)
					// The same kernels on the same shapes: one GPU's logits;
					// the CPU's layers of the hybrid plan round otherwise.
					tol := 1e-3
					if tc.strategy == paging.StrategyHybrid {
						tol = 3e-2
					}
					worst, flips := 0.0, 0
					for i := range got {
						worst = max(worst, maxDiff(got[i], ref[i]))
						if argmax(got[i]) != argmax(ref[i]) && margin(ref[i]) >= 2*tol {
							flips++
						}
					}
					t.Logf("two GPUs, %s: %v a token (one GPU %v, %.2fx), logits within %.3g of one GPU's", tc.name, per, oneTime, float64(per)/float64(oneTime), worst)
					if !(worst <= tol) || flips > 0 {
						t.Errorf("logits differ from one GPU's by %g (want <= %g), %d greedy ids differ where the margin is >= %g", worst, tol, flips, 2*tol)
					}
					switch tc.name {
					case "resident":
						peerLogits = got
					case "resident, through host memory":
						if peerLogits == nil {
							t.Skip("no peer run to compare with (filtered out)")
						}
						for i := range got {
							if d := maxDiff(got[i], peerLogits[i]); d != 0 {
								t.Errorf("step %d: the hand-over through host memory changes the logits by %g", i, d)
							}
						}
					}
					for _, d := range e.Devices() {
						if tc.budget > 0 && d.PeakDeviceBytes > tc.budget {
							t.Errorf("%s: peak %d over the budget %d", d.Name, d.PeakDeviceBytes, tc.budget)
						}
					}
					if r := e.Experts(); r != nil {
						t.Logf("%s", r)
						if !strings.Contains(r.String(), "device 1 ("+g1.Name()+")") {
							t.Errorf("expert report without device 1:\n%s", r)
						}
					}
				})
			}
		})
	}
}

func argmax(l []float32) int {
	best := 0
	for i, v := range l {
		if v > l[best] || math.IsNaN(float64(l[best])) {
			best = i
		}
	}
	return best
}

// TestCUDATwoGPUsBatched: the batcher over two GPUs (resident, and with
// the hybrid strategy) gives each request the greedy ids of its session
// run alone on the same engine, and logs the steps' mean batch size.
func TestCUDATwoGPUsBatched(t *testing.T) {
	g0, g1 := openTwoCUDA(t)
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77, 12, 8, 40, 2, 6}, {7}, {3, 4, 5, 6, 7}}
	for _, strategy := range []paging.Strategy{paging.StrategyNone, paging.StrategyHybrid} {
		t.Run(fmt.Sprint(strategy), func(t *testing.T) {
			o := Options{Backends: []tensor.Backend{g0, g1}, Context: 32, Chunk: 8, KVPositions: 64, Memory: Memory{Strategy: strategy}}
			if strategy == paging.StrategyHybrid {
				o.Memory.Budgets = []int64{lm.WeightBytes()/3 + 64<<20}
			}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			want, _ := runAlone(t, e, prompts, 5)
			got, st := runBatched(t, e, prompts, 5, BatchOptions{MaxSequences: 4, StepTokens: 8, BlockSize: 4, KVBlocks: 16})
			for i := range prompts {
				if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) {
					t.Errorf("request %d: %v, alone %v", i, got[i], want[i])
				}
			}
			t.Logf("%s: %d steps, mean batch %.2f", strategy, st.Steps, float64(st.BatchSizeSum)/float64(max(st.Steps, 1)))
		})
	}
}
