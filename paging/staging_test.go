package paging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
)

// stagedFake is the fake backend with pinned memory and staged uploads on
// one simulated copy engine: every copy (synchronous, asynchronous or
// staged) waits its turn and takes copyPerKiB per KiB of src, as copies
// over one link do. A queued copy poisons its destination and lands when
// the engine has run it. Like a GPU's, an asynchronous copy's ready wait
// blocks nobody: it orders the fake's "compute" (Download) after the copy;
// landed blocks the caller until the copy has landed. The fake checks the
// staging contract: a copy's source must hold, when the copy runs, the
// bytes it held when the copy was queued (a buffer refilled before its
// copy landed fails this), and a read must not land in memory a queued
// copy still reads (checkRead).
type stagedFake struct {
	*fakeBackend
	copyPerKiB time.Duration
	engine     chan func() // the copy engine's queue, in order
	engineEnd  time.Time   // when the engine's last copy ends; the engine's own

	mu         sync.Mutex
	inflight   map[*pendingCopy]bool
	ordered    []<-chan struct{} // copies compute was ordered after by ready
	violations []string
	staged     int   // staged copies queued
	peakPinned int64 // the most pinned host memory held at once
	failUpload func(dst *tensor.Tensor) error
	trace      func(string)
}

func newStagedFake(copyPerKiB time.Duration) *stagedFake {
	f := &stagedFake{fakeBackend: newFake(), copyPerKiB: copyPerKiB, engine: make(chan func(), 1024), inflight: map[*pendingCopy]bool{}}
	go func() {
		for job := range f.engine {
			job()
		}
	}()
	return f
}

// Close stops the copy engine.
func (f *stagedFake) Close() error {
	close(f.engine)
	return nil
}

func (f *stagedFake) AllocPinned(n int64) ([]byte, error) {
	b, err := f.fakeBackend.AllocPinned(n)
	f.mu.Lock()
	_, _, pinned := f.fakeBackend.outstanding()
	f.peakPinned = max(f.peakPinned, pinned)
	f.mu.Unlock()
	return b, err
}

// Download is compute: it runs after the copies it was ordered after.
func (f *stagedFake) Download(dst []byte, src *tensor.Tensor) error {
	f.mu.Lock()
	waits := f.ordered
	f.ordered = nil
	f.mu.Unlock()
	for _, w := range waits {
		<-w
	}
	return f.fakeBackend.Download(dst, src)
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// copyTime is how long the engine takes to copy n bytes.
func (f *stagedFake) copyTime(n int) time.Duration {
	return time.Duration(int64(f.copyPerKiB) * int64(n) / 1024)
}

// queue puts a copy of src into dst at off on the engine and returns a
// channel closed once it has landed.
func (f *stagedFake) queue(dst *tensor.Tensor, off int64, src []byte) (<-chan struct{}, error) {
	if !f.isLive(dst) {
		return nil, fmt.Errorf("staged fake: copy to a tensor that is not live")
	}
	if off < 0 || off+int64(len(src)) > dst.NumBytes() {
		return nil, fmt.Errorf("staged fake: copy out of range")
	}
	done := make(chan struct{})
	var c *pendingCopy
	if len(src) > 0 {
		lo := uintptr(unsafe.Pointer(&src[0]))
		c = &pendingCopy{lo, lo + uintptr(len(src))}
	}
	f.mu.Lock()
	if c != nil {
		f.inflight[c] = true
	}
	f.mu.Unlock()
	want := bytes.Clone(src)
	for i := range dst.Bytes()[off : off+int64(len(src))] {
		dst.Bytes()[off+int64(i)] = 0xA5 // nothing has landed yet
	}
	queued := time.Now()
	f.engine <- func() {
		// Each copy ends copyTime after the later of its queueing and the
		// end of the one before, however late the sleeps wake.
		f.engineEnd = later(queued, f.engineEnd).Add(f.copyTime(len(src)))
		if f.trace != nil {
			f.trace(fmt.Sprintf("copy %d", len(src)))
		}
		time.Sleep(time.Until(f.engineEnd))
		f.mu.Lock()
		if !bytes.Equal(src, want) {
			f.violations = append(f.violations, fmt.Sprintf("a copy's %d source bytes changed before it landed (a staging buffer refilled under it)", len(src)))
		}
		copy(dst.Bytes()[off:], want)
		if c != nil {
			delete(f.inflight, c)
		}
		f.mu.Unlock()
		f.uploads.Add(int64(len(src)))
		close(done)
	}
	return done, nil
}

// Upload is a synchronous copy: it waits for the engine.
func (f *stagedFake) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	done, err := f.queue(dst, off, src)
	if err != nil {
		return err
	}
	<-done
	return nil
}

