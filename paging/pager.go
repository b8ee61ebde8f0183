package paging

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/singleflight"

	"github.com/strata-llm/strata/tensor"
)

// Order is the direction in which layers are expected to be used next; the
// pager prefetches along it.
type Order int32

// The access orders.
const (
	Forward Order = iota // 0, 1, ..., n-1, 0, ... (decoding)
	Reverse              // n-1, ..., 1, 0, n-1, ... (a backward pass)
)

// Options adjust a Pager.
type Options struct {
	// PrefetchDepth overrides the plan's prefetch depth when > 0; < 0
	// turns prefetch off.
	PrefetchDepth int
	// HostCacheBytes bounds the host RAM that keeps streamed layers
	// between uses: 0 takes the plan's HostCacheBytes, < 0 keeps none
	// (every streamed load reads the source). Beyond it, layers are
	// re-read from the source.
	HostCacheBytes int64
	// Order is the initial prefetch order (SetOrder changes it).
	Order Order
}

var (
	errClosed          = errors.New("paging: pager closed")
	errPrefetchSkipped = errors.New("paging: prefetch skipped: no room in the ring")
)

// Pager keeps a model's layers on the device under a Budget: the layers the
// plan makes resident stay once loaded, the streamed parts pass through a
// ring reserved in the budget, and the next layers in the access order are
// prefetched while the current one computes. Host RAM caches streamed parts
// up to a byte bound; beyond it they are re-read from the Source.
//
// Acquire pins a layer (it is never evicted while pinned) and Release
// unpins it. Concurrent Acquires of one layer load it once. Parts that are
// neither pinned nor in the ring are evicted least recently used first when
// the budget needs room, across every evictor of the budget: the Pager
// registers itself with its Budget as an Evictor until Close.
//
// A Pager is safe for concurrent use.
type Pager struct {
	src    Source
	bg     *Budget
	b      tensor.Memory
	plan   *PlanResult
	id     int
	depth  int
	layers []*entry
	order  atomic.Int32
	pinned tensor.PinnedAllocator // nil when the backend has none
	async  tensor.AsyncUploader   // nil when the backend has none
	reads  readBufs
	// unregister removes the pager from its budget's evictors.
	unregister func()

	life     context.Context // cancelled by Close
	stopLife context.CancelFunc
	sf       singleflight.Group
	pf       errgroup.Group

	mu           sync.Mutex
	cond         *sync.Cond
	ringCap      int64
	ringUsed     int64
	hostCap      int64
	hostUsed     int64
	pinnedBytes  int64
	inflight     int
	cursor       int    // the layer acquired last: prefetch follows it
	changes      uint64 // counts releases, evictions and finished loads
	closed       bool
	st           Stats
	steps        steps
	prefetchWait time.Duration
	demandWait   time.Duration
}

type entry struct {
	layer    int
	specs    []TensorSpec
	res, str []int // indices into specs: resident and streamed tensors
	strOff   []int64
	resBytes int64
	strBytes int64

	resT, strT []*tensor.Tensor
	resLoaded  bool
	strLoaded  bool
	strInRing  bool
	host       []byte // streamed part cached in host RAM, or nil
	hostPinned bool
	// ready holds the waits of asynchronous uploads into the layer's
	// tensors that no compute has been ordered after yet; the first
	// Acquire (or an eviction) runs them.
	ready []func() error

	pins, waiters int
	loading       bool
	lastUse       uint64
}

func (e *entry) loaded() bool { return e.resLoaded && e.strLoaded }

