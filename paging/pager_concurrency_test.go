package paging

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// randomFaults makes a faults value fail each call through the given seams
// with probability rate, from a seeded generator, once rate is set.
func randomFaults(seed uint64, seams ...string) *faults {
	f := newFaults()
	f.rng, f.seams = rand.New(rand.NewPCG(seed, 1)), seams
	return f
}

// concurrentTally is what a concurrent run did.
type concurrentTally struct {
	ok, failed, injected, cancelled int
	// known names a known bug the run ran into (see faultSweep).
	known []string
}

// concurrentRun shares one pager between workers goroutines making steps
// acquires each, in cyclic (a decoder) or random order, some cancelled or
// timing out, while the backend and source fail calls with probability
// rate. The budget is the plan's reserves plus room(largest layer, weight
// bytes). Every Acquire must return the layer's exact bytes or an error
// wrapping the fault or the context's; afterwards the accounts must be
// consistent, a clean request must succeed, the budget's peak must be
// within its limit, and Close must leave nothing allocated.
//
// A run that makes no progress for stall is a deadlock: the pager is closed
// to free the goroutines, and the run reports it as a known bug.
func concurrentRun(t *testing.T, kind string, strategy Strategy, rate float64, room func(lmax, w int64) int64, workers, steps int, stall time.Duration) (tally concurrentTally) {
	t.Helper()
	f := randomFaults(uint64(len(kind))*31+uint64(len(strategy)), seamAlloc, seamUpload, seamRead, seamPinned)
	fb := newFaultBackend(f)
	var be tensor.Memory = fb
	switch kind {
	case "pageable":
		be = hidePinned{fb}
	case "pinned-async", "pinned-async-fill":
		be = asyncFaultBackend{fb}
	}
	base := llamaSynth(6, 32, 48, 16, 64)
	src := faultSource{base, f}
	info := smallDims(base, 6)
	W, lmax := totalAndMax(info)
	p0, err := Plan(info, 1<<40, strategy, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + room(lmax, W)
	plan, err := Plan(info, budget, strategy, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, be, budget, "fault")
	free := nnReserve(t, bg, plan)
	p, err := NewPager(src, bg, plan, Options{HostCacheBytes: W / 3, PrefetchFill: kind == "pinned-async-fill"})
	if err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.rate = rate // from now on
	f.mu.Unlock()
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	var acquires int64
	spurious := 0 // out of memory with no fault injected
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 7))
			n := p.NumLayers()
			l := r.IntN(n)
			for range steps {
				if w%2 == 0 {
					l = (l + 1) % n // a decoder's cyclic walk
				} else {
					l = r.IntN(n)
				}
				ctx, cancel := context.Background(), context.CancelFunc(func() {})
				switch r.IntN(10) {
				case 0:
					ctx, cancel = context.WithTimeout(ctx, time.Duration(r.IntN(200))*time.Microsecond)
				case 1:
					ctx, cancel = context.WithCancel(ctx)
					cancel()
				}
				ws, err := p.Acquire(ctx, l)
				cancel()
				if err == nil {
					err = check(be, base, l, ws)
					if err != nil {
						err = fmt.Errorf("wrong data: %w", err)
					}
					p.Release(l)
				}
				mu.Lock()
				acquires++
				switch {
				case err == nil:
					tally.ok++
				case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
					tally.cancelled++
				case errors.Is(err, errInjected) && strings.HasPrefix(err.Error(), "paging: "):
					tally.failed++
				case errors.Is(err, tensor.ErrOutOfMemory) && strings.HasPrefix(err.Error(), "paging: "):
					spurious++
				default:
					errs = append(errs, err)
				}
				mu.Unlock()
			}
		}()
	}
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	deadlocked := false
	for last := int64(-1); !deadlocked; {
		select {
		case <-finished:
		case <-time.After(stall):
			mu.Lock()
			now := acquires
			mu.Unlock()
			if now == last {
				deadlocked = true
				// Known bugs in paging/pager.go, reported for its owner:
				// demand loads wait in waitChange for a change that never
				// comes. (1) An Acquire that gives up (its context ended)
				// decrements its layer's waiters without a broadcast,
				// though waitChange counted it as progress to come. (2)
				// Two loads whose allocations fail with the backend's
				// ErrOutOfMemory (a device fuller than the budget knows)
				// each count the other's load as progress and wait; nothing
				// is pinned and the budget never reclaims on a backend
				// failure, so nothing wakes them.
				tally.known = append(tally.known, fmt.Sprintf("%s: deadlock after %d of %d acquires: every worker waits in Acquire, no layer pinned\n%s", t.Name(), now, workers*steps, p.dump()))
				p.Close() // frees the stuck loads
				<-finished
			}
			last = now
			continue
		}
		break
	}
	f.mu.Lock()
	tally.injected = f.fired
	f.rate = 0
	f.mu.Unlock()
	if !deadlocked {
		for _, err := range errs {
			t.Errorf("acquire: %v", err)
		}
		if err := consistent(p, fb.fakeBackend); err != nil {
			t.Fatalf("after the concurrent run: %v\n%s", err, p.dump())
		}
		if err := request(context.Background(), p, be, base); err != nil {
			t.Fatalf("clean request after the concurrent run: %v\n%s", err, p.dump())
		}
		if st := p.Stats(); st.PinnedLayers != 0 || st.BadReleases != 0 {
			t.Errorf("%d layers pinned, %d bad releases", st.PinnedLayers, st.BadReleases)
		}
	}
	if spurious > 0 {
		// Known bug in paging/pager.go, reported for its owner: a demand
		// load runs under the context of the Acquire that started it; when
		// that context ends while the load waits for room, the load fails
		// with ErrOutOfMemory rather than the context's error, so the
		// Acquires that joined it fail instead of loading again.
		tally.known = append(tally.known, fmt.Sprintf("%s: %d of %d acquires failed with ErrOutOfMemory that waiting would have served", t.Name(), spurious, workers*steps))
	}
	if bg.Peak() > budget {
		t.Errorf("budget peak %d over the limit %d", bg.Peak(), budget)
	}
	free()
	if err := p.Close(); err != nil {
		t.Errorf("pager Close: %v", err)
	}
	if err := bg.Close(); err != nil {
		t.Errorf("budget Close: %v", err)
	}
	if nt, live, pinned := fb.outstanding(); nt != 0 || live != 0 || pinned != 0 {
		t.Errorf("after Close: %d tensors, %d bytes, %d pinned bytes", nt, live, pinned)
	}
	if v := fb.problems(); len(v) > 0 { // see faultSweep: a known bug in loadTensors
		tally.known = append(tally.known, fmt.Sprintf("%s: pinned host buffer freed under an in-flight copy, %d times", t.Name(), len(v)))
	}
	return tally
}

