//go:build cuda

package cuda

import (
	"context"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
)

// TestModelsLeaveNothing runs the F16 fixture through package nn on the GPU
// (generation with every weight resident and paged in every memory mode,
// training resident and paged) and checks, in the backend's own
// accounts, that once every model, server, pager and trainer is closed no
// device, pinned or managed bytes remain. The results themselves are
// checked by nn's tests (TestCUDAFixtures, TestCUDATrainGrads), which see
// the backend only through the registry.
func TestModelsLeaveNothing(t *testing.T) {
	b := openGPU(t)
	ctx := context.Background()
	dir, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir()) // the embedded copy: this binary may run far from the sources
	if err != nil {
		t.Fatal(err)
	}
	lm, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14}
	generate := func(m *nn.Model) {
		t.Helper()
		s, err := m.NewSession(32, 8)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		logits, err := s.Forward(ctx, prompt, false, nil)
		for range 4 {
			if err != nil {
				t.Fatal(err)
			}
			logits, err = s.Forward(ctx, []int32{int32(nn.Argmax(logits))}, false, nil)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	train := func(m *nn.Model) {
		t.Helper()
		tr, err := nn.CheckpointSequential(m, 2)
		if err != nil {
			t.Fatal(err)
		}
		inputs, targets := nn.NextToken(prompt)
		if _, err := tr.LossAndGrads(ctx, inputs, targets, nn.Grads{}, 1); err != nil {
			t.Fatal(err)
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
	}

	hw, err := nn.LoadWeights(ctx, lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := nn.New(cfg, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	generate(m)
	train(m)
	hw.Close()

	info, err := nn.ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	probe, err := paging.Plan(info, 1<<40, paging.StrategyAggressive, 32, 1, paging.WithChunkTokens(8), paging.WithDevice(b))
	if err != nil {
		t.Fatal(err)
	}
	budget := probe.MinBudgetBytes + lm.WeightBytes()/4
	for _, mode := range []paging.MemoryMode{paging.ModeExplicit, paging.ModeUnified, paging.ModeUnifiedNoPrefetch} {
		plan, err := paging.Plan(info, budget, paging.StrategyBalanced, 32, 1, paging.WithChunkTokens(8), paging.WithDevice(b))
		if err != nil {
			t.Fatal(err)
		}
		bud, err := paging.NewBudget(b, budget, b.Name())
		if err != nil {
			t.Fatal(err)
		}
		srv, err := paging.NewServer(ctx, mode, nn.Source(lm), bud, plan, paging.Options{})
		if err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		pm, err := nn.New(cfg, b, bud, srv)
		if err != nil {
			t.Fatal(err)
		}
		generate(pm)
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
		if err := bud.Close(); err != nil {
			t.Error(err)
		}
	}

	// Training with the layers paged, with room for its activations and
	// the device's gradients beside the plan.
	T := len(prompt) - 1
	info.Reserve = nn.TrainReserve(cfg, T, 2, true)
	opts := []paging.PlanOption{paging.WithChunkTokens(T), paging.WithDevice(b)}
	probe, err = paging.Plan(info, 1<<40, paging.StrategyAggressive, T, 1, opts...)
	if err != nil {
		t.Fatal(err)
	}
	budget = probe.MinBudgetBytes + lm.WeightBytes()/4
	plan, err := paging.Plan(info, budget, paging.StrategyBalanced, T, 1, opts...)
	if err != nil {
		t.Fatal(err)
	}
	bud, err := paging.NewBudget(b, budget, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	pager, err := paging.NewPager(nn.Source(lm), bud, plan, paging.Options{})
	if err != nil {
		t.Fatal(err)
	}
	tm, err := nn.New(cfg, b, bud, pager)
	if err != nil {
		t.Fatal(err)
	}
	train(tm)
	if err := pager.Close(); err != nil {
		t.Error(err)
	}
	if err := bud.Close(); err != nil {
		t.Error(err)
	}

	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	if st := b.Stats(); st.InUse != 0 || st.Pinned != 0 || st.Managed != 0 {
		t.Errorf("after every model closed: %+v", st)
	}
}
