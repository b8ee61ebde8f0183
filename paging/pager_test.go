package paging

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// nnReserve allocates what nn would: the KV cache, activations and rotary
// tables the plan reserved, from the budget.
func nnReserve(t testing.TB, bg *Budget, p *PlanResult) func() {
	t.Helper()
	kv, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{int(p.KVCacheBytes / 4)})
	if err != nil {
		t.Fatalf("KV cache: %v", err)
	}
	act, err := bg.Alloc(Activations, tensor.F32, tensor.Shape{int(p.ActivationBytes / 4)})
	if err != nil {
		t.Fatalf("activations: %v", err)
	}
	var ws *tensor.Tensor
	if p.WorkspaceBytes > 0 {
		ws, err = bg.Alloc(Workspace, tensor.F32, tensor.Shape{int(p.WorkspaceBytes / 4)})
		if err != nil {
			t.Fatalf("workspace: %v", err)
		}
	}
	return func() { bg.Free(kv); bg.Free(act); bg.Free(ws) }
}

// sweep acquires, checks and releases every layer once in the given order.
func sweep(t testing.TB, p *Pager, src *synthSource, order []int) {
	t.Helper()
	for _, l := range order {
		ws, err := p.Acquire(context.Background(), l)
		if err != nil {
			t.Fatalf("acquire %d: %v", l, err)
		}
		if err := check(p.b, src, l, ws); err != nil {
			t.Fatal(err)
		}
		p.Release(l)
	}
}

func forward(n int) []int {
	o := make([]int, n)
	for i := range o {
		o[i] = i
	}
	return o
}

func reverse(n int) []int {
	o := make([]int, n)
	for i := range o {
		o[i] = n - 1 - i
	}
	return o
}

// waitIdle waits for loads in flight, prefetches included, to finish.
func waitIdle(p *Pager) {
	p.pf.Wait()
	p.mu.Lock()
	for p.inflight > 0 {
		p.cond.Wait()
	}
	p.mu.Unlock()
}

// TestCyclicScanBound checks the residency policy's promise: per decoded
// token, bytes moved to the device are at most 1.05 x the weight bytes that
// do not fit (budget less KV cache and activations) plus one layer, for
// many budgets, forward and in reverse.
func TestCyclicScanBound(t *testing.T) {
	src := llamaSynth(10, 64, 172, 32, 256)
	info := smallDims(src, 10)
	W, _ := totalAndMax(info)
	lmax := ringLayer(info) // the largest layer as the ring holds it
	n := src.NumLayers()
	for _, s := range []Strategy{StrategyMinimal, StrategyBalanced} {
		for _, rev := range []bool{false, true} {
			step := 10
			if testing.Short() {
				step = 20
			}
			for pct := 10; pct <= 110; pct += step {
				name := fmt.Sprintf("%s/%d%%/reverse=%v", s, pct, rev)
				p0, _ := Plan(info, 1<<40, s, 32, 1)
				fixed := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes
				budget := max(fixed+W*int64(pct)/100, fixed+lmax)
				plan, err := Plan(info, budget, s, 32, 1)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				fb := newFake()
				bg := newBudget(t, fb, budget, "fake:0")
				free := nnReserve(t, bg, plan)
				pg, err := NewPager(src, bg, plan, Options{})
				if err != nil {
					t.Fatal(err)
				}
				order := forward(n)
				if rev {
					order = reverse(n)
					pg.SetOrder(Reverse)
				}
				sweep(t, pg, src, order) // warm-up: residents load
				waitIdle(pg)
				pg.MarkStep()
				X := max(0, W-(budget-fixed))
				bound := X + X/20 + lmax
				for range 10 {
					sweep(t, pg, src, order)
					waitIdle(pg)
					pg.MarkStep()
				}
				// A token's prefetches of the next token's first layers
				// may land on either side of a mark: bound the mean, of
				// enough tokens that one window more or less at the ends
				// does not swamp it.
				st := pg.Stats()
				if st.BytesPerStep > float64(bound) {
					t.Errorf("%s: moved %.0f bytes per token, bound %d (X %d, layer %d)", name, st.BytesPerStep, bound, X, lmax)
				}
				if st.ResidentWeightBytes != plan.ResidentBytes {
					t.Errorf("%s: %d resident bytes, plan %d", name, st.ResidentWeightBytes, plan.ResidentBytes)
				}
				if X == 0 && st.MaxStepBytes != 0 {
					t.Errorf("%s: everything fits but %d bytes move per token", name, st.MaxStepBytes)
				}
				peak := bg.Peak()
				if peak > budget {
					t.Errorf("%s: peak %d over budget %d", name, peak, budget)
				}
				if d := float64(peak-plan.PredictedPeakBytes) / float64(plan.PredictedPeakBytes); d > 0.05 || d < -0.05 {
					t.Errorf("%s: measured peak %d, predicted %d", name, peak, plan.PredictedPeakBytes)
				}
				if _, live, _ := fb.outstanding(); live > budget {
					t.Errorf("%s: backend holds %d bytes, budget %d", name, live, budget)
				}
				free()
				if err := pg.Close(); err != nil {
					t.Error(err)
				}
				if err := bg.Close(); err != nil {
					t.Error(err)
				}
				if nt, live, pinned := fb.outstanding(); nt != 0 || live != 0 || pinned != 0 {
					t.Errorf("%s: after Close %d tensors, %d bytes, %d pinned", name, nt, live, pinned)
				}
			}
		}
	}
}