func (f *stagedFake) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	ready, _, err := f.UploadStaged(ctx, dst, off, src)
	return ready, err
}

func (f *stagedFake) UploadStaged(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (ready, landed func() error, err error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	f.mu.Lock()
	fail := f.failUpload
	f.mu.Unlock()
	if fail != nil {
		if err := fail(dst); err != nil {
			return nil, nil, err
		}
	}
	done, err := f.queue(dst, off, src)
	if err != nil {
		return nil, nil, err
	}
	f.mu.Lock()
	f.staged++
	f.mu.Unlock()
	ready = func() error {
		f.mu.Lock()
		f.ordered = append(f.ordered, done)
		f.mu.Unlock()
		return nil
	}
	return ready, func() error { <-done; return nil }, nil
}

// checkRead records a violation when dst overlaps the source of a copy
// that has not landed.
func (f *stagedFake) checkRead(dst []byte) {
	if len(dst) == 0 {
		return
	}
	lo := uintptr(unsafe.Pointer(&dst[0]))
	hi := lo + uintptr(len(dst))
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.inflight {
		if c.lo < hi && lo < c.hi {
			f.violations = append(f.violations, fmt.Sprintf("a read of %d bytes into memory a queued copy still reads", len(dst)))
			return
		}
	}
}

// counts returns the staged copies queued and the peak of pinned memory.
func (f *stagedFake) counts() (staged int, peakPinned int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.staged, f.peakPinned
}

func (f *stagedFake) problems() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.violations...)
}

// slowSource reads at perKiB per KiB on each goroutine, as a read from the
// page cache runs on one thread, and checks every read against the fake's
// copies in flight.
type slowSource struct {
	*synthSource
	perKiB time.Duration
	fake   *stagedFake
	mu     sync.Mutex
	fail   func(l int, name string) error
}

