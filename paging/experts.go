package paging

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sync/errgroup"

	"github.com/strata-llm/strata/tensor"
)

// ExpertPolicy chooses which cached expert makes room for another.
type ExpertPolicy string

// The expert cache's eviction policies.
const (
	// ExpertLRU evicts the least recently used expert, its recency
	// counted in visits of its own layer: an expert its layer did not use
	// for more visits goes first, and among those alike, the one whose
	// layer comes last in the walk from the layer acquired now (it is
	// needed last), then the least recently used. Plain LRU would evict,
	// in a cyclic walk over the layers, the experts of the layers about to
	// run.
	ExpertLRU ExpertPolicy = "lru"
	// ExpertLFU evicts the expert least likely to be used again, judged
	// by how often it was used, its uses aged: each use counts 1, halved
	// every 16 x (the pager's experts) expert acquires since (16E/k
	// tokens for E experts of a layer, k a token), so that what was
	// popular a while ago gives way. Counts within a factor of about 1.4
	// of each other compare equal, an expert used at its layer's last
	// visit ranks as one used twice as often, and ties go to the expert
	// whose layer is needed last, then the least recently used. Every
	// expert's count is kept while it is out of the cache too, so a
	// popular expert evicted comes back with its count.
	ExpertLFU ExpertPolicy = "lfu"
)

// DefaultExpertPolicy is the policy of a Pager whose Options name none.
// Neither policy misses less on every routing (TestExpertPolicies in nn
// measures them on synthetic routing): LFU where a few experts are
// popular, LRU where a token keeps its experts from the token before,
// which trained routers are reported to do.
const DefaultExpertPolicy = ExpertLRU

// ParseExpertPolicy accepts "lru" and "lfu", case-insensitive; empty is
// DefaultExpertPolicy.
func ParseExpertPolicy(s string) (ExpertPolicy, error) {
	switch p := ExpertPolicy(strings.ToLower(strings.TrimSpace(s))); p {
	case "":
		return DefaultExpertPolicy, nil
	case ExpertLRU, ExpertLFU:
		return p, nil
	}
	return "", fmt.Errorf("paging: unknown expert cache policy %q (want lru or lfu)", s)
}

// ExpertServer is a Server that pages a model's experts one by one (a
// Pager whose plan has an expert cache, WithExpertCache): the layers'
// maps from Acquire leave the experts out, and AcquireExperts serves them.
type ExpertServer interface {
	// PagesExperts reports whether the layer's experts are served by
	// AcquireExperts rather than in its map from Acquire.
	PagesExperts(layer int) bool
	// ExpertSlots is the most experts AcquireExperts holds at once.
	ExpertSlots() int
	// AcquireExperts returns the tensors of the given experts of the
	// layer by expert and name, loading the missing ones, and pins them
	// until ReleaseExperts.
	AcquireExperts(ctx context.Context, layer int, experts []int) (map[int]map[string]*tensor.Tensor, error)
	// AcquireExpertsLazy is AcquireExperts leaving the compute's wait for
	// the copies of the experts in pending to await (Pager's).
	AcquireExpertsLazy(ctx context.Context, layer int, experts []int) (ws map[int]map[string]*tensor.Tensor, pending []int, await func(e int) error, err error)
	// ReleaseExperts unpins experts from AcquireExperts.
	ReleaseExperts(layer int, experts []int)
	// PrefetchExperts starts loading experts likely to be acquired soon.
	PrefetchExperts(layer int, experts []int)
	// SettleExperts waits for the prefetches under way to end.
	SettleExperts()
	// AcquireResident returns the layer's resident tensors (its routing
	// among them), loading them if they are not on the device, and pins
	// the layer until Release.
	AcquireResident(ctx context.Context, layer int) (map[string]*tensor.Tensor, error)
}

var _ ExpertServer = (*Pager)(nil)

// ErrExpertCacheFull is wrapped by AcquireExperts when more experts are
// asked for at once than the expert cache holds.
var ErrExpertCacheFull = errors.New("more experts at once than the expert cache holds")

// expertCache is a Pager's cache of experts: one device allocation of
// slots of slotBytes, each holding one expert, its tensors views into the
// slot at aligned offsets. Guarded by the pager's mu.
type expertCache struct {
	policy    ExpertPolicy
	slab      *tensor.Tensor
	slotBytes int64
	slots     []*expertEntry   // the expert in each slot, nil when free
	layers    [][]*expertEntry // by layer, nil for a layer without experts
	total     int
	prefetch  bool
	pf        errgroup.Group
	// prefetching counts the prefetch loads under way (SettleExperts).
	prefetching int
	// accesses counts expert acquires: the clock of LFU's aging, whose
	// counts halve every halfLife of them; sum is every expert's count
	// together, as of sumAt accesses.
	accesses uint64
	halfLife float64
	sum      float64
	sumAt    uint64
	// pass counts the passes over the layers: it moves on when an
	// acquire's layer is not after the one before (cur). visits counts
	// each layer's acquires.
	pass   uint64
	cur    int
	visits []uint64
	steps  expertSteps
	// loads counts the loads committed (expertEntry.queued).
	loads uint64
	// mapped is the source whose experts are copied in place from its
	// page-locked mapping (and computed from it on the CPU), nil when
	// they go through host copies; unregister undoes the page-locking
	// the cache did itself (none when it shares the staging ring's).
	mapped      MappedSource
	regions     [][]byte // mapped's regions, as page-locked
	unregister  []func() error
	mappedBytes int64 // what unregister undoes
	// arena pins the host copies in large chunks, nil without pinned
	// memory.
	arena *pinnedArena
	// lookups are lookUpExperts' goroutines.
	lookups sync.WaitGroup
	// free, best, bestN and logMean are reserveExpertsLocked's, kept
	// between calls: the free slots, and the victims chosen so far
	// (beginVictims).
	free    []int
	best    []standing
	bestN   int
	logMean float64
	// prep is PrepareExperts' choice, for the next acquire.
	prep struct {
		ok      bool
		layer   int
		changes uint64 // the pager's changes when it was made
		uses    uint64 // and the cache's accesses (LFU's clock, which no change counts)
		free    []int
		best    []standing
	}
}

