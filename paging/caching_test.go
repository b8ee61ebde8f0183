package paging

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// cachingFake is the fake backend with an allocator like the CUDA
// backend's: blocks rounded up to a multiple of 1 KiB, freed blocks kept
// by size and handed out again, Trim giving them back, and a workspace held
// outside Alloc. It tracks what the device holds: live blocks, cached
// blocks and the workspace.
type cachingFake struct {
	*fakeBackend
	fixed int64

	mu         sync.Mutex
	sizes      map[*tensor.Tensor]int64
	free       map[int64]int
	cached     int64
	inUse      int64
	peakDevice int64
	trims      int
}

func newCachingFake(fixed int64) *cachingFake {
	return &cachingFake{fakeBackend: newFake(), fixed: fixed, sizes: map[*tensor.Tensor]int64{}, free: map[int64]int{}}
}

func (c *cachingFake) AllocSize(n int64) int64 { return (n + 1023) &^ 1023 }
func (c *cachingFake) Fixed() int64            { return c.fixed }

func (c *cachingFake) Cached() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cached
}

func (c *cachingFake) Trim() (int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.cached
	c.cached, c.free = 0, map[int64]int{}
	c.trims++
	return n, nil
}

func (c *cachingFake) Alloc(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	t, err := c.fakeBackend.Alloc(dt, shape)
	if err != nil {
		return nil, err
	}
	r := c.AllocSize(t.NumBytes())
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.free[r] > 0 {
		c.free[r]--
		c.cached -= r
	}
	c.inUse += r
	c.sizes[t] = r
	c.peakDevice = max(c.peakDevice, c.inUse+c.cached+c.fixed)
	return t, nil
}

func (c *cachingFake) Free(t *tensor.Tensor) {
	c.mu.Lock()
	if r, ok := c.sizes[t]; ok {
		delete(c.sizes, t)
		c.inUse -= r
		c.cached += r
		c.free[r]++
	}
	c.mu.Unlock()
	c.fakeBackend.Free(t)
}

func (c *cachingFake) device() (held, peak int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.inUse + c.cached + c.fixed, c.peakDevice
}

// TestBudgetCachingAllocator: on a backend that caches freed blocks, the
// budget charges the block each allocation takes, counts the cached blocks
// as held (category "cached") and the backend's workspace from the start,
// gives the cache back before it would refuse or evict, and so bounds what
// the device really holds.
func TestBudgetCachingAllocator(t *testing.T) {
	const fixed = 3000
	if _, err := NewBudget(newCachingFake(fixed), fixed-1, "fake"); !errors.Is(err, ErrFixedOverBudget) {
		t.Fatalf("a budget smaller than the workspace: %v, want ErrFixedOverBudget", err)
	}
	be := newCachingFake(fixed)
	const limit = 10 << 10
	bg := newBudget(t, be, limit, "fake")
	bg.RecordHistory(1000)
	if bg.UsedBy(Workspace) != fixed || bg.Used() != fixed {
		t.Fatalf("a fresh budget charges workspace %d, in all %d; want %d", bg.UsedBy(Workspace), bg.Used(), fixed)
	}
	x, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{100}) // 400 bytes: a 1 KiB block
	if err != nil {
		t.Fatal(err)
	}
	if bg.UsedBy(KVCache) != 1024 {
		t.Errorf("a 400-byte tensor charged %d, its block is 1024", bg.UsedBy(KVCache))
	}
	bg.Free(x)
	if bg.UsedBy(KVCache) != 0 || bg.UsedBy(Cached) != 1024 || bg.Used() != fixed+1024 {
		t.Errorf("after Free: kv %d, cached %d, in all %d; the block stays held in the cache", bg.UsedBy(KVCache), bg.UsedBy(Cached), bg.Used())
	}
	y, err := bg.Alloc(Activations, tensor.F32, tensor.Shape{200}) // the cached block again
	if err != nil {
		t.Fatal(err)
	}
	if bg.UsedBy(Cached) != 0 || bg.Used() != fixed+1024 || be.trims != 0 {
		t.Errorf("reusing the cached block: cached %d, in all %d, %d trims", bg.UsedBy(Cached), bg.Used(), be.trims)
	}
	// Fill the budget with 2 KiB blocks, free two: a 3 KiB block fits only
	// once the cache is given back.
	var held []*tensor.Tensor
	for {
		z, err := bg.Alloc(Activations, tensor.F32, tensor.Shape{512})
		if err != nil {
			break
		}
		held = append(held, z)
	}
	bg.Free(held[0])
	bg.Free(held[1])
	if bg.UsedBy(Cached) != 4096 {
		t.Fatalf("two 2 KiB blocks freed, %d cached", bg.UsedBy(Cached))
	}
	if _, err := bg.Alloc(Workspace, tensor.F32, tensor.Shape{768}); err != nil {
		t.Fatalf("a block that fits once the cache is trimmed: %v", err)
	}
	if be.trims != 1 || bg.UsedBy(Cached) != 0 {
		t.Errorf("%d trims, %d cached: the cache was not given back", be.trims, bg.UsedBy(Cached))
	}
	if _, err := bg.Alloc(Workspace, tensor.F32, tensor.Shape{2048}); !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Errorf("over the limit: %v", err)
	}
	if held, peak := be.device(); peak > limit || held != bg.Used() {
		t.Errorf("the device holds %d (peak %d), the budget charges %d, limit %d", held, peak, bg.Used(), limit)
	}
	if sum := bg.Summary(); !strings.Contains(sum, "cached") {
		t.Errorf("summary lacks the cache:\n%s", sum)
	}
	var charged int64
	for _, ev := range bg.Snapshot().Events {
		charged += ev.Charged
	}
	if charged != bg.Used() {
		t.Errorf("the history charges %d, the budget %d", charged, bg.Used())
	}
	bg.Free(y)
	for _, z := range held[2:] {
		bg.Free(z)
	}
	err = bg.Close()
	if !errors.Is(err, ErrLeak) || !strings.Contains(err.Error(), "1 tensors") {
		t.Errorf("Close with the 3 KiB tensor live: %v", err)
	}
	if bg.Used() != 0 || be.Cached() != 0 {
		t.Errorf("after Close: %d charged, %d cached", bg.Used(), be.Cached())
	}
}