// TestLRUWouldThrash documents why the ring exists: with the same budget,
// the plan streams less than the whole model per token, whereas an LRU
// cache smaller than the model misses every layer of a cyclic scan.
func TestLRUWouldThrash(t *testing.T) {
	src := llamaSynth(10, 64, 172, 32, 256)
	info := smallDims(src, 10)
	W, _ := totalAndMax(info)
	budget := W * 7 / 10
	// LRU over whole layers with capacity budget: simulate.
	var cache []int
	var used, moved int64
	n := src.NumLayers()
	for tok := range 3 {
		for l := range n {
			if i := indexOf(cache, l); i >= 0 {
				cache = append(append(cache[:i:i], cache[i+1:]...), l)
				continue
			}
			for used+info.Layers[l].Bytes > budget {
				used -= info.Layers[cache[0]].Bytes
				cache = cache[1:]
			}
			cache = append(cache, l)
			used += info.Layers[l].Bytes
			if tok == 2 {
				moved += info.Layers[l].Bytes
			}
		}
	}
	if moved != W {
		t.Fatalf("LRU simulation moved %d of %d per token", moved, W)
	}
	plan, err := Plan(info, budget, StrategyMinimal, 1, 1, WithChunkTokens(1))
	if err != nil {
		t.Fatal(err)
	}
	if plan.StreamedBytes > W/2 {
		t.Errorf("plan streams %d of %d with 70%% of the weights' budget", plan.StreamedBytes, W)
	}
}

func indexOf(s []int, v int) int {
	for i, x := range s {
		if x == v {
			return i
		}
	}
	return -1
}