// expertPrefetchLoads bounds the prefetches of experts under way at once.
const expertPrefetchLoads = 4

type expertEntry struct {
	layer, expert int
	specs         []TensorSpec
	offs          []int64 // the tensors' offsets in a slot, each ringAlign-aligned
	hostOffs      []int64 // and in the host copy, each hostAlign-aligned
	bytes         int64
	hostSize      int64

	slot       int // -1 when not in the cache
	loaded     bool
	loading    bool
	prefetched bool // brought by PrefetchExperts and not acquired since
	// onCPU: last used on the CPU (HostExpert), not acquired since;
	// PrefetchExperts leaves it to the CPU.
	onCPU bool
	// prefetchedAt is its layer's visits when it was prefetched: it is
	// just prefetched (fresh) until its layer's next visit.
	prefetchedAt uint64
	pins         int
	t            []*tensor.Tensor // views into the slot, when loaded
	ready        []func() error   // waits of asynchronous uploads into t
	// queued orders the loads whose copies are in flight: the cache's
	// count of loads when this one's copies had all been queued.
	queued uint64
	// failed: a lazy acquire's wait for its copies failed; it is evicted
	// when its last pin goes.
	failed     bool
	host       []byte   // the host copy, or nil
	srcs       [][]byte // the tensors in place in the mapped source, once looked up (mappedExpert)
	hostArena  bool     // host is a piece of the cache's pinnedArena
	hostPinned bool

	lastUse uint64  // the budget's stamp of the last acquire or release
	usePass uint64  // the pass of the last acquire
	count   float64 // LFU: the aged uses, as of countAt accesses
	countAt uint64
	logUses float64 // log2(count + uses0), for worth
}

// uses0 keeps the logarithm of an expert's count finite before its first
// use.
const uses0 = 1e-3

func (e *expertEntry) awaitUploads() error {
	var errs []error
	for _, r := range e.ready {
		if err := r(); err != nil {
			errs = append(errs, err)
		}
	}
	e.ready = nil
	return errors.Join(errs...)
}

// newExpertEntry lays out expert x of layer l, whose tensors are names
// among specs (by name in byName).
func newExpertEntry(l, x int, byName map[string]TensorSpec, names []string) *expertEntry {
	e := &expertEntry{layer: l, expert: x, slot: -1, logUses: math.Log2(uses0)}
	for _, n := range names {
		s := byName[n]
		e.offs = append(e.offs, e.slabBytes())
		e.specs = append(e.specs, s)
		e.hostOffs = append(e.hostOffs, e.hostSize)
		e.bytes += s.Bytes
		e.hostSize += alignHost(s.Bytes)
	}
	return e
}

// slabBytes is what the expert's tensors take in a slot.
func (e *expertEntry) slabBytes() int64 {
	var n int64
	for _, s := range e.specs {
		n += alignUp(s.Bytes)
	}
	return n
}

// newExpertCache sets up the expert cache the plan sizes, over the experts
// src lists, and allocates it. experts are each layer's experts' tensor
// names, checked by NewPager.
func (p *Pager) newExpertCache(experts [][][]string, opts Options) error {
	plan := p.plan
	x := &expertCache{policy: opts.ExpertPolicy, slotBytes: plan.ExpertSlotBytes, layers: make([][]*expertEntry, len(p.layers)),
		slots: make([]*expertEntry, plan.ExpertSlots), prefetch: opts.PrefetchDepth >= 0}
	if x.policy == "" {
		x.policy = DefaultExpertPolicy
	}
	if _, err := ParseExpertPolicy(string(x.policy)); err != nil {
		return err
	}
	for l, names := range experts {
		byName := map[string]TensorSpec{}
		for _, s := range p.layers[l].specs {
			byName[s.Name] = s
		}
		for e, ns := range names {
			en := newExpertEntry(l, e, byName, ns)
			if en.slabBytes() > x.slotBytes {
				return fmt.Errorf("paging: layer %d expert %d: %d bytes with each tensor %d-byte aligned, the plan's expert slots hold %d",
					l, e, en.slabBytes(), ringAlign, x.slotBytes)
			}
			x.layers[l] = append(x.layers[l], en)
			x.total++
		}
	}
	if x.total != plan.Experts {
		return fmt.Errorf("paging: plan has %d experts, source has %d", plan.Experts, x.total)
	}
	if x.total > 0 && len(x.slots) == 0 {
		return fmt.Errorf("paging: plan caches none of the %d experts", x.total)
	}
	x.halfLife = 16 * float64(x.total)
	x.visits = make([]uint64, len(p.layers))
	x.cur = len(x.layers) // the first acquire starts a pass
	x.pf.SetLimit(expertPrefetchLoads)
	if p.pinned != nil && p.hostCap > 0 {
		x.arena = newPinnedArena(p.pinned, p.hostCap)
	}
	if n := int64(len(x.slots)) * x.slotBytes; n > 0 {
		slab, err := p.bg.alloc(StreamedWeights, tensor.F32, tensor.Shape{int(n / 4)}, -1, mayEvict)
		if err != nil {
			return fmt.Errorf("paging: allocating the expert cache: %w", err)
		}
		x.slab = slab
	}
	p.ex = x
	return nil
}

// PagesExperts reports whether the layer's experts are in the expert
// cache, served by AcquireExperts and left out of Acquire's map.
func (p *Pager) PagesExperts(layer int) bool {
	return p.ex != nil && layer >= 0 && layer < len(p.ex.layers) && p.ex.layers[layer] != nil
}

// ExpertSlots is the number of experts the expert cache holds, the most
// AcquireExperts pins at once; 0 without an expert cache.
func (p *Pager) ExpertSlots() int {
	if p.ex == nil {
		return 0
	}
	return len(p.ex.slots)
}

