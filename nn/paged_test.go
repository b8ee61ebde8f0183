package nn

import (
	"context"
	"errors"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// newBudget is paging.NewBudget for a test.
func newBudget(t testing.TB, b tensor.Memory, limit int64, device string) *paging.Budget {
	t.Helper()
	bud, err := paging.NewBudget(b, limit, device)
	if err != nil {
		t.Fatal(err)
	}
	return bud
}

// generateIDs runs a prompt and greedy decoding, returning every logit it
// saw and the ids it chose.
func generateIDs(t *testing.T, m *Model, prompt []int32, steps, maxPos, chunk int) ([]float32, []int32) {
	t.Helper()
	s, err := m.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	logits, err := s.Forward(ctx, prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	all := append([]float32(nil), logits...)
	last := logits[len(logits)-m.cfg.VocabSize:]
	var ids []int32
	for range steps {
		id := int32(Argmax(last))
		ids = append(ids, id)
		if last, err = s.Forward(ctx, []int32{id}, false, nil); err != nil {
			t.Fatal(err)
		}
		all = append(all, last...)
	}
	return all, ids
}

// TestPagedBitIdentical runs the F16 fixture with every strategy under a
// budget that holds only the ring, and under one with room to spare, and
// asserts the logits and ids are bit-identical to running with every weight
// resident; the budget's peak never passes its limit and nothing is left
// allocated after Close.
func TestPagedBitIdentical(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	const steps, maxPos, chunk = 12, 32, 8

	b := tensor.NewCPU(1)
	defer b.Close()
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := New(cfg, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	wantLogits, wantIDs := generateIDs(t, ref, prompt, steps, maxPos, chunk)
	hw.Close()

	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The smallest budget any streaming plan accepts.
	_, err = paging.Plan(info, 1, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("a 1-byte budget planned: %v", err)
	}
	minBudget := be.Needed
	for _, strategy := range []paging.Strategy{paging.StrategyNone, paging.StrategyMinimal, paging.StrategyBalanced, paging.StrategyAggressive} {
		for _, budget := range []int64{minBudget, minBudget + lm.WeightBytes()/2, 1 << 30} {
			plan, err := paging.Plan(info, budget, strategy, maxPos, 1, paging.WithChunkTokens(chunk))
			if strategy == paging.StrategyNone && budget < 1<<30 {
				if err == nil {
					t.Errorf("strategy none planned a model of %d bytes in %d", lm.WeightBytes(), budget)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s at %d: %v", strategy, budget, err)
			}
			bud := newBudget(t, b, budget, "cpu")
			pager, err := paging.NewPager(Source(lm), bud, plan, paging.Options{})
			if err != nil {
				t.Fatal(err)
			}
			m, err := New(cfg, b, bud, pager)
			if err != nil {
				t.Fatal(err)
			}
			gotLogits, gotIDs := generateIDs(t, m, prompt, steps, maxPos, chunk)
			for i := range wantIDs {
				if gotIDs[i] != wantIDs[i] {
					t.Fatalf("%s at %d bytes: ids %v, resident run %v", strategy, budget, gotIDs, wantIDs)
				}
			}
			for i := range wantLogits {
				if gotLogits[i] != wantLogits[i] {
					t.Fatalf("%s at %d bytes: logit %d is %v, resident run %v", strategy, budget, i, gotLogits[i], wantLogits[i])
				}
			}
			// At the smallest budget the weights must have streamed: more
			// bytes moved than the model holds.
			if st := pager.Stats(); budget == minBudget && st.BytesHostToDevice <= lm.WeightBytes() {
				t.Errorf("%s at the minimum budget moved only %d bytes for %d of weights", strategy, st.BytesHostToDevice, lm.WeightBytes())
			}
			if bud.Peak() > budget {
				t.Errorf("%s: peak %d over the budget %d", strategy, bud.Peak(), budget)
			}
			if err := pager.Close(); err != nil {
				t.Error(err)
			}
			if err := bud.Close(); err != nil {
				t.Errorf("%s: %v", strategy, err)
			}
			if bud.Used() != 0 {
				t.Errorf("%s: %d bytes still allocated after Close", strategy, bud.Used())
			}
		}
	}
}

// TestReserveCountsWhatNNAllocates: the reserve nn gives the planner adds
// up to its own byte counts, for a session (KV cache, rotary tables,
// forward buffers, the logits only with the head) and for training.
func TestReserveCountsWhatNNAllocates(t *testing.T) {
	cfg := &arch.Config{HiddenSize: 64, IntermediateSize: 172, NumLayers: 5, NumHeads: 4, NumKVHeads: 2, HeadDim: 16, VocabSize: 300, RopeTheta: 1e4}
	r := Reserve(cfg)
	const maxPos, chunk, batch = 37, 9, 2
	bytes := func(r paging.Reserve, cat paging.Category, blocks int) int64 {
		return r.Bytes(cat, blocks, maxPos, chunk, batch, nil)
	}
	if got, want := bytes(r, paging.KVCache, cfg.NumLayers), batch*KVCacheBytes(cfg, maxPos); got != want {
		t.Errorf("KV cache %d, want %d", got, want)
	}
	if got, want := bytes(r, paging.Workspace, cfg.NumLayers), batch*(RopeBytes(cfg, maxPos)+GraphPositionBytes); got != want {
		t.Errorf("rotary tables and the graphs' position %d, want %d", got, want)
	}
	if got, want := bytes(r, paging.Activations, cfg.NumLayers), batch*ActivationBytes(cfg, chunk); got != want {
		t.Errorf("activations %d, want %d", got, want)
	}
	info := paging.ModelInfo{Layers: make([]paging.LayerInfo, cfg.NumLayers+2), NumLayers: cfg.NumLayers, Reserve: r}
	first := info.Stage(paging.Placement{FirstBlock: 0, EndBlock: 2, Layers: []int{0, 1, 2}})
	if got, want := bytes(first.Reserve, paging.Activations, 2), batch*(ActivationBytes(cfg, chunk)-4*chunk*int64(cfg.VocabSize)); got != want {
		t.Errorf("a stage without the head: activations %d, want %d (no logits)", got, want)
	}
	for _, onDevice := range []bool{false, true} {
		tr := TrainReserve(cfg, 20, 2, onDevice)
		var got int64
		for _, c := range []paging.Category{paging.KVCache, paging.Activations, paging.Workspace, paging.Gradients} {
			got += bytes(tr, c, cfg.NumLayers)
		}
		want := TrainWorkspaceBytes(cfg, 20, 2)
		if onDevice {
			want += TrainGradientBytes(cfg)
		}
		if got != want || bytes(tr, paging.KVCache, cfg.NumLayers) != 0 {
			t.Errorf("training reserve (gradients on the device %v): %d, want %d and no KV cache", onDevice, got, want)
		}
	}
}
