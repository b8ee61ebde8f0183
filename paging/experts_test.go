package paging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// newExpertPager pages m under a budget that holds its layers resident
// and slots experts.
func newExpertPager(t *testing.T, m *moeSynth, slots int, opts Options) (*Pager, *Budget, *fakeBackend, int64) {
	t.Helper()
	fb := newFake()
	pg, bg, limit := newExpertPagerOn(t, fb, fb, m, slots, opts)
	return pg, bg, fb, limit
}

// newExpertPagerOn is newExpertPager on the backend b, whose fake is fb.
func newExpertPagerOn(t *testing.T, b tensor.Memory, fb *fakeBackend, m *moeSynth, slots int, opts Options) (*Pager, *Budget, int64) {
	t.Helper()
	info, limit := moeBudget(t, m, slots, 8)
	p, err := Plan(info, limit, StrategyBalanced, 8, 1, WithExpertCache(1))
	if err != nil {
		t.Fatal(err)
	}
	if p.ExpertSlots != slots || p.StreamedBytes != 0 {
		t.Fatalf("plan caches %d experts and streams %d bytes, want %d and none", p.ExpertSlots, p.StreamedBytes, slots)
	}
	bg := newBudget(t, b, limit, "fake")
	pg, err := NewPager(m, bg, p, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if bg.Peak() > limit {
			t.Errorf("budget peaked at %d over its limit %d", bg.Peak(), limit)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
		if n, live, pinned := fb.outstanding(); n != 0 || live != 0 || pinned != 0 {
			t.Errorf("after Close the backend holds %d tensors (%d bytes), %d pinned", n, live, pinned)
		}
	})
	return pg, bg, limit
}

// acquireCheck acquires experts, checks their bytes and releases them.
func acquireCheck(t *testing.T, pg *Pager, m *moeSynth, b tensor.Memory, l int, xs ...int) {
	t.Helper()
	ws, err := pg.AcquireExperts(context.Background(), l, xs)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		if err := m.checkExpert(b, l, x, ws[x]); err != nil {
			t.Fatal(err)
		}
	}
	pg.ReleaseExperts(l, xs)
}

