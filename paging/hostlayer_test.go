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
	"unsafe"

	"github.com/strata-llm/strata/tensor"
)

// checkHost verifies that HostLayer's tensors are host tensors with the
// layer's bytes, each at a 64-byte offset of the pager's host copy.
func checkHost(p *Pager, src *synthSource, l int, ws map[string]*tensor.Tensor) error {
	if len(ws) != len(src.layers[l]) {
		return fmt.Errorf("layer %d: %d host tensors, want %d", l, len(ws), len(src.layers[l]))
	}
	p.mu.Lock()
	host := p.layers[l].host
	p.mu.Unlock()
	for _, s := range src.layers[l] {
		t := ws[s.Name]
		if t == nil || !t.OnHost() || t.DType() != s.DType || !t.Shape().Equal(s.Shape) {
			return fmt.Errorf("layer %d: tensor %s is %v", l, s.Name, t)
		}
		if !bytes.Equal(t.Bytes(), src.pattern(l, s.Name, s.Bytes)) {
			return fmt.Errorf("layer %d: tensor %s: bytes differ from the source's", l, s.Name)
		}
		if off := uintptr(unsafe.Pointer(&t.Bytes()[0])) - uintptr(unsafe.Pointer(&host[0])); off%hostAlign != 0 || off >= uintptr(len(host)) {
			return fmt.Errorf("layer %d: tensor %s at offset %d of the host copy", l, s.Name, off)
		}
	}
	return nil
}

// hostRig is a pager over a plan that streams the CPU's layers whole.
type hostRig struct {
	src      *synthSource
	cpu, seq []int
	plan     *PlanResult
	bg       *Budget
	pg       *Pager
	free     func()
	need     int64 // the host copies of the CPU's layers
}

func newHostRig(t *testing.T, be tensor.Memory, opts func(r *hostRig) Options) *hostRig {
	t.Helper()
	r := &hostRig{src: llamaSynth(8, 64, 172, 32, 256)}
	n := r.src.NumLayers()
	info := smallDims(r.src, n)
	W, _ := totalAndMax(info)
	r.cpu, r.seq = hybridSplit(n)
	p0 := planAtDepth(t, info, 1<<40, r.cpu, r.seq, 1)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W/2
	r.plan = planAtDepth(t, info, budget, r.cpu, r.seq, 1)
	for _, l := range r.cpu {
		for _, s := range r.src.layers[l] {
			r.need += alignHost(s.Bytes)
		}
	}
	r.bg = newBudget(t, be, budget, "fake:0")
	r.free = nnReserve(t, r.bg, r.plan)
	pg, err := NewPager(r.src, r.bg, r.plan, opts(r))
	if err != nil {
		t.Fatal(err)
	}
	r.pg = pg
	return r
}

func (r *hostRig) close(t *testing.T, fb *fakeBackend) {
	t.Helper()
	r.free()
	if err := r.pg.Close(); err != nil {
		t.Error(err)
	}
	if err := r.bg.Close(); err != nil {
		t.Error(err)
	}
	if nt, live, pinned := fb.outstanding(); nt != 0 || live != 0 || pinned != 0 {
		t.Errorf("after Close %d tensors, %d bytes, %d pinned", nt, live, pinned)
	}
}

// reads returns the source's tensor reads of each layer so far.
func (r *hostRig) reads() []int64 {
	out := make([]int64, len(r.src.calls))
	for l := range out {
		out[l] = r.src.calls[l].Load()
	}
	return out
}