func (s *slowSource) ReadTensor(ctx context.Context, l int, name string, dst []byte) error {
	s.fake.checkRead(dst)
	s.mu.Lock()
	fail := s.fail
	s.mu.Unlock()
	if fail != nil {
		if err := fail(l, name); err != nil {
			copy(dst[:len(dst)/2], s.pattern(l, name, int64(len(dst)))) // a short read
			return err
		}
	}
	select {
	case <-time.After(time.Duration(int64(s.perKiB) * int64(len(dst)) / 1024)):
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.synthSource.ReadTensor(ctx, l, name, dst)
}

// stagedModel is n layers of eight 32 KiB tensors.
func stagedModel(n int) *synthSource {
	var ls [][]TensorSpec
	for l := range n {
		var ts []TensorSpec
		for k := range 8 {
			ts = append(ts, spec(fmt.Sprintf("layers.%d.t%d", l, k), tensor.F16, tensor.Shape{128, 128}))
		}
		ls = append(ls, ts)
	}
	return newSynth(ls)
}

// stagedRig is an aggressive pager over stagedModel on a stagedFake.
type stagedRig struct {
	be     *stagedFake
	src    *slowSource
	ranged *rangedSource // the pager's source when it reads ranges
	plan   *PlanResult
	bg     *Budget
	p      *Pager
	free   func()
}

func newStagedRig(t *testing.T, layers int, readPerKiB, copyPerKiB time.Duration, opts Options) *stagedRig {
	return newStagedRigOf(t, stagedModel(layers), 0, readPerKiB, copyPerKiB, opts)
}

// newStagedRigOf is a rig of base's layers; piece > 0 makes the source a
// RangeSource and the staging ring read pieces of that many bytes.
func newStagedRigOf(t *testing.T, base *synthSource, piece int64, readPerKiB, copyPerKiB time.Duration, opts Options) *stagedRig {
	t.Helper()
	be := newStagedFake(copyPerKiB)
	src := &slowSource{synthSource: base, perKiB: readPerKiB, fake: be}
	info := smallDims(base, base.NumLayers())
	plan, err := Plan(info, 1<<30, StrategyAggressive, 16, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, be, 1<<30, "fake")
	var ps Source = src
	if piece > 0 {
		ps = &rangedSource{slowSource: src}
	}
	p, err := NewPager(ps, bg, plan, opts)
	if err != nil {
		t.Fatal(err)
	}
	if piece > 0 && p.stage != nil {
		p.stage.piece = piece
	}
	r := &stagedRig{be: be, src: src, plan: plan, bg: bg, p: p, free: nnReserve(t, bg, plan)}
	if rs, ok := ps.(*rangedSource); ok {
		r.ranged = rs
	}
	t.Cleanup(func() { r.close(t) })
	return r
}

// rangedSource is a slowSource that reads ranges too, each at the same
// rate on its goroutine, and checks that a range is whole rows.
type rangedSource struct {
	*slowSource
	mu       sync.Mutex
	ranges   int
	maxRange int64
	bad      []string
	started  []int // the layer of each range read, in the order the reads began
}

func (s *rangedSource) ReadTensorRange(ctx context.Context, l int, name string, off int64, dst []byte) error {
	s.fake.checkRead(dst)
	var sp TensorSpec
	for _, x := range s.layers[l] {
		if x.Name == name {
			sp = x
		}
	}
	row := sp.Bytes / max(int64(sp.Shape[0]), 1)
	s.mu.Lock()
	s.ranges++
	s.started = append(s.started, l)
	s.maxRange = max(s.maxRange, int64(len(dst)))
	if sp.Name == "" || off%row != 0 || int64(len(dst))%row != 0 || off+int64(len(dst)) > sp.Bytes {
		s.bad = append(s.bad, fmt.Sprintf("layer %d %s: range of %d bytes at %d, not whole rows of %d within %d", l, name, len(dst), off, row, sp.Bytes))
	}
	s.mu.Unlock()
	select {
	case <-time.After(time.Duration(int64(s.perKiB) * int64(len(dst)) / 1024)):
	case <-ctx.Done():
		return ctx.Err()
	}
	copy(dst, s.pattern(l, name, sp.Bytes)[off:])
	return nil
}

// close closes the pager and the budget and checks that nothing is left:
// no device tensor, no pinned byte, no violation of the staging contract.
func (r *stagedRig) close(t *testing.T) {
	t.Helper()
	if r.p == nil {
		return
	}
	r.free()
	if err := r.p.Close(); err != nil {
		t.Errorf("pager Close: %v", err)
	}
	if err := r.bg.Close(); err != nil {
		t.Errorf("budget Close: %v", err)
	}
	if n, live, pinned := r.be.outstanding(); n != 0 || live != 0 || pinned != 0 {
		t.Errorf("after Close: %d tensors (%d bytes) and %d pinned bytes remain", n, live, pinned)
	}
	for _, v := range r.be.problems() {
		t.Error("staging contract: " + v)
	}
	r.be.Close()
	r.p = nil
}

// scan walks the layers in order passes times, each layer acquired,
// checked, held for compute and released; it returns the mean time per
// step after the first pass (0 for one pass).
func (r *stagedRig) scan(t *testing.T, passes int, compute time.Duration) time.Duration {
	t.Helper()
	n := r.p.NumLayers()
	var start time.Time
	for pass := range passes {
		if pass == 1 {
			start = time.Now()
		}
		for l := range n {
			ws, err := r.p.Acquire(context.Background(), l)
			if err != nil {
				t.Fatalf("acquire %d: %v", l, err)
			}
			if err := check(r.be, r.src.synthSource, l, ws); err != nil {
				t.Fatal(err)
			}
			time.Sleep(compute)
			r.p.Release(l)
		}
	}
	if passes < 2 {
		return 0
	}
	return time.Since(start) / time.Duration((passes-1)*n)
}

// staged waits until every staging buffer is free and returns how many
// there are.
func (r *stagedRig) staged(t *testing.T) int {
	t.Helper()
	s := r.p.stage
	if s == nil {
		return 0
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(s.free) != len(s.bufs) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d staging buffers never came back", len(s.bufs)-len(s.free), len(s.bufs))
		}
		time.Sleep(time.Millisecond)
	}
	return len(s.bufs)
}