// NewPager prepares to page src's layers on budget's device as plan says. It
// reserves the ring in the budget at once; layers load on first Acquire. It
// registers the pager with the budget as an Evictor: Close the pager before
// the budget.
func NewPager(src Source, budget *Budget, plan *PlanResult, opts Options) (*Pager, error) {
	if src == nil || budget == nil || plan == nil {
		return nil, fmt.Errorf("paging: NewPager needs a source, a budget and a plan")
	}
	n := src.NumLayers()
	if n != len(plan.Layers) {
		return nil, fmt.Errorf("paging: plan has %d layers, source has %d", len(plan.Layers), n)
	}
	p := &Pager{src: src, bg: budget, b: budget.Backend(), plan: plan, depth: plan.PrefetchDepth}
	p.cond = sync.NewCond(&p.mu)
	if au, ok := p.b.(tensor.AsyncUploader); ok {
		p.async = au
	}
	if pa, ok := p.b.(tensor.PinnedAllocator); ok {
		p.pinned = pa
	}
	switch {
	case opts.PrefetchDepth > 0:
		p.depth = opts.PrefetchDepth
	case opts.PrefetchDepth < 0:
		p.depth = 0
	}
	p.depth = min(p.depth, n-1)
	switch {
	case opts.HostCacheBytes > 0:
		p.hostCap = opts.HostCacheBytes
	case opts.HostCacheBytes == 0:
		p.hostCap = plan.HostCacheBytes
	}
	p.order.Store(int32(opts.Order))
	var ringNeed int64
	for l := range n {
		specs := slices.Clone(src.LayerTensors(l))
		if err := checkSpecs(l, specs); err != nil {
			return nil, err
		}
		e := &entry{layer: l, specs: specs}
		lp := plan.Layers[l]
		var total int64
		for _, s := range specs {
			total += s.Bytes
		}
		if total != lp.Bytes {
			return nil, fmt.Errorf("paging: layer %d: plan says %d bytes, source has %d", l, lp.Bytes, total)
		}
		streamed := map[string]bool{}
		for _, name := range lp.Streamed {
			streamed[name] = true
		}
		all := len(lp.Streamed) == 0 && lp.StreamedBytes == total && total > 0
		for i, s := range specs {
			if all || streamed[s.Name] {
				e.strOff = append(e.strOff, e.strBytes)
				e.str = append(e.str, i)
				e.strBytes += s.Bytes
				delete(streamed, s.Name)
			} else {
				e.res = append(e.res, i)
				e.resBytes += s.Bytes
			}
		}
		if len(streamed) > 0 {
			return nil, fmt.Errorf("paging: layer %d: plan streams tensors the source does not have: %v", l, mapKeys(streamed))
		}
		if e.strBytes != lp.StreamedBytes {
			return nil, fmt.Errorf("paging: layer %d: plan streams %d bytes, its tensors add up to %d", l, lp.StreamedBytes, e.strBytes)
		}
		e.resLoaded = len(e.res) == 0
		e.strLoaded = len(e.str) == 0
		ringNeed = max(ringNeed, e.strBytes)
		p.layers = append(p.layers, e)
	}
	if ringNeed > plan.RingBytes {
		return nil, fmt.Errorf("paging: plan's ring of %d bytes cannot hold its largest streamed part (%d bytes)", plan.RingBytes, ringNeed)
	}
	p.ringCap = plan.RingBytes
	if p.ringCap > 0 {
		if err := budget.charge(StreamedWeights, p.ringCap, -1, true, true); err != nil {
			return nil, fmt.Errorf("paging: reserving the ring: %w", err)
		}
	}
	p.life, p.stopLife = context.WithCancel(context.Background())
	p.pf.SetLimit(p.depth + 1) // one more than the depth: a stale prefetch may still hold a slot
	p.id = budget.newPagerID()
	p.unregister = budget.Register(pagerEvictor{p})
	return p, nil
}

func mapKeys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// pagerEvictor is how the budget asks a Pager for room: its least recently
// used layer whose parts hold budget bytes outside the ring.
type pagerEvictor struct{ p *Pager }

func (v pagerEvictor) Oldest() (uint64, bool)  { return v.p.lruCandidate() }
func (v pagerEvictor) Evict(stamp uint64) bool { return v.p.evictStamp(stamp) }
func (v pagerEvictor) Stats() Stats            { return v.p.Stats() }

// Plan returns the plan the pager follows.
func (p *Pager) Plan() *PlanResult { return p.plan }

// NumLayers returns the number of layers.
func (p *Pager) NumLayers() int { return len(p.layers) }

// SetOrder sets the direction prefetch follows from now on.
func (p *Pager) SetOrder(o Order) { p.order.Store(int32(o)) }

func (p *Pager) next(layer, k int) int {
	n := len(p.layers)
	if Order(p.order.Load()) == Reverse {
		return ((layer-k)%n + n) % n
	}
	return (layer + k) % n
}

// window is the layer and the depth layers after it in the access order.
func (p *Pager) window(layer int) []int {
	w := []int{layer}
	for k := 1; k <= p.depth; k++ {
		w = append(w, p.next(layer, k))
	}
	return w
}