// TestHostLayer: HostLayer returns the CPU's layers as host views of the
// pager's host copies, with the source's bytes. The host cache's limit is
// exactly what they take, so that every other streamed part is read again
// on every load: the host copies survive that and a decode over the
// sequence, are counted in the host cache and in HostLayerBytes, and are
// what a prefill uploads the layers from (no second read), in either order
// of first use.
func TestHostLayer(t *testing.T) {
	ctx := context.Background()
	for _, pinned := range []bool{true, false} {
		for _, hostFirst := range []bool{true, false} {
			name := fmt.Sprintf("pinned=%v/host first=%v", pinned, hostFirst)
			fb := newFake()
			var be tensor.Memory = fb
			if !pinned {
				be = pageableBackend{fb}
			}
			var r *hostRig
			r = newHostRig(t, be, func(r *hostRig) Options { return Options{HostLayers: r.cpu, HostCacheBytes: r.need} })
			n := r.src.NumLayers()
			hostAll := func() map[int]map[string]*tensor.Tensor {
				out := map[int]map[string]*tensor.Tensor{}
				for _, l := range r.cpu {
					ws, err := r.pg.HostLayer(ctx, l)
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					if err := checkHost(r.pg, r.src, l, ws); err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					out[l] = ws
				}
				return out
			}
			var views map[int]map[string]*tensor.Tensor
			if hostFirst {
				views = hostAll()
			}
			before := r.reads()
			sweep(t, r.pg, r.src, forward(n)) // prefill
			waitIdle(r.pg)
			if !hostFirst {
				before = r.reads()
				views = hostAll()
			}
			for _, l := range r.cpu {
				if got := r.src.calls[l].Load() - before[l]; got != 0 {
					t.Errorf("%s: CPU layer %d read %d times more: the prefill and HostLayer do not share its host copy", name, l, got)
				}
			}
			if err := r.pg.SetSequence(r.seq); err != nil {
				t.Fatal(err)
			}
			for range 4 { // decode: the CPU's layers from the host, the others acquired
				for l := range n {
					if slices.Contains(r.cpu, l) {
						ws, err := r.pg.HostLayer(ctx, l)
						if err != nil {
							t.Fatal(err)
						}
						if err := checkHost(r.pg, r.src, l, ws); err != nil {
							t.Fatalf("%s: %v", name, err)
						}
						continue
					}
					sweep(t, r.pg, r.src, []int{l})
				}
			}
			if err := r.pg.SetSequence(nil); err != nil {
				t.Fatal(err)
			}
			sweep(t, r.pg, r.src, forward(n)) // another prefill
			waitIdle(r.pg)
			for l, ws := range views {
				if err := checkHost(r.pg, r.src, l, ws); err != nil {
					t.Errorf("%s: the first views: %v", name, err)
				}
			}
			st := r.pg.Stats()
			if st.HostLayerBytes != r.need || st.HostCacheBytes != r.need || st.HostCacheLimit != r.need {
				t.Errorf("%s: host layers hold %d, host cache %d of %d, want %d", name, st.HostLayerBytes, st.HostCacheBytes, st.HostCacheLimit, r.need)
			}
			if pinned != (st.PinnedHostBytes == r.need) {
				t.Errorf("%s: %d pinned bytes", name, st.PinnedHostBytes)
			}
			if wantLoads := int64(len(r.cpu)); hostFirst != (st.HostLayerLoads == wantLoads) {
				t.Errorf("%s: HostLayer read %d layers", name, st.HostLayerLoads)
			}
			if !strings.Contains(r.bg.Summary(), "held by CPU layers "+FormatSize(r.need)) {
				t.Errorf("%s: the summary does not show the host layers:\n%s", name, r.bg.Summary())
			}
			if err := consistent(r.pg, fb); err != nil {
				t.Errorf("%s: %v", name, err)
			}
			r.close(t, fb)
		}
	}
}

// TestHostLayerRefuses: host layers that do not fit the host memory limit,
// layers kept in part on the device, layers out of range or listed twice,
// and a pager closed: each an error that holds nothing.
func TestHostLayerRefuses(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		opts  func(r *hostRig) Options
		isMem bool
	}{
		{"one byte short", func(r *hostRig) Options { return Options{HostLayers: r.cpu, HostCacheBytes: r.need - 1} }, true},
		{"no host cache", func(r *hostRig) Options { return Options{HostLayers: r.cpu, HostCacheBytes: -1} }, true},
		{"out of range", func(r *hostRig) Options { return Options{HostLayers: []int{r.src.NumLayers()}} }, false},
		{"twice", func(r *hostRig) Options { return Options{HostLayers: []int{r.cpu[0], r.cpu[0]}} }, false},
		{"kept in part", func(r *hostRig) Options { return Options{HostLayers: []int{r.seq[1]}} }, false},
	} {
		fb := newFake()
		src := llamaSynth(8, 64, 172, 32, 256)
		n := src.NumLayers()
		info := smallDims(src, n)
		cpu, seq := hybridSplit(n)
		W, _ := totalAndMax(info)
		p0 := planAtDepth(t, info, 1<<40, cpu, seq, 1)
		budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W/2
		plan := planAtDepth(t, info, budget, cpu, seq, 1)
		if plan.Layers[seq[1]].ResidentBytes == 0 {
			t.Fatalf("layer %d is streamed whole: the test needs one kept in part", seq[1])
		}
		r := &hostRig{src: src, cpu: cpu, seq: seq, plan: plan}
		for _, l := range cpu {
			for _, s := range src.layers[l] {
				r.need += alignHost(s.Bytes)
			}
		}
		bg := newBudget(t, fb, budget, "")
		_, err := NewPager(src, bg, plan, tc.opts(r))
		if err == nil || errors.Is(err, ErrHostMemory) != tc.isMem {
			t.Errorf("%s: NewPager: %v", tc.name, err)
		} else if tc.isMem && !strings.Contains(err.Error(), fmt.Sprint(r.need)) {
			t.Errorf("%s: %v does not name the bytes the host layers take (%d)", tc.name, err, r.need)
		}
		bg.Close()
	}

	// HostLayer on a pager told of no host layers: a layer streamed whole
	// fits while the host cache has room, one more does not, and one kept
	// in part on the device never does.
	fb := newFake()
	var first int64
	r := newHostRig(t, fb, func(r *hostRig) Options {
		for _, s := range r.src.layers[r.cpu[0]] {
			first += alignHost(s.Bytes)
		}
		return Options{HostCacheBytes: first}
	})
	if _, err := r.pg.HostLayer(ctx, r.cpu[0]); err != nil {
		t.Fatal(err)
	}
	_, err := r.pg.HostLayer(ctx, r.cpu[1])
	if !errors.Is(err, ErrHostMemory) {
		t.Errorf("a host layer past the limit: %v", err)
	}
	if _, err := r.pg.HostLayer(ctx, r.seq[1]); err == nil || errors.Is(err, ErrHostMemory) {
		t.Errorf("a layer kept in part on the device: %v", err)
	}
	if _, err := r.pg.HostLayer(ctx, -1); err == nil {
		t.Error("layer -1 accepted")
	}
	if st := r.pg.Stats(); st.HostLayerBytes != first || st.HostCacheBytes != first {
		t.Errorf("after the refusals the host layers hold %d, the host cache %d; want %d", st.HostLayerBytes, st.HostCacheBytes, first)
	}
	if err := consistent(r.pg, fb); err != nil {
		t.Error(err)
	}
	r.close(t, fb)
	if _, err := r.pg.HostLayer(ctx, r.cpu[0]); err == nil {
		t.Error("HostLayer after Close succeeded")
	}
}