// TestStagingOverlaps: under the aggressive strategy, with reads from the
// source, copies to the device and compute each taking time, a cyclic scan
// through the staging ring takes about the longest of the three per step,
// not their sum, and far less than the same scan without the ring and the
// host cache (reads by one goroutine into pageable memory, synchronous
// copies: the aggressive strategy before the ring). Every layer
// holds its bytes, and the fake sees no staging buffer refilled before its
// copies landed. The times are sleeps: on a loaded machine a scan may run
// late, so a scan that misses the bounds is measured again, up to three
// times; under the race detector the times are logged, not judged.
func TestStagingOverlaps(t *testing.T) {
	const (
		readPerKiB = 120 * time.Microsecond // a 32 KiB tensor: 3.84 ms; a layer read by one goroutine: 30.7 ms
		copyPerKiB = 15 * time.Microsecond  // a layer: 3.84 ms
		compute    = 4 * time.Millisecond
	)
	tensorRead := 32 * readPerKiB
	layerCopy := 8 * 32 * copyPerKiB
	sum := 8*tensorRead + layerCopy + compute
	bound := max(tensorRead, layerCopy, compute)

	off := newStagedRig(t, 10, readPerKiB, copyPerKiB, Options{StagingSlots: -1, HostCacheBytes: -1})
	if off.p.stage != nil {
		t.Fatal("StagingSlots -1 left the staging ring on")
	}
	r := newStagedRig(t, 10, readPerKiB, copyPerKiB, Options{})
	if r.p.stage == nil {
		t.Fatal("no staging ring under the aggressive strategy on a backend with staged uploads")
	}
	var problems []string
	for attempt := range 3 {
		plain := off.scan(t, 3, compute)
		step := r.scan(t, 3, compute)
		t.Logf("prefetch depth %d, %d staging buffers; per step: staged %v, without staging %v; read %v a tensor (%v a layer on one goroutine), copy %v, compute %v: sum %v, longest %v",
			r.plan.PrefetchDepth, len(r.p.stage.bufs), step.Round(10*time.Microsecond), plain.Round(10*time.Microsecond), tensorRead, 8*tensorRead, layerCopy, compute, sum, bound)
		problems = nil
		if step > sum/3 {
			problems = append(problems, fmt.Sprintf("staged step %v: reads, copies and compute do not overlap (their sum %v, the longest %v)", step, sum, bound))
		}
		if step > plain*7/10 {
			problems = append(problems, fmt.Sprintf("staged step %v, without staging %v: the ring does not speed the scan up", step, plain))
		}
		if step < bound {
			t.Fatalf("staged step %v under the longest stage %v: the fake's times are not honoured", step, bound)
		}
		if len(problems) == 0 || raceEnabled {
			break
		}
		t.Logf("attempt %d: %s", attempt+1, strings.Join(problems, "; "))
	}
	if !raceEnabled {
		for _, p := range problems {
			t.Error(p)
		}
	}
	if st := off.p.Stats(); st.BytesStaged != 0 {
		t.Errorf("%d bytes staged with the ring off", st.BytesStaged)
	}
	off.close(t)
	st := r.p.Stats()
	if st.BytesStaged != st.BytesHostToDevice || st.BytesStaged == 0 {
		t.Errorf("staged %d bytes of %d uploaded: every upload of the aggressive strategy goes through the ring", st.BytesStaged, st.BytesHostToDevice)
	}
	if staged, _ := r.be.counts(); staged == 0 {
		t.Error("no copy went through UploadStaged")
	}
}