// TestPagerExperts: experts load into the cache on a miss, are hits while
// cached, and the policy chooses whom a miss evicts (LRU the least
// recently used, LFU the least used); a layer's map from Acquire leaves
// its experts out, AcquireResident serves its router; the bytes moved are
// the misses' experts'.
func TestPagerExperts(t *testing.T) {
	for _, tc := range []struct {
		policy ExpertPolicy
		// After experts 0 (three times), 1 and 2 of layer 1 in a cache of
		// 3, expert 3 evicts:
		victim int
	}{
		{ExpertLRU, 0},
		{ExpertLFU, 1},
	} {
		t.Run(string(tc.policy), func(t *testing.T) {
			m := newMoESynth(2, 6, 8, 16)
			pg, _, fb, _ := newExpertPager(t, m, 3, Options{ExpertPolicy: tc.policy})
			if !pg.PagesExperts(1) || pg.PagesExperts(0) || pg.ExpertSlots() != 3 {
				t.Fatalf("PagesExperts(1) %v, (0) %v, slots %d", pg.PagesExperts(1), pg.PagesExperts(0), pg.ExpertSlots())
			}
			ctx := context.Background()
			lw, err := pg.Acquire(ctx, 1)
			if err != nil {
				t.Fatal(err)
			}
			if len(lw) != 4 || lw["b0.router"] == nil || lw["b0.e0.gate"] != nil {
				t.Errorf("layer 1's map has %d tensors (router %v, an expert's %v): want its 4 without the experts", len(lw), lw["b0.router"] != nil, lw["b0.e0.gate"] != nil)
			}
			pg.Release(1)
			rw, err := pg.AcquireResident(ctx, 2)
			if err != nil || rw["b1.router"] == nil {
				t.Fatalf("AcquireResident(2): %v, router %v", err, rw["b1.router"])
			}
			pg.Release(2)
			for _, x := range []int{0, 0, 0, 1, 2} {
				acquireCheck(t, pg, m, fb, 1, x)
			}
			st := pg.Stats()
			if st.ExpertMisses != 3 || st.ExpertHits != 2 || st.ExpertEvictions != 0 || st.ExpertsCached != 3 {
				t.Fatalf("after 5 acquires of 3 experts: %d misses, %d hits, %d evictions, %d cached", st.ExpertMisses, st.ExpertHits, st.ExpertEvictions, st.ExpertsCached)
			}
			acquireCheck(t, pg, m, fb, 1, 3)
			before := pg.Stats().ExpertMisses
			acquireCheck(t, pg, m, fb, 1, tc.victim)
			if pg.Stats().ExpertMisses != before+1 {
				t.Errorf("%s: expert %d was not the one evicted", tc.policy, tc.victim)
			}
			st = pg.Stats()
			if st.ExpertBytesMoved != st.ExpertMisses*m.expertBytes() {
				t.Errorf("%d expert bytes moved for %d misses of %d bytes", st.ExpertBytesMoved, st.ExpertMisses, m.expertBytes())
			}
			// Experts of another layer share the cache; a batch takes up
			// to every slot.
			acquireCheck(t, pg, m, fb, 2, 5, 4, 0)
			if _, err := pg.AcquireExperts(ctx, 2, []int{0, 1, 2, 3}); !errors.Is(err, ErrExpertCacheFull) {
				t.Errorf("4 experts in a cache of 3: %v", err)
			}
			for _, bad := range [][]int{{6}, {-1}, {1, 1}} {
				if _, err := pg.AcquireExperts(ctx, 1, bad); err == nil {
					t.Errorf("experts %v acquired", bad)
				}
			}
			if _, err := pg.AcquireExperts(ctx, 0, []int{0}); err == nil {
				t.Error("experts of the embedding acquired")
			}
			if st := pg.Stats(); st.ExpertsPinned != 0 || st.BadReleases != 0 {
				t.Errorf("%d experts pinned, %d bad releases", st.ExpertsPinned, st.BadReleases)
			}
			pg.ReleaseExperts(1, []int{0})
			if pg.Stats().BadReleases != 1 {
				t.Error("a release of an expert not pinned was not counted")
			}
			if s := pg.bg.Summary(); !bytes.Contains([]byte(s), []byte("experts: cache")) {
				t.Errorf("summary without the expert cache:\n%s", s)
			}
		})
	}
}

// TestPagerExpertsHostCache: an evicted expert comes back from the host
// cache, not the source; without a host cache it is read again.
func TestPagerExpertsHostCache(t *testing.T) {
	for _, tc := range []struct {
		name  string
		host  int64
		reads int64 // of the source, in experts, for 4 misses of 3 experts
	}{
		{"host cache", 0, 3},
		{"none", -1, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMoESynth(1, 4, 8, 16)
			pg, _, fb, _ := newExpertPager(t, m, 2, Options{HostCacheBytes: tc.host, ExpertPolicy: ExpertLRU})
			before := m.reads.Load()
			for _, x := range []int{0, 1, 2, 0} {
				acquireCheck(t, pg, m, fb, 1, x)
			}
			if got := m.reads.Load() - before; got != tc.reads*m.expertBytes() {
				t.Errorf("read %d bytes from the source, want %d experts' (%d)", got, tc.reads, tc.reads*m.expertBytes())
			}
			if st := pg.Stats(); st.ExpertMisses != 4 {
				t.Errorf("%d misses, want 4", st.ExpertMisses)
			}
		})
	}
}

// waitExperts waits for the pager's expert prefetches to end.
func waitExperts(t *testing.T, pg *Pager) {
	t.Helper()
	pg.SettleExperts()
}