// TestRandomised runs random models (a third with a tensor the first and
// the last layer share, as tied embeddings), budgets, strategies, access
// orders and numbers of concurrent acquirers, checking every acquired tensor's bytes,
// the budget, and that the counters add up.
func TestRandomised(t *testing.T) {
	iters := 60
	if testing.Short() {
		iters = 15
	}
	rng := rand.New(rand.NewPCG(7, 11))
	for it := range iters {
		src := randomSynth(rng, 2+rng.IntN(9), 5, 48)
		n := src.NumLayers()
		if rng.IntN(3) == 0 { // tied: the last layer lists the first layer's first tensor too
			shared := src.layers[0][0]
			src.layers[n-1] = append(src.layers[n-1], shared)
			src.tied = map[string]bool{shared.Name: true}
		}
		info := smallDims(src, n)
		W, lmax := totalAndMax(info)
		strategies := []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive, StrategyNone}
		s := strategies[rng.IntN(4)]
		p0, _ := Plan(info, 1<<40, s, 4, 1)
		fixed := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes
		budget := p0.MinBudgetBytes + rng.Int64N(W+1)
		if s == StrategyNone {
			budget = fixed + W + rng.Int64N(lmax+1)
		}
		plan, err := Plan(info, budget, s, 4, 1)
		if err != nil {
			t.Fatalf("iteration %d: %v", it, err)
		}
		var fb tensor.Memory = newFake()
		fake := fb.(*fakeBackend)
		if rng.IntN(2) == 0 {
			fb = pageableBackend{fb}
		}
		bg := newBudget(t, fb, budget, "fake:0")
		bg.RecordHistory(1 << 16)
		free := nnReserve(t, bg, plan)
		opts := Options{}
		if rng.IntN(3) == 0 {
			opts.HostCacheBytes = rng.Int64N(W + 1)
		}
		pg, err := NewPager(src, bg, plan, opts)
		if err != nil {
			t.Fatal(err)
		}
		workers := 1 + rng.IntN(4)
		mode := rng.IntN(3) // 0 cyclic, 1 reverse, 2 random
		if mode == 1 {
			pg.SetOrder(Reverse)
		}
		var acquires sync.WaitGroup
		errs := make(chan error, workers)
		const steps = 40
		for w := range workers {
			seed := rng.Uint64()
			acquires.Add(1)
			go func() {
				defer acquires.Done()
				r := rand.New(rand.NewPCG(seed, uint64(w)))
				pos := r.IntN(n)
				for range steps {
					l := pos
					switch mode {
					case 0:
						pos = (pos + 1) % n
					case 1:
						pos = (pos + n - 1) % n
					default:
						pos = r.IntN(n)
					}
					ws, err := pg.Acquire(context.Background(), l)
					if err != nil {
						errs <- fmt.Errorf("acquire %d: %w\n%s", l, err, pg.dump())
						return
					}
					if err := check(fb, src, l, ws); err != nil {
						errs <- err
						return
					}
					runtime.Gosched()
					if err := check(fb, src, l, ws); err != nil { // still there while pinned
						errs <- err
						return
					}
					pg.Release(l)
				}
			}()
		}
		acquires.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("iteration %d (%s, %d workers, mode %d, budget %d of min %d): %v", it, s, workers, mode, budget, plan.MinBudgetBytes, err)
		}
		waitIdle(pg)
		st := pg.Stats()
		if st.Acquires != int64(workers*steps) || st.Hits+st.Misses != st.Acquires {
			t.Errorf("iteration %d: acquires %d, hits %d + misses %d, want %d", it, st.Acquires, st.Hits, st.Misses, workers*steps)
		}
		if st.BytesHostToDevice != fake.uploads.Load() || st.BytesDiskToHost != src.reads.Load() {
			t.Errorf("iteration %d: counted %d up, %d read; backend saw %d, source %d", it, st.BytesHostToDevice, st.BytesDiskToHost, fake.uploads.Load(), src.reads.Load())
		}
		if st.PinnedLayers != 0 || st.BadReleases != 0 {
			t.Errorf("iteration %d: %d pinned, %d bad releases", it, st.PinnedLayers, st.BadReleases)
		}
		if st.HostCacheBytes > st.HostCacheLimit {
			t.Errorf("iteration %d: host cache %d over %d", it, st.HostCacheBytes, st.HostCacheLimit)
		}
		if bg.Peak() > budget || fake.peakBytes > budget {
			t.Errorf("iteration %d: peak %d (backend %d) over budget %d", it, bg.Peak(), fake.peakBytes, budget)
		}
		// the history replays to the accounts
		snap := bg.Snapshot()
		var charged int64
		for _, ev := range snap.Events {
			charged += ev.Charged
		}
		if charged != bg.Used() || snap.DroppedEvents != 0 {
			t.Errorf("iteration %d: events add up to %d, budget uses %d", it, charged, bg.Used())
		}
		free()
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		if nt, live, pinned := fake.outstanding(); nt != 0 || live != 0 || pinned != 0 || bg.Used() != 0 {
			t.Errorf("iteration %d: after Close %d tensors, %d bytes, %d pinned, %d charged", it, nt, live, pinned, bg.Used())
		}
	}
}