// expertEntries returns the entries of experts of layer, checking them.
func (p *Pager) expertEntries(what string, layer int, experts []int) ([]*expertEntry, error) {
	if !p.PagesExperts(layer) {
		return nil, fmt.Errorf("paging: %s experts of layer %d: the layer has no experts in the expert cache", what, layer)
	}
	all := p.ex.layers[layer]
	out := make([]*expertEntry, 0, len(experts))
	for i, x := range experts {
		if x < 0 || x >= len(all) {
			return nil, fmt.Errorf("paging: %s expert %d of layer %d: have experts 0..%d", what, x, layer, len(all)-1)
		}
		if slices.Contains(experts[:i], x) {
			return nil, fmt.Errorf("paging: %s experts of layer %d: expert %d listed twice", what, layer, x)
		}
		out = append(out, all[x])
	}
	return out, nil
}

// AcquireExperts returns the tensors of the layer's experts by expert and
// name, loading the missing ones into the expert cache, and pins them
// until ReleaseExperts; the tensors keep their stored dtype and stay valid
// until then. A missing expert is uploaded from the host cache when it
// holds it, else read from the source (and kept in the host cache when it
// has room); to make room it evicts unpinned experts of any layer, as the
// policy (Options.ExpertPolicy) chooses, sparing those just prefetched
// while others will do. When every slot it could use is pinned or loading
// for another caller, it waits for one (until ctx ends: a caller holding
// experts pinned while it asks for more than the rest of the cache waits
// for itself). More experts than the cache holds
// (ExpertSlots) fail with an error wrapping ErrExpertCacheFull. On any
// error nothing is pinned; the experts it did load stay cached.
func (p *Pager) AcquireExperts(ctx context.Context, layer int, experts []int) (map[int]map[string]*tensor.Tensor, error) {
	out, _, err := p.acquireExperts(ctx, layer, experts, false)
	return out, err
}

// AcquireExpertsLazy is AcquireExperts without ordering the compute after
// the copies: pending lists the experts whose copies may still be in
// flight, in the order they were queued on the link, and the caller calls
// await(e) before it queues the first operation that reads expert e (the
// device's wait for e's copies). The other experts can compute at once,
// while the pending ones land: a sparse block computes its cached experts
// during its misses' copies rather than after the last of them. An expert
// whose wait fails is evicted when it is released.
func (p *Pager) AcquireExpertsLazy(ctx context.Context, layer int, experts []int) (ws map[int]map[string]*tensor.Tensor, pending []int, await func(e int) error, err error) {
	ws, pending, err = p.acquireExperts(ctx, layer, experts, true)
	if err != nil {
		return nil, nil, nil, err
	}
	await = func(x int) error {
		es, err := p.expertEntries("await", layer, []int{x})
		if err != nil {
			return err
		}
		e := es[0]
		p.mu.Lock()
		defer p.mu.Unlock()
		if e.pins == 0 || !e.loaded {
			return fmt.Errorf("paging: await expert %d of layer %d: not acquired", x, layer)
		}
		if err := e.awaitUploads(); err != nil {
			e.failed = true // its copy never landed: evicted on release
			return fmt.Errorf("paging: expert %d of layer %d: %w", x, layer, err)
		}
		return nil
	}
	return ws, pending, await, nil
}

// acquireExperts is AcquireExperts, and with lazy AcquireExpertsLazy
// (which leaves the waits of the experts it returns in pending).
func (p *Pager) acquireExperts(ctx context.Context, layer int, experts []int, lazy bool) (map[int]map[string]*tensor.Tensor, []int, error) {
	es, err := p.expertEntries("acquire", layer, experts)
	if err != nil {
		return nil, nil, err
	}
	x := p.ex
	if len(es) > len(x.slots) {
		return nil, nil, fmt.Errorf("paging: acquire %d experts of layer %d: %w: it holds %d", len(es), layer, ErrExpertCacheFull, len(x.slots))
	}
	fail := func(err error) error {
		return fmt.Errorf("paging: acquire experts %v of layer %d: %w", experts, layer, err)
	}
	missed := map[*expertEntry]bool{}
	p.mu.Lock()
	x.visit(layer)
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, nil, fail(errClosed)
		}
		if err := ctx.Err(); err != nil {
			p.mu.Unlock()
			return nil, nil, fail(err)
		}
		var need []*expertEntry
		waiting := false
		for _, e := range es {
			switch {
			case e.loaded:
			case e.loading:
				waiting = true
			default:
				need = append(need, e)
			}
		}
		if len(need) > 0 {
			ok := p.reserveExpertsLocked(need, es, false)
			tensor.Mark(p.b, "reserved") // on a timeline (tensor.Marker): the victims' part of the host's time before the first copy
			if !ok {
				// Every slot it could take is pinned or loading for
				// someone else: wait for a release or a load to end.
				if err := p.waitExpertsLocked(ctx); err != nil {
					p.mu.Unlock()
					return nil, nil, fail(err)
				}
				continue
			}
			for _, e := range need {
				missed[e] = true
			}
			p.inflight++ // Close waits for the load
			p.mu.Unlock()
			err := p.loadExperts(ctx, need)
			p.mu.Lock()
			p.inflight--
			p.changedLocked()
			if err != nil {
				p.mu.Unlock()
				return nil, nil, fail(err)
			}
			continue
		}
		if waiting {
			if err := p.waitExpertsLocked(ctx); err != nil {
				p.mu.Unlock()
				return nil, nil, fail(err)
			}
			continue
		}
		break
	}
	// Every expert is loaded: order compute after their copies (or, lazy,
	// leave that to the caller), then pin.
	var pending []*expertEntry
	for _, e := range es {
		if lazy && len(e.ready) > 0 {
			pending = append(pending, e)
			continue
		}
		if err := e.awaitUploads(); err != nil {
			p.evictExpertLocked(e) // the copy never landed
			p.mu.Unlock()
			return nil, nil, fail(err)
		}
	}
	stamp := p.bg.Stamp()
	out := make(map[int]map[string]*tensor.Tensor, len(es))
	for _, e := range es {
		e.pins++
		e.lastUse, e.usePass = stamp, x.pass
		x.touchLocked(e)
		p.st.ExpertAcquires++
		if missed[e] {
			p.st.ExpertMisses++
		} else {
			p.st.ExpertHits++
		}
		if e.prefetched && e.prefetchedAt+1 == x.visits[layer] { // the visit it was prefetched for
			p.st.ExpertPrefetchHits++
		}
		e.prefetched, e.onCPU = false, false
		m := make(map[string]*tensor.Tensor, len(e.specs))
		for k, s := range e.specs {
			m[s.Name] = e.t[k]
		}
		out[e.expert] = m
	}
	p.mu.Unlock()
	slices.SortFunc(pending, func(a, b *expertEntry) int { return cmp.Compare(a.queued, b.queued) })
	var order []int
	for _, e := range pending {
		order = append(order, e.expert)
	}
	return out, order, nil
}