// Acquire returns the layer's tensors by name, loading the layer if it is
// not on the device, and pins it until the matching Release. The tensors
// keep their stored dtype. The map is the caller's; the tensors are the
// pager's and stay valid until Release (or Close). Acquire then starts
// prefetching the next layers in the access order.
func (p *Pager) Acquire(ctx context.Context, layer int) (map[string]*tensor.Tensor, error) {
	if layer < 0 || layer >= len(p.layers) {
		return nil, fmt.Errorf("paging: acquire layer %d: have layers 0..%d", layer, len(p.layers)-1)
	}
	e := p.layers[layer]
	start := time.Now()
	missed, joined := false, false
	p.mu.Lock()
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, fmt.Errorf("paging: acquire layer %d: %w", layer, errClosed)
		}
		if e.loaded() {
			if err := e.awaitUploads(); err != nil {
				// The copies never landed: drop the layer's parts so that
				// no Acquire hands them out and the next one reloads them.
				p.evictLocked(e, false)
				if e.strLoaded && e.strInRing && len(e.str) > 0 {
					p.evictLocked(e, true)
				}
				p.mu.Unlock()
				return nil, fmt.Errorf("paging: acquire layer %d: %w", layer, err)
			}
			e.pins++
			e.lastUse = p.bg.Stamp()
			p.st.Acquires++
			if !missed {
				p.st.Hits++
			} else if joined {
				p.prefetchWait += time.Since(start)
			} else {
				p.demandWait += time.Since(start)
			}
			m := make(map[string]*tensor.Tensor, len(e.specs))
			for k, i := range e.res {
				m[e.specs[i].Name] = e.resT[k]
			}
			for k, i := range e.str {
				m[e.specs[i].Name] = e.strT[k]
			}
			p.cursor = layer
			p.prefetchLocked(layer)
			p.mu.Unlock()
			if !missed {
				p.bg.record(Event{Kind: EventHit, Layer: layer, Pager: p.id})
			}
			return m, nil
		}
		if !missed {
			missed, joined = true, e.loading
			p.st.Misses++
			p.bg.record(Event{Kind: EventMiss, Layer: layer, Pager: p.id})
		}
		e.waiters++
		p.mu.Unlock()
		err := p.loadShared(ctx, layer, loadDemand)
		p.mu.Lock()
		e.waiters--
		p.changedLocked() // a load waiting in waitChange may have counted this waiter as progress to come
		if err != nil {
			if ctx.Err() != nil {
				p.mu.Unlock()
				return nil, fmt.Errorf("paging: acquire layer %d: %w", layer, ctx.Err())
			}
			if errors.Is(err, errPrefetchSkipped) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				continue // a load started by someone else gave up: load it ourselves
			}
			p.mu.Unlock()
			return nil, err
		}
	}
}

// Release unpins a layer from Acquire. Releasing a layer that is not pinned
// does nothing (and is counted in Stats.BadReleases).
func (p *Pager) Release(layer int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if layer < 0 || layer >= len(p.layers) || p.layers[layer].pins == 0 {
		p.st.BadReleases++
		return
	}
	e := p.layers[layer]
	e.pins--
	e.lastUse = p.bg.Stamp()
	if e.pins == 0 {
		p.changedLocked()
	}
}

