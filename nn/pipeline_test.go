package nn

import (
	"context"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestPipelineMatchesOneDevice spreads the F16 fixture, and the Mixtral
// and Qwen3-MoE ones, over two and three "devices" (CPU backends with
// budgets of their own), placed in proportion to the budgets, each
// streaming within its budget, and checks logits and ids are bit-identical
// to one device, each device's session takes what the planner reserved for
// it, no device passes its budget, and every byte is returned.
func TestPipelineMatchesOneDevice(t *testing.T) {
	type pipelineCase struct {
		name     string
		budgets  []int64
		strategy paging.Strategy
	}
	for _, fx := range []struct {
		name  string
		cases func(weights int64) []pipelineCase
	}{
		{fixtures.TinyLlamaF16Sharded, func(int64) []pipelineCase {
			return []pipelineCase{
				{"two devices, everything resident", []int64{1 << 30, 1 << 30}, paging.StrategyNone},
				{"two unequal budgets, streaming", []int64{260 << 10, 360 << 10}, paging.StrategyBalanced},
				{"three devices, minimal", []int64{170 << 10, 170 << 10, 200 << 10}, paging.StrategyMinimal},
			}
		}},
		{fixtures.TinyMixtralBF16, func(w int64) []pipelineCase {
			return []pipelineCase{
				{"two devices, everything resident", []int64{1 << 30, 1 << 30}, paging.StrategyNone},
				{"two unequal budgets, streaming", []int64{w * 2 / 5, w / 2}, paging.StrategyBalanced},
			}
		}},
		{fixtures.TinyQwen3MoEF16, func(w int64) []pipelineCase {
			return []pipelineCase{
				{"two devices, minimal", []int64{w * 2 / 5, w * 2 / 5}, paging.StrategyMinimal},
			}
		}},
	} {
		t.Run(fx.name, func(t *testing.T) {
			lm, err := loader.Open(fixtures.Dir(fx.name))
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			for _, tc := range fx.cases(lm.WeightBytes()) {
				t.Run(tc.name, func(t *testing.T) {
					testPipeline(t, lm, tc.budgets, tc.strategy)
				})
			}
		})
	}
}

// testPipeline runs lm on one CPU device with every weight resident, then
// as a pipeline over devices with the given budgets, and compares.
func testPipeline(t *testing.T, lm *loader.Model, budgetsOf []int64, strategy paging.Strategy) {
	ctx := context.Background()
	cfg := lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	const maxPos, chunk = 32, 8
	one := tensor.NewCPU(1)
	defer one.Close()
	hw, err := LoadWeights(ctx, lm, one, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := New(cfg, one, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	wantLogits, wantIDs := generateIDs(t, ref, prompt, 10, maxPos, chunk)
	hw.Close()

	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	places, err := paging.PlaceLayers(info, budgetsOf)
	if err != nil {
		t.Fatal(err)
	}
	var stages []Stage
	var plans []*paging.PlanResult
	var budgets []*paging.Budget
	var servers []paging.Server
	defer func() {
		for _, s := range servers {
			s.Close()
		}
		for _, b := range budgets {
			if err := b.Close(); err != nil {
				t.Error(err)
			}
			if b.Used() != 0 {
				t.Errorf("%s: %d bytes left after Close", b.Device(), b.Used())
			}
		}
	}()
	for d, p := range places {
		b := tensor.NewCPU(1)
		defer b.Close()
		plan, err := paging.Plan(info.Stage(p), p.Budget, strategy, maxPos, 1, paging.WithChunkTokens(chunk))
		if err != nil {
			t.Fatalf("device %d (%d bytes for layers %v): %v", d, p.Budget, p.Layers, err)
		}
		plans = append(plans, plan)
		bud := newBudget(t, b, p.Budget, b.Name())
		budgets = append(budgets, bud)
		srv, err := paging.NewPager(StageSource(Source(lm), p.Layers), bud, plan, paging.Options{})
		if err != nil {
			t.Fatal(err)
		}
		servers = append(servers, srv)
		stages = append(stages, Stage{Backend: b, Alloc: bud, Weights: StageWeights(srv, p.Layers), FirstBlock: p.FirstBlock, EndBlock: p.EndBlock})
	}
	pl, err := NewPipeline(cfg, stages)
	if err != nil {
		t.Fatal(err)
	}
	s, err := pl.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	// Each stage's session takes what Reserve told the planner for the
	// stage: its blocks' KV cache, the forward buffers with the logits
	// only on the last stage, the rotary tables.
	for d, bud := range budgets {
		p := plans[d]
		if kv, act, ws := bud.UsedBy(paging.KVCache), bud.UsedBy(paging.Activations), bud.UsedBy(paging.Workspace); kv != p.KVCacheBytes || act != p.ActivationBytes || ws != p.WorkspaceBytes {
			t.Errorf("device %d (layers %v): session holds KV %d, activations %d, workspace %d; plan reserved %d, %d, %d",
				d, places[d].Layers, kv, act, ws, p.KVCacheBytes, p.ActivationBytes, p.WorkspaceBytes)
		}
	}
	logits, err := s.Forward(ctx, prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := append([]float32(nil), logits...)
	last := logits[len(logits)-cfg.VocabSize:]
	var ids []int32
	for range wantIDs {
		id := int32(Argmax(last))
		ids = append(ids, id)
		if last, err = s.Forward(ctx, []int32{id}, false, nil); err != nil {
			t.Fatal(err)
		}
		got = append(got, last...)
	}
	s.Close()
	for i := range wantIDs {
		if ids[i] != wantIDs[i] {
			t.Fatalf("ids %v, one device %v", ids, wantIDs)
		}
	}
	for i := range wantLogits {
		if got[i] != wantLogits[i] {
			t.Fatalf("logit %d: %v, one device %v", i, got[i], wantLogits[i])
		}
	}
	if strategy != paging.StrategyNone {
		moved := int64(0)
		for _, srv := range servers {
			moved += srv.Stats().BytesHostToDevice
		}
		if moved <= lm.WeightBytes() {
			t.Errorf("moved %d bytes for %d of weights: nothing streamed", moved, lm.WeightBytes())
		}
	}
	for d, b := range budgets {
		if b.Peak() > budgetsOf[d] {
			t.Errorf("device %d peaked at %d over its budget %d", d, b.Peak(), budgetsOf[d])
		}
	}
}

// TestPipelineGap: stages that leave a gap are refused.
func TestPipelineGap(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	one := tensor.NewCPU(1)
	defer one.Close()
	if _, err := NewPipeline(cfg, []Stage{{Backend: one, FirstBlock: 0, EndBlock: 1}, {Backend: one, FirstBlock: 2, EndBlock: 4}}); err == nil {
		t.Error("a pipeline with a gap was accepted")
	}
}
