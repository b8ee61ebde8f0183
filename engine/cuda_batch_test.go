package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// TestCUDABatcherPlacements runs the batcher on a GPU under every
// placement of one device: resident, streamed under a budget, the hybrid
// strategy (layers on the CPU), the KV cache in host memory (alone and
// with hybrid), both unified memory modes, and Q8_0 and Q4_K weights
// resident and streamed. Six requests of mixed prompt lengths run
// batched, then each alone through the same batcher: the greedy ids of at
// most one may differ (a near tie that the GPU's products of several rows
// round the other way; each difference is logged), every KV block is
// free after them, a step ran several sequences, the peak stays within
// the budget and after Close the budget holds what it held before (less
// the allocator's cache). The host KV runs count their CPU attentions.
// It logs each placement's plan, steps and mean batch. It skips without
// a CUDA device.
func TestCUDABatcherPlacements(t *testing.T) {
	gpu, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
	if err != nil {
		t.Skipf("no CUDA device: %v", err)
	}
	defer gpu.Close()
	ctx := context.Background()
	const ctxLen, block, blocks = 64, 16, 16
	cpuHeavy := paging.Rates{H2D: 1e9, CPU: 50e9, H2DShared: 1e9, CPUShared: 50e9, Device: 1e12}
	f16 := openFixture(t, fixtures.TinyLlamaF16Sharded)
	q8 := openGGUF(t, fixtures.TinyLlamaF16Sharded, quant.Q8_0)
	q4k := synthGGUF(t, quant.Q4_K)
	// budget is the device's fixed memory, the reserves (with the pool's
	// room) and a third of the weights: most layers stream.
	budget := func(t *testing.T, lm *loader.Model) int64 {
		_, err := paging.Plan(mustInfo(t, lm), 1, paging.StrategyBalanced, ctxLen, 1, paging.WithChunkTokens(8), paging.WithDevice(gpu), paging.WithKVPositions(blocks*block))
		var be *paging.BudgetError
		if !asBudgetError(err, &be) {
			t.Fatalf("probe plan: %v", err)
		}
		return be.Needed + lm.WeightBytes()/3
	}
	for _, tc := range []struct {
		name     string
		lm       *loader.Model
		mem      Memory
		budget   bool
		rates    *paging.Rates
		managed  bool
		hostKV   bool
		streamed bool // the plan must stream something
	}{
		{name: "resident", lm: f16},
		{name: "streamed", lm: f16, mem: Memory{Strategy: paging.StrategyBalanced}, budget: true, streamed: true},
		{name: "hybrid", lm: f16, mem: Memory{Strategy: paging.StrategyHybrid}, budget: true, rates: &cpuHeavy},
		{name: "host KV", lm: f16, mem: Memory{KVCache: paging.KVHost, Strategy: paging.StrategyBalanced}, budget: true, rates: &cpuHeavy, hostKV: true},
		{name: "hybrid host KV", lm: f16, mem: Memory{KVCache: paging.KVHost, Strategy: paging.StrategyHybrid}, budget: true, rates: &cpuHeavy, hostKV: true},
		{name: "unified", lm: f16, mem: Memory{Mode: paging.ModeUnified}, budget: true, managed: true},
		{name: "unified-noprefetch", lm: f16, mem: Memory{Mode: paging.ModeUnifiedNoPrefetch}, budget: true, managed: true},
		{name: "Q8_0 resident", lm: q8},
		{name: "Q8_0 streamed", lm: q8, mem: Memory{Strategy: paging.StrategyBalanced}, budget: true, streamed: true},
		{name: "Q4_K resident", lm: q4k},
		{name: "Q4_K streamed", lm: q4k, mem: Memory{Strategy: paging.StrategyBalanced}, budget: true, streamed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, ok := tensor.Managed(gpu); tc.managed && !ok {
				t.Skipf("%s has no unified memory", gpu.Name())
			}
			mem := tc.mem
			var limit int64
			if tc.budget {
				limit = budget(t, tc.lm)
				mem.Budgets = []int64{limit}
			}
			e, err := Open(ctx, tc.lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: 8, KVPositions: blocks * block, Memory: mem, Rates: tc.rates})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			plan := e.Devices()[0].Plan
			t.Logf("budget %d: strategy %s, mode %s, %d bytes streamed a token; KV %s", limit, e.Strategy(), e.Mode(), plan.StreamedBytes, e.KV())
			if h := e.Hybrid(); h != nil {
				t.Logf("%s", h.Plan)
			}
			if tc.streamed && plan.StreamedBytes == 0 {
				t.Fatal("the budget streams nothing")
			}
			if tc.hostKV && len(e.KV().HostBlocks) == 0 {
				t.Fatal("no block's KV cache in host memory")
			}
			// The bytes the budget holds, less the allocator's cached free
			// blocks (the pool's, once freed, may stay there).
			held := func() int64 { bg := e.budgets[0]; return bg.Used() - bg.UsedBy(paging.Cached) }
			before := held()
			b, err := e.NewBatcher(BatchOptions{MaxSequences: 4, StepTokens: 8, BlockSize: block, KVBlocks: blocks})
			if err != nil {
				t.Fatal(err)
			}
			r := rand.New(rand.NewPCG(9, uint64(len(tc.name))))
			var reqs []Request
			for range 6 {
				p := make([]int32, 1+r.IntN(20))
				for j := range p {
					p[j] = int32(r.IntN(tc.lm.Config.VocabSize))
				}
				reqs = append(reqs, Request{Prompt: p, MaxTokens: 8, IgnoreEOS: true})
			}
			kv0 := e.KV().KVStats
			t0 := time.Now()
			got := make([][]int32, len(reqs))
			ends := make([]Token, len(reqs))
			var wg sync.WaitGroup
			for i, req := range reqs {
				ch, err := b.Submit(ctx, req)
				if err != nil {
					t.Fatal(err)
				}
				wg.Add(1)
				go func() { defer wg.Done(); got[i], ends[i] = collect(t, ch) }()
			}
			wg.Wait()
			batched := time.Since(t0)
			st := b.Stats()
			kv1 := e.KV().KVStats
			differ := 0
			for i, req := range reqs {
				ch, err := b.Submit(ctx, req)
				if err != nil {
					t.Fatal(err)
				}
				alone, end := collect(t, ch)
				if ends[i].Err != nil || end.Err != nil {
					t.Fatalf("request %d: ended with %v batched, %v alone", i, ends[i].Err, end.Err)
				}
				if fmt.Sprint(got[i]) != fmt.Sprint(alone) {
					differ++
					t.Logf("request %d (prompt %d tokens): %v batched, %v alone", i, len(req.Prompt), got[i], alone)
				}
			}
			t.Logf("%d requests batched in %v: %d steps, mean batch %.2f, %.1f rows a step; %d of them differ from the request alone; CPU attentions %d (%v)",
				len(reqs), batched, st.Steps, float64(st.BatchSizeSum)/float64(max(st.Steps, 1)), float64(st.StepRowsSum)/float64(max(st.Steps, 1)),
				differ, kv1.CPUAttentions-kv0.CPUAttentions, kv1.CPUAttention-kv0.CPUAttention)
			if differ > 1 {
				t.Errorf("%d of %d requests' greedy ids differ batched and alone: more than a near tie explains", differ, len(reqs))
			}
			if st.BatchSizeSum <= st.Steps {
				t.Errorf("no step ran more than one sequence: %+v", st)
			}
			if tc.hostKV && kv1.CPUAttentions == kv0.CPUAttentions {
				t.Error("the batched steps attended on the device: no CPU attention over the host pool")
			}
			if st := b.Stats(); st.KVBlocksFree != st.KVBlocks {
				t.Errorf("%d of %d KV blocks free after every request", st.KVBlocksFree, st.KVBlocks)
			}
			if err := b.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if peak := e.Devices()[0].PeakDeviceBytes; limit > 0 && peak > limit {
				t.Errorf("peak %d over the budget %d", peak, limit)
			}
			if after := held(); after != before {
				t.Errorf("the budget holds %d bytes (less its cache) after the batcher, %d before", after, before)
			}
		})
	}
}