// ReleaseExperts unpins experts from AcquireExperts. Releasing an expert
// that is not pinned does nothing (and is counted in Stats.BadReleases).
func (p *Pager) ReleaseExperts(layer int, experts []int) {
	if !p.PagesExperts(layer) {
		p.mu.Lock()
		p.st.BadReleases++
		p.mu.Unlock()
		return
	}
	all := p.ex.layers[layer]
	p.mu.Lock()
	defer p.mu.Unlock()
	stamp := p.bg.Stamp()
	for _, x := range experts {
		if x < 0 || x >= len(all) || all[x].pins == 0 {
			p.st.BadReleases++
			continue
		}
		all[x].pins--
		all[x].lastUse = stamp
		if e := all[x]; e.failed && e.pins == 0 {
			e.failed = false
			p.evictExpertLocked(e)
		}
	}
	p.changedLocked()
}

// PrefetchExperts starts loading the layer's experts that are not in the
// cache into slots that are free or hold experts neither pinned, loading
// nor just prefetched (the policy choosing among them); it stops at the
// first it finds no room for. The uploads of experts whose pinned host
// copy the host cache holds, with a device that copies asynchronously,
// are queued before it returns (they only queue copies); the others load
// in the background. It does nothing without an expert cache for the
// layer, with prefetch off (Options.PrefetchDepth < 0), or for experts
// out of range, nor for an expert last computed on the CPU (HostExpert)
// and not acquired since: ExpertsOnCPU sent it there rather than upload
// it, and a guess of the experts a block chose at the position before
// (synthetic routing's) uploaded every such expert one token later (on
// the H200, 112 of 114 a token, issue #16). Errors surface on
// AcquireExperts, which loads what a prefetch did not.
//
// Queued by the caller, not by a goroutine: nn computes a layer's experts
// on the CPU right after it prefetches the next layer's, on as many
// threads as the host has cores, and a goroutine queuing copies (a few
// cgo calls each) waited for those products to end while the link
// idled; the CPU's products ran in series with the uploads on the H200
// (issue #16).
func (p *Pager) PrefetchExperts(layer int, experts []int) {
	es, err := p.expertEntries("prefetch", layer, experts)
	if err != nil || !p.ex.prefetch {
		return
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	var now, later []*expertEntry
	for _, e := range es {
		if e.loaded || e.loading || e.onCPU {
			continue
		}
		if !p.reserveExpertsLocked([]*expertEntry{e}, es, true) {
			p.st.ExpertPrefetchNoRoom++
			break
		}
		e.prefetched, e.prefetchedAt = true, p.ex.visits[layer]
		e.lastUse = p.bg.Stamp()
		if p.copiesOnlyLocked(e) {
			now = append(now, e) // only copies to queue: from its pinned host copy, or in place
		} else {
			later = append(later, e)
		}
	}
	if len(now) > 0 {
		p.inflight++ // Close waits for the load
		p.st.ExpertPrefetches += int64(len(now))
	}
	p.prefetchExpertsLocked(later)
	p.mu.Unlock()
	if len(now) == 0 {
		return
	}
	p.loadExperts(p.life, now) // errors surface on AcquireExperts
	p.mu.Lock()
	p.inflight--
	p.changedLocked()
	p.mu.Unlock()
}

// prefetchExpertsLocked loads es, whose slots are reserved, in the
// background, or gives their slots back when too many prefetches are
// under way.
func (p *Pager) prefetchExpertsLocked(es []*expertEntry) {
	if len(es) == 0 {
		return
	}
	p.ex.prefetching++
	if !p.ex.pf.TryGo(func() error {
		p.loadExperts(p.life, es) // errors surface on AcquireExperts
		p.mu.Lock()
		p.ex.prefetching--
		p.changedLocked()
		p.mu.Unlock()
		return nil
	}) {
		p.ex.prefetching--
		for _, e := range es {
			p.unreserveExpertLocked(e)
			e.prefetched = false
		}
		p.st.ExpertPrefetchSkipped++
		return
	}
	p.st.ExpertPrefetches += int64(len(es))
}

// SettleExperts waits for the expert prefetches under way to end, so that
// Stats counts every byte they move (a report at the end of a run).
func (p *Pager) SettleExperts() {
	if p.ex == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.ex.prefetching > 0 {
		p.cond.Wait()
	}
}

// reserveExpertsLocked finds slots for need, which are neither loaded nor
// loading, evicting cached experts if it must, and marks them loading. It
// never evicts an expert pinned, loading or in keep; a prefetch never
// evicts one prefetched for its layer's next visit, which has not come
// yet (fresh), and a demand load only when nothing else will do. It reports false, changing nothing, when
// there are not enough slots.
func (p *Pager) reserveExpertsLocked(need, keep []*expertEntry, prefetch bool) bool {
	x := p.ex
	if ok, done := p.reservePreparedLocked(need, keep, prefetch); done {
		return ok
	}
	free := x.free[:0]
	x.beginVictims(len(need))
	evictable := 0
	for s, o := range x.slots {
		switch {
		case o == nil:
			free = append(free, s)
		case o.pins == 0 && !o.loading && !(prefetch && x.fresh(o)) && !slices.Contains(keep, o):
			evictable++
			x.offerVictim(o)
		}
	}
	x.free = free
	if len(free)+evictable < len(need) {
		return false
	}
	p.claimSlotsLocked(need, free, x.best)
	return true
}

// claimSlotsLocked gives need the slots free, in order, then those of the
// first victims, evicted, as many as it takes (free and victims cover
// need), and marks them loading.
func (p *Pager) claimSlotsLocked(need []*expertEntry, free []int, victims []standing) {
	x := p.ex
	for _, v := range victims[:max(len(need)-len(free), 0)] {
		free = append(free, v.e.slot)
		p.evictExpertLocked(v.e)
	}
	x.free = free
	for i, e := range need {
		e.slot, e.loading = free[i], true
		x.slots[e.slot] = e
	}
}

// PrepareExperts works out, ahead of the next acquire of layer's experts
// (AcquireExperts, AcquireExpertsLazy), the free slots and the n experts
// it would evict first, as it would find them: the acquire then takes
// them without its scan of every slot, so long as nothing in the cache
// changed in between (a release, a load, a prefetch) and no more than
// they cover is needed; else it scans as ever. Its choices are the
// scan's. A decode step calls it while the device computes the router
// (the host waits then), with n twice the experts a token takes: the
// acquire's scan of some 550 cached experts of the Qwen3-30B-A3B shape
// at 8 GiB was a sixth of the host's time from the router's scores to
// the first copy, while the link idled. Without experts paged in layer,
// or with n < 1, it does nothing.
func (p *Pager) PrepareExperts(layer, n int) {
	if !p.PagesExperts(layer) || n < 1 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	x := p.ex
	// The standings as the acquire will see them, after its bookkeeping.
	pass, cur, visits := x.pass, x.cur, x.visits[layer]
	x.visit(layer)
	pr := &x.prep
	pr.free = pr.free[:0]
	x.beginVictims(n)
	for s, o := range x.slots {
		switch {
		case o == nil:
			pr.free = append(pr.free, s)
		case o.pins == 0 && !o.loading:
			x.offerVictim(o)
		}
	}
	pr.best = append(pr.best[:0], x.best...)
	x.pass, x.cur, x.visits[layer] = pass, cur, visits
	pr.layer, pr.changes, pr.uses, pr.ok = layer, p.changes, x.accesses, true
}

// reservePreparedLocked is reserveExpertsLocked from PrepareExperts'
// choice, when it holds: done reports that it did (ok as
// reserveExpertsLocked's), else the caller scans. The choice is used once.
func (p *Pager) reservePreparedLocked(need, keep []*expertEntry, prefetch bool) (ok, done bool) {
	x := p.ex
	pr := &x.prep
	if !pr.ok {
		return false, false
	}
	pr.ok = false
	if prefetch || pr.layer != x.cur || pr.changes != p.changes || pr.uses != x.accesses {
		return false, false
	}
	free := append(x.free[:0], pr.free...)
	victims := x.best[:0] // the scan's buffer, free until the next scan
	for _, v := range pr.best {
		if len(free)+len(victims) >= len(need) {
			break
		}
		if !slices.Contains(keep, v.e) {
			victims = append(victims, v)
		}
	}
	if len(free)+len(victims) < len(need) {
		return false, false // more than the choice covers: the scan decides
	}
	p.claimSlotsLocked(need, free, victims)
	p.st.ExpertsPrepared++
	return true, true
}

// unreserveExpertLocked gives back the slot of a load that did not happen.
func (p *Pager) unreserveExpertLocked(e *expertEntry) {
	p.ex.slots[e.slot] = nil
	e.slot, e.loading = -1, false
	p.changedLocked()
}

// visit counts an acquire of layer's experts (the caller holds p.mu): a
// new pass of the walk over the layers unless layer comes after the last
// one acquired, and a visit of layer.
func (x *expertCache) visit(layer int) {
	if layer <= x.cur {
		x.pass++
	}
	x.cur = layer
	x.visits[layer]++
}

// standing is an evictable expert's place in the order victims go in:
// those not fresh from a prefetch before those that are, then as the
// policy says (ExpertLRU, ExpertLFU), then the layer used furthest on,
// then the least recently used.
type standing struct {
	e          *expertEntry
	prefetched bool
	rank       float64 // LFU's worth, or minus LRU's age: the lower goes first
	far        int     // the layer's next use: the further goes first
}

// before reports a to go before b.
func (a *standing) before(b *standing) bool {
	if a.prefetched != b.prefetched {
		return b.prefetched
	}
	if a.rank != b.rank {
		return a.rank < b.rank
	}
	if a.far != b.far {
		return a.far > b.far
	}
	return a.e.lastUse < b.e.lastUse
}

// beginVictims starts a choice of the n experts to go first among those
// offerVictim is given next; x.best holds them, in order, after. Each
// expert's standing is worked out once, and only the n first are kept as
// they come (the misses of a decode step evict a few of hundreds, and the
// host does this before it queues their first copy, while the link
// waits).
func (x *expertCache) beginVictims(n int) {
	x.best, x.bestN = x.best[:0], n
	if x.policy == ExpertLFU {
		x.logMean = x.logMeanCount()
	}
}

// offerVictim considers e (beginVictims); ties keep the order offered.
func (x *expertCache) offerVictim(e *expertEntry) {
	n := x.bestN
	if n <= 0 {
		return
	}
	s := standing{e: e, prefetched: x.fresh(e), far: x.nextUse(e), rank: -float64(x.age(e))}
	if x.policy == ExpertLFU {
		s.rank = x.worth(e, x.logMean)
	}
	best := x.best
	if len(best) == n && !s.before(&best[n-1]) {
		return
	}
	i := len(best)
	if i < n {
		best = append(best, s)
	} else {
		i = n - 1
	}
	for ; i > 0 && s.before(&best[i-1]); i-- {
		best[i] = best[i-1]
	}
	best[i] = s
	x.best = best
}

// fresh reports an expert prefetched for its layer's next visit, which
// has not come yet.
func (x *expertCache) fresh(e *expertEntry) bool {
	return e.prefetched && e.prefetchedAt == x.visits[e.layer]
}

// age is the visits of e's layer since e was last used: 0 for an
// expert its layer used at its last visit.
func (x *expertCache) age(e *expertEntry) uint64 {
	last := x.pass // the pass of the layer's last visit
	if e.layer > x.cur {
		last--
	}
	return last - min(e.usePass, last)
}

// worth is how likely LFU deems e to be used again, in whole steps: the
// base-2 logarithm of its aged count over the mean of every expert's
// (logMean, logMeanCount), rounded (so that the counts of experts used
// alike, which differ by chance, compare equal), plus 1 when e was used at
// its layer's last visit.
func (x *expertCache) worth(e *expertEntry, logMean float64) float64 {
	w := math.Round(e.logUses - float64(x.accesses-e.countAt)/x.halfLife - logMean)
	if e.usePass == x.pass || e.usePass+1 == x.pass && e.layer > x.cur {
		w++
	}
	return w
}

// logMeanCount is the base-2 logarithm of the mean of every expert's
// aged count.
func (x *expertCache) logMeanCount() float64 {
	return math.Log2(x.sum/float64(x.total)) - float64(x.accesses-x.sumAt)/x.halfLife
}

// nextUse is how many layers on from the one acquired now e's layer comes
// in a walk over the layers in order: 1 for the next, the number of layers
// for the layer acquired now.
func (x *expertCache) nextUse(e *expertEntry) int {
	d := e.layer - x.cur - 1 // in [-n, n-2]: no division, once an evictable expert
	if d < 0 {
		d += len(x.layers)
	}
	return d + 1
}

// agedCount is e's LFU count now.
func (x *expertCache) agedCount(e *expertEntry) float64 {
	return e.count * math.Exp2(-float64(x.accesses-e.countAt)/x.halfLife)
}

// touchLocked counts an acquire of e.
func (x *expertCache) touchLocked(e *expertEntry) {
	x.accesses++
	e.count = x.agedCount(e) + 1
	e.countAt = x.accesses
	e.logUses = math.Log2(e.count + uses0)
	x.sum = x.sum*math.Exp2(-float64(x.accesses-x.sumAt)/x.halfLife) + 1
	x.sumAt = x.accesses
}

// evictExpertLocked drops a cached expert from its slot; its host copy
// stays.
func (p *Pager) evictExpertLocked(e *expertEntry) {
	_ = e.awaitUploads() // later uploads into the slot land after these
	p.ex.slots[e.slot] = nil
	e.slot, e.loaded, e.t, e.prefetched = -1, false, nil, false
	p.st.ExpertEvictions++
	p.changedLocked()
}

// waitExpertsLocked waits for a release or the end of a load, or until
// retryRoomAfter has passed.
func (p *Pager) waitExpertsLocked(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, retryRoomAfter)
	defer cancel()
	err := p.waitLocked(wctx)
	if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		return nil
	}
	return err
}