// TestPrefetchExperts: prefetched experts acquired later are hits counted
// as prefetch hits (accuracy); prefetch never evicts a pinned expert or
// one just prefetched, and is off with PrefetchDepth < 0.
func TestPrefetchExperts(t *testing.T) {
	ctx := context.Background()
	t.Run("accuracy", func(t *testing.T) {
		m := newMoESynth(2, 6, 8, 16)
		pg, _, fb, _ := newExpertPager(t, m, 4, Options{})
		pg.PrefetchExperts(1, []int{0, 1}) // right
		pg.PrefetchExperts(2, []int{5})    // wrong
		waitExperts(t, pg)
		acquireCheck(t, pg, m, fb, 1, 0, 1)
		acquireCheck(t, pg, m, fb, 2, 4)
		acquireCheck(t, pg, m, fb, 1, 0) // a hit, but not the prefetch's again
		st := pg.Stats()
		if st.ExpertPrefetches != 3 || st.ExpertPrefetchHits != 2 || st.ExpertHits != 3 || st.ExpertMisses != 1 {
			t.Errorf("prefetches %d (hits %d), acquires: %d hits, %d misses; want 3 (2), 3 and 1", st.ExpertPrefetches, st.ExpertPrefetchHits, st.ExpertHits, st.ExpertMisses)
		}
		if acc := st.PrefetchAccuracy(); acc < 0.66 || acc > 0.67 {
			t.Errorf("prefetch accuracy %v, want 2/3", acc)
		}
		if st.ExpertBytesMoved != (st.ExpertMisses+st.ExpertPrefetches)*m.expertBytes() {
			t.Errorf("%d bytes moved for %d misses and %d prefetches", st.ExpertBytesMoved, st.ExpertMisses, st.ExpertPrefetches)
		}
	})
	t.Run("spares pinned and just prefetched", func(t *testing.T) {
		m := newMoESynth(2, 6, 8, 16)
		pg, _, _, _ := newExpertPager(t, m, 3, Options{})
		if _, err := pg.AcquireExperts(ctx, 1, []int{0}); err != nil {
			t.Fatal(err)
		}
		pg.PrefetchExperts(2, []int{0, 1})
		waitExperts(t, pg)
		pg.PrefetchExperts(2, []int{2}) // every other slot pinned or just prefetched
		waitExperts(t, pg)
		st := pg.Stats()
		if st.ExpertPrefetches != 2 || st.ExpertPrefetchNoRoom != 1 || st.ExpertEvictions != 0 {
			t.Errorf("prefetches %d, no room %d, evictions %d; want 2, 1 and 0", st.ExpertPrefetches, st.ExpertPrefetchNoRoom, st.ExpertEvictions)
		}
		// A demand load takes a prefetched expert's slot when nothing
		// else will do, and the pinned one stays.
		if _, err := pg.AcquireExperts(ctx, 2, []int{3}); err != nil {
			t.Fatal(err)
		}
		if st := pg.Stats(); st.ExpertEvictions != 1 || st.ExpertsPinned != 2 {
			t.Errorf("%d evictions, %d pinned; want 1 and 2", st.ExpertEvictions, st.ExpertsPinned)
		}
		pg.ReleaseExperts(1, []int{0})
		pg.ReleaseExperts(2, []int{3})
	})
	t.Run("fresh until the layer's next visit", func(t *testing.T) {
		m := newMoESynth(2, 6, 8, 16)
		pg, _, fb, _ := newExpertPager(t, m, 3, Options{})
		pg.PrefetchExperts(1, []int{0, 1, 2})
		waitExperts(t, pg)
		pg.PrefetchExperts(1, []int{4}) // the three are fresh
		waitExperts(t, pg)
		acquireCheck(t, pg, m, fb, 1, 0) // the visit: 1 and 2 were wrong guesses
		pg.PrefetchExperts(1, []int{4})
		waitExperts(t, pg)
		acquireCheck(t, pg, m, fb, 1, 4)
		acquireCheck(t, pg, m, fb, 1, 2) // cached still (4 took 1's slot), but not at the visit it was prefetched for
		st := pg.Stats()
		if st.ExpertPrefetchNoRoom != 1 || st.ExpertPrefetches != 4 || st.ExpertPrefetchHits != 2 || st.ExpertMisses != 0 {
			t.Errorf("no room %d, prefetches %d, prefetch hits %d, misses %d; want 1, 4, 2 and 0", st.ExpertPrefetchNoRoom, st.ExpertPrefetches, st.ExpertPrefetchHits, st.ExpertMisses)
		}
	})
	t.Run("queued before it returns", func(t *testing.T) {
		// An expert whose pinned host copy the host cache holds has its
		// copy queued when PrefetchExperts returns, not by a goroutine
		// that the CPU's experts, computed next on every core, would
		// hold back; one without a host copy loads in the background.
		m := newMoESynth(2, 6, 8, 16)
		be := &asyncFake{fakeBackend: newFake()}
		pg, _, _ := newExpertPagerOn(t, be, be.fakeBackend, m, 2, Options{})
		acquireCheck(t, pg, m, be, 1, 0, 1) // their host copies kept
		acquireCheck(t, pg, m, be, 2, 0, 1) // 0 and 1 of layer 1 evicted
		be.mu.Lock()
		before := be.async
		be.mu.Unlock()
		pg.PrefetchExperts(1, []int{0, 1})
		be.mu.Lock()
		queued := be.async - before
		be.mu.Unlock()
		st := pg.Stats()
		if queued != 2*len(m.LayerExperts(1)[0]) || st.ExpertPrefetches != 2 {
			t.Errorf("%d uploads queued (%d prefetches) when PrefetchExperts returned, want those of both experts' %d tensors", queued, st.ExpertPrefetches, len(m.LayerExperts(1)[0]))
		}
		acquireCheck(t, pg, m, be, 1, 0, 1) // the copies land before the compute
		if st := pg.Stats(); st.ExpertPrefetchHits != 2 || st.ExpertMisses != 4 {
			t.Errorf("prefetch hits %d, misses %d; want 2 and 4", st.ExpertPrefetchHits, st.ExpertMisses)
		}
	})
	t.Run("leaves experts on the CPU", func(t *testing.T) {
		// An expert computed on the CPU is not prefetched (a guess of
		// what the block chose at the position before would upload it
		// a token later) until an acquire has uploaded it.
		m := newMoESynth(2, 6, 8, 16)
		pg, _, fb, _ := newExpertPager(t, m, 3, Options{ExpertsCPU: ExpertCPUAlways})
		_, release, err := pg.HostExpert(ctx, 1, 3, 1)
		if err != nil {
			t.Fatal(err)
		}
		release()
		pg.PrefetchExperts(1, []int{3, 4})
		waitExperts(t, pg)
		st := pg.Stats()
		if st.ExpertPrefetches != 1 || st.ExpertsCached != 1 || st.ExpertBytesMoved != m.expertBytes() {
			t.Errorf("after expert 3 on the CPU, prefetching 3 and 4: %d prefetches, %d cached, %d bytes moved; want 4's alone", st.ExpertPrefetches, st.ExpertsCached, st.ExpertBytesMoved)
		}
		acquireCheck(t, pg, m, fb, 1, 3)
		acquireCheck(t, pg, m, fb, 2, 0, 1, 2) // evicts layer 1's
		pg.PrefetchExperts(1, []int{3})
		waitExperts(t, pg)
		if st := pg.Stats(); st.ExpertPrefetches != 2 {
			t.Errorf("expert 3 acquired since the CPU computed it: %d prefetches, want 2", st.ExpertPrefetches)
		}
	})
	t.Run("off", func(t *testing.T) {
		m := newMoESynth(1, 4, 8, 16)
		pg, _, _, _ := newExpertPager(t, m, 2, Options{PrefetchDepth: -1})
		pg.PrefetchExperts(1, []int{0})
		waitExperts(t, pg)
		if st := pg.Stats(); st.ExpertPrefetches != 0 || st.ExpertsCached != 0 {
			t.Errorf("prefetch off: %d prefetches, %d cached", st.ExpertPrefetches, st.ExpertsCached)
		}
	})
}