// Prefetch starts loading a layer in the background, if there is room for
// it without evicting a pinned layer or one of the layers about to be used.
func (p *Pager) Prefetch(layer int) {
	if layer < 0 || layer >= len(p.layers) {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.startPrefetchLocked(layer, loadExplicit)
}

// prefetchLocked starts loads of the depth layers after layer.
func (p *Pager) prefetchLocked(layer int) {
	if p.depth <= 0 {
		return
	}
	for _, j := range p.window(layer)[1:] {
		p.startPrefetchLocked(j, loadWindow)
	}
}

func (p *Pager) startPrefetchLocked(j int, mode loadMode) {
	e := p.layers[j]
	if p.closed || e.loaded() || e.loading {
		return
	}
	if p.pf.TryGo(func() error {
		p.loadShared(p.life, j, mode) // errors surface on Acquire
		return nil
	}) {
		p.st.Prefetches++
	} else {
		p.st.PrefetchSkipped++
	}
}

// loadMode says who asked for a load.
type loadMode int

const (
	loadDemand   loadMode = iota // Acquire
	loadWindow                   // prefetch of the layers after the cursor
	loadExplicit                 // Prefetch
)

// loadShared loads a layer once however many callers ask at the same time.
func (p *Pager) loadShared(ctx context.Context, layer int, mode loadMode) error {
	ch := p.sf.DoChan(strconv.Itoa(layer), func() (any, error) {
		return nil, p.load(ctx, layer, mode)
	})
	select {
	case r := <-ch:
		return r.Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// load brings the missing parts of a layer onto the device. On any error it
// leaves nothing behind.
//
// A prefetch never waits and never evicts the layers about to be used (the
// cursor's window); a window prefetch whose layer has left the window by
// the time it runs is dropped.
func (p *Pager) load(ctx context.Context, layer int, mode loadMode) (err error) {
	e := p.layers[layer]
	prefetch := mode != loadDemand
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return errClosed
	}
	if e.loaded() {
		p.mu.Unlock()
		return nil
	}
	var protect []int
	switch mode {
	case loadDemand:
		protect = p.window(layer)
	case loadWindow:
		protect = p.window(p.cursor)
		if !slices.Contains(protect[1:], layer) {
			p.st.PrefetchStale++
			p.mu.Unlock()
			return errPrefetchSkipped
		}
	case loadExplicit:
		protect = append(p.window(p.cursor), layer)
	}
	needRes, needStr := !e.resLoaded, !e.strLoaded
	e.loading = true
	p.inflight++
	p.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(p.life, cancel)
	defer func() {
		if err != nil && prefetch && !errors.Is(err, errPrefetchSkipped) {
			// an Acquire that joined this load retries with a load of its own
			err = fmt.Errorf("%w: %w", errPrefetchSkipped, err)
		}
		stop()
		cancel()
		p.mu.Lock()
		e.loading = false
		p.inflight--
		p.changedLocked()
		p.mu.Unlock()
	}()
	p.bg.record(Event{Kind: EventLoadStart, Layer: layer, Pager: p.id, Prefetch: prefetch})

	var resT, strT []*tensor.Tensor
	var moved int64
	var ready []func() error
	inRing := false
	fail := func(err error) error {
		for _, r := range ready {
			_ = r()
		}
		for _, t := range resT {
			p.bg.Free(t)
		}
		for _, t := range strT {
			p.bg.Free(t)
		}
		if inRing {
			p.mu.Lock()
			p.ringUsed -= e.strBytes
			p.changedLocked()
			p.mu.Unlock()
		}
		p.bg.record(Event{Kind: EventLoadEnd, Layer: layer, Pager: p.id, Prefetch: prefetch, Bytes: moved, Error: err.Error()})
		return err
	}
	for needRes {
		gen := p.generation()
		resT, err = p.loadTensors(ctx, e, e.res, ResidentWeights, true, !prefetch, &moved, &ready)
		if err == nil {
			break
		}
		if prefetch || !errors.Is(err, tensor.ErrOutOfMemory) || !p.waitChange(ctx, e, gen) {
			if cerr := ctx.Err(); cerr != nil {
				err = cerr // the starter's context ended: an Acquire that joined retries
			}
			return fail(err)
		}
	}
	for needStr {
		gen := p.generation()
		inRing, err = p.ringReserve(ctx, e, prefetch, protect)
		if err != nil {
			return fail(err)
		}
		strT, err = p.loadTensors(ctx, e, e.str, StreamedWeights, !inRing, !inRing, &moved, &ready)
		if err == nil {
			break
		}
		if inRing || !errors.Is(err, tensor.ErrOutOfMemory) || !p.waitChange(ctx, e, gen) {
			if cerr := ctx.Err(); cerr != nil {
				err = cerr // the starter's context ended: an Acquire that joined retries
			}
			return fail(err)
		}
	}

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fail(errClosed)
	}
	if needRes {
		e.resT, e.resLoaded = resT, true
	}
	if needStr {
		e.strT, e.strLoaded, e.strInRing = strT, true, inRing
	}
	e.ready = append(e.ready, ready...)
	e.lastUse = p.bg.Stamp()
	p.st.Loads++
	p.mu.Unlock()
	p.bg.record(Event{Kind: EventLoadEnd, Layer: layer, Pager: p.id, Prefetch: prefetch, Bytes: moved})
	return nil
}

// ringReserve makes room for e's streamed part in the ring, evicting ring
// entries that are not pinned, least recently used first, sparing the
// protected layers if it can (a prefetch always spares them). It returns
// false when the part should be placed outside the ring instead.
func (p *Pager) ringReserve(ctx context.Context, e *entry, prefetch bool, protect []int) (bool, error) {
	need := e.strBytes
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if p.closed {
			return false, errClosed
		}
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if need <= p.ringCap-p.ringUsed {
			p.ringUsed += need
			return true, nil
		}
		if need <= p.ringCap {
			v := p.ringVictimLocked(protect)
			if v == nil && !prefetch {
				v = p.ringVictimLocked(nil)
			}
			if v != nil {
				p.evictLocked(v, true)
				continue
			}
		}
		if prefetch {
			return false, errPrefetchSkipped
		}
		return false, nil
	}
}