// runConcurrent runs concurrentRun for every backend kind and strategy and
// reports the figures, skipping with the first known bug if one was met.
func runConcurrent(t *testing.T, rate float64, room func(lmax, w int64) int64) {
	workers, steps, stall := 6, 150, time.Second
	if raceEnabled || testing.Short() {
		steps, stall = 60, 3*time.Second
	}
	var total concurrentTally
	kinds := []string{"pageable", "pinned", "pinned-async", "pinned-async-fill"}
	for _, kind := range kinds {
		for _, strategy := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive} {
			t.Run(kind+"/"+string(strategy), func(t *testing.T) {
				c := concurrentRun(t, kind, strategy, rate, room, workers, steps, stall)
				total.ok += c.ok
				total.failed += c.failed
				total.injected += c.injected
				total.cancelled += c.cancelled
				total.known = append(total.known, c.known...)
			})
		}
	}
	t.Logf("%d goroutines x %d acquires x %d configurations: %d served with exact bytes, %d failed by %d injected faults, %d cancelled, %d runs hit known bugs",
		workers, steps, 3*len(kinds), total.ok, total.failed, total.injected, total.cancelled, len(total.known))
	// The deadlocks and spurious out-of-memory failures these runs found
	// are fixed in the pager: seeing one again is a failure.
	for _, k := range total.known {
		t.Error("pager bug: " + k)
	}
}

// TestPagerConcurrentFaults: six goroutines share one pager with room for a
// few layers beyond the ring, while 4% of allocations, uploads, reads and
// pinned allocations fail and a fifth of the acquires are cancelled or
// time out.
func TestPagerConcurrentFaults(t *testing.T) {
	runConcurrent(t, 0.04, func(lmax, w int64) int64 { return 3*lmax + w/4 })
}

// TestPagerConcurrentTightBudget: six goroutines share one pager whose
// budget holds the plan's reserves and one and a half of the largest layer,
// the smallest that plans: more acquirers than the layers that fit, no
// faults. Acquires must wait for each other, never fail or hang (this one
// reproduces the deadlock and the spurious out-of-memory errors reported
// as known bugs).
func TestPagerConcurrentTightBudget(t *testing.T) {
	runConcurrent(t, 0, func(lmax, w int64) int64 { return lmax + lmax/2 })
}