// loadExperts loads es, whose slots are reserved, a few at a time, and
// commits each: loaded, or its slot given back when its load failed. It
// returns the loads' errors.
func (p *Pager) loadExperts(ctx context.Context, es []*expertEntry) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(p.life, cancel)
	defer stop()
	// Loads that only queue copies run here, one after another, in the
	// order of es (the order their copies land in); those that read run
	// a few at once.
	inline := true
	p.mu.Lock()
	for _, e := range es {
		inline = inline && p.copiesOnlyLocked(e)
	}
	p.mu.Unlock()
	tensor.Mark(p.b, "loading") // on a timeline (tensor.Marker)
	var g errgroup.Group
	g.SetLimit(expertPrefetchLoads)
	errs := make([]error, len(es))
	for i, e := range es {
		run := func() error {
			ts, ready, err := p.loadExpert(ctx, e)
			p.mu.Lock()
			defer p.mu.Unlock()
			if err == nil && p.closed {
				err = errClosed
			}
			if err != nil {
				for _, r := range ready {
					_ = r()
				}
				p.unreserveExpertLocked(e)
				e.prefetched = false
				errs[i] = err
				return nil
			}
			e.t, e.ready, e.loaded, e.loading = ts, ready, true, false
			p.ex.loads++
			e.queued = p.ex.loads
			p.changedLocked()
			return nil
		}
		if inline {
			_ = run()
			continue
		}
		g.Go(run)
	}
	g.Wait()
	return errors.Join(errs...)
}