// waitChange waits for a Release or the end of another load when the
// device is too full for a demand load; it reports false when nothing this
// pager holds could make room (then the load fails), or on cancellation or
// Close. A caller that holds the very layers whose release would make room
// waits until ctx is done.
func (p *Pager) waitChange(ctx context.Context, self *entry, gen uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	if p.changes != gen { // something changed since the attempt: try again
		return true
	}
	busy := false
	for _, o := range p.layers {
		busy = busy || o.pins > 0 || o != self && (o.waiters > 0 || o.loading)
	}
	if !busy {
		return false
	}
	// Wait for a change, but not for ever: loads that all wait for room
	// from each other, or for a device that refused an allocation the
	// budget allowed, would never signal one. After a while the caller
	// simply tries again.
	wctx, cancel := context.WithTimeout(ctx, retryRoomAfter)
	defer cancel()
	err := p.waitLocked(wctx)
	return err == nil || ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded)
}

// retryRoomAfter bounds a load's wait for room before it tries again.
const retryRoomAfter = 50 * time.Millisecond

func (p *Pager) changedLocked() {
	p.changes++
	p.cond.Broadcast()
}

func (p *Pager) generation() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.changes
}

func (p *Pager) waitLocked(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	p.cond.Wait()
	stop()
	if p.closed {
		return errClosed
	}
	return ctx.Err()
}

func (p *Pager) ringVictimLocked(protect []int) *entry {
	var v *entry
	for _, e := range p.layers {
		if !e.strLoaded || !e.strInRing || len(e.str) == 0 || e.pins > 0 || e.waiters > 0 || e.loading || slices.Contains(protect, e.layer) {
			continue
		}
		if v == nil || e.lastUse < v.lastUse {
			v = e
		}
	}
	return v
}

func (e *entry) evictable() bool {
	if e.pins > 0 || e.waiters > 0 || e.loading {
		return false
	}
	return e.resLoaded && len(e.res) > 0 || e.strLoaded && !e.strInRing && len(e.str) > 0
}

// lruCandidate returns the LRU stamp of this pager's least recently used
// layer that holds budget bytes outside the ring and is not pinned.
func (p *Pager) lruCandidate() (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var best *entry
	for _, e := range p.layers {
		if e.evictable() && (best == nil || e.lastUse < best.lastUse) {
			best = e
		}
	}
	if best == nil {
		return 0, false
	}
	return best.lastUse, true
}

// evictStamp evicts the layer with LRU stamp s, if it is still evictable.
func (p *Pager) evictStamp(s uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range p.layers {
		if e.lastUse == s && e.evictable() {
			p.evictLocked(e, false)
			return true
		}
	}
	return false
}

// evictLocked frees a layer's parts: its ring part when ring is true,
// otherwise every part held outside the ring.
func (p *Pager) evictLocked(e *entry, ring bool) {
	// Order later uses of the memory after copies still landing in it.
	_ = e.awaitUploads()
	var freed int64
	if ring {
		for _, t := range e.strT {
			p.bg.Free(t)
		}
		e.strT, e.strLoaded = nil, false
		p.ringUsed -= e.strBytes
		freed = e.strBytes
	} else {
		if e.resLoaded && len(e.res) > 0 {
			for _, t := range e.resT {
				p.bg.Free(t)
			}
			e.resT, e.resLoaded = nil, false
			freed += e.resBytes
		}
		if e.strLoaded && !e.strInRing && len(e.str) > 0 {
			for _, t := range e.strT {
				p.bg.Free(t)
			}
			e.strT, e.strLoaded = nil, false
			freed += e.strBytes
		}
	}
	p.st.Evictions++
	p.changedLocked()
	p.bg.record(Event{Kind: EventEvict, Layer: e.layer, Pager: p.id, Bytes: freed})
}