// TestBudgetCachingConcurrent: allocations and frees of every size from
// many goroutines never make the device hold more than the limit.
func TestBudgetCachingConcurrent(t *testing.T) {
	be := newCachingFake(1500)
	const limit = 40 << 10
	bg := newBudget(t, be, limit, "")
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var held []*tensor.Tensor
			for i := range 300 {
				if x, err := bg.Alloc(Category(i%int(Cached)), tensor.F32, tensor.Shape{1 + (i*37+w*11)%1500}); err == nil {
					held = append(held, x)
				} else if !errors.Is(err, tensor.ErrOutOfMemory) {
					t.Error(err)
					return
				}
				if len(held) > 3 {
					bg.Free(held[0])
					held = held[1:]
				}
			}
			for _, x := range held {
				bg.Free(x)
			}
		}()
	}
	wg.Wait()
	if _, peak := be.device(); peak > limit || bg.Peak() > limit {
		t.Errorf("the device peaked at %d, the budget at %d, limit %d", peak, bg.Peak(), limit)
	}
	if be.trims == 0 {
		t.Error("no trim: the test does not fill the cache")
	}
	if err := bg.Close(); err != nil {
		t.Error(err)
	}
}

// TestPlanWithDevice pages a model on the caching backend with a plan made
// for it: the plan counts the blocks the resident tensors, the ring and
// each tensor of the reserve take, and the backend's workspace, so the
// budget peaks at exactly the prediction, the device never holds more than
// the budget, and steady decode neither allocates nor trims. (The test
// allocates the reserve in one tensor a category, of the planned size.)
func TestPlanWithDevice(t *testing.T) {
	src := llamaSynth(8, 64, 172, 32, 256) // norms of 128 bytes: blocks of 1 KiB
	info := smallDims(src, 8)
	W, _ := totalAndMax(info)
	for _, s := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive, StrategyNone} {
		be := newCachingFake(5000)
		p0, err := Plan(info, 1<<40, s, 16, 1, WithDevice(be))
		if err != nil {
			t.Fatal(err)
		}
		budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W*6/10
		if s == StrategyNone {
			budget = p0.PredictedPeakBytes
		}
		name := fmt.Sprintf("%s at %d", s, budget)
		plan, err := Plan(info, budget, s, 16, 1, WithDevice(be))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if plan.WorkspaceBytes != p0.WorkspaceBytes || plan.WorkspaceBytes < be.fixed {
			t.Errorf("%s: workspace %d leaves out the backend's %d", name, plan.WorkspaceBytes, be.fixed)
		}
		if plan.DeviceOverheadBytes <= 0 && plan.ResidentBytes > 0 {
			t.Errorf("%s: no allocator overhead counted for %d resident bytes", name, plan.ResidentBytes)
		}
		bg := newBudget(t, be, budget, "fake")
		reserve := []int64{plan.KVCacheBytes, plan.ActivationBytes, plan.WorkspaceBytes - be.fixed}
		free := nnReserveSizes(t, bg, reserve)
		pg, err := NewPager(src, bg, plan, Options{})
		if err != nil {
			t.Fatal(err)
		}
		for range 2 {
			sweep(t, pg, src, forward(src.NumLayers()))
			waitIdle(pg)
		}
		allocs, trims := be.allocs.Load(), be.trims
		for range 3 {
			sweep(t, pg, src, forward(src.NumLayers()))
			waitIdle(pg)
		}
		if be.allocs.Load() != allocs || be.trims != trims {
			t.Errorf("%s: steady decode allocated %d and trimmed %d times", name, be.allocs.Load()-allocs, be.trims-trims)
		}
		if peak := bg.Peak(); peak != plan.PredictedPeakBytes {
			t.Errorf("%s: peak %d, predicted %d", name, peak, plan.PredictedPeakBytes)
		}
		if plain, _ := Plan(info, budget, s, 16, 1); plain.KVCacheBytes >= plan.KVCacheBytes {
			t.Errorf("%s: the reserve's tensors of 256 bytes take the same %d bytes in 1 KiB blocks", name, plan.KVCacheBytes)
		}
		if held, peak := be.device(); peak > budget || held != bg.Used() {
			t.Errorf("%s: the device holds %d (peak %d), the budget charges %d of %d", name, held, peak, bg.Used(), budget)
		}
		var snap bytes.Buffer
		if err := bg.WriteSnapshot(&snap); err != nil || !strings.Contains(snap.String(), `"category": "cached"`) {
			t.Errorf("%s: the snapshot lacks the cached category (%v)", name, err)
		}
		free()
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
	}
}

// nnReserveSizes allocates tensors of the given sizes as nn would its KV
// cache, activations and workspace.
func nnReserveSizes(t testing.TB, bg *Budget, sizes []int64) func() {
	t.Helper()
	var ts []*tensor.Tensor
	for i, n := range sizes {
		if n == 0 {
			continue
		}
		x, err := bg.Alloc([]Category{KVCache, Activations, Workspace}[i], tensor.F32, tensor.Shape{int(n / 4)})
		if err != nil {
			t.Fatalf("reserve %d: %v", i, err)
		}
		ts = append(ts, x)
	}
	return func() {
		for _, x := range ts {
			bg.Free(x)
		}
	}
}