// TestStagingHostMemory: the staging ring's pinned memory is bounded by
// the plan's StagingBytes (a buffer of the largest streamed part per load
// that runs at once), reported in Stats and the summary, charged to the
// host limit (a smaller limit gets fewer buffers, and what it leaves is
// the host cache's), and given back at Close.
func TestStagingHostMemory(t *testing.T) {
	const part = 4 * 64 << 10 // stagedModel's layer, as the host holds it
	cases := []struct {
		name      string
		opts      Options
		slots     int
		hostCache int64 // the host cache's room beside the ring
	}{
		{"plan", Options{}, 3, 0},
		{"prefetch 1", Options{PrefetchDepth: 1}, 2, 0}, // two loads at once
		{"slots 1", Options{StagingSlots: 1}, 1, 0},
		{"slots 5", Options{StagingSlots: 5, HostCacheBytes: 5 * part}, 5, 0}, // more than the loads at once
		{"host limit of 2 parts", Options{HostCacheBytes: 2 * part}, 2, 0},
		{"host limit of 4 parts", Options{HostCacheBytes: 4*part + 100}, 3, part + 100},
		{"host limit under a part", Options{HostCacheBytes: part - 1}, 0, part - 1},
		{"no host memory", Options{HostCacheBytes: -1}, 0, 0},
		{"off", Options{StagingSlots: -1}, 0, 0}, // the plan's staging bytes are not the host cache's
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newStagedRig(t, 6, 0, 0, tc.opts)
			if r.plan.StagingBytes != 3*part || r.plan.HostCacheBytes != 0 {
				t.Fatalf("plan: staging %d, host cache %d; want %d and 0", r.plan.StagingBytes, r.plan.HostCacheBytes, 3*part)
			}
			if !strings.Contains(r.plan.String(), "host staging "+FormatSize(3*part)) {
				t.Errorf("plan summary does not report the staging: %s", r.plan)
			}
			r.scan(t, 3, 0)
			if got := r.staged(t); got != tc.slots {
				t.Fatalf("%d staging buffers, want %d", got, tc.slots)
			}
			st := r.p.Stats()
			want := int64(tc.slots) * part
			if st.StagingSlots != tc.slots || st.StagingBytes != want {
				t.Errorf("Stats: %d staging buffers of %d bytes in all, want %d of %d", st.StagingSlots, st.StagingBytes, tc.slots, want)
			}
			if _, _, pinned := r.be.outstanding(); pinned != want+st.PinnedHostBytes {
				t.Errorf("the backend holds %d pinned bytes, the ring %d and the host cache %d", pinned, want, st.PinnedHostBytes)
			}
			if st.HostCacheBytes > tc.hostCache {
				t.Errorf("host cache holds %d bytes, the limit leaves it %d beside the ring", st.HostCacheBytes, tc.hostCache)
			}
			if _, peak := r.be.counts(); peak > max(r.plan.StagingBytes, st.HostCacheLimit) {
				t.Errorf("peak pinned host memory %d over the plan's staging %d and the host limit %d", peak, r.plan.StagingBytes, st.HostCacheLimit)
			}
			sum := Summary(r.bg)
			if has := strings.Contains(sum, "staging ring "+FormatSize(want)); has != (tc.slots > 0) {
				t.Errorf("summary reports the staging ring: %v, want %v:\n%s", has, tc.slots > 0, sum)
			}
			if tc.slots > 0 && st.BytesStaged == 0 {
				t.Error("a staging ring that staged nothing")
			}
			if tc.slots == 0 && st.BytesStaged != 0 {
				t.Errorf("%d bytes staged without a ring", st.BytesStaged)
			}
		})
	}
}