// TestHostLayerFaults: a read that fails or is cancelled at any tensor of a
// host layer, or pinned memory that cannot be had, leaves nothing held: no
// host bytes, no pinned memory, the reservation whole; the next HostLayer
// reads the layer right. Close during a read ends it and frees everything.
func TestHostLayerFaults(t *testing.T) {
	ctx := context.Background()
	for _, cancel := range []bool{false, true} {
		f := newFaults()
		fb := newFaultBackend(f)
		r := newHostRig(t, fb, func(r *hostRig) Options { return Options{HostLayers: r.cpu} })
		r.pg.src = faultSource{r.src, f}
		l := r.cpu[1]
		injected := 0
		for at := 1; at <= len(r.src.layers[l]); at++ {
			cctx, stop := context.WithCancel(ctx)
			var c context.CancelFunc
			if cancel {
				c = stop
			}
			f.arm(seamRead, at, c)
			_, err := r.pg.HostLayer(cctx, l)
			fired := f.disarmCount()
			stop()
			if fired == 0 {
				t.Fatalf("cancel=%v: no fault at read %d", cancel, at)
			}
			injected++
			if err == nil && cancel && at == len(r.src.layers[l]) {
				break // cancelled during the last read, which went on: nothing was left to stop
			}
			if err == nil {
				t.Fatalf("cancel=%v: fault at read %d: HostLayer succeeded", cancel, at)
			}
			if st := r.pg.Stats(); st.HostLayerBytes != 0 || st.HostCacheBytes != 0 || st.PinnedHostBytes != 0 {
				t.Errorf("cancel=%v: fault at read %d: %d bytes held by host layers, %d in the host cache, %d pinned", cancel, at, st.HostLayerBytes, st.HostCacheBytes, st.PinnedHostBytes)
			}
			if err := consistent(r.pg, fb.fakeBackend); err != nil {
				t.Errorf("cancel=%v: fault at read %d: %v", cancel, at, err)
			}
		}
		if !cancel {
			f.arm(seamPinned, 1, nil) // pageable memory instead: still a host layer
			ws, err := r.pg.HostLayer(ctx, r.cpu[0])
			if f.disarmCount() != 1 || err != nil {
				t.Fatalf("pinned memory refused: %v", err)
			}
			if err := checkHost(r.pg, r.src, r.cpu[0], ws); err != nil {
				t.Error(err)
			}
		}
		ws, err := r.pg.HostLayer(ctx, l)
		if err != nil {
			t.Fatalf("cancel=%v: after %d faults: %v", cancel, injected, err)
		}
		if err := checkHost(r.pg, r.src, l, ws); err != nil {
			t.Error(err)
		}
		if err := consistent(r.pg, fb.fakeBackend); err != nil {
			t.Error(err)
		}
		r.close(t, fb.fakeBackend)
	}

	// Close while a read is blocked.
	fb := newFake()
	r := newHostRig(t, fb, func(r *hostRig) Options { return Options{HostLayers: r.cpu} })
	r.src.blockLayer, r.src.block, r.src.started = r.cpu[1], make(chan struct{}), make(chan struct{}, 1)
	errc := make(chan error, 1)
	go func() {
		_, err := r.pg.HostLayer(ctx, r.cpu[1])
		errc <- err
	}()
	<-r.src.started
	r.free()
	if err := r.pg.Close(); err != nil {
		t.Error(err)
	}
	if err := <-errc; err == nil {
		t.Error("HostLayer across Close succeeded")
	}
	if err := r.bg.Close(); err != nil {
		t.Error(err)
	}
	if nt, live, pinned := fb.outstanding(); nt != 0 || live != 0 || pinned != 0 {
		t.Errorf("after Close %d tensors, %d bytes, %d pinned", nt, live, pinned)
	}
}

