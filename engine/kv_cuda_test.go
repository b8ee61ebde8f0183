package engine

import (
	"context"
	"math"
	"slices"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestCUDAKVCacheInHostMemory runs the dense fixtures on a GPU with their
// KV cache in host memory, under a budget that cannot hold the cache on
// the device at the fixtures' full context (256 positions), three ways:
// decode attending on the CPU (rates with a CPU faster than the link),
// decode over rows uploaded to the device (rates with a slow CPU), and
// auto with the rates measured on the machine. The prompt runs in chunks
// of 4 from 4 tokens, so its later chunks upload the earlier rows on the
// copy engine into the alternating scratch; and the hybrid strategy with
// two layers on the CPU and the GPU's blocks' caches in host memory. It
// checks: the prompt's
// logits at every position within the GPU tolerance (2e-2) of
// transformers'; 8 greedy decode steps' logits within 2e-2 of the same
// GPU with the whole cache on the device and no budget (and the same ids
// where that run's margin is above 2e-2); the budget's peak within the
// budget and the plan; the CPU attending in every decode step of every
// host block when it should, and never when the rows upload; the pinned
// host memory returned at Close. It logs the plan and the KV report (time
// in CPU attention, bytes moved). It skips without a CUDA device.
func TestCUDAKVCacheInHostMemory(t *testing.T) {
	gpu, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	defer gpu.Close()
	ctx := context.Background()
	const ctxLen, chunk, steps = 256, 4, 8
	fastCPU := paging.Rates{H2D: 10e9, CPU: 50e9, Handoff: 0, Device: 1e12}
	slowCPU := paging.Rates{H2D: 50e9, CPU: 1e9, Device: 1e12}
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16, fixtures.TinyQwen3F16} {
		lm := openFixture(t, name)
		ids, wantLogits := fixtureReference(t, name)
		V := lm.Config.VocabSize
		// The reference: the whole cache on the GPU, no budget.
		ref, err := Open(ctx, lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: chunk})
		if err != nil {
			t.Fatal(err)
		}
		refSteps := greedySteps(t, ref, ids, steps)
		ref.Close()

		// A budget between the least a plan with every block's cache in
		// host memory needs and the least one with it on the device needs.
		info := mustInfo(t, lm)
		need := func(kv paging.KVPlacement) int64 {
			_, err := paging.Plan(info, 1, paging.StrategyBalanced, ctxLen, 1, paging.WithChunkTokens(chunk), paging.WithDevice(gpu), paging.WithKVPlacement(kv))
			var be *paging.BudgetError
			if !asBudgetError(err, &be) {
				t.Fatalf("probe plan: %v", err)
			}
			return be.Needed
		}
		hostNeed, devNeed := need(paging.KVHost), need(paging.KVDevice)
		budget := hostNeed + (devNeed-hostNeed)/2
		t.Logf("%s: least budget with the KV cache in host memory %d bytes, on the device %d: testing at %d", name, hostNeed, devNeed, budget)
		// The hybrid strategy with two layers on the CPU: its budget is
		// found the same way.
		needHybrid := func(kv paging.KVPlacement) int64 {
			_, err := paging.PlanHybrid(info, 1, ctxLen, 1, fastCPU, paging.HybridOptions{Mode: paging.HybridForced, CPULayers: 2},
				paging.WithChunkTokens(chunk), paging.WithDevice(gpu), paging.WithKVPlacement(kv))
			var be *paging.BudgetError
			if !asBudgetError(err, &be) {
				t.Fatalf("probe hybrid plan: %v", err)
			}
			return be.Needed
		}
		hHost, hDev := needHybrid(paging.KVHost), needHybrid(paging.KVDevice)
		hybridBudget := hHost + (hDev-hHost)/2
		for _, tc := range []struct {
			what       string
			kv         paging.KVPlacement
			rates      *paging.Rates
			cpu, never bool // decode attends on the CPU in every step of the GPU's blocks / in none
			hybrid     bool
		}{
			{"host, decode on the CPU", paging.KVHost, &fastCPU, true, false, false},
			{"host, decode over uploaded rows", paging.KVHost, &slowCPU, false, true, false},
			{"auto, measured rates", paging.KVAuto, nil, false, false, false},
			{"hybrid, two CPU layers, host, decode on the CPU", paging.KVHost, &fastCPU, true, false, true},
		} {
			t.Run(name+"/"+tc.what, func(t *testing.T) {
				mem := Memory{Budgets: []int64{budget}, KVCache: tc.kv}
				if tc.hybrid {
					mem = Memory{Budgets: []int64{hybridBudget}, KVCache: tc.kv, Strategy: paging.StrategyHybrid, CPULayers: 2}
				}
				e, err := Open(ctx, lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: chunk, TwinMinTokens: chunk,
					Memory: mem, Rates: tc.rates})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				plan := e.Devices()[0].Plan
				t.Logf("%s", plan)
				if h := e.Hybrid(); h != nil {
					t.Logf("%s", h.Plan)
				}
				if len(plan.KVHostBlocks) == 0 {
					t.Fatalf("no block's KV cache in host memory")
				}
				// The blocks the GPU computes, whose attention the CPU
				// takes over in decode (the CPU's own blocks attend on the
				// CPU anyway).
				n := int64(0)
				for b := range lm.Config.NumLayers {
					if h := e.Hybrid(); h == nil || !slices.Contains(h.Plan.CPULayers, lm.Config.BlockLayer(b)) {
						n++
					}
				}
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
				t.Logf("prompt logits: max abs difference from transformers %.3g", worst)
				if !(worst <= 2e-2) {
					t.Errorf("prompt logits differ from transformers by %g, want <= 2e-2", worst)
				}
				kv0 := e.KV()
				last := logits[len(logits)-V:]
				worst = 0
				for i, want := range refSteps {
					id := int32(nn.Argmax(last))
					if margin(want.prev) > 2e-2 && id != want.id {
						t.Fatalf("step %d: id %d, the device-KV run chose %d", i, id, want.id)
					}
					if last, err = s.Forward(ctx, []int32{want.id}, false, nil); err != nil {
						t.Fatal(err)
					}
					for j := range last {
						worst = max(worst, math.Abs(float64(last[j]-want.logits[j])))
					}
				}
				t.Logf("decode logits: max abs difference from the device-KV run %.3g", worst)
				if !(worst <= 2e-2) {
					t.Errorf("decode logits differ from the device-KV run by %g, want <= 2e-2", worst)
				}
				r := e.KV()
				t.Logf("%s", r)
				if d := r.CPUAttentions - kv0.CPUAttentions; tc.cpu && d != steps*n || tc.never && d != 0 {
					t.Errorf("%d CPU attentions in %d steps of %d host blocks (want every step: %v, none: %v)", d, steps, n, tc.cpu, tc.never)
				}
				if r.UploadBytes == 0 {
					t.Errorf("no KV rows uploaded for the prompt's later chunks")
				}
				if peak := e.Devices()[0].PeakDeviceBytes; peak > mem.Budgets[0] || peak > plan.PredictedPeakBytes {
					t.Errorf("peak %d, budget %d, planned %d", peak, mem.Budgets[0], plan.PredictedPeakBytes)
				}
				s.Close()
				if err := e.Close(); err != nil {
					t.Fatal(err)
				}
				if h := e.HostHeldBytes(); h != 0 {
					t.Errorf("%d bytes of pinned host memory held after Close", h)
				}
			})
		}
	}
}

// greedyStep is one greedy decode step of a reference run: the logits it
// chose from (prev), its id, and the logits after it.
type greedyStep struct {
	prev   []float32
	id     int32
	logits []float32
}

// greedySteps runs prompt and steps greedy decode steps on e.
func greedySteps(t *testing.T, e *Engine, prompt []int32, steps int) []greedyStep {
	t.Helper()
	s, err := e.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	last, err := s.Forward(context.Background(), prompt, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []greedyStep
	for range steps {
		st := greedyStep{prev: append([]float32(nil), last...), id: int32(nn.Argmax(last))}
		if last, err = s.Forward(context.Background(), []int32{st.id}, false, nil); err != nil {
			t.Fatal(err)
		}
		st.logits = append([]float32(nil), last...)
		out = append(out, st)
	}
	return out
}

// margin is the top logit less the second.
func margin(l []float32) float64 {
	a, b := math.Inf(-1), math.Inf(-1)
	for _, v := range l {
		switch x := float64(v); {
		case x > a:
			a, b = x, a
		case x > b:
			b = x
		}
	}
	return a - b
}