// TestStagingFaults: a read or a copy that fails in the middle of a staged
// load fails the Acquire with the fault, leaves no layer pinned and no
// tensor of the load behind, gives the staging buffer back (once the
// copies queued from it have landed), and the next scan gets every layer
// with its bytes.
func TestStagingFaults(t *testing.T) {
	const layer = 2 // after a scan, 0 and 1 are in the host cache, 3 to 5 in the ring
	fault := fmt.Errorf("fault: %w", errInjected)
	cases := []struct {
		name string
		arm  func(r *stagedRig, fire func() bool)
	}{
		{"read of the first tensor", func(r *stagedRig, fire func() bool) {
			r.src.fail = func(l int, name string) error {
				if l == layer && fire() {
					return fault
				}
				return nil
			}
		}},
		{"read of the last tensor", func(r *stagedRig, fire func() bool) {
			r.src.fail = func(l int, name string) error {
				if l == layer && strings.HasSuffix(name, "t7") && fire() { // the tensors are equal: queued in order, t7 last
					return fault
				}
				return nil
			}
		}},
		{"third copy", func(r *stagedRig, fire func() bool) {
			n := 0
			r.be.failUpload = func(*tensor.Tensor) error {
				if n++; n == 3 && fire() { // two copies of the layer are queued
					return fault
				}
				return nil
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newStagedRig(t, 6, 5*time.Microsecond, 20*time.Microsecond, Options{PrefetchDepth: -1})
			r.scan(t, 1, 0)
			slots := r.staged(t)
			r.p.mu.Lock()
			cached, loaded := r.p.layers[layer].host != nil, r.p.layers[layer].strLoaded
			r.p.mu.Unlock()
			if slots != 1 || cached || loaded {
				t.Fatalf("%d staging buffers, layer %d in the host cache %v, on the device %v: want 1, a layer to stage", slots, layer, cached, loaded)
			}
			var mu sync.Mutex
			fired := false
			r.src.mu.Lock()
			r.be.mu.Lock()
			tc.arm(r, func() bool {
				mu.Lock()
				defer mu.Unlock()
				if fired {
					return false
				}
				fired = true
				return true
			})
			r.be.mu.Unlock()
			r.src.mu.Unlock()
			_, err := r.p.Acquire(context.Background(), layer)
			if !errors.Is(err, errInjected) || !strings.HasPrefix(fmt.Sprint(err), "paging: ") {
				t.Fatalf("acquire %d: %v, want the injected fault with the package prefix", layer, err)
			}
			if err := settle(r.p); err != nil {
				t.Fatal(err)
			}
			if got := r.staged(t); got != slots {
				t.Fatalf("%d staging buffers after the fault, %d before", got, slots)
			}
			st := r.p.Stats()
			r.p.mu.Lock()
			e := r.p.layers[layer]
			if e.pins != 0 || e.strLoaded || e.slot != nil || e.strT != nil || e.loading {
				t.Errorf("layer %d after the fault: pins %d, loaded %v, slot %v, loading %v", layer, e.pins, e.strLoaded, e.slot, e.loading)
			}
			r.p.mu.Unlock()
			if _, _, pinned := r.be.outstanding(); pinned != st.StagingBytes+st.PinnedHostBytes {
				t.Errorf("the backend holds %d pinned bytes, the ring %d and the host cache %d", pinned, st.StagingBytes, st.PinnedHostBytes)
			}
			if err := consistent(r.p, r.be.fakeBackend); err != nil {
				t.Error(err)
			}
			r.scan(t, 2, 0)
			if got := r.staged(t); got != slots {
				t.Fatalf("%d staging buffers after the next scan, %d before", got, slots)
			}
		})
	}
}

// TestStagingPieces: from a RangeSource, the staging ring reads a large
// tensor in pieces of whole rows on several goroutines and copies each
// piece as its read ends, so that a layer of one large tensor (an
// embedding table, a head) streams at about the rate of its copies, not
// of one goroutine's read; every layer holds its bytes.
func TestStagingPieces(t *testing.T) {
	const (
		readPerKiB = 100 * time.Microsecond // the 512 KiB tensor: 51 ms on one goroutine, 3.2 ms a piece
		copyPerKiB = 8 * time.Microsecond   // 4 ms
	)
	model := func() *synthSource {
		var ls [][]TensorSpec
		for l := range 8 {
			ls = append(ls, []TensorSpec{
				spec(fmt.Sprintf("layers.%d.norm", l), tensor.F16, tensor.Shape{128}),
				spec(fmt.Sprintf("layers.%d.table", l), tensor.F16, tensor.Shape{2048, 128}), // rows of 256 bytes
			})
		}
		return newSynth(ls)
	}
	whole := newStagedRigOf(t, model(), 0, readPerKiB, copyPerKiB, Options{})
	const piece = 32<<10 + 100 // not a whole number of rows: pieces of 128 rows
	r := newStagedRigOf(t, model(), piece, readPerKiB, copyPerKiB, Options{})
	var step, stepWhole time.Duration
	for attempt := range 3 { // sleeps run late on a loaded machine: measure again
		stepWhole = whole.scan(t, 3, 0)
		step = r.scan(t, 3, 0)
		t.Logf("per step: %v in pieces, %v whole", step.Round(10*time.Microsecond), stepWhole.Round(10*time.Microsecond))
		if step <= stepWhole*6/10 || raceEnabled {
			break
		}
		t.Logf("attempt %d: slower than 0.6 of whole reads", attempt+1)
	}
	whole.close(t)
	rs := r.ranged
	rs.mu.Lock()
	ranges, most, bad := rs.ranges, rs.maxRange, rs.bad
	rs.mu.Unlock()
	t.Logf("%d ranges read, the largest %d bytes", ranges, most)
	for _, b := range bad {
		t.Error(b)
	}
	if ranges < 16*8*3 || most != 128*256 {
		t.Errorf("%d ranges read, the largest %d bytes: want 16 pieces of 32 KiB per load, 8 layers a pass", ranges, most)
	}
	if st := r.p.Stats(); st.BytesStaged != st.BytesHostToDevice {
		t.Errorf("%d bytes staged of %d uploaded", st.BytesStaged, st.BytesHostToDevice)
	}
	if !raceEnabled && step > stepWhole*6/10 {
		t.Errorf("a step in pieces takes %v, whole %v: the pieces are not read at once", step, stepWhole)
	}
}

// piecesModel is 8 layers of a norm and a 512 KiB table of rows of 256
// bytes; read in pieces of piecesSize, the table is 16 pieces.
func piecesModel() *synthSource {
	var ls [][]TensorSpec
	for l := range 8 {
		ls = append(ls, []TensorSpec{
			spec(fmt.Sprintf("layers.%d.norm", l), tensor.F16, tensor.Shape{128}),
			spec(fmt.Sprintf("layers.%d.table", l), tensor.F16, tensor.Shape{2048, 128}),
		})
	}
	return newSynth(ls)
}

const piecesSize = 32<<10 + 100 // pieces of 128 rows

// TestStagingReadOrder: the staging ring's readers serve the loads in the
// order they were queued: the pieces of the load queued first are all
// begun before any piece of the next, so that the layer needed first is
// read, and its copies queued, first, with prefetches of two layers under
// way at once. (Readers of their own per load, as before, interleaved the
// two loads' pieces.) With several readers the reads of a load's last
// pieces and the next load's first ones may begin in either order: a few
// more runs are allowed there. Stats report the readers and the time they
// read.
func TestStagingReadOrder(t *testing.T) {
	for _, tc := range []struct {
		readers int
		slack   float64 // runs of one layer's reads allowed per load
	}{
		{1, 1},
		{4, 2},
	} {
		t.Run(fmt.Sprintf("%d readers", tc.readers), func(t *testing.T) {
			r := newStagedRigOf(t, piecesModel(), piecesSize, 20*time.Microsecond, 2*time.Microsecond, Options{StagingReaders: tc.readers})
			if r.plan.PrefetchDepth != 2 {
				t.Fatalf("plan's prefetch depth %d, want 2", r.plan.PrefetchDepth)
			}
			r.scan(t, 3, 0)
			r.staged(t)
			rs := r.ranged
			rs.mu.Lock()
			started := slices.Clone(rs.started)
			rs.mu.Unlock()
			if len(started)%16 != 0 || len(started) == 0 {
				t.Fatalf("%d ranges read, want 16 a load", len(started))
			}
			loads := len(started) / 16
			runs, run := 0, 0
			var short []string
			for i, l := range started {
				run++
				if i+1 == len(started) || started[i+1] != l {
					runs++
					if tc.readers == 1 && run != 16 {
						short = append(short, fmt.Sprintf("layer %d: %d pieces at %d", l, run, i+1-run))
					}
					run = 0
				}
			}
			t.Logf("%d loads, %d runs of one layer's reads", loads, runs)
			if len(short) > 0 {
				t.Errorf("with one reader, a load's pieces were not read together: %v", short)
			}
			if float64(runs) > tc.slack*float64(loads) {
				t.Errorf("%d runs of one layer's reads for %d loads: the loads' pieces interleave", runs, loads)
			}
			st := r.p.Stats()
			if st.StagingReaders != tc.readers || st.StagingReadTime <= 0 || st.StagedReadGBps() <= 0 {
				t.Errorf("Stats: %d readers, read for %v (%.3f GB/s); want %d readers and a time", st.StagingReaders, st.StagingReadTime, st.StagedReadGBps(), tc.readers)
			}
			if sum := Summary(r.bg); !strings.Contains(sum, fmt.Sprintf("%d readers, reading for", tc.readers)) {
				t.Errorf("the summary does not report the readers:\n%s", sum)
			}
		})
	}
}

// TestStagingCancel: an Acquire whose context ends while its layer's
// pieces are read through the staging ring returns the context's error at
// once; the pieces not yet begun are not read, the buffer comes back, the
// next scan gets every layer with its bytes, and Close leaves nothing
// pinned (the rig's close checks).
func TestStagingCancel(t *testing.T) {
	for _, readers := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d readers", readers), func(t *testing.T) {
			// A piece reads in 32 ms: 16 of them take half a second on one
			// reader.
			r := newStagedRigOf(t, piecesModel(), piecesSize, time.Millisecond, time.Microsecond, Options{PrefetchDepth: -1, StagingReaders: readers})
			slots := r.staged(t)
			if slots != 1 {
				t.Fatalf("%d staging buffers, want 1", slots)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
			defer cancel()
			start := time.Now()
			_, err := r.p.Acquire(ctx, 3)
			took := time.Since(start)
			if !errors.Is(err, context.DeadlineExceeded) || !strings.HasPrefix(fmt.Sprint(err), "paging: ") {
				t.Fatalf("acquire: %v, want the context's deadline with the package prefix", err)
			}
			if took > 200*time.Millisecond && !raceEnabled {
				t.Errorf("acquire returned %v after its context ended", took-10*time.Millisecond)
			}
			if err := settle(r.p); err != nil {
				t.Fatal(err)
			}
			if got := r.staged(t); got != slots {
				t.Fatalf("%d staging buffers after the cancel, %d before", got, slots)
			}
			rs := r.ranged
			rs.mu.Lock()
			read := rs.ranges
			rs.mu.Unlock()
			if read > 2*readers {
				t.Errorf("%d pieces read of the cancelled load's 16 with %d readers: the rest were read after the cancel", read, readers)
			}
			if err := consistent(r.p, r.be.fakeBackend); err != nil {
				t.Error(err)
			}
			r.src.perKiB, r.ranged.perKiB = time.Microsecond, time.Microsecond
			r.scan(t, 2, 0)
			if got := r.staged(t); got != slots {
				t.Fatalf("%d staging buffers after the next scan, %d before", got, slots)
			}
		})
	}
}