// TestHostLayerConcurrent: HostLayer from several goroutines at once, with
// a prefill acquiring every layer beside them, reads each host layer from
// the source once, and every caller gets its bytes (run with -race).
func TestHostLayerConcurrent(t *testing.T) {
	ctx := context.Background()
	for it := range 20 {
		fb := newFake()
		r := newHostRig(t, fb, func(r *hostRig) Options { return Options{HostLayers: r.cpu} })
		n := r.src.NumLayers()
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := range r.cpu {
					l := r.cpu[(k+g+it)%len(r.cpu)]
					ws, err := r.pg.HostLayer(ctx, l)
					if err != nil {
						t.Error(err)
						return
					}
					if err := checkHost(r.pg, r.src, l, ws); err != nil {
						t.Error(err)
					}
				}
			}()
		}
		sweep(t, r.pg, r.src, forward(n))
		wg.Wait()
		for _, l := range r.cpu {
			if got, want := r.src.calls[l].Load(), int64(len(r.src.layers[l])); got != want {
				t.Errorf("iteration %d: host layer %d: %d tensor reads, want %d", it, l, got, want)
			}
		}
		if err := consistent(r.pg, fb); err != nil {
			t.Error(err)
		}
		r.close(t, fb)
	}
}

// refusingPins is a backend that pins no memory: AllocPinned fails, or
// gives fewer bytes than asked.
type refusingPins struct {
	*fakeBackend
	short bool
}

func (r refusingPins) AllocPinned(n int64) ([]byte, error) {
	if r.short {
		return r.fakeBackend.AllocPinned(n / 2)
	}
	return nil, errors.New("pinned memory limit reached")
}

// TestPinnedFallback: host copies that the backend refuses to pin are made
// in pageable memory and counted (Stats.PinnedFallbacks, the bytes, the
// first refusal) and shown in the summary; a backend that pins, or one
// that has no pinned memory at all, counts nothing.
func TestPinnedFallback(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		be        func(fb *fakeBackend) tensor.Memory
		fallbacks bool
		refusal   string
	}{
		{"pins", func(fb *fakeBackend) tensor.Memory { return fb }, false, ""},
		{"pageable backend", func(fb *fakeBackend) tensor.Memory { return pageableBackend{fb} }, false, ""},
		{"refuses", func(fb *fakeBackend) tensor.Memory { return refusingPins{fakeBackend: fb} }, true, "pinned memory limit reached"},
		{"gives less", func(fb *fakeBackend) tensor.Memory { return refusingPins{fakeBackend: fb, short: true} }, true, "bytes asked"},
	} {
		fb := newFake()
		r := newHostRig(t, tc.be(fb), func(r *hostRig) Options { return Options{HostLayers: r.cpu, HostCacheBytes: r.need} })
		for _, l := range r.cpu {
			ws, err := r.pg.HostLayer(ctx, l)
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			if err := checkHost(r.pg, r.src, l, ws); err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
		}
		st := r.pg.Stats()
		sum := r.bg.Summary()
		if !tc.fallbacks {
			if st.PinnedFallbacks != 0 || st.PinnedFallbackBytes != 0 || st.PinnedFallbackError != "" || strings.Contains(sum, "refused") {
				t.Errorf("%s: %d fallbacks of %d bytes (%q)", tc.name, st.PinnedFallbacks, st.PinnedFallbackBytes, st.PinnedFallbackError)
			}
		} else {
			if st.PinnedFallbacks != int64(len(r.cpu)) || st.PinnedFallbackBytes != r.need || !strings.Contains(st.PinnedFallbackError, tc.refusal) || st.PinnedHostBytes != 0 {
				t.Errorf("%s: %d fallbacks of %d bytes (%q), %d pinned; want %d of %d", tc.name, st.PinnedFallbacks, st.PinnedFallbackBytes, st.PinnedFallbackError, st.PinnedHostBytes, len(r.cpu), r.need)
			}
			if want := fmt.Sprintf("pinned host memory refused %d times: %s", len(r.cpu), FormatSize(r.need)); !strings.Contains(sum, want) {
				t.Errorf("%s: the summary does not say %q:\n%s", tc.name, want, sum)
			}
		}
		r.close(t, fb)
	}
}