// copiesOnlyLocked reports whether loading e only queues copies: from its
// pinned host copy, or in place from the mapping, on a device that copies
// asynchronously (no read, nothing for the caller to wait on).
func (p *Pager) copiesOnlyLocked(e *expertEntry) bool {
	return p.async != nil && (e.host != nil && e.hostPinned || e.host == nil && p.ex.mapped != nil)
}

// loadExpert uploads e into its slot: from its host copy when there is
// one, else read from the source, into a host copy kept in the host
// cache when it has room.
func (p *Pager) loadExpert(ctx context.Context, e *expertEntry) (ts []*tensor.Tensor, ready []func() error, err error) {
	if e.host == nil {
		srcs, err := p.mappedExpert(e)
		if err != nil {
			return nil, nil, err
		}
		if srcs != nil {
			// The copies first, the views of the slot after: a decode
			// step's first miss is what the link waits for.
			ready, err := p.uploadMappedExpert(ctx, e, srcs)
			if err != nil {
				return nil, nil, err
			}
			if ts, err = p.slotViews(e); err != nil {
				for _, r := range ready {
					_ = r()
				}
				return nil, nil, err
			}
			return ts, ready, nil
		}
	}
	if ts, err = p.slotViews(e); err != nil {
		return nil, nil, err
	}
	p.mu.Lock()
	buf, cachedPinned := e.host, e.hostPinned
	cached, admitted := buf != nil, false
	switch {
	case cached:
		p.st.HostCacheHits++
	case p.hostUsed+p.hostReserved+e.hostSize <= p.hostCap:
		p.hostUsed += e.hostSize // returned if the load fails
		admitted = true
		p.st.HostCacheMisses++
	default:
		p.st.HostCacheMisses++
	}
	p.mu.Unlock()
	pinned, fromArena := false, false
	if admitted {
		buf, pinned, fromArena = p.expertHostAlloc(e.hostSize)
	}
	defer func() {
		if err == nil || !admitted {
			return
		}
		for _, r := range ready { // the copies read buf
			_ = r()
		}
		ready = nil
		p.expertHostFree(buf, pinned, fromArena)
		p.mu.Lock()
		p.hostUsed -= e.hostSize
		p.mu.Unlock()
	}()
	for k, s := range e.specs {
		var src []byte
		var tmp *[]byte
		if buf != nil {
			src = buf[e.hostOffs[k] : e.hostOffs[k]+s.Bytes]
		}
		if !cached {
			if src == nil {
				tmp = p.reads.get(s.Bytes)
				src = (*tmp)[:s.Bytes]
			}
			if err := ctx.Err(); err != nil {
				p.reads.put(tmp)
				return nil, ready, err
			}
			if err := p.src.ReadTensor(ctx, e.layer, s.Name, src); err != nil {
				p.reads.put(tmp)
				return nil, ready, fmt.Errorf("paging: layer %d expert %d tensor %s: reading: %w", e.layer, e.expert, s.Name, err)
			}
			p.mu.Lock()
			p.st.BytesDiskToHost += s.Bytes
			p.mu.Unlock()
		}
		var err error
		if p.async != nil && (pinned || cached && cachedPinned) {
			var r func() error
			if r, err = p.async.UploadAsync(ctx, ts[k], 0, src); err == nil {
				ready = append(ready, r)
			}
		} else {
			err = p.b.Upload(ts[k], 0, src)
		}
		p.reads.put(tmp)
		if err != nil {
			return nil, ready, fmt.Errorf("paging: layer %d expert %d tensor %s: upload: %w", e.layer, e.expert, s.Name, err)
		}
		p.mu.Lock()
		p.st.BytesHostToDevice += s.Bytes
		p.st.ExpertBytesMoved += s.Bytes
		p.mu.Unlock()
	}
	if admitted {
		p.mu.Lock()
		e.host, e.hostPinned, e.hostArena = buf, pinned, fromArena
		if pinned && !fromArena {
			p.pinnedBytes += int64(len(buf))
		}
		p.mu.Unlock()
	}
	return ts, ready, nil
}