// loadTensors allocates and fills the tensors idx of e. Streamed parts come
// from the host cache when it has them, and enter it when it has room.
//
// Uploads from pinned host memory go through the backend's AsyncUploader
// when it has one, on its copy stream; their waits are appended to ready,
// and run before the tensors are used or freed.
func (p *Pager) loadTensors(ctx context.Context, e *entry, idx []int, cat Category, charged, reclaim bool, moved *int64, ready *[]func() error) ([]*tensor.Tensor, error) {
	var ts []*tensor.Tensor
	nReady := len(*ready)
	undo := func(err error) ([]*tensor.Tensor, error) {
		for _, r := range (*ready)[nReady:] {
			_ = r()
		}
		*ready = (*ready)[:nReady]
		for _, t := range ts {
			p.bg.Free(t)
		}
		return nil, err
	}
	for _, i := range idx {
		s := e.specs[i]
		t, err := p.bg.alloc(cat, s.DType, s.Shape, e.layer, charged, reclaim)
		if err != nil {
			return undo(fmt.Errorf("paging: layer %d tensor %s: %w", e.layer, s.Name, err))
		}
		ts = append(ts, t)
	}
	streamed := cat == StreamedWeights
	var buf []byte // the streamed part, whole, when it is or will be cached
	cached, cachedPinned, admitted := false, false, false
	if streamed {
		p.mu.Lock()
		switch {
		case e.host != nil:
			buf, cached, cachedPinned = e.host, true, e.hostPinned
			p.st.HostCacheHits++
		case p.hostUsed+e.strBytes <= p.hostCap:
			p.hostUsed += e.strBytes // reserved; returned if the load fails
			admitted = true
			p.st.HostCacheMisses++
		default:
			p.st.HostCacheMisses++
		}
		p.mu.Unlock()
	}
	pinned := false
	if admitted {
		buf, pinned = p.hostAlloc(e.strBytes)
	}
	dropAdmission := func() {
		if admitted {
			p.hostFree(buf, pinned)
			p.mu.Lock()
			p.hostUsed -= e.strBytes
			p.mu.Unlock()
		}
	}
	for k, i := range idx {
		s := e.specs[i]
		var src []byte
		var tmp *[]byte // a staging buffer from readBufs, for the upload only
		if buf != nil {
			src = buf[e.strOff[k] : e.strOff[k]+s.Bytes]
		}
		if !cached {
			if src == nil {
				tmp = p.reads.get(s.Bytes)
				src = (*tmp)[:s.Bytes]
			}
			// undo waits for the copies still reading the host buffer
			// before dropAdmission frees it.
			if err := ctx.Err(); err != nil {
				ts, err := undo(err)
				dropAdmission()
				return ts, err
			}
			if err := p.src.ReadTensor(ctx, e.layer, s.Name, src); err != nil {
				p.reads.put(tmp)
				ts, err := undo(fmt.Errorf("paging: layer %d tensor %s: reading: %w", e.layer, s.Name, err))
				dropAdmission()
				return ts, err
			}
			p.mu.Lock()
			p.st.BytesDiskToHost += s.Bytes
			p.mu.Unlock()
		}
		var err error
		if p.async != nil && (pinned || cachedPinned) {
			var r func() error
			if r, err = p.async.UploadAsync(ctx, ts[k], 0, src); err == nil {
				*ready = append(*ready, r)
			}
		} else {
			err = p.b.Upload(ts[k], 0, src) // synchronous: src is free after it
		}
		p.reads.put(tmp)
		if err != nil {
			ts, err := undo(fmt.Errorf("paging: layer %d tensor %s: upload: %w", e.layer, s.Name, err))
			dropAdmission()
			return ts, err
		}
		p.mu.Lock()
		p.st.BytesHostToDevice += s.Bytes
		p.mu.Unlock()
		*moved += s.Bytes
	}
	if admitted {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			for _, r := range (*ready)[nReady:] { // the copies read buf
				_ = r()
			}
			*ready = (*ready)[:nReady]
			dropAdmission()
			return ts, nil
		}
		e.host, e.hostPinned = buf, pinned
		if pinned {
			p.pinnedBytes += int64(len(buf))
		}
		p.mu.Unlock()
	}
	return ts, nil
}

