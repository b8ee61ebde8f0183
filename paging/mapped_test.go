package paging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"
)

// mappedFake is a stagedFake that page-locks host memory
// (tensor.HostRegistrar): it records what is registered, fails the
// registration numbered failAt (from 1; 0 never), and counts
// unregistrations, flagging one called twice.
type mappedFake struct {
	*stagedFake
	mu           sync.Mutex
	registered   int
	live         int
	failAt       int
	unregistered int
	twice        bool
}

func (f *mappedFake) RegisterHost(b []byte) (func() error, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.registered++
	if f.registered == f.failAt {
		return nil, fmt.Errorf("register: %w", errInjected)
	}
	f.live++
	done := false
	return func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		if done {
			f.twice = true
			return errors.New("unregistered twice")
		}
		done = true
		f.live--
		f.unregistered++
		return nil
	}, nil
}

// mappedSrc is a slowSource whose tensors lie in regions of host memory
// (two: the layers before and from the middle), each tensor's bytes its
// pattern; inPlace says which tensors it gives in place, fail fails
// MappedTensor.
type mappedSrc struct {
	*slowSource
	regions [][]byte
	at      map[string][]byte // "layer/name" -> the tensor's bytes in a region
	inPlace func(l int, name string) bool
	mu      sync.Mutex
	fail    func(l int, name string) error
}

func newMappedSrc(s *slowSource, inPlace func(l int, name string) bool) *mappedSrc {
	m := &mappedSrc{slowSource: s, at: map[string][]byte{}, inPlace: inPlace}
	half := len(s.layers) / 2
	for _, ls := range [][2]int{{0, half}, {half, len(s.layers)}} {
		var region []byte
		for l := ls[0]; l < ls[1]; l++ {
			for _, sp := range s.layers[l] {
				region = append(region, s.pattern(l, sp.Name, sp.Bytes)...)
			}
		}
		off := 0
		for l := ls[0]; l < ls[1]; l++ {
			for _, sp := range s.layers[l] {
				m.at[fmt.Sprintf("%d/%s", l, sp.Name)] = region[off : off+int(sp.Bytes) : off+int(sp.Bytes)]
				off += int(sp.Bytes)
			}
		}
		m.regions = append(m.regions, region)
	}
	return m
}

func (m *mappedSrc) MappedRegions() [][]byte { return m.regions }

func (m *mappedSrc) MappedTensor(l int, name string) ([]byte, bool, error) {
	m.mu.Lock()
	fail := m.fail
	m.mu.Unlock()
	if fail != nil {
		if err := fail(l, name); err != nil {
			return nil, false, err
		}
	}
	if !m.inPlace(l, name) {
		return nil, false, nil
	}
	return m.at[fmt.Sprintf("%d/%s", l, name)], true, nil
}

