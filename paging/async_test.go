package paging

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// asyncFake is a backend whose UploadAsync copies nothing until its wait
// runs: data read before the wait is stale, so a pager that hands out a
// layer without ordering compute after its copies fails the data check.
type asyncFake struct {
	*fakeBackend
	mu      sync.Mutex
	pending int // waits not yet run
	async   int // uploads that went the asynchronous way
}

func (a *asyncFake) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.pending++
	a.async++
	a.mu.Unlock()
	// Poison the destination: the copy "lands" only on the wait.
	for i := range dst.Bytes()[off : off+int64(len(src))] {
		dst.Bytes()[off+int64(i)] = 0xA5
	}
	var once sync.Once
	return func() error {
		once.Do(func() {
			copy(dst.Bytes()[off:], src)
			a.fakeBackend.uploads.Add(int64(len(src)))
			a.mu.Lock()
			a.pending--
			a.mu.Unlock()
		})
		return nil
	}, nil
}

// TestAsyncUploadsOrdered streams layers through pinned memory with an
// asynchronous uploader under budgets that force evictions, in cyclic,
// reverse and random order: every acquired layer holds its data, every
// wait runs (before use, on eviction or at Close), and nothing leaks.
func TestAsyncUploadsOrdered(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	src := llamaSynth(8, 64, 96, 32, 200)
	info := smallDims(src, 8)
	total, largest := totalAndMax(info)
	for _, frac := range []float64{0.2, 0.5, 0.9} {
		for _, strategy := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive} {
			be := &asyncFake{fakeBackend: newFake()}
			probe, err := Plan(info, 1<<40, StrategyAggressive, 16, 1)
			if err != nil {
				t.Fatal(err)
			}
			budget := max(int64(frac*float64(total)), probe.MinBudgetBytes) + largest/4
			plan, err := Plan(info, budget, strategy, 16, 1)
			if err != nil {
				t.Fatalf("%s at %.0f%%: %v", strategy, 100*frac, err)
			}
			bg := newBudget(t, be, budget, "fake")
			p, err := NewPager(src, bg, plan, Options{})
			if err != nil {
				t.Fatal(err)
			}
			free := nnReserve(t, bg, plan)
			n := p.NumLayers()
			for round := 0; round < 4; round++ {
				sweep(t, p, src, forward(n))
				sweep(t, p, src, reverse(n))
				sweep(t, p, src, rng.Perm(n))
			}
			waitIdle(p)
			free()
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if err := bg.Close(); err != nil {
				t.Fatal(err)
			}
			if be.async == 0 && strategy != StrategyAggressive { // aggressive keeps no host cache: pageable reads
				t.Errorf("%s at %.0f%%: no upload went through UploadAsync", strategy, 100*frac)
			}
			if be.pending != 0 {
				t.Errorf("%s at %.0f%%: %d upload waits never ran", strategy, 100*frac, be.pending)
			}
			if live, bytes, pinned := be.outstanding(); live != 0 || bytes != 0 || pinned != 0 {
				t.Errorf("%s at %.0f%%: after Close %d tensors (%d bytes) and %d pinned bytes remain", strategy, 100*frac, live, bytes, pinned)
			}
		}
	}
}