func TestSingleLoadForConcurrentAcquires(t *testing.T) {
	src := llamaSynth(2, 16, 32, 8, 32)
	info := smallDims(src, 2)
	plan, err := Plan(info, 1<<30, StrategyAggressive, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	fb := newFake()
	bg := newBudget(t, fb, 1<<30, "")
	pg, err := NewPager(src, bg, plan, Options{PrefetchDepth: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer bg.Close()
	defer pg.Close()
	src.blockLayer, src.block = 1, make(chan struct{})
	const N = 8
	var wg sync.WaitGroup
	for range N {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ws, err := pg.Acquire(context.Background(), 1)
			if err == nil {
				err = check(fb, src, 1, ws)
				pg.Release(1)
			}
			if err != nil {
				t.Error(err)
			}
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		pg.mu.Lock()
		w := pg.layers[1].waiters
		pg.mu.Unlock()
		if w == N {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d acquirers waiting", w, N)
		}
		time.Sleep(time.Millisecond)
	}
	close(src.block)
	wg.Wait()
	if got, want := src.calls[1].Load(), int64(len(src.layers[1])); got != want {
		t.Errorf("layer 1 read %d tensors for %d acquirers, want %d (one load)", got, N, want)
	}
	if st := pg.Stats(); st.Loads != 1 || st.Misses != N {
		t.Errorf("loads %d, misses %d", st.Loads, st.Misses)
	}
}

func TestCancelDuringLoad(t *testing.T) {
	src := llamaSynth(3, 16, 32, 8, 32)
	info := smallDims(src, 3)
	W, _ := totalAndMax(info)
	p0, _ := Plan(info, 1<<40, StrategyMinimal, 4, 1)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W/2
	plan, err := Plan(info, budget, StrategyMinimal, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	fb := newFake()
	bg := newBudget(t, fb, budget, "")
	free := nnReserve(t, bg, plan)
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	sweep(t, pg, src, []int{0, 1})
	_, liveBefore, _ := fb.outstanding()
	usedBefore := bg.Used()
	src.blockLayer, src.block, src.started = 2, make(chan struct{}), make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() {
		_, err := pg.Acquire(ctx, 2)
		done <- err
	}()
	<-src.started
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled acquire: %v", err)
	}
	waitIdle(pg)
	st := pg.Stats()
	if st.PinnedLayers != 0 {
		t.Errorf("%d layers pinned after cancel", st.PinnedLayers)
	}
	if _, live, _ := fb.outstanding(); live != liveBefore || bg.Used() != usedBefore {
		t.Errorf("after cancel: backend %d bytes (was %d), budget %d (was %d)", live, liveBefore, bg.Used(), usedBefore)
	}
	pg.mu.Lock()
	e := pg.layers[2]
	if e.resT != nil || e.strT != nil || e.slot != nil || e.loaded() && len(e.res)+len(e.str) > 0 {
		t.Error("cancelled layer left tensors or its place in the ring")
	}
	pg.mu.Unlock()
	// a deadline while waiting for ring space behaves the same
	close(src.block)
	sweep(t, pg, src, []int{2, 0, 1, 2})

	free()
	if err := pg.Close(); err != nil {
		t.Error(err)
	}
	if err := bg.Close(); err != nil {
		t.Error(err)
	}
	if nt, live, pinned := fb.outstanding(); nt+int(live)+int(pinned) != 0 {
		t.Errorf("after Close: %d tensors, %d bytes, %d pinned", nt, live, pinned)
	}
}

func TestCancelWaitingForRing(t *testing.T) {
	src := llamaSynth(3, 16, 32, 8, 32)
	info := smallDims(src, 3)
	p0, _ := Plan(info, 1<<40, StrategyAggressive, 4, 1)
	plan, err := Plan(info, p0.MinBudgetBytes, StrategyAggressive, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, newFake(), plan.Budget, "")
	free := nnReserve(t, bg, plan)
	defer bg.Close()
	defer free()
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	if _, err := pg.Acquire(context.Background(), 1); err != nil { // holds the whole ring
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = pg.Acquire(ctx, 2)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("acquire with a full ring: %v", err)
	}
	waitIdle(pg)
	if st := pg.Stats(); st.PinnedLayers != 1 {
		t.Errorf("%d pinned, want 1", st.PinnedLayers)
	}
	pg.Release(1)
	sweep(t, pg, src, []int{2})
}

// TestSharedBudget runs two models on one budget: their resident layers
// compete, least recently used first, and the budget holds.
func TestSharedBudget(t *testing.T) {
	a := llamaSynth(4, 32, 64, 16, 64)
	b := randomSynth(rand.New(rand.NewPCG(3, 4)), 6, 4, 64)
	ia, ib := smallDims(a, 4), smallDims(b, 6)
	wa, _ := totalAndMax(ia)
	wb, _ := totalAndMax(ib)
	budget := (wa + wb) * 6 / 10
	pb, err := Plan(ib, budget/2, StrategyBalanced, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	// each plan thinks it has all the budget that is left for its weights
	pa2, err := Plan(ia, budget-pb.RingBytes, StrategyMinimal, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	fb := newFake()
	bg := newBudget(t, fb, budget, "fake:0")
	ga, err := NewPager(a, bg, pa2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	gb, err := NewPager(b, bg, pb, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		sweep(t, ga, a, forward(a.NumLayers()))
		sweep(t, gb, b, reverse(b.NumLayers()))
	}
	if bg.Peak() > budget {
		t.Errorf("peak %d over %d", bg.Peak(), budget)
	}
	if ga.Stats().Evictions+gb.Stats().Evictions == 0 {
		t.Error("two models over budget evicted nothing")
	}
	sum := Summary(bg)
	for _, want := range []string{"kv cache", "streamed weights", "pager 0", "pager 1", "hit rate"} {
		if !contains(sum, want) {
			t.Errorf("summary lacks %q:\n%s", want, sum)
		}
	}
	if err := errors.Join(ga.Close(), gb.Close()); err != nil {
		t.Error(err)
	}
	if err := bg.Close(); err != nil {
		t.Error(err)
	}
	if nt, _, _ := fb.outstanding(); nt != 0 {
		t.Errorf("%d tensors after Close", nt)
	}
}

func contains(s, sub string) bool {
	return len(s) >= len(sub) && (s == sub || indexString(s, sub) >= 0)
}

func indexString(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

// TestHostCache checks the host tier: with room for part of the streamed
// bytes, the rest is re-read from the source every token; pinned memory is
// used when the backend has it and returned at Close.
func TestHostCache(t *testing.T) {
	src := llamaSynth(6, 32, 64, 16, 64)
	info := smallDims(src, 6)
	W, _ := totalAndMax(info)
	p0, _ := Plan(info, 1<<40, StrategyMinimal, 4, 1)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W/2
	plan, err := Plan(info, budget, StrategyMinimal, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		host   int64
		pinned bool
	}{{-1, false}, {plan.StreamedBytes / 2, true}, {0, true}, {0, false}} {
		fb := newFake()
		var b tensor.Memory = fb
		if !tc.pinned {
			b = pageableBackend{fb}
		}
		bg := newBudget(t, b, budget, "")
		free := nnReserve(t, bg, plan)
		pg, err := NewPager(src, bg, plan, Options{HostCacheBytes: tc.host})
		if err != nil {
			t.Fatal(err)
		}
		sweep(t, pg, src, forward(src.NumLayers()))
		before := src.reads.Load()
		sweep(t, pg, src, forward(src.NumLayers()))
		read := src.reads.Load() - before
		st := pg.Stats()
		limit := st.HostCacheLimit
		if tc.host == 0 && limit != plan.HostCacheBytes || tc.host < 0 && limit != 0 {
			t.Errorf("host %d: limit %d", tc.host, limit)
		}
		if read < plan.StreamedBytes-limit || read > plan.StreamedBytes {
			t.Errorf("host cache %d of %d streamed: read %d per token", limit, plan.StreamedBytes, read)
		}
		if limit >= plan.StreamedBytes && read != 0 {
			t.Errorf("everything cached, yet %d bytes read per token", read)
		}
		if tc.pinned != (st.PinnedHostBytes > 0) && limit > 0 {
			t.Errorf("pinned backend %v, pinned bytes %d", tc.pinned, st.PinnedHostBytes)
		}
		free()
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
		if _, _, pinned := fb.outstanding(); pinned != 0 {
			t.Errorf("%d pinned bytes after Close", pinned)
		}
	}
}

// TestHostCachePadded: host copies put each tensor at a 64-byte offset, so
// that they take more than the tensors' bytes when sizes are uneven; the
// plan's host cache counts them so and holds every streamed part, and each
// tensor of a host copy is aligned.
func TestHostCachePadded(t *testing.T) {
	src := unevenSynth(rand.New(rand.NewPCG(11, 12)), 8)
	info := smallDims(src, src.NumLayers())
	W, _ := totalAndMax(info)
	p0, _ := Plan(info, 1<<40, StrategyMinimal, 4, 1)
	budget := max(p0.KVCacheBytes+p0.ActivationBytes+p0.WorkspaceBytes+W/2, p0.MinBudgetBytes)
	plan, err := Plan(info, budget, StrategyMinimal, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	if plan.HostCacheBytes <= plan.StreamedBytes {
		t.Fatalf("host cache %d for %d streamed bytes of uneven tensors: no padding counted", plan.HostCacheBytes, plan.StreamedBytes)
	}
	bg := newBudget(t, newFake(), budget, "")
	defer bg.Close()
	free := nnReserve(t, bg, plan)
	defer free()
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	sweep(t, pg, src, forward(src.NumLayers()))
	before := src.reads.Load()
	sweep(t, pg, src, forward(src.NumLayers()))
	if read := src.reads.Load() - before; read != 0 {
		t.Errorf("the plan's host cache of %d bytes did not keep every streamed part: %d bytes read again", plan.HostCacheBytes, read)
	}
	if st := pg.Stats(); st.HostCacheBytes != plan.HostCacheBytes {
		t.Errorf("host cache holds %d bytes, plan says %d", st.HostCacheBytes, plan.HostCacheBytes)
	}
	for _, e := range pg.layers {
		for _, off := range e.strOff {
			if off%hostAlign != 0 {
				t.Errorf("layer %d: a tensor at offset %d of its host copy", e.layer, off)
			}
		}
	}
}

func TestPagerBadInput(t *testing.T) {
	src := llamaSynth(2, 16, 32, 8, 32)
	info := smallDims(src, 2)
	plan, err := Plan(info, 1<<30, StrategyMinimal, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, newFake(), 1<<30, "")
	defer bg.Close()
	other := llamaSynth(3, 16, 32, 8, 32)
	if _, err := NewPager(other, bg, plan, Options{}); err == nil {
		t.Error("plan for another model accepted")
	}
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pg.Acquire(context.Background(), 99); err == nil {
		t.Error("acquire of a layer out of range succeeded")
	}
	pg.Release(0)
	if pg.Stats().BadReleases != 1 {
		t.Error("bad release not counted")
	}
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := pg.Acquire(context.Background(), 0); err == nil {
		t.Error("acquire after Close succeeded")
	}
}

// TestStreamingRecyclesReadBuffers: layers streamed without a host cache
// (the aggressive strategy, or no host memory for it) are read into
// recycled buffers on their way to the device, so that sweeping the model
// again and again does not allocate its size every time. The data of every
// acquired layer is checked.
func TestStreamingRecyclesReadBuffers(t *testing.T) {
	src := llamaSynth(6, 256, 512, 128, 300)
	n := src.NumLayers()
	info := smallDims(src, n)
	W, _ := totalAndMax(info)
	be := pageableBackend{newFake()}
	probe, err := Plan(info, 1<<40, StrategyAggressive, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := Plan(info, probe.MinBudgetBytes, StrategyAggressive, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, be, probe.MinBudgetBytes, "fake:0")
	free := nnReserve(t, bg, plan)
	defer free()
	pg, err := NewPager(src, bg, plan, Options{HostCacheBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	sweep := func() {
		for l := range n {
			ws, err := pg.Acquire(context.Background(), l)
			if err != nil {
				t.Fatal(err)
			}
			if err := check(be.Memory, src, l, ws); err != nil {
				t.Fatal(err)
			}
			pg.Release(l)
		}
	}
	sweep() // fills the pools
	first, _ := pg.reads.stats()
	const sweeps = 10
	for range sweeps {
		sweep()
	}
	total, kept := pg.reads.stats()
	made := total - first
	moved := pg.Stats().BytesHostToDevice
	t.Logf("%d weight bytes; %d bytes moved in %d sweeps; %d read buffers made in the first, %d after; %d bytes kept",
		W, moved, sweeps+1, first, made, kept)
	if moved < 5*W {
		t.Fatalf("moved %d bytes over %d sweeps of %d: the layers were not streamed", moved, sweeps+1, W)
	}
	if made != 0 {
		t.Errorf("%d read buffers made in %d sweeps after the first: they are not recycled", made, sweeps)
	}
	if kept > W {
		t.Errorf("%d bytes of read buffers kept for a %d-byte model", kept, W)
	}
}

// TestPagerResident checks Resident against the plan: false for every
// layer before its load, and after a sweep true exactly for the layers
// the plan keeps wholly resident (none of their tensors streamed); false
// for a layer out of range.
func TestPagerResident(t *testing.T) {
	src := llamaSynth(6, 32, 64, 16, 64)
	info := smallDims(src, 6)
	W, _ := totalAndMax(info)
	p0, _ := Plan(info, 1<<40, StrategyMinimal, 4, 1)
	for _, frac := range []int64{1 << 20, 2, 4} { // all resident, half, a quarter
		budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W/frac
		if frac == 1<<20 {
			budget = 1 << 40
		}
		plan, err := Plan(info, budget, StrategyMinimal, 4, 1)
		if err != nil {
			t.Fatal(err)
		}
		bg := newBudget(t, newFake(), budget, "")
		free := nnReserve(t, bg, plan)
		pg, err := NewPager(src, bg, plan, Options{})
		if err != nil {
			t.Fatal(err)
		}
		for l := range src.NumLayers() {
			if pg.Resident(l) && len(plan.Layers[l].Streamed) > 0 {
				t.Errorf("budget 1/%d: layer %d, partly streamed, is resident before any load", frac, l)
			}
		}
		sweep(t, pg, src, forward(src.NumLayers()))
		waitIdle(pg)
		resident := 0
		for l := range src.NumLayers() {
			want := len(plan.Layers[l].Streamed) == 0 && plan.Layers[l].StreamedBytes == 0
			if got := pg.Resident(l); got != want {
				t.Errorf("budget 1/%d: Resident(%d) = %v; the plan streams %v (%d bytes)", frac, l, got, plan.Layers[l].Streamed, plan.Layers[l].StreamedBytes)
			}
			if want {
				resident++
			}
		}
		if frac == 1<<20 && resident != src.NumLayers() || frac == 4 && resident == src.NumLayers() {
			t.Errorf("budget 1/%d: %d of %d layers resident", frac, resident, src.NumLayers())
		}
		if pg.Resident(-1) || pg.Resident(src.NumLayers()) {
			t.Error("a layer out of range is resident")
		}
		free()
		pg.Close()
		bg.Close()
	}
}