// TestStagingMapped: from a MappedSource on a backend that page-locks
// host memory, the staging ring registers the source's regions and copies
// the tensors the source gives in place straight from them (no read, no
// staging buffer), the others through the ring as before; every layer
// holds its bytes. A registration that fails undoes those done and every
// tensor is read; Options.NoMappedUploads registers nothing; a fault in
// MappedTensor fails the Acquire with the package's prefix and leaves the
// pager working. Close unregisters each region once.
func TestStagingMapped(t *testing.T) {
	all := func(int, string) bool { return true }
	even := func(_ int, name string) bool { return name[len(name)-1]%2 == 0 } // t0, t2, t4, t6 of each layer
	cases := []struct {
		name       string
		inPlace    func(int, string) bool
		opts       Options
		failAt     int
		mappedPart float64 // of the bytes moved
		registered bool
	}{
		{"every tensor in place", all, Options{}, 0, 1, true},
		{"half in place", even, Options{}, 0, 0.5, true},
		{"second registration fails", all, Options{}, 2, 0, false},
		{"first registration fails", all, Options{}, 1, 0, false},
		{"NoMappedUploads", all, Options{NoMappedUploads: true}, 0, 0, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			be := &mappedFake{stagedFake: newStagedFake(2 * time.Microsecond), failAt: tc.failAt}
			base := stagedModel(6)
			slow := &slowSource{synthSource: base, perKiB: 2 * time.Microsecond, fake: be.stagedFake}
			src := newMappedSrc(slow, tc.inPlace)
			plan, err := Plan(smallDims(base, base.NumLayers()), 1<<30, StrategyAggressive, 16, 1)
			if err != nil {
				t.Fatal(err)
			}
			bg := newBudget(t, be, 1<<30, "fake")
			p, err := NewPager(src, bg, plan, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			r := &stagedRig{be: be.stagedFake, src: slow, plan: plan, bg: bg, p: p, free: nnReserve(t, bg, plan)}
			defer r.close(t)
			r.scan(t, 3, 0)
			r.staged(t)
			st := p.Stats()
			moved := st.BytesHostToDevice
			var regionBytes int64
			for _, g := range src.regions {
				regionBytes += int64(len(g))
			}
			t.Logf("moved %d: %d in place, %d staged, %d read; %d registered", moved, st.BytesMapped, st.BytesStaged, base.reads.Load(), st.MappedBytes)
			// A prefetch dropped part way (stale, or without room) moves
			// part of a layer: half in place is about half.
			if got := float64(st.BytesMapped) / float64(moved); math.Abs(got-tc.mappedPart) > 0.05 || (got == 0) != (tc.mappedPart == 0) || (got == 1) != (tc.mappedPart == 1) {
				t.Errorf("%.2f of the bytes moved copied in place, want %.2f", got, tc.mappedPart)
			}
			if st.BytesMapped+st.BytesStaged != moved || base.reads.Load() < st.BytesStaged || (st.BytesStaged == 0) != (base.reads.Load() == 0) {
				t.Errorf("moved %d = %d in place + %d staged? %d read", moved, st.BytesMapped, st.BytesStaged, base.reads.Load())
			}
			// Copied in place, the buffers are pinned when a load first
			// needs one.
			if (st.StagingSlots == 0) != (tc.mappedPart == 1) {
				t.Errorf("%d staging buffers pinned with %.0f%% of the bytes copied in place", st.StagingSlots, 100*tc.mappedPart)
			}
			if _, _, pinned := be.outstanding(); pinned != st.StagingBytes {
				t.Errorf("the backend holds %d pinned bytes, the ring reports %d", pinned, st.StagingBytes)
			}
			if want := map[bool]int64{true: regionBytes}[tc.registered]; st.MappedBytes != want {
				t.Errorf("Stats: %d bytes page-locked, want %d", st.MappedBytes, want)
			}
			if sum := Summary(bg); strings.Contains(sum, "page-locked") != tc.registered {
				t.Errorf("the summary reports the mapped files: %v, want %v:\n%s", !tc.registered, tc.registered, sum)
			}
			if tc.registered {
				// A fault in MappedTensor: the Acquire fails, the next ones
				// work.
				var once sync.Once
				src.mu.Lock()
				src.fail = func(l int, name string) error {
					var err error
					if l == 3 {
						once.Do(func() { err = fmt.Errorf("mapping: %w", errInjected) })
					}
					return err
				}
				src.mu.Unlock()
				_, err := p.Acquire(context.Background(), 3)
				if !errors.Is(err, errInjected) || !strings.HasPrefix(err.Error(), "paging: layer 3 tensor ") {
					t.Errorf("acquire with a fault in MappedTensor: %v, want the fault with the package's prefix", err)
				}
				if err := settle(p); err != nil {
					t.Fatal(err)
				}
				r.scan(t, 2, 0)
			}
			r.close(t)
			be.mu.Lock()
			defer be.mu.Unlock()
			if be.live != 0 || be.twice {
				t.Errorf("after Close: %d regions still registered, one unregistered twice %v", be.live, be.twice)
			}
			if tc.registered && be.unregistered != len(src.regions) {
				t.Errorf("%d regions unregistered, want %d", be.unregistered, len(src.regions))
			}
		})
	}
}

// mappedMoE is a moeSynth whose tensors lie in one region of host memory,
// each its pattern, all given in place; it counts the reads of experts'
// tensors (ReadTensor).
type mappedMoE struct {
	*moeSynth
	region      []byte
	at          map[string][]byte // "layer/name" -> the tensor's bytes in region
	expertReads atomic.Int64
	lookups     atomic.Int64 // MappedTensor's calls
	// split, when not 0, cuts the region in two regions there.
	split int
}

