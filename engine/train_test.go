package engine

import (
	"context"
	"errors"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestOpenTraining: the gradients are the same computed on the parameters
// directly (the CPU with no budget) and with the layers paged under a
// budget that streams them, which moves weight bytes every call; a budget
// too small says the smallest one.
func TestOpenTraining(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	params, err := nn.LoadParams(context.Background(), lm)
	if err != nil {
		t.Fatal(err)
	}
	inputs, targets := nn.NextToken([]int32{1, 5, 9, 200, 3, 77, 12, 400, 8})
	grads := func(o Options) (nn.Grads, *Training) {
		t.Helper()
		tr, err := OpenTraining(context.Background(), params, o, nn.TrainOptions{Segments: 2}, len(inputs))
		if err != nil {
			t.Fatal(err)
		}
		g := nn.Grads{}
		if err := tr.With(func(tr *nn.Trainer) error {
			_, err := tr.LossAndGrads(context.Background(), inputs, targets, g, 1)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return g, tr
	}
	direct, tr := grads(Options{Backends: cpus(1)})
	if tr.Budget() != nil {
		t.Error("the CPU with no budget pages its layers")
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	paged, tr := grads(Options{Backends: cpus(1), Memory: Memory{Budgets: []int64{400 << 10}}})
	if tr.Budget() == nil || tr.MovedPerCall() == 0 {
		t.Errorf("a 400 KiB budget: budget %v, %d bytes moved", tr.Budget(), tr.MovedPerCall())
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	for name, g := range direct {
		a, b := g.F32(), paged[name].F32()
		for i := range a {
			if a[i] != b[i] {
				t.Fatalf("%s[%d]: %v paged, %v direct", name, i, b[i], a[i])
			}
		}
	}
	_, err = OpenTraining(context.Background(), params, Options{Backends: []tensor.Backend{tensor.NewCPU(1)}, Memory: Memory{Budgets: []int64{1000}}}, nn.TrainOptions{}, len(inputs))
	if !errors.Is(err, paging.ErrBudgetTooSmall) {
		t.Errorf("a 1000-byte budget: %v, want ErrBudgetTooSmall", err)
	}
}