// mappedExpert returns e's tensors' bytes in the page-locked mapping of
// the source, in the order of e.specs, or nil when the cache copies from
// host copies or the source gives one of them other than in place (the
// expert then loads as any other).
func (p *Pager) mappedExpert(e *expertEntry) ([][]byte, error) {
	ms := p.ex.mapped
	if ms == nil {
		return nil, nil
	}
	p.mu.Lock()
	srcs := e.srcs
	p.mu.Unlock()
	if srcs != nil {
		return srcs, nil
	}
	srcs = make([][]byte, len(e.specs))
	for k, s := range e.specs {
		b, ok, err := ms.MappedTensor(e.layer, s.Name)
		if err != nil {
			return nil, fmt.Errorf("paging: layer %d expert %d tensor %s: %w", e.layer, e.expert, s.Name, err)
		}
		if !ok || int64(len(b)) != s.Bytes {
			return nil, nil
		}
		srcs[k] = b
	}
	p.mu.Lock()
	e.srcs = srcs
	p.mu.Unlock()
	return srcs, nil
}

// slotViews returns e's tensors as views of its slot.
func (p *Pager) slotViews(e *expertEntry) ([]*tensor.Tensor, error) {
	x := p.ex
	base := int64(e.slot) * x.slotBytes
	ts := make([]*tensor.Tensor, len(e.specs))
	for k, s := range e.specs {
		t, err := x.slab.View(base+e.offs[k], s.DType, s.Shape)
		if err != nil {
			return nil, fmt.Errorf("paging: layer %d expert %d tensor %s: %w", e.layer, e.expert, s.Name, err)
		}
		ts[k] = t
	}
	return ts, nil
}

// uploadMappedExpert queues the copies of e's tensors into ts straight
// from the mapping (srcs, mappedExpert): no read into host memory, no host
// copy kept. Tensors that lie end to end both in the mapping and in the
// slot go in one copy (a file's gate, up and down of an expert usually
// do: one copy an expert, where a copy a tensor took three, each with its
// own gaps on the link and driver calls). On an error the waits of the
// copies queued have run.
func (p *Pager) uploadMappedExpert(ctx context.Context, e *expertEntry, srcs [][]byte) ([]func() error, error) {
	var ready []func() error
	fail := func(k int, err error) ([]func() error, error) {
		for _, r := range ready {
			_ = r()
		}
		return nil, fmt.Errorf("paging: layer %d expert %d tensor %s: upload: %w", e.layer, e.expert, e.specs[k].Name, err)
	}
	base := int64(e.slot) * p.ex.slotBytes
	for k := 0; k < len(srcs); {
		j, n := k+1, int64(len(srcs[k]))
		for j < len(srcs) && adjacent(srcs[j-1], srcs[j]) && p.ex.sameRegion(srcs[k], srcs[j]) && e.offs[j] == e.offs[k]+n {
			n += int64(len(srcs[j]))
			j++
		}
		if n%2 != 0 { // a run's view counts 16-bit words (every stored dtype's bytes are even)
			j, n = k+1, int64(len(srcs[k]))
		}
		dt, shape, src := e.specs[k].DType, e.specs[k].Shape, srcs[k]
		if j > k+1 {
			dt, shape, src = tensor.F16, tensor.Shape{int(n / 2)}, unsafe.Slice(&srcs[k][0], n)
		}
		dst, err := p.ex.slab.View(base+e.offs[k], dt, shape)
		if err != nil {
			return fail(k, err)
		}
		r, err := p.async.UploadAsync(ctx, dst, 0, src)
		if err != nil {
			return fail(k, err)
		}
		ready = append(ready, r)
		k = j
	}
	p.mu.Lock()
	p.st.BytesHostToDevice += e.bytes
	p.st.ExpertBytesMoved += e.bytes
	p.st.BytesMapped += e.bytes
	p.mu.Unlock()
	return ready, nil
}