func newMappedMoE(m *moeSynth) *mappedMoE {
	mm := &mappedMoE{moeSynth: m, at: map[string][]byte{}}
	offs := map[string]int{}
	for l, specs := range m.layers {
		for _, sp := range specs {
			mm.region = append(mm.region, make([]byte, (64-len(mm.region)%64)%64)...) // aligned as a file's tensors
			offs[fmt.Sprintf("%d/%s", l, sp.Name)] = len(mm.region)
			mm.region = append(mm.region, m.pattern(l, sp.Name, sp.Bytes)...)
		}
	}
	for l, specs := range m.layers {
		for _, sp := range specs {
			key := fmt.Sprintf("%d/%s", l, sp.Name)
			mm.at[key] = mm.region[offs[key] : offs[key]+int(sp.Bytes) : offs[key]+int(sp.Bytes)]
		}
	}
	return mm
}

func (m *mappedMoE) MappedRegions() [][]byte {
	if m.split > 0 {
		return [][]byte{m.region[:m.split], m.region[m.split:]}
	}
	return [][]byte{m.region}
}

func (m *mappedMoE) MappedTensor(l int, name string) ([]byte, bool, error) {
	m.lookups.Add(1)
	b, ok := m.at[fmt.Sprintf("%d/%s", l, name)]
	return b, ok, nil
}

func (m *mappedMoE) ReadTensor(ctx context.Context, l int, name string, dst []byte) error {
	if strings.Contains(name, ".e") {
		m.expertReads.Add(1)
	}
	return m.moeSynth.ReadTensor(ctx, l, name, dst)
}

// newMappedPager pages src's experts on a mappedAsync fake, slots of them
// cached, with opts.
func newMappedPager(t *testing.T, src *mappedMoE, slots int, opts Options) (*Pager, *mappedAsync) {
	t.Helper()
	be := &mappedAsync{asyncFake: &asyncFake{fakeBackend: newFake()}}
	info, limit := moeBudget(t, src.moeSynth, slots, 8)
	plan, err := Plan(info, limit, StrategyBalanced, 8, 1, WithExpertCache(1))
	if err != nil {
		t.Fatal(err)
	}
	pg, err := NewPager(src, newBudget(t, be, limit, "fake"), plan, opts)
	if err != nil {
		t.Fatal(err)
	}
	return pg, be
}

// mappedAsync is an asyncFake that page-locks host memory, counting the
// registrations alive.
type mappedAsync struct {
	*asyncFake
	mu   sync.Mutex
	live int
}

func (f *mappedAsync) RegisterHost(b []byte) (func() error, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.live++
	var once sync.Once
	return func() error {
		once.Do(func() {
			f.mu.Lock()
			f.live--
			f.mu.Unlock()
		})
		return nil
	}, nil
}

// TestExpertsMapped: from a MappedSource on a backend that page-locks
// host memory and copies asynchronously, the expert cache copies each
// expert straight from the page-locked mapping (nothing read, no host
// copy pinned, one copy an expert whose tensors lie end to end),
// prefetches and acquires alike, and HostExpert gives the
// CPU views of the mapping; Options.NoMappedUploads goes back to reading
// into host copies. Close unregisters the region.
func TestExpertsMapped(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		noMapped, split bool
	}{{false, false}, {true, false}, {false, true}} {
		noMapped := tc.noMapped
		t.Run(fmt.Sprintf("NoMappedUploads=%v/split=%v", noMapped, tc.split), func(t *testing.T) {
			m := newMoESynth(2, 6, 8, 16)
			src := newMappedMoE(m)
			wantCopies := 3 // gate, up and down lie end to end: one copy an expert
			if tc.split {
				// Two regions, the second from expert 0's up: its gate
				// and its up are copied apart.
				up := src.at["1/"+m.experts[1][0][1]]
				src.split = int(uintptr(unsafe.Pointer(&up[0])) - uintptr(unsafe.Pointer(&src.region[0])))
				wantCopies = 4
			}
			pg, be := newMappedPager(t, src, 3, Options{NoMappedUploads: noMapped})
			acquireCheck(t, pg, m, be, 1, 0, 1)
			pg.PrefetchExperts(2, []int{4})
			waitExperts(t, pg)
			acquireCheck(t, pg, m, be, 2, 4)
			ts, release, err := pg.HostExpert(ctx, 1, 5, 1)
			if err != nil {
				t.Fatal(err)
			}
			name := m.experts[1][5][0]
			aliased := &ts[name].Bytes()[0] == &src.at["1/"+name][0]
			if !bytes.Equal(ts[name].Bytes(), m.pattern(1, name, ts[name].NumBytes())) {
				t.Errorf("HostExpert's %s holds other bytes", name)
			}
			release()
			st := pg.Stats()
			if noMapped {
				if st.BytesMapped != 0 || src.expertReads.Load() == 0 || aliased {
					t.Errorf("NoMappedUploads: %d bytes copied in place, %d expert reads, HostExpert aliased %v; want none, some, false", st.BytesMapped, src.expertReads.Load(), aliased)
				}
			} else {
				if want := 3 * m.expertBytes(); st.BytesMapped != want || src.expertReads.Load() != 0 || st.PinnedHostBytes != 0 || !aliased {
					t.Errorf("%d bytes copied in place (want %d), %d expert reads, %d bytes pinned, HostExpert aliased %v; want none read or pinned, aliased", st.BytesMapped, want, src.expertReads.Load(), st.PinnedHostBytes, aliased)
				}
				be.asyncFake.mu.Lock()
				copies := be.asyncFake.async
				be.asyncFake.mu.Unlock()
				if copies != wantCopies {
					t.Errorf("%d copies for 3 experts, want %d", copies, wantCopies)
				}
				if regions := len(src.MappedRegions()); be.live != regions || st.MappedBytes != int64(len(src.region)) {
					t.Errorf("%d regions registered, %d bytes reported page-locked; want %d of %d", be.live, st.MappedBytes, regions, len(src.region))
				}
			}
			if err := pg.Close(); err != nil {
				t.Fatal(err)
			}
			if be.live != 0 {
				t.Errorf("after Close %d regions registered", be.live)
			}
		})
	}
}

