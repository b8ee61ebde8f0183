package paging

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// heldEvictor holds tensors from a budget, each stamped when it was last
// used, and gives them back oldest first when the budget asks.
type heldEvictor struct {
	bg      *Budget
	mu      sync.Mutex
	held    []*tensor.Tensor
	stamps  []uint64
	evicted []uint64
}

func (h *heldEvictor) take(t *testing.T, n int) uint64 {
	t.Helper()
	x, err := h.bg.Alloc(ResidentWeights, tensor.F32, tensor.Shape{n / 4})
	if err != nil {
		t.Fatal(err)
	}
	s := h.bg.Stamp()
	h.mu.Lock()
	h.held, h.stamps = append(h.held, x), append(h.stamps, s)
	h.mu.Unlock()
	return s
}

func (h *heldEvictor) Oldest() (uint64, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.stamps) == 0 {
		return 0, false
	}
	return slices.Min(h.stamps), true
}

func (h *heldEvictor) Evict(stamp uint64) bool {
	h.mu.Lock()
	i := slices.Index(h.stamps, stamp)
	if i < 0 {
		h.mu.Unlock()
		return false
	}
	x := h.held[i]
	h.held = slices.Delete(h.held, i, i+1)
	h.stamps = slices.Delete(h.stamps, i, i+1)
	h.evicted = append(h.evicted, stamp)
	h.mu.Unlock()
	h.bg.Free(x)
	return true
}

func (h *heldEvictor) freeAll() {
	for _, x := range h.held {
		h.bg.Free(x)
	}
	h.held, h.stamps = nil, nil
}

// TestEvictors: a charge that does not fit evicts the least recently used
// bytes across every registered evictor, and only as many as it needs; an
// evictor unregistered is not asked; Close reports evictors still
// registered, and a Pager unregisters itself when it closes.
func TestEvictors(t *testing.T) {
	bg := newBudget(t, newFake(), 10000, "fake:0")
	a, b := &heldEvictor{bg: bg}, &heldEvictor{bg: bg}
	unA, unB := bg.Register(a), bg.Register(b)
	a1 := a.take(t, 2000)
	b2 := b.take(t, 2000)
	a.take(t, 2000)
	b4 := b.take(t, 2000)
	a5 := a.take(t, 2000)                                      // full
	x, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{750}) // 3000 bytes: two of the oldest go
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a.evicted, []uint64{a1}) || !slices.Equal(b.evicted, []uint64{b2}) {
		t.Errorf("evicted %v from a and %v from b, want the two oldest: %d and %d", a.evicted, b.evicted, a1, b2)
	}
	unA()
	unA() // twice: no harm
	bg.Free(x)
	if _, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{1500}); err != nil { // 6000: 4000 free, the rest from b alone
		t.Fatal(err)
	}
	if len(a.evicted) != 1 || !slices.Equal(b.evicted, []uint64{b2, b4}) {
		t.Errorf("after a left: evicted %v from a, %v from b", a.evicted, b.evicted)
	}
	if _, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{500}); !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Errorf("with only an unregistered evictor's bytes left: %v, want out of memory", err)
	}
	if _, ok := a.Oldest(); !ok || a5 == 0 {
		t.Error("the unregistered evictor lost its bytes")
	}
	a.freeAll()
	err = bg.Close()
	if !errors.Is(err, ErrLeak) || !strings.Contains(err.Error(), "1 evictors still registered") {
		t.Errorf("Close with an evictor registered: %v", err)
	}
	unB()

	// A Pager registers with its budget and leaves at Close.
	src := llamaSynth(2, 16, 32, 8, 32)
	plan, err := Plan(smallDims(src, 2), 1<<30, StrategyMinimal, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg = newBudget(t, newFake(), 1<<30, "")
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(bg.registered()); n != 1 {
		t.Errorf("%d evictors registered with a pager open", n)
	}
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
	if err := bg.Close(); err != nil {
		t.Errorf("Close after the pager closed: %v", err)
	}
}
