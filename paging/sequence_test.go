package paging

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// hybridSplit returns, for n layers, the layers a hybrid plan might give
// the CPU (every third, and the embedding) and the sequence of the others.
func hybridSplit(n int) (cpu, seq []int) {
	for l := range n {
		if l == 0 || l%3 == 2 {
			cpu = append(cpu, l)
		} else {
			seq = append(seq, l)
		}
	}
	return cpu, seq
}

// planAtDepth plans with the CPU layers streamed whole, the ring sized for
// the sequence, and the prefetch depth d.
func planAtDepth(t testing.TB, info ModelInfo, budget int64, cpu, seq []int, d int) *PlanResult {
	t.Helper()
	o := planOptions{chunk: 8, maxPrefetch: 2, depth: d, whole: cpu, sequence: seq}
	p, err := plan(info, budget, StrategyBalanced, 16, 1, o)
	if err != nil {
		t.Fatalf("plan at depth %d: %v", d, err)
	}
	return p
}

// TestPagerSequence decodes over a sequence with gaps, the way a hybrid
// plan does: after a prefill pass over every layer, the pager follows the
// sequence, forward or backwards, each Acquire after the loads under way
// are done (as when the CPU computes the layers between), with prefetch
// filling the ring (PrefetchFill) or not. The layers left
// out are never loaded again (the source, with no host cache, is read on
// every load), every streamed layer of the sequence loads once a token
// when the ring cannot hold them all, prefetch brings every one before its
// Acquire, and the walk neither allocates nor leaves the ring.
func TestPagerSequence(t *testing.T) {
	const tokens = 5
	for _, m := range []struct {
		name string
		src  *synthSource
	}{{"llama", llamaSynth(10, 64, 172, 32, 256)}, {"gqa", llamaSynth(9, 96, 256, 32, 300)}} {
		n := m.src.NumLayers()
		info := smallDims(m.src, n)
		W, _ := totalAndMax(info)
		cpu, seq := hybridSplit(n)
		for _, pct := range []int64{40, 70} {
			for _, d := range []int{1, 2} {
				for _, c := range []struct{ rev, fill bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
					rev := c.rev
					name := fmt.Sprintf("%s/%d%%/depth %d/reverse=%v/fill=%v", m.name, pct, d, rev, c.fill)
					p0 := planAtDepth(t, info, 1<<40, cpu, seq, d)
					budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W*pct/100
					plan := planAtDepth(t, info, budget, cpu, seq, d)
					fb := newFake()
					bg := newBudget(t, fb, budget, "fake:0")
					free := nnReserve(t, bg, plan)
					pg, err := NewPager(m.src, bg, plan, Options{HostCacheBytes: -1, PrefetchFill: c.fill})
					if err != nil {
						t.Fatal(err)
					}
					all, order := forward(n), slices.Clone(seq)
					if rev {
						pg.SetOrder(Reverse)
						all = reverse(n)
						slices.Reverse(order)
					}
					sweep(t, pg, m.src, all) // prefill: every layer
					waitIdle(pg)
					if err := pg.SetSequence(seq); err != nil {
						t.Fatal(err)
					}
					decode := func() {
						for _, l := range order {
							waitIdle(pg)
							sweep(t, pg, m.src, []int{l})
						}
						waitIdle(pg)
					}
					// The ring holds parts in the order of the prefill,
					// which the walk over the sequence puts in its own
					// within two tokens: a prefetch or two may find no
					// room meanwhile (and the layer loads on demand).
					decode()
					decode()
					calls := make([]int64, n)
					for l := range n {
						calls[l] = m.src.calls[l].Load()
					}
					allocs, frees := fb.allocs.Load(), fb.frees.Load()
					before := pg.Stats()
					for range tokens {
						decode()
					}
					st := pg.Stats()
					var seqParts int64
					for _, l := range seq {
						seqParts += alignUp(plan.Layers[l].StreamedBytes)
					}
					cycles := int64(tokens)
					if seqParts <= plan.RingBytes {
						cycles = 0 // the ring holds them all
					}
					for l := range n {
						got := m.src.calls[l].Load() - calls[l]
						want := cycles * int64(len(plan.Layers[l].Streamed))
						if slices.Contains(cpu, l) {
							want = 0
						}
						if got != want {
							t.Errorf("%s: layer %d: %d tensor reads in %d tokens, want %d", name, l, got, tokens, want)
						}
					}
					if a, f := fb.allocs.Load()-allocs, fb.frees.Load()-frees; a != 0 || f != 0 {
						t.Errorf("%s: %d allocations and %d frees in decode", name, a, f)
					}
					if st.PrefetchNoRoom != before.PrefetchNoRoom || st.OutsideRing != before.OutsideRing || st.Misses != before.Misses {
						t.Errorf("%s: in decode %d prefetches without room, %d parts outside the ring, %d misses\n%s", name,
							st.PrefetchNoRoom-before.PrefetchNoRoom, st.OutsideRing-before.OutsideRing, st.Misses-before.Misses, pg.dump())
					}
					if err := pg.SetSequence(nil); err != nil {
						t.Fatal(err)
					}
					sweep(t, pg, m.src, all) // the next prefill
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
}

// TestPagerPrefetchAfterRelease: once the layer acquired last is released,
// prefetch moves on by a layer, so that the copies go on while the caller
// computes elsewhere (on the CPU) before its next Acquire: with depth 1,
// releasing a layer loads the one two places after it.
func TestPagerPrefetchAfterRelease(t *testing.T) {
	src := llamaSynth(8, 64, 172, 32, 256)
	n := src.NumLayers()
	info := smallDims(src, n)
	cpu, seq := hybridSplit(n)
	aggressive, err := Plan(info, 1<<40, StrategyAggressive, 16, 1, WithMaxPrefetch(1), WithStreamedWhole(cpu), WithSequence(seq))
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, newFake(), 1<<40, "")
	defer bg.Close()
	pg, err := NewPager(src, bg, aggressive, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	if pg.depth != 1 {
		t.Fatalf("depth %d", pg.depth)
	}
	if err := pg.SetSequence(seq); err != nil {
		t.Fatal(err)
	}
	loaded := func(l int) bool {
		pg.mu.Lock()
		defer pg.mu.Unlock()
		return pg.layers[l].loaded()
	}
	ctx := context.Background()
	for i, l := range seq[:len(seq)-2] {
		if _, err := pg.Acquire(ctx, l); err != nil {
			t.Fatal(err)
		}
		waitIdle(pg)
		two := seq[i+2]
		if loaded(two) {
			t.Fatalf("layer %d loaded while %d is acquired, with depth 1", two, l)
		}
		pg.Release(l)
		waitIdle(pg)
		if !loaded(two) {
			t.Errorf("layer %d not loaded after %d was released (sequence %v)", two, l, seq)
		}
		for _, c := range cpu {
			if loaded(c) {
				t.Errorf("layer %d, outside the sequence, loaded", c)
			}
		}
	}
}

// TestSetSequence: the order prefetch follows, forward and backwards, for
// layers in and out of the sequence; bad sequences are refused; and
// changing the sequence while layers are acquired is safe (run with -race).
func TestSetSequence(t *testing.T) {
	src := llamaSynth(6, 16, 32, 8, 32)
	n := src.NumLayers() // 8
	info := smallDims(src, n)
	plan, err := Plan(info, 1<<40, StrategyAggressive, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, newFake(), 1<<40, "")
	defer bg.Close()
	pg, err := NewPager(src, bg, plan, Options{PrefetchDepth: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	for _, bad := range [][]int{{1, 2, 1}, {-1}, {n}} {
		if err := pg.SetSequence(bad); err == nil {
			t.Errorf("sequence %v accepted", bad)
		}
	}
	seq := []int{1, 3, 4, 6}
	for _, tc := range []struct {
		seq    []int
		order  Order
		layer  int
		window []int
	}{
		{nil, Forward, 7, []int{7, 0, 1}},
		{nil, Reverse, 0, []int{0, 7, 6}},
		{seq, Forward, 4, []int{4, 6, 1}},
		{seq, Forward, 6, []int{6, 1, 3}},
		{seq, Forward, 5, []int{5, 6, 1}}, // outside: the layers above it
		{seq, Forward, 7, []int{7, 1, 3}},
		{seq, Reverse, 3, []int{3, 1, 6}},
		{seq, Reverse, 2, []int{2, 1, 6}}, // outside: the layers below it
		{seq, Reverse, 0, []int{0, 6, 4}},
		{[]int{5, 2}, Forward, 2, []int{2, 5}}, // shorter than the window
		{[]int{5, 2}, Forward, 3, []int{3, 5, 2}},
	} {
		if err := pg.SetSequence(tc.seq); err != nil {
			t.Fatal(err)
		}
		pg.SetOrder(tc.order)
		if w := pg.window(tc.layer); !slices.Equal(w, tc.window) {
			t.Errorf("sequence %v, order %d: window of %d is %v, want %v", tc.seq, tc.order, tc.layer, w, tc.window)
		}
	}
	pg.SetOrder(Forward)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			var s []int
			if i%2 == 0 {
				s = seq
			}
			if err := pg.SetSequence(s); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for range 20 {
		sweep(t, pg, src, forward(n))
	}
	close(stop)
	wg.Wait()
}

// TestPagerFillsRing: with PrefetchFill, a Release followed by no Acquire
// (the CPU computing its layers) loads the sequence's next streamed parts
// as far as the ring has room, each prefetch that ends starting the next;
// without it, the depth+1 after the released layer. The parts loaded
// ahead are the walk's next ones, in order, and all fit in the ring.
func TestPagerFillsRing(t *testing.T) {
	src := llamaSynth(10, 64, 172, 32, 256)
	n := src.NumLayers()
	info := smallDims(src, n)
	W, _ := totalAndMax(info)
	cpu, seq := hybridSplit(n)
	const d = 1
	p0 := planAtDepth(t, info, 1<<40, cpu, seq, d)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W*60/100
	plan := planAtDepth(t, info, budget, cpu, seq, d)
	ahead := map[bool]int{}
	for _, fill := range []bool{false, true} {
		fb := newFake()
		bg := newBudget(t, fb, budget, "fake:0")
		free := nnReserve(t, bg, plan)
		pg, err := NewPager(src, bg, plan, Options{HostCacheBytes: -1, PrefetchFill: fill})
		if err != nil {
			t.Fatal(err)
		}
		if err := pg.SetSequence(seq); err != nil {
			t.Fatal(err)
		}
		for range 3 { // settle the ring into the walk's order
			for _, l := range seq {
				waitIdle(pg)
				sweep(t, pg, src, []int{l})
			}
		}
		waitIdle(pg)
		// Where the walk stands now: its last layer released. The parts
		// ahead, in the walk's order, up to the first not loaded.
		var loaded, bytes, next int64
		for _, l := range seq {
			e := pg.layers[l]
			if len(e.str) == 0 {
				continue
			}
			if !e.ringLoaded() {
				next = e.strSlab
				break
			}
			loaded++
			bytes += e.strSlab
		}
		if fill && next > 0 && bytes+next <= pg.ringCap {
			t.Errorf("fill: the next part (%d bytes) fits beside the %d loaded ahead in the %d-byte ring, and is not loaded", next, bytes, pg.ringCap)
		}
		ahead[fill] = int(loaded)
		streamed := 0
		for _, l := range seq {
			if len(pg.layers[l].str) > 0 {
				streamed++
			}
		}
		t.Logf("fill=%v: %d of %d streamed parts ahead loaded (%d bytes of a %d-byte ring)", fill, loaded, streamed, bytes, pg.ringCap)
		if bytes > pg.ringCap {
			t.Errorf("fill=%v: %d bytes loaded ahead in a ring of %d", fill, bytes, pg.ringCap)
		}
		free()
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
	}
	if ahead[false] > d+1 {
		t.Errorf("without fill %d parts ahead loaded, want at most depth+1 = %d", ahead[false], d+1)
	}
	if ahead[true] <= d+1 {
		t.Errorf("with fill %d parts ahead loaded, want more than depth+1 = %d", ahead[true], d+1)
	}
}

// gatedAsync is a backend whose UploadAsync waits for its gate to open,
// but for the first free calls.
type gatedAsync struct {
	*fakeBackend
	mu   sync.Mutex
	free int
	gate chan struct{}
}

func (g *gatedAsync) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	g.mu.Lock()
	wait := g.free <= 0
	g.free--
	g.mu.Unlock()
	if wait {
		select {
		case <-g.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	copy(dst.Bytes()[off:], src)
	return func() error { return nil }, nil
}

// TestPagerFillStartsAtOnce: an Acquire and a Release start the loads of
// every part the ring has room for at once, not depth+1 of them with the
// others left to the loads' ends: loads may all end together, and each
// would find the others still holding their places in the prefetch group.
// Here the copies of the walk's first layer pass, the others wait at a
// gate while the test counts the loads under way.
func TestPagerFillStartsAtOnce(t *testing.T) {
	src := llamaSynth(10, 64, 172, 32, 256)
	n := src.NumLayers()
	info := smallDims(src, n)
	W, _ := totalAndMax(info)
	cpu, seq := hybridSplit(n)
	const d = 1
	p0 := planAtDepth(t, info, 1<<40, cpu, seq, d)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W*60/100
	plan := planAtDepth(t, info, budget, cpu, seq, d)
	be := &gatedAsync{fakeBackend: newFake(), gate: make(chan struct{})}
	bg := newBudget(t, be, budget, "fake:0")
	free := nnReserve(t, bg, plan)
	pg, err := NewPager(src, bg, plan, Options{HostCacheBytes: 1 << 30, PrefetchFill: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.SetSequence(seq); err != nil {
		t.Fatal(err)
	}
	first := seq[0]
	be.free = len(pg.layers[first].str)
	sweep(t, pg, src, []int{first})
	pg.mu.Lock()
	var started int
	var bytes int64
	for _, l := range seq[1:] {
		e := pg.layers[l]
		if len(e.str) > 0 && (e.loading || e.queued) {
			started++
			bytes += e.strSlab
		}
	}
	ring := pg.ringCap
	pg.mu.Unlock()
	close(be.gate)
	waitIdle(pg)
	t.Logf("after the walk's first layer: %d loads under way (%d bytes of a %d-byte ring)", started, bytes, ring)
	if started <= d+1 {
		t.Errorf("after the walk's first layer %d loads under way; want more than depth+1 = %d", started, d+1)
	}
	free()
	if err := pg.Close(); err != nil {
		t.Error(err)
	}
	if err := bg.Close(); err != nil {
		t.Error(err)
	}
}