// TestExpertsMappedInOrder: loads that only queue copies (in place from
// the mapping) are queued by the acquiring goroutine in the order asked,
// so a lazy acquire's pending misses come in that order, the order their
// copies land in (through goroutines, a few at once, they came in any).
func TestExpertsMappedInOrder(t *testing.T) {
	ctx := context.Background()
	m := newMoESynth(2, 6, 8, 16)
	pg, be := newMappedPager(t, newMappedMoE(m), 6, Options{})
	defer pg.Close()
	for _, order := range [][]int{{4, 1, 5, 0, 3}, {2, 0, 5, 1, 4, 3}} {
		for l := 1; l <= 2; l++ {
			ws, pending, await, err := pg.AcquireExpertsLazy(ctx, l, order)
			if err != nil {
				t.Fatal(err)
			}
			var asked []int // the misses, in the order asked
			for _, x := range order {
				if slices.Contains(pending, x) {
					asked = append(asked, x)
				}
			}
			if len(pending) < 4 || !slices.Equal(pending, asked) {
				t.Errorf("layer %d: pending %v of %v asked; want four or more misses in the order asked", l, pending, order)
			}
			for _, x := range pending {
				if err := await(x); err != nil {
					t.Fatal(err)
				}
				if err := m.checkExpert(be, l, x, ws[x]); err != nil {
					t.Error(err)
				}
			}
			pg.ReleaseExperts(l, order)
		}
	}
}

// TestExpertsLookedUpAhead: with experts copied in place from a mapping,
// the pager looks up every expert's tensors in the background once it is
// made (a loader checks a tensor's values the first time it gives it in
// place: on a miss that came before the copy), each once; acquires then
// ask the source for nothing, and their data is the source's. Close stops
// the lookups (a pager closed at once leaves none running).
func TestExpertsLookedUpAhead(t *testing.T) {
	m := newMoESynth(3, 8, 8, 16)
	src := newMappedMoE(m)
	pg, be := newMappedPager(t, src, 4, Options{})
	want := int64(3 * 8 * 3) // layers, experts, tensors
	deadline := time.Now().Add(5 * time.Second)
	for src.lookups.Load() < want && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := src.lookups.Load(); n != want {
		t.Fatalf("%d tensors looked up in the background, want %d", n, want)
	}
	for l := 1; l <= 3; l++ {
		acquireCheck(t, pg, m, be, l, 0, 3, 7)
	}
	if n := src.lookups.Load(); n != want {
		t.Errorf("%d lookups after the acquires, want the background's %d alone", n, want)
	}
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}

	// Closed at once: Close waits for the lookups, which stop early.
	src2 := newMappedMoE(newMoESynth(40, 64, 8, 16))
	pg2, _ := newMappedPager(t, src2, 4, Options{})
	if err := pg2.Close(); err != nil {
		t.Fatal(err)
	}
	n := src2.lookups.Load()
	time.Sleep(10 * time.Millisecond)
	if src2.lookups.Load() != n {
		t.Errorf("lookups went on after Close: %d, then %d", n, src2.lookups.Load())
	}
}
