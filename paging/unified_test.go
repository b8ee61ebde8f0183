package paging

import (
	"context"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// managedFake tracks where each managed tensor's pages are.
type managedFake struct {
	*fakeBackend
	mu       sync.Mutex
	onDevice map[*tensor.Tensor]bool
	mapped   map[*tensor.Tensor]bool
	devBytes int64
	devPeak  int64
	advised  int
}

func newManagedFake() *managedFake {
	return &managedFake{fakeBackend: newFake(), onDevice: map[*tensor.Tensor]bool{}, mapped: map[*tensor.Tensor]bool{}}
}

func (m *managedFake) AllocManaged(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	return m.fakeBackend.Alloc(dt, shape)
}

func (m *managedFake) move(t *tensor.Tensor, dev bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.onDevice[t] == dev {
		return nil
	}
	m.onDevice[t] = dev
	if dev {
		m.devBytes += t.NumBytes()
		m.devPeak = max(m.devPeak, m.devBytes)
	} else {
		m.devBytes -= t.NumBytes()
	}
	return nil
}

func (m *managedFake) PrefetchToDevice(t *tensor.Tensor) error { return m.move(t, true) }
func (m *managedFake) PrefetchToHost(t *tensor.Tensor) error   { return m.move(t, false) }
func (m *managedFake) AdviseHost(t *tensor.Tensor) error {
	m.mu.Lock()
	m.advised++
	m.mu.Unlock()
	return nil
}
func (m *managedFake) AdviseDeviceAccess(t *tensor.Tensor) error {
	m.mu.Lock()
	m.mapped[t] = true
	m.mu.Unlock()
	return nil
}

// TestUnifiedPrefetch checks the unified-memory mode's bookkeeping, for a
// model and its twin with tied embeddings (the table allocated once): the
// data of every acquired layer, device-resident pages exactly the plan's
// resident tensors, every streamed tensor mapped for the device and left in
// host memory, the bytes read over the link per cyclic sweep equal to the
// streamed bytes, and everything freed at Close.
func TestUnifiedPrefetch(t *testing.T) {
	for _, src := range []*synthSource{llamaSynth(8, 64, 96, 32, 200), tiedSynth(8, 64, 96, 32, 200)} {
		testUnifiedPrefetch(t, src)
	}
}

func testUnifiedPrefetch(t *testing.T, src *synthSource) {
	info := smallDims(src, 8)
	total, _ := totalAndMax(info)
	tensors := 0 // managed allocations: a tied table once
	for l := range src.NumLayers() {
		tensors += len(src.LayerTensors(l))
	}
	tensors -= len(src.tied)
	for _, c := range []struct {
		frac     float64
		strategy Strategy
	}{{0.3, StrategyMinimal}, {0.6, StrategyMinimal}, {1.2, StrategyMinimal}, {0.5, StrategyBalanced}, {0.8, StrategyBalanced}} {
		frac := c.frac
		be := newManagedFake()
		probe, err := Plan(info, 1<<40, StrategyAggressive, 16, 1)
		if err != nil {
			t.Fatal(err)
		}
		budget := max(int64(frac*float64(total)), probe.MinBudgetBytes)
		plan, err := Plan(info, budget, c.strategy, 16, 1)
		if err != nil {
			t.Fatal(err)
		}
		bg := newBudget(t, be, budget, "fake")
		u, err := NewUnified(context.Background(), src, bg, plan, true)
		if err != nil {
			t.Fatal(err)
		}
		if live, _, _ := be.outstanding(); live != tensors {
			t.Errorf("%.0f%%: %d managed tensors, the model has %d", 100*frac, live, tensors)
		}
		free := nnReserve(t, bg, plan)
		n := src.NumLayers()
		for round := 0; round < 3; round++ {
			for l := range n {
				ws, err := u.Acquire(context.Background(), l)
				if err != nil {
					t.Fatal(err)
				}
				if err := check(be, src, l, ws); err != nil {
					t.Fatal(err)
				}
				u.Release(l)
			}
			u.MarkStep()
		}
		st := u.Stats()
		if be.devPeak != plan.ResidentBytes {
			t.Errorf("%.0f%%: device-resident pages peaked at %d, the plan's resident bytes are %d", 100*frac, be.devPeak, plan.ResidentBytes)
		}
		for l := range n {
			for i, tt := range u.layers[l] {
				if u.streamed[l][i] != be.mapped[tt] || u.streamed[l][i] && be.onDevice[tt] {
					t.Errorf("%.0f%%: layer %d %s: streamed %v, mapped %v, on the device %v",
						100*frac, l, u.names[l][i], u.streamed[l][i], be.mapped[tt], be.onDevice[tt])
				}
			}
		}
		if int64(st.BytesPerStep) != plan.StreamedBytes {
			t.Errorf("%.0f%%: %v bytes prefetched per sweep, plan streams %d", 100*frac, st.BytesPerStep, plan.StreamedBytes)
		}
		if bg.Peak() > budget {
			t.Errorf("budget peak %d over %d", bg.Peak(), budget)
		}
		free()
		if err := u.Close(); err != nil {
			t.Fatal(err)
		}
		if err := u.Close(); err != nil {
			t.Fatal(err)
		}
		if err := bg.Close(); err != nil {
			t.Fatal(err)
		}
		if live, bytes, _ := be.outstanding(); live != 0 || bytes != 0 {
			t.Errorf("after Close %d managed tensors (%d bytes) remain", live, bytes)
		}
		if be.advised == 0 {
			t.Error("no tensor was advised to prefer the host")
		}
	}
	// A backend with no managed memory is refused clearly.
	plan, _ := Plan(info, 1<<40, StrategyNone, 16, 1)
	if _, err := NewUnified(context.Background(), src, newBudget(t, newFake(), 1<<40, "fake"), plan, true); err == nil {
		t.Error("unified memory on a backend without managed memory")
	}
}

// TestUnifiedNoPrefetch: without prefetch nothing is migrated or mapped at
// load or acquire (the driver moves pages as the device touches them), the
// data is right, and no bytes are counted as moved.
func TestUnifiedNoPrefetch(t *testing.T) {
	src := llamaSynth(4, 64, 96, 32, 200)
	info := smallDims(src, 4)
	total, _ := totalAndMax(info)
	be := newManagedFake()
	plan, err := Plan(info, total/2, StrategyBalanced, 16, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, be, total/2, "fake")
	u, err := NewUnified(context.Background(), src, bg, plan, false)
	if err != nil {
		t.Fatal(err)
	}
	for l := range src.NumLayers() {
		ws, err := u.Acquire(context.Background(), l)
		if err != nil {
			t.Fatal(err)
		}
		if err := check(be, src, l, ws); err != nil {
			t.Fatal(err)
		}
		u.Release(l)
	}
	if len(be.mapped) != 0 || be.devPeak != 0 {
		t.Errorf("without prefetch: %d tensors mapped, %d bytes prefetched to the device", len(be.mapped), be.devPeak)
	}
	if st := u.Stats(); st.BytesHostToDevice != 0 || st.Hits != int64(src.NumLayers()) {
		t.Errorf("without prefetch: stats %+v", st)
	}
	if err := u.Close(); err != nil {
		t.Fatal(err)
	}
	if err := bg.Close(); err != nil {
		t.Fatal(err)
	}
}