// readBufs recycles the buffers that tensors outside the host cache are
// read into on their way to a synchronous upload: without them a streaming
// strategy that keeps nothing on the host allocated the model's size in
// garbage every token. Buffers come in power-of-two sizes, since a layer's
// tensors range from kilobytes (norms) to hundreds of megabytes, and each
// size keeps at most readBufsKept (about what the loads in flight use).
// They are the pager's, not a sync.Pool's, which a collection empties.
type readBufs struct {
	mu    sync.Mutex
	free  [64][]*[]byte // by log2 of the capacity
	made  int64         // buffers allocated, for the tests
	bytes int64         // bytes held in free
}

const readBufsKept = 4

func (r *readBufs) get(n int64) *[]byte {
	class := bits.Len64(uint64(max(n, 1) - 1))
	r.mu.Lock()
	if f := r.free[class]; len(f) > 0 {
		b := f[len(f)-1]
		r.free[class] = f[:len(f)-1]
		r.bytes -= int64(cap(*b))
		r.mu.Unlock()
		return b
	}
	r.made++
	r.mu.Unlock()
	b := make([]byte, 1<<class)
	return &b
}

func (r *readBufs) put(b *[]byte) {
	if b == nil {
		return
	}
	class := bits.Len64(uint64(cap(*b) - 1))
	r.mu.Lock()
	if len(r.free[class]) < readBufsKept {
		r.free[class] = append(r.free[class], b)
		r.bytes += int64(cap(*b))
	}
	r.mu.Unlock()
}

// stats returns the buffers allocated so far and the bytes kept.
func (r *readBufs) stats() (made, bytes int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.made, r.bytes
}

// release drops every kept buffer.
func (r *readBufs) release() {
	r.mu.Lock()
	r.free, r.bytes = [64][]*[]byte{}, 0
	r.mu.Unlock()
}

func (p *Pager) hostAlloc(n int64) ([]byte, bool) {
	if p.pinned != nil {
		if b, err := p.pinned.AllocPinned(n); err == nil && int64(len(b)) == n {
			return b, true
		} else if err == nil {
			_ = p.pinned.FreePinned(b)
		}
	}
	return make([]byte, n), false
}

func (p *Pager) hostFree(b []byte, pinned bool) error {
	if pinned && b != nil {
		return p.pinned.FreePinned(b)
	}
	return nil
}

// Close frees every device tensor and pinned buffer the pager holds,
// returns the ring to the budget, stops prefetching and removes the pager
// from its budget's evictors. Tensors from Acquire are invalid afterwards.
// Close is idempotent.
func (p *Pager) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.changedLocked()
	p.mu.Unlock()
	p.unregister()
	p.stopLife()
	p.pf.Wait()
	p.mu.Lock()
	for p.inflight > 0 {
		p.cond.Wait()
	}
	p.reads.release()
	var errs []error
	for _, e := range p.layers {
		if err := e.awaitUploads(); err != nil {
			errs = append(errs, fmt.Errorf("paging: layer %d: %w", e.layer, err))
		}
		for _, t := range e.resT {
			p.bg.Free(t)
		}
		for _, t := range e.strT {
			p.bg.Free(t)
		}
		e.resT, e.strT = nil, nil
		e.resLoaded, e.strLoaded = len(e.res) == 0, len(e.str) == 0
		e.pins = 0
		if err := p.hostFree(e.host, e.hostPinned); err != nil {
			errs = append(errs, fmt.Errorf("paging: freeing pinned host memory of layer %d: %w", e.layer, err))
		}
		if e.hostPinned {
			p.pinnedBytes -= int64(len(e.host))
		}
		e.host, e.hostPinned = nil, false
	}
	p.ringUsed, p.hostUsed = 0, 0
	p.mu.Unlock()
	if p.ringCap > 0 {
		p.bg.uncharge(StreamedWeights, p.ringCap, -1, true)
	}
	return errors.Join(errs...)
}

// awaitUploads orders the backend's compute after the layer's pending
// asynchronous uploads. The caller holds p.mu (or owns e exclusively).
func (e *entry) awaitUploads() error {
	var errs []error
	for _, r := range e.ready {
		if err := r(); err != nil {
			errs = append(errs, err)
		}
	}
	e.ready = nil
	return errors.Join(errs...)
}