// TestAcquireExpertsLazy: a lazy acquire hands out a cached expert ready
// to compute and leaves a miss's wait for its copies to await, which the
// plain acquire runs for every expert; a miss's bytes land only on its
// wait (the fake copies nothing before), so computing it without the wait
// would read stale bytes.
func TestAcquireExpertsLazy(t *testing.T) {
	ctx := context.Background()
	m := newMoESynth(2, 6, 8, 16)
	be := &asyncFake{fakeBackend: newFake()}
	pg, _, _ := newExpertPagerOn(t, be, be.fakeBackend, m, 4, Options{})
	acquireCheck(t, pg, m, be, 1, 0) // cached, its copy waited for
	ws, pending, await, err := pg.AcquireExpertsLazy(ctx, 1, []int{0, 2, 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(pending) != 2 || !slices.Contains(pending, 2) || !slices.Contains(pending, 3) {
		t.Fatalf("pending %v, want the misses 2 and 3", pending)
	}
	if err := m.checkExpert(be, 1, 0, ws[0]); err != nil {
		t.Errorf("the cached expert before any wait: %v", err)
	}
	if err := m.checkExpert(be, 1, 2, ws[2]); err == nil {
		t.Error("a miss holds its bytes before its wait: the acquire waited for its copies")
	}
	for _, x := range pending {
		if err := await(x); err != nil {
			t.Fatal(err)
		}
		if err := m.checkExpert(be, 1, x, ws[x]); err != nil {
			t.Errorf("after its wait: %v", err)
		}
	}
	pg.ReleaseExperts(1, []int{0, 2, 3})
	if err := await(2); err == nil {
		t.Error("await of a released expert: no error")
	}

	// The plain acquire leaves nothing to wait for.
	ws, err = pg.AcquireExperts(ctx, 2, []int{1, 4})
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []int{1, 4} {
		if err := m.checkExpert(be, 2, x, ws[x]); err != nil {
			t.Error(err)
		}
	}
	pg.ReleaseExperts(2, []int{1, 4})
}

// TestExpertLoadFaults: a failed read leaves nothing pinned and no slot
// taken by the expert that failed; the experts that loaded stay cached,
// and the next acquire loads the rest and serves the right bytes. A failed
// prefetch leaves the expert to the acquire that follows.
func TestExpertLoadFaults(t *testing.T) {
	ctx := context.Background()
	m := newMoESynth(2, 6, 8, 16)
	pg, _, fb, _ := newExpertPager(t, m, 4, Options{})
	m.mu.Lock()
	m.fail["b0.e2.up"] = 1
	m.mu.Unlock()
	if _, err := pg.AcquireExperts(ctx, 1, []int{1, 2, 3}); !errors.Is(err, errExpertRead) {
		t.Fatalf("acquire with a failing read: %v", err)
	}
	st := pg.Stats()
	if st.ExpertsPinned != 0 || st.ExpertsCached != 2 || st.ExpertAcquires != 0 {
		t.Errorf("after the failure: %d pinned, %d cached, %d acquires; want 0, 2, 0", st.ExpertsPinned, st.ExpertsCached, st.ExpertAcquires)
	}
	acquireCheck(t, pg, m, fb, 1, 1, 2, 3)
	if st := pg.Stats(); st.ExpertMisses != 1 || st.ExpertHits != 2 {
		t.Errorf("after the retry: %d misses, %d hits; want 1 and 2", st.ExpertMisses, st.ExpertHits)
	}
	m.mu.Lock()
	m.fail["b1.e0.down"] = 1
	m.mu.Unlock()
	pg.PrefetchExperts(2, []int{0})
	waitExperts(t, pg)
	acquireCheck(t, pg, m, fb, 2, 0)
	if st := pg.Stats(); st.ExpertPrefetchHits != 0 || st.ExpertMisses != 2 || st.ExpertsPinned != 0 {
		t.Errorf("after a failed prefetch: %d prefetch hits, %d misses, %d pinned", st.ExpertPrefetchHits, st.ExpertMisses, st.ExpertsPinned)
	}
}

// TestExpertsConcurrent: several callers acquire overlapping experts of
// two layers from a small cache at once, some batches as large as the
// cache, with prefetches in between; each gets its experts' bytes, none
// waits for ever, and nothing stays pinned. Run with -race.
func TestExpertsConcurrent(t *testing.T) {
	m := newMoESynth(2, 8, 8, 16)
	pg, _, fb, _ := newExpertPager(t, m, 4, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 9))
			for range 200 {
				l := 1 + rng.IntN(2)
				xs := rng.Perm(8)[:1+rng.IntN(4)]
				ws, err := pg.AcquireExperts(ctx, l, xs)
				if err != nil {
					errs <- err
					return
				}
				for _, x := range xs {
					if err := m.checkExpert(fb, l, x, ws[x]); err != nil {
						errs <- err
						return
					}
				}
				pg.PrefetchExperts(3-l, rng.Perm(8)[:2])
				pg.ReleaseExperts(l, xs)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	waitExperts(t, pg)
	if st := pg.Stats(); st.ExpertsPinned != 0 || st.ExpertAcquires == 0 {
		t.Errorf("%d experts pinned after every release, %d acquires", st.ExpertsPinned, st.ExpertAcquires)
	}
}

// BenchmarkAcquireExperts measures the pager's own cost of a sparse
// block's AcquireExperts and ReleaseExperts at the Qwen3-30B-A3B scale of
// the cache's bookkeeping (48 blocks of 128 experts, 8 a token, 480
// slots), on tiny experts so that the copies cost little; a quarter of
// the experts asked for miss.
func BenchmarkAcquireExperts(b *testing.B) {
	for _, policy := range []ExpertPolicy{ExpertLRU, ExpertLFU} {
		b.Run(string(policy), func(b *testing.B) {
			benchAcquire(b, policy, 480, 32, false) // a quarter of a block's experts: many hits
		})
	}
}

// BenchmarkAcquireExpertsUniform: the host's cost of a decode step's
// acquire of a sparse block's experts on the Qwen3-30B-A3B shape's cache
// (8 of 128 experts a block, 554 slots over 48 blocks, uniform routing:
// about 7 misses, each evicting one of hundreds). On a GPU the link idles
// while the host does this, before the first copy is queued.
func BenchmarkAcquireExpertsUniform(b *testing.B) {
	benchAcquire(b, ExpertLRU, 554, 128, true)
}

// benchAcquire times acquires (lazy ones where lazy) and releases of 8
// experts drawn from the first among of 128 in 48 blocks visited in turn,
// with an expert cache of slots, and reports the hit rate.
func benchAcquire(b *testing.B, policy ExpertPolicy, slots, among int, lazy bool) {
	m := newMoESynth(48, 128, 8, 8)
	pg, err := benchPager(b, m, m, newFake(), slots, policy)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	ctx := context.Background()
	l := 0
	for b.Loop() {
		l = l%48 + 1
		xs := rng.Perm(among)[:8]
		if lazy {
			_, _, _, err = pg.AcquireExpertsLazy(ctx, l, xs)
		} else {
			_, err = pg.AcquireExperts(ctx, l, xs)
		}
		if err != nil {
			b.Fatal(err)
		}
		pg.ReleaseExperts(l, xs)
	}
	st := pg.Stats()
	b.ReportMetric(st.ExpertHitRate(), "hit-rate")
	b.ReportMetric(float64(st.ExpertSlots), "slots")
}

// TestExpertHostCachePinsInChunks: the experts a pass admits to the host
// cache are pinned in a few large chunks, not one call per expert (each
// call to the driver page-locks with a cost of its own); a second pass is
// served from those host copies, their bytes intact; Close frees every
// chunk (newExpertPager's cleanup checks nothing stays pinned).
func TestExpertHostCachePinsInChunks(t *testing.T) {
	m := newMoESynth(2, 8, 8, 16)
	pg, _, fb, _ := newExpertPager(t, m, 2, Options{ExpertPolicy: ExpertLRU})
	pass := func() {
		for l := 1; l <= 2; l++ {
			for x := range 8 {
				acquireCheck(t, pg, m, fb, l, x)
			}
		}
	}
	pass()
	calls, reads := fb.pinnedCalls.Load(), m.reads.Load()
	if want := int64(16) * m.expertBytes(); reads < want {
		t.Fatalf("first pass read %d bytes, want at least the 16 experts' %d", reads, want)
	}
	if calls < 1 || calls > 2 {
		t.Errorf("16 experts admitted to the host cache with %d AllocPinned calls, want one or two chunks", calls)
	}
	if st := pg.Stats(); st.PinnedHostBytes < 16*m.expertBytes() {
		t.Errorf("%d pinned host bytes reported, want at least the 16 experts' %d", st.PinnedHostBytes, 16*m.expertBytes())
	}
	pass()
	if got := m.reads.Load(); got != reads {
		t.Errorf("the second pass read %d bytes from the source, want none (host cache)", got-reads)
	}
	if got := fb.pinnedCalls.Load(); got != calls {
		t.Errorf("the second pass pinned %d more times, want none", got-calls)
	}
}

// benchPager pages the experts of m (48 layers of 128, the Qwen3-30B-A3B
// shape's), read from src, on dev with slots of them cached under policy,
// no layer prefetched, once the pager has looked its experts up
// (lookUpExperts); the pager and its budget close when the benchmark ends.
func benchPager(b *testing.B, m *moeSynth, src Source, dev tensor.Memory, slots int, policy ExpertPolicy) (*Pager, error) {
	info := smallDims(m, 48)
	p, err := Plan(info, 1<<40, StrategyBalanced, 8, 1, WithExpertCache(8))
	if err != nil {
		return nil, err
	}
	limit := p.PredictedPeakBytes - p.ExpertCacheBytes + int64(slots)*p.ExpertSlotBytes
	if p, err = Plan(info, limit, StrategyBalanced, 8, 1, WithExpertCache(8)); err != nil {
		return nil, err
	}
	bg, err := NewBudget(dev, limit, "fake")
	if err != nil {
		return nil, err
	}
	pg, err := NewPager(src, bg, p, Options{ExpertPolicy: policy, PrefetchDepth: -1})
	if err != nil {
		bg.Close()
		return nil, err
	}
	b.Cleanup(func() {
		pg.Close()
		bg.Close()
	})
	pg.ex.lookups.Wait() // the background lookups of a mapped source, off the timing
	return pg, nil
}

// firstCopy is a mapped asynchronous backend that copies nothing: it notes
// when the first UploadAsync since arm came, for BenchmarkFirstExpertCopy.
type firstCopy struct {
	*mappedAsync
	t0, first time.Time
	armed     bool
}

func (f *firstCopy) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	if f.armed {
		f.first, f.armed = time.Now(), false
	}
	return func() error { return nil }, nil
}

// BenchmarkFirstExpertCopy times what the host does, on an acquire of 8 of
// 128 experts among 554 cached (the Qwen3-30B-A3B shape's decode at 8 GiB,
// uniform routing), before the first copy of a miss is queued: on a GPU
// the link idles meanwhile. The experts are copied in place from a
// page-locked mapping, as the CUDA backend does. first-copy-ns is that
// time, ns/op the whole acquire and release; prepared has each acquire's
// slots chosen ahead (PrepareExperts, outside first-copy-ns), scan not.
func BenchmarkFirstExpertCopy(b *testing.B) {
	for _, prepared := range []bool{false, true} {
		name := "scan"
		if prepared {
			name = "prepared"
		}
		b.Run(name, func(b *testing.B) { benchFirstCopy(b, prepared) })
	}
}

func benchFirstCopy(b *testing.B, prepared bool) {
	m := newMoESynth(48, 128, 8, 8)
	be := &firstCopy{mappedAsync: &mappedAsync{asyncFake: &asyncFake{fakeBackend: newFake()}}}
	pg, err := benchPager(b, m, newMappedMoE(m), be, 554, ExpertLRU)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	ctx := context.Background()
	var first time.Duration
	n, l := 0, 0
	for b.Loop() {
		l = l%48 + 1
		xs := rng.Perm(128)[:8]
		if prepared {
			pg.PrepareExperts(l, 16)
		}
		be.t0, be.armed = time.Now(), true
		if _, _, _, err := pg.AcquireExpertsLazy(ctx, l, xs); err != nil {
			b.Fatal(err)
		}
		if !be.armed {
			first += be.first.Sub(be.t0)
			n++
		}
		be.armed = false
		pg.ReleaseExperts(l, xs)
	}
	b.ReportMetric(float64(first.Nanoseconds())/float64(max(n, 1)), "first-copy-ns")
	b.ReportMetric(pg.Stats().ExpertHitRate(), "hit-rate")
}

// TestPrepareExpertsSameChoice: acquires whose slots come from
// PrepareExperts' choice put the same experts in the same slots, evicting
// the same, as acquires that scan the cache, under LRU and LFU, with a
// prefetch or an expert computed on the CPU (a use LFU counts) now and
// then between the choice and the acquire (which then scans); most
// acquires take the choice.
func TestPrepareExpertsSameChoice(t *testing.T) {
	for _, policy := range []ExpertPolicy{ExpertLRU, ExpertLFU} {
		t.Run(string(policy), func(t *testing.T) {
			m := newMoESynth(6, 16, 8, 8)
			var pgs [2]*Pager
			for i := range pgs {
				pgs[i], _, _, _ = newExpertPager(t, m, 20, Options{ExpertPolicy: policy, PrefetchDepth: -1})
			}
			rng := rand.New(rand.NewPCG(3, 4))
			ctx := context.Background()
			for step := range 400 {
				l := step%6 + 1
				xs := rng.Perm(16)[:4]
				between := rng.IntN(8)
				pgs[0].PrepareExperts(l, 8)
				hx := rng.IntN(16)
				for _, pg := range pgs {
					switch between {
					case 0: // a prefetch of the next layer's: the choice no longer holds
						pg.PrefetchExperts(l%6+1, []int{hx})
						waitExperts(t, pg)
					case 1: // an expert computed on the CPU: a use LFU counts
						_, release, err := pg.HostExpert(ctx, l%6+1, hx, 1)
						if err != nil {
							t.Fatal(err)
						}
						release()
					}
				}
				for _, pg := range pgs {
					if _, _, _, err := pg.AcquireExpertsLazy(ctx, l, xs); err != nil {
						t.Fatal(err)
					}
				}
				for s := range pgs[0].ex.slots {
					a, b := pgs[0].ex.slots[s], pgs[1].ex.slots[s]
					if (a == nil) != (b == nil) || a != nil && (a.layer != b.layer || a.expert != b.expert) {
						t.Fatalf("step %d: slot %d holds %v with the prepared choice, %v with the scan", step, s, slotName(a), slotName(b))
					}
				}
				for _, pg := range pgs {
					pg.ReleaseExperts(l, xs)
				}
			}
			a, b := pgs[0].Stats(), pgs[1].Stats()
			if a.ExpertEvictions != b.ExpertEvictions || a.ExpertHits != b.ExpertHits || a.ExpertEvictions == 0 {
				t.Errorf("evictions %d and hits %d with the prepared choice, %d and %d with the scan (want equal, and evictions)", a.ExpertEvictions, a.ExpertHits, b.ExpertEvictions, b.ExpertHits)
			}
			if a.ExpertsPrepared < 300 || b.ExpertsPrepared != 0 {
				t.Errorf("%d of 400 acquires took the prepared choice (want most), %d without one", a.ExpertsPrepared, b.ExpertsPrepared)
			}
		})
	}
}

func slotName(e *expertEntry) string {
	if e == nil {
		return "nothing"
	}
	return fmt.Sprintf("layer %d expert %d", e.layer, e.expert)
}
