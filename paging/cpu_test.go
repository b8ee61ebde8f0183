package paging

import (
	"context"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestCPUBackend pages a model on the real CPU backend: the weights keep
// their stored dtype (F16 here) in budgeted memory, and the budget holds
// exactly their stored bytes, with no F32 copy.
func TestCPUBackend(t *testing.T) {
	src := llamaSynth(4, 32, 64, 16, 64)
	info := smallDims(src, 4)
	W, _ := totalAndMax(info)
	p0, _ := Plan(info, 1<<40, StrategyBalanced, 8, 1)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W*7/10
	plan, err := Plan(info, budget, StrategyBalanced, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	bg := newBudget(t, cpu, budget, "")
	free := nnReserve(t, bg, plan)
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		for l := range src.NumLayers() {
			ws, err := pg.Acquire(context.Background(), l)
			if err != nil {
				t.Fatal(err)
			}
			if err := check(cpu, src, l, ws); err != nil {
				t.Fatal(err)
			}
			var stored int64
			for _, w := range ws {
				if w.DType() != tensor.F16 {
					t.Fatalf("layer %d: weight in %v, stored as F16", l, w.DType())
				}
				stored += w.NumBytes()
			}
			if stored != info.Layers[l].Bytes {
				t.Fatalf("layer %d: %d bytes on the device, %d stored", l, stored, info.Layers[l].Bytes)
			}
			pg.Release(l)
		}
	}
	waitIdle(pg)
	if got := bg.UsedBy(ResidentWeights); got != plan.ResidentBytes {
		t.Errorf("resident weights charge %d bytes, plan's stored bytes %d", got, plan.ResidentBytes)
	}
	if bg.Peak() > budget {
		t.Errorf("peak %d over %d", bg.Peak(), budget)
	}
	t.Log("\n" + bg.Summary())
	free()
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pg.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := bg.Close(); err != nil || bg.Used() != 0 {
		t.Fatalf("budget Close: %v, %d still charged", err, bg.Used())
	}
}