// adjacent reports whether b starts where a ends in memory.
func adjacent(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && uintptr(unsafe.Pointer(&a[0]))+uintptr(len(a)) == uintptr(unsafe.Pointer(&b[0]))
}

// sameRegion reports whether a and b lie in one region of the mapping (a
// copy spanning two, registered apart, might not be read as page-locked).
func (x *expertCache) sameRegion(a, b []byte) bool {
	in := func(r, t []byte) bool {
		lo := uintptr(unsafe.Pointer(&r[0]))
		p := uintptr(unsafe.Pointer(&t[0]))
		return p >= lo && p+uintptr(len(t)) <= lo+uintptr(len(r))
	}
	for _, r := range x.regions {
		if len(r) > 0 && in(r, a) {
			return in(r, b)
		}
	}
	return false
}

// mapExperts has the expert cache copy its experts in place from the
// source's mapping, page-locked, where the source maps its files
// (MappedSource), the backend copies asynchronously and can page-lock host
// memory, and opts allow it: with the staging ring's registration when
// the ring made one, else its own. Where none can be made the experts go
// through host copies as before.
func (p *Pager) mapExperts(opts Options) {
	ms, ok := p.src.(MappedSource)
	if p.ex == nil || !ok || opts.NoMappedUploads || p.async == nil {
		return
	}
	if p.stage != nil && p.stage.mapped != nil {
		p.ex.mapped, p.ex.regions = p.stage.mapped, ms.MappedRegions()
		return
	}
	if undo, n := registerMapped(p.b, ms); len(undo) > 0 {
		p.ex.mapped, p.ex.regions, p.ex.unregister, p.ex.mappedBytes = ms, ms.MappedRegions(), undo, n
	}
}

// expertLookups is how many goroutines lookUpExperts runs.
const expertLookups = 2

// lookUpExperts looks up, in the background, every expert's tensors in
// the mapped source the expert cache copies in place from (mappedExpert),
// layer by layer in the order decode visits them, until the pager closes.
// A source checks a tensor's values the first time it gives it in place
// (loader.Model.Mapped reads it whole for non-finite values), and that
// first time came on a miss, before its copy was queued, with the link
// idle: 0.42 s of 1.91 s of decode of the Mixtral-8x7B shape at half
// depth under skewed routing on the H200 (session 8), a few tens of
// milliseconds each time an expert was first used. Errors are left for
// the load that meets them.
func (p *Pager) lookUpExperts() {
	x := p.ex
	if x == nil || x.mapped == nil {
		return
	}
	var all []*expertEntry
	for _, es := range x.layers {
		all = append(all, es...)
	}
	for g := range expertLookups {
		x.lookups.Go(func() {
			for i := g; i < len(all); i += expertLookups {
				if p.life.Err() != nil {
					return
				}
				_, _ = p.mappedExpert(all[i])
			}
		})
	}
}

// expertHostAlloc allocates an expert's host copy for the host cache: a
// piece of the expert cache's pinned arena, else (no arena, or the arena
// could not grow) the pager's hostAlloc. pinned says it is page-locked,
// fromArena that it is the arena's.
func (p *Pager) expertHostAlloc(n int64) (buf []byte, pinned, fromArena bool) {
	if b, grown := p.ex.arena.alloc(n); b != nil {
		if grown > 0 {
			p.mu.Lock()
			p.pinnedBytes += grown
			p.mu.Unlock()
		}
		return b, true, true
	}
	buf, pinned = p.hostAlloc(n)
	return buf, pinned, false
}

// expertHostFree gives back a host copy from expertHostAlloc that the
// host cache does not keep: an arena's piece stays with the arena until
// Close.
func (p *Pager) expertHostFree(buf []byte, pinned, fromArena bool) {
	if !fromArena {
		_ = p.hostFree(buf, pinned)
	}
}

// closeExpertsLocked frees the expert cache's host copies; the caller holds mu,
// with every load ended.
func (p *Pager) closeExpertsLocked() []error {
	x := p.ex
	if x == nil {
		return nil
	}
	var errs []error
	for _, es := range x.layers {
		for _, e := range es {
			if err := e.awaitUploads(); err != nil {
				errs = append(errs, fmt.Errorf("paging: layer %d expert %d: %w", e.layer, e.expert, err))
			}
			e.t, e.loaded, e.loading, e.slot, e.pins = nil, false, false, -1, 0
			if !e.hostArena {
				if err := p.hostFree(e.host, e.hostPinned); err != nil {
					errs = append(errs, fmt.Errorf("paging: freeing pinned host memory of layer %d expert %d: %w", e.layer, e.expert, err))
				}
				if e.hostPinned {
					p.pinnedBytes -= int64(len(e.host))
				}
			}
			e.host, e.hostPinned, e.hostArena = nil, false, false
		}
	}
	freed, err := x.arena.close()
	p.pinnedBytes -= freed
	if err != nil {
		errs = append(errs, err)
	}
	for _, u := range x.unregister { // after the copies from the mapping landed
		if err := u(); err != nil {
			errs = append(errs, fmt.Errorf("paging: unregistering a mapped weight file: %w", err))
		}
	}
	x.unregister, x.mapped, x.regions, x.mappedBytes = nil, nil, nil, 0
	clear(x.slots)
	return errs
}

// expertSteps turns the expert counters into per-step figures, as steps
// does the bytes moved: the first step is left out of the means.
type expertSteps struct {
	lastBytes, lastMisses, sumBytes, sumMisses, count int64
}

func (k *expertSteps) mark(st *Stats) {
	db, dm := st.ExpertBytesMoved-k.lastBytes, st.ExpertMisses-k.lastMisses
	k.lastBytes, k.lastMisses = st.ExpertBytesMoved, st.ExpertMisses
	if st.Steps > 1 {
		k.sumBytes += db
		k.sumMisses += dm
		k.count++
	}
}

func (k *expertSteps) means() (bytes, misses float64) {
	if k.count == 0 {
		return 0, 0
	}
	return float64(k.sumBytes) / float64(k.count), float64(k.sumMisses) / float64(k.count)
}
