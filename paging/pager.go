package paging

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
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
// pager prefetches along it, over the sequence (SetSequence).
type Order int32

// The access orders.
const (
	Forward Order = iota // 0, 1, ..., n-1, 0, ... (decoding): the sequence in its order
	Reverse              // n-1, ..., 1, 0, n-1, ... (a backward pass): the sequence backwards
)

// Options adjust a Pager.
type Options struct {
	// PrefetchDepth overrides the plan's prefetch depth when > 0; < 0
	// turns prefetch off.
	PrefetchDepth int
	// PrefetchFill makes prefetch go on past the depth layers, along the
	// sequence, as far as the ring has room for the parts ahead: with
	// layers computed elsewhere between the pager's (on the CPU, in
	// hybrid decode), the copies of the next streamed parts then keep
	// the link busy for the whole time the pager's layers are away, not
	// only for depth of them. Each prefetch that ends starts the next
	// ones, so the ring fills while nobody acquires. It needs a prefetch
	// depth > 0.
	PrefetchFill bool
	// HostCacheBytes bounds the host RAM that keeps streamed layers
	// between uses and stages the others (the staging ring, StagingSlots):
	// 0 takes the plan's HostCacheBytes, and its StagingBytes for a
	// staging ring when the pager sets one up; < 0 keeps none (every
	// streamed load reads the source into pageable memory). Beyond it,
	// layers are re-read from the source.
	HostCacheBytes int64
	// Order is the initial prefetch order (SetOrder changes it).
	Order Order
	// HostLayers are the layers computed on the CPU from host memory
	// (HostLayer). Each must be streamed whole by the plan
	// (WithStreamedWhole). NewPager reserves their host copies under
	// HostCacheBytes, so that other streamed parts never take their room,
	// and fails with an error wrapping ErrHostMemory when they do not fit.
	HostLayers []int
	// Pinned, when set, is where the pager's page-locked host memory
	// comes from (its host copies, the staging ring, the experts' arena)
	// instead of the backend: a caller that builds a pager again can
	// keep the first one's buffers through it (pinning runs at about
	// 2 GB/s on the H200's host).
	Pinned tensor.PinnedAllocator
	// StagingSlots overrides the buffers of the staging ring when > 0; < 0
	// turns it off. 0 takes one per load that runs at once (the prefetch
	// depth plus one), at most three. The ring is set up only on a
	// backend with pinned memory and staged uploads
	// (tensor.StagedUploader), when the host cache cannot keep every
	// streamed part, and takes its bytes from HostCacheBytes first: as
	// many buffers as fit, each the size of the largest streamed part.
	StagingSlots int
	// StagingReaders is the goroutines that read the staged parts, shared
	// by every load, when > 0; 0 takes one per core the process may use
	// (runtime.GOMAXPROCS).
	StagingReaders int
	// StagingPiece is the bytes of the pieces a RangeSource's large
	// tensors are read and copied in through the staging ring (whole
	// rows, at least one), when > 0; 0 takes 16 MiB.
	StagingPiece int64
	// NoMappedUploads keeps the staging ring from copying the tensors of
	// a MappedSource straight from their page-locked mapping
	// (tensor.HostRegistrar): every tensor is then read into the ring.
	NoMappedUploads bool
	// ExpertPolicy chooses the experts the expert cache evicts, when the
	// plan has one (WithExpertCache); empty is DefaultExpertPolicy.
	// PrefetchDepth < 0 turns PrefetchExperts off too.
	ExpertPolicy ExpertPolicy
	// ExpertsCPU says when ExpertsOnCPU hands missing experts to the CPU
	// (ExpertCPUAuto, ExpertCPUNever, ExpertCPUAlways); empty is never,
	// for a pager whose caller has no CPU to compute with.
	ExpertsCPU ExpertCPUPolicy
	// Rates are the machine's, which ExpertCPUAuto decides with; nil
	// leaves every expert to the device.
	Rates *Rates
}

// ErrHostMemory is wrapped by NewPager, HostLayer and PlanHybrid when the
// host memory limit (Options.HostCacheBytes, -host-memory-limit) cannot hold
// the layers the CPU computes.
var ErrHostMemory = errors.New("host memory limit too small for the CPU's layers")

var (
	errClosed          = errors.New("paging: pager closed")
	errPrefetchSkipped = errors.New("paging: prefetch skipped: no room in the ring")
)

// Pager keeps a model's layers on the device under a Budget: the layers the
// plan makes resident stay once loaded, the streamed parts pass through a
// ring, and the next layers in the access order are prefetched while the
// current one computes. Host RAM caches streamed parts up to a byte bound;
// beyond it they are re-read from the Source.
//
// The ring is one device allocation of the plan's RingBytes, made by
// NewPager and charged to StreamedWeights; every streamed tensor is a view
// into it at an offset aligned to ringAlign bytes, so that streaming
// allocates and frees nothing. Parts go into the ring one after the other,
// in the order they load, wrapping to its start; a part evicts the parts
// in its way. Decoding walks the layers in a cycle, so the parts in the way
// are the oldest and never the ones about to be used, and the ring never
// fragments: Plan sizes it for that walk (PlanResult.RingBytes).
//
// Prefetch follows the layer acquired last: the depth layers after it in
// the sequence (SetSequence) load while it computes, and once it is
// released, the next one too, so that copies go on while the caller
// computes elsewhere (layers on the CPU) before its next Acquire. With
// Options.PrefetchFill, the layers after those load too, as far as the
// ring has room, each prefetch that ends starting the next.
//
// Acquire pins a layer (it is never evicted while pinned) and Release
// unpins it. Concurrent Acquires of one layer load it once. Parts that are
// neither pinned nor in the ring are evicted least recently used first when
// the budget needs room, across every evictor of the budget: the Pager
// registers itself with its Budget as an Evictor until Close.
//
// A Pager is safe for concurrent use.
type Pager struct {
	src        Source
	bg         *Budget
	b          tensor.Memory
	plan       *PlanResult
	id         int
	depth      int
	fill       bool // Options.PrefetchFill
	layers     []*entry
	order      atomic.Int32
	seq        atomic.Pointer[sequence] // nil: every layer in order
	pinned     tensor.PinnedAllocator   // nil when the backend has none
	async      tensor.AsyncUploader     // nil when the backend has none
	reads      readBufs
	stage      *staging     // the staging ring; nil without one
	unregister func()       // removes the pager from its budget's evictors
	ex         *expertCache // nil without experts in the plan
	expertsCPU ExpertCPUPolicy
	rates      *Rates

	life     context.Context // cancelled by Close
	stopLife context.CancelFunc
	sf       singleflight.Group
	pf       errgroup.Group

	mu           sync.Mutex
	cond         *sync.Cond
	ring         *tensor.Tensor // the slab streamed tensors are views into; nil when nothing streams
	ringCap      int64          // its bytes, a multiple of ringAlign
	ringHead     int64          // where the next part goes
	ringUsed     int64          // bytes held by placed parts, wrap gaps included
	hostCap      int64
	hostUsed     int64 // bytes of host copies held
	hostReserved int64 // bytes reserved for host layers not yet read
	pinnedBytes  int64
	stageBytes   int64 // the staging ring's buffers, charged to hostCap
	inflight     int
	cursor       int    // the layer acquired last: prefetch follows it
	advanced     bool   // the cursor was released since: prefetch follows the layer after it
	changes      uint64 // counts releases, evictions and finished loads
	closed       bool
	st           Stats
	steps        steps
	prefetchWait time.Duration
	demandWait   time.Duration
	stagingWait  time.Duration
}

// ringAlign is the alignment of every tensor in the ring: 256 bytes serves
// the wide loads of every backend's kernels (tensor.View).
const ringAlign = 256

func alignUp(n int64) int64 { return (n + ringAlign - 1) &^ (ringAlign - 1) }

// hostAlign is the alignment of every tensor in a host copy of a streamed
// part: host tensors viewed in it (HostLayer) are aligned for any element
// type and for the CPU's wide loads. Host copies take their tensors' bytes
// each so padded, and the host cache counts them so.
const hostAlign = 64

func alignHost(n int64) int64 { return (n + hostAlign - 1) &^ (hostAlign - 1) }

type entry struct {
	layer    int
	specs    []TensorSpec
	res, str []int   // indices into specs: resident and streamed tensors
	strOff   []int64 // offsets of the streamed tensors in the host cache's buffer, each hostAlign-aligned
	resBytes int64
	strBytes int64
	hostSize int64 // the host cache's buffer for the streamed part: its tensors, each padded to hostAlign
	strSlab  int64 // bytes of the streamed part laid out in the ring, each tensor aligned
	// strBySize orders the streamed tensors (indices into str) largest
	// first, as layout places them.
	strBySize []int

	resT, strT []*tensor.Tensor
	resLoaded  bool
	strLoaded  bool
	// slot is the streamed part's place in the ring, reserved while it
	// loads; strT are views into it. nil when the part is not in the ring
	// (then, if loaded, strT are allocations of their own).
	slot       *ringSlot
	host       []byte // streamed part cached in host RAM, or nil
	hostPinned bool
	// held marks a host layer (Options.HostLayers, HostLayer): its host
	// copy, once read, stays until Close, and its room is reserved until
	// then. hostFilling is set while a load or HostLayer reads the host
	// copy.
	held, hostFilling bool
	// ready holds the waits of asynchronous uploads into the layer's
	// tensors that no compute has been ordered after yet; the first
	// Acquire (or an eviction) runs them.
	ready []func() error

	// shared are the tensors (indices into specs) the layer borrows from
	// its lender's copy (LayerPlan.Shared): neither in res nor in str.
	// lender is that layer, or -1; lentRes says the tensors are in the
	// lender's resident part.
	shared   []int
	lender   int
	lentRes  bool
	lentPins int // pins of the lender held for this layer's acquires

	pins, waiters int
	loading       bool
	queued        bool // a prefetch of the layer is started and has not returned
	lastUse       uint64
}

func (e *entry) loaded() bool { return e.resLoaded && e.strLoaded }

// orderForRing orders the streamed tensors largest first, as layout
// places them.
func (e *entry) orderForRing() {
	e.strBySize = make([]int, len(e.str))
	for k := range e.strBySize {
		e.strBySize[k] = k
	}
	slices.SortStableFunc(e.strBySize, func(a, b int) int {
		return cmp.Compare(e.specs[e.str[b]].Bytes, e.specs[e.str[a]].Bytes)
	})
}

// ringLoaded reports a streamed part loaded into the ring.
func (e *entry) ringLoaded() bool { return e.strLoaded && e.slot != nil && len(e.str) > 0 }

// heldOutside reports a streamed part loaded outside the ring, in
// allocations charged to StreamedWeights.
func (e *entry) heldOutside() bool { return e.strLoaded && e.slot == nil && len(e.str) > 0 }

// part names a layer's resident or streamed tensors.
type part int

const (
	residentPart part = iota
	streamedPart
)

func (e *entry) tensors(pt part) []int {
	if pt == streamedPart {
		return e.str
	}
	return e.res
}

// ringSlot is a streamed part's place in the ring: [start, end), where an
// end past the ring's size means the part wraps and also holds
// [0, end-size); offs are its tensors' offsets.
type ringSlot struct {
	start, end int64
	offs       []int64
}

// spans are the slot's byte ranges in a ring of size n.
func (s *ringSlot) spans(n int64) [][2]int64 {
	if s.end <= n {
		return [][2]int64{{s.start, s.end}}
	}
	return [][2]int64{{s.start, n}, {0, s.end - n}}
}

func (s *ringSlot) overlaps(o *ringSlot, n int64) bool {
	for _, a := range s.spans(n) {
		for _, b := range o.spans(n) {
			if a[0] < b[1] && b[0] < a[1] {
				return true
			}
		}
	}
	return false
}

// NewPager prepares to page src's layers on budget's device as plan says. It
// allocates the ring at once; layers load on first Acquire. It registers
// the pager with the budget as an Evictor: Close the pager before the
// budget.
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
	if au, ok := tensor.AsyncUpload(p.b); ok {
		p.async = au
	}
	if pa, ok := tensor.Pinned(p.b); ok {
		p.pinned = pa
	}
	if opts.Pinned != nil {
		p.pinned = opts.Pinned
	}
	switch {
	case opts.PrefetchDepth > 0:
		p.depth = opts.PrefetchDepth
	case opts.PrefetchDepth < 0:
		p.depth = 0
	}
	p.depth = min(p.depth, n-1)
	p.fill = opts.PrefetchFill && p.depth > 0
	switch {
	case opts.HostCacheBytes > 0:
		p.hostCap = opts.HostCacheBytes
	case opts.HostCacheBytes == 0:
		p.hostCap = plan.HostCacheBytes
	}
	p.order.Store(int32(opts.Order))
	if opts.ExpertsCPU != "" {
		if _, err := ParseExpertCPUPolicy(string(opts.ExpertsCPU)); err != nil {
			return nil, err
		}
	}
	p.expertsCPU = opts.ExpertsCPU
	if opts.Rates != nil {
		r := *opts.Rates
		p.rates = &r
	}
	var es ExpertSource
	var experts [][][]string // each layer's experts' tensors, with an expert cache
	if plan.Experts > 0 {
		var ok bool
		if es, ok = src.(ExpertSource); !ok {
			return nil, fmt.Errorf("paging: plan has an expert cache, the source lists no experts")
		}
		experts = make([][][]string, n)
	}
	var ringNeed int64
	ringNeedLayer := 0
	for l := range n {
		specs := slices.Clone(src.LayerTensors(l))
		if err := checkSpecs(l, specs); err != nil {
			return nil, err
		}
		e := &entry{layer: l, specs: specs, lender: -1}
		lp := plan.Layers[l]
		var total int64
		for _, s := range specs {
			total += s.Bytes
		}
		isShared := map[string]bool{}
		var sharedBytes int64
		if sh := lp.Shared; sh != nil {
			if sh.From < 0 || sh.From >= n || sh.From == l {
				return nil, fmt.Errorf("paging: layer %d: plan shares its tensors with layer %d: have layers 0..%d", l, sh.From, n-1)
			}
			e.lender = sh.From
			for _, name := range sh.Names {
				isShared[name] = true
			}
		}
		if total != lp.Bytes {
			return nil, fmt.Errorf("paging: layer %d: plan says %d bytes, source has %d", l, lp.Bytes, total)
		}
		isExpert := map[string]bool{}
		if es != nil {
			names := es.LayerExperts(l)
			if err := checkExperts(l, specs, names, es.LayerRouting(l)); err != nil {
				return nil, err
			}
			if len(names) != lp.Experts {
				return nil, fmt.Errorf("paging: layer %d: plan caches %d experts, source has %d", l, lp.Experts, len(names))
			}
			size := make(map[string]int64, len(specs))
			for _, s := range specs {
				size[s.Name] = s.Bytes
			}
			var bytes int64
			for _, ns := range names {
				for _, name := range ns {
					isExpert[name] = true
					bytes += size[name]
				}
			}
			if bytes != lp.ExpertBytes {
				return nil, fmt.Errorf("paging: layer %d: plan caches %d bytes of experts, source has %d", l, lp.ExpertBytes, bytes)
			}
			experts[l] = names
		}
		streamed := map[string]bool{}
		for _, name := range lp.Streamed {
			streamed[name] = true
		}
		for i, s := range specs {
			if isShared[s.Name] {
				e.shared = append(e.shared, i)
				sharedBytes += s.Bytes
				delete(isShared, s.Name)
			}
		}
		if len(isShared) > 0 || lp.Shared != nil && sharedBytes != lp.Shared.Bytes {
			return nil, fmt.Errorf("paging: layer %d: plan shares tensors %v (%d bytes) with layer %d, the source's layer has %d bytes of them", l, lp.Shared.Names, lp.Shared.Bytes, lp.Shared.From, sharedBytes)
		}
		all := len(lp.Streamed) == 0 && lp.StreamedBytes == total-sharedBytes && total > sharedBytes
		for i, s := range specs {
			if isExpert[s.Name] || slices.Contains(e.shared, i) {
				continue // in the expert cache, or the lender's
			}
			if all || streamed[s.Name] {
				e.strOff = append(e.strOff, e.hostSize)
				e.str = append(e.str, i)
				e.strBytes += s.Bytes
				e.hostSize += alignHost(s.Bytes)
				e.strSlab += alignUp(s.Bytes)
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
		e.orderForRing()
		e.resLoaded = len(e.res) == 0
		e.strLoaded = len(e.str) == 0
		if e.strSlab > ringNeed {
			ringNeed, ringNeedLayer = e.strSlab, l
		}
		p.layers = append(p.layers, e)
	}
	if err := p.checkLenders(); err != nil {
		return nil, err
	}
	if err := p.reserveHostLayers(opts.HostLayers); err != nil {
		return nil, err
	}
	p.ringCap = plan.RingBytes &^ (ringAlign - 1)
	if ringNeed > p.ringCap {
		return nil, fmt.Errorf("paging: plan's ring of %d bytes cannot hold layer %d's streamed part (%d bytes with each tensor %d-byte aligned)",
			plan.RingBytes, ringNeedLayer, ringNeed, ringAlign)
	}
	if p.ringCap > 0 {
		ring, err := budget.alloc(StreamedWeights, tensor.F32, tensor.Shape{int(p.ringCap / 4)}, -1, mayEvict)
		if err != nil {
			return nil, fmt.Errorf("paging: allocating the ring: %w", err)
		}
		p.ring = ring
	}
	if experts != nil {
		if err := p.newExpertCache(experts, opts); err != nil {
			budget.Free(p.ring)
			return nil, err
		}
	}
	planned := int64(0) // the plan's staging bytes, beside the host limit it takes
	if opts.HostCacheBytes == 0 {
		planned = plan.StagingBytes
	}
	p.newStaging(opts, planned)
	p.mapExperts(opts)
	p.life, p.stopLife = context.WithCancel(context.Background())
	p.lookUpExperts()
	p.pf.SetLimit(p.depth + 1) // one more than the depth: a stale prefetch may still hold a slot
	if p.fill {
		// As many as the walk ahead: the ring's room bounds them. With
		// depth+1, the loads of a fill that end together each found the
		// others' slots taken and started nothing more.
		p.pf.SetLimit(n + 1)
	}
	p.id = budget.newPagerID()
	p.unregister = budget.Register(pagerEvictor{p})
	return p, nil
}

// checkLenders checks that each layer's shared tensors are its lender's
// own, alike, and notes where the lender keeps them.
func (p *Pager) checkLenders() error {
	for _, e := range p.layers {
		if e.lender < 0 {
			continue
		}
		a := p.layers[e.lender]
		if a.lender >= 0 {
			return fmt.Errorf("paging: layer %d: plan shares its tensors with layer %d, which shares tensors of its own with layer %d", e.layer, a.layer, a.lender)
		}
		e.lentRes = true
		for _, i := range e.shared {
			s := e.specs[i]
			k := slices.IndexFunc(a.specs, func(o TensorSpec) bool { return o.Name == s.Name })
			if k < 0 || a.specs[k].DType != s.DType || !a.specs[k].Shape.Equal(s.Shape) {
				return fmt.Errorf("paging: layer %d: plan shares tensor %s with layer %d, which has no such %v %v tensor", e.layer, s.Name, a.layer, s.DType, s.Shape)
			}
			if !slices.Contains(a.res, k) {
				e.lentRes = false
			}
		}
	}
	return nil
}

// reserveHostLayers marks the host layers and reserves their room in the
// host cache.
func (p *Pager) reserveHostLayers(layers []int) error {
	var need int64
	for _, l := range layers {
		if l < 0 || l >= len(p.layers) {
			return fmt.Errorf("paging: host layer %d: have layers 0..%d", l, len(p.layers)-1)
		}
		e := p.layers[l]
		if e.held {
			return fmt.Errorf("paging: host layer %d listed twice", l)
		}
		if err := e.checkHostLayer(); err != nil {
			return err
		}
		e.held = true
		need += e.hostSize
	}
	if need > p.hostCap {
		return fmt.Errorf("paging: host layers %v: %w: they take %s (%d bytes) of host memory, the limit is %s (%d bytes)",
			layers, ErrHostMemory, FormatSize(need), need, FormatSize(p.hostCap), p.hostCap)
	}
	p.hostReserved = need
	return nil
}

// checkHostLayer refuses a layer the plan keeps in part on the device.
func (e *entry) checkHostLayer() error {
	if len(e.res) > 0 {
		return fmt.Errorf("paging: host layer %d: the plan keeps %s of it resident; only a layer streamed whole is computed from host memory (WithStreamedWhole)",
			e.layer, FormatSize(e.resBytes))
	}
	if len(e.shared) > 0 {
		return fmt.Errorf("paging: host layer %d: the plan shares %d of its tensors with layer %d's device copy; a plan WithStreamedWhole shares nothing", e.layer, len(e.shared), e.lender)
	}
	return nil
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

// Resident reports whether the layer is wholly resident and loaded now:
// none of its tensors is streamed (its shared ones are in its lender's
// resident part), so an Acquire neither loads it nor takes a ring slot,
// and its tensors keep their addresses until the budget evicts it.
func (p *Pager) Resident(layer int) bool {
	if layer < 0 || layer >= len(p.layers) {
		return false
	}
	e := p.layers[layer]
	if len(e.str) > 0 || e.lender >= 0 && !e.lentRes {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return e.loaded() && (e.lender < 0 || p.layers[e.lender].resLoaded)
}

// SetOrder sets the direction prefetch follows from now on.
func (p *Pager) SetOrder(o Order) { p.order.Store(int32(o)) }

// SetSequence sets the cyclic order of layers that prefetch follows from
// now on (Forward: as listed; Reverse: backwards); nil or empty restores
// every layer, 0..n-1. Layers left out are never prefetched: decoding with
// some layers computed on the CPU (HostLayer) sets the sequence of the
// others, so that the copies of the next streamed layers run while the CPU
// computes, and the layers the CPU computes are never uploaded. A layer
// outside the sequence that is acquired anyway prefetches the layers of the
// sequence that follow it by number. The ring holds any PrefetchDepth+1
// consecutive layers of 0..n-1; for a sequence it holds those of the
// sequence when the plan was made WithSequence of it (PlanHybrid does).
// Prefetches under way for layers the new sequence leaves out finish or
// are dropped; parts loaded in the old order may stand in the way of the
// new walk for up to two passes, during which a prefetch may find no room
// (its layer then loads on demand). Set the sequence before the last
// Release of the pass before, or the prefetch after that Release follows
// the old order. It refuses a layer out of range or listed twice.
func (p *Pager) SetSequence(layers []int) error {
	n := len(p.layers)
	if len(layers) == 0 {
		p.seq.Store(nil)
		return nil
	}
	s := &sequence{layers: slices.Clone(layers), pos: make([]int, n), after: make([]int, n), before: make([]int, n)}
	for l := range s.pos {
		s.pos[l] = -1
	}
	for i, l := range layers {
		if l < 0 || l >= n {
			return fmt.Errorf("paging: sequence: layer %d: have layers 0..%d", l, n-1)
		}
		if s.pos[l] >= 0 {
			return fmt.Errorf("paging: sequence: layer %d listed twice", l)
		}
		s.pos[l] = i
	}
	// For a layer outside the sequence, the sequence's layers nearest
	// above and below it by number, cyclically.
	for l := range n {
		s.after[l], s.before[l] = -1, -1
		for k := 1; k < n && (s.after[l] < 0 || s.before[l] < 0); k++ {
			if i := s.pos[(l+k)%n]; i >= 0 && s.after[l] < 0 {
				s.after[l] = i
			}
			if i := s.pos[(l-k+n)%n]; i >= 0 && s.before[l] < 0 {
				s.before[l] = i
			}
		}
	}
	p.seq.Store(s)
	return nil
}

// Sequence returns the cyclic order of layers prefetch follows now
// (SetSequence): every layer in order when none was set.
func (p *Pager) Sequence() []int {
	if s := p.seq.Load(); s != nil {
		return slices.Clone(s.layers)
	}
	all := make([]int, len(p.layers))
	for l := range all {
		all[l] = l
	}
	return all
}

// sequence is a cyclic order of some of the layers (SetSequence).
type sequence struct {
	layers []int
	pos    []int // each layer's index in layers, or -1
	// after and before are, for a layer outside layers, the index in
	// layers of the nearest layer above and below it by number.
	after, before []int
}

// next is the k-th layer after layer in the access order, k >= 1.
func (p *Pager) next(layer, k int) int {
	rev := Order(p.order.Load()) == Reverse
	s := p.seq.Load()
	if s == nil {
		n := len(p.layers)
		if rev {
			return ((layer-k)%n + n) % n
		}
		return (layer + k) % n
	}
	m := len(s.layers)
	i := s.pos[layer]
	switch {
	case i < 0 && rev:
		i, k = s.before[layer], k-1
	case i < 0:
		i, k = s.after[layer], k-1
	}
	if rev {
		return s.layers[((i-k)%m+m)%m]
	}
	return s.layers[(i+k)%m]
}

// window is the layer and the depth layers after it in the access order
// (fewer when the sequence is shorter).
func (p *Pager) window(layer int) []int { return p.walk(layer, p.depth, -1) }

// walk is the layer and up to k layers after it in the access order,
// ending before a layer met already or before stop.
func (p *Pager) walk(layer, k, stop int) []int {
	w := []int{layer}
	var seen []bool // for a long walk; a short one looks in w
	if k > 8 {
		seen = make([]bool, len(p.layers))
		seen[layer] = true
	}
	for i := 1; i <= k; i++ {
		j := p.next(layer, i)
		if j == stop || seen != nil && seen[j] || seen == nil && slices.Contains(w, j) {
			break
		}
		if seen != nil {
			seen[j] = true
		}
		w = append(w, j)
	}
	return w
}

// aheadLocked returns the layers prefetch loads now, and those its loads
// must not evict: the depth layers after the cursor, sparing the cursor
// too while it is acquired; once it is released, the layer after it and
// the depth layers after that one, so that the copies go on while the
// caller computes elsewhere (on the CPU) before its next Acquire. With
// PrefetchFill the targets go on along the sequence up to the cursor (the
// ring's room ends them: prefetchLocked).
func (p *Pager) aheadLocked() (targets, protect []int) {
	k := p.depth
	if p.fill {
		k = len(p.layers)
	}
	if p.advanced {
		w := p.walk(p.next(p.cursor, 1), k, p.cursor)
		return w, p.withLenders(w)
	}
	w := p.walk(p.cursor, k, -1)
	return w[1:], p.withLenders(w)
}

// withLenders returns layers and the lenders of those that borrow
// tensors (LayerPlan.Shared): a borrower's Acquire needs its lender on the
// device too, so a load must not evict it (the plan sized the ring for
// the lender beside the borrower's window).
func (p *Pager) withLenders(layers []int) []int {
	out := layers
	for _, l := range layers {
		if a := p.layers[l].lender; a >= 0 && !slices.Contains(out, a) {
			if len(out) == len(layers) {
				out = slices.Clone(layers)
			}
			out = append(out, a)
		}
	}
	return out
}

// Acquire returns the layer's tensors by name, loading the layer if it is
// not on the device, and pins it until the matching Release. The tensors
// keep their stored dtype. The map is the caller's; the tensors are the
// pager's and stay valid until Release (or Close). Acquire then starts
// prefetching the next layers in the access order.
//
// A layer that shares tensors with the layer before it (LayerPlan.Shared:
// tied embeddings) gets them from that layer's copy, which it pins too
// (its resident part alone when they are resident) until the matching
// Release. It waits for either layer's load holding no pin, and pins both
// at once.
func (p *Pager) Acquire(ctx context.Context, layer int) (map[string]*tensor.Tensor, error) {
	var m map[string]*tensor.Tensor
	err := p.acquire(ctx, layer, func(e *entry, lent map[string]*tensor.Tensor) {
		m = make(map[string]*tensor.Tensor, len(e.specs))
		for k, i := range e.res {
			m[e.specs[i].Name] = e.resT[k]
		}
		for k, i := range e.str {
			m[e.specs[i].Name] = e.strT[k]
		}
		maps.Copy(m, lent)
	})
	return m, err
}

// PinLayer pins a layer as Acquire does, until the matching Release,
// without handing out its tensors: it appends to fp where each of them
// starts (tensor.Tensor.Addr), 8 bytes each, in an order fixed for the
// layer. Two pins
// of a layer append the same bytes exactly when its tensors are where
// they were: what a captured decode graph needs to know before it is
// replayed, at the cost of no map (nn's runs of resident blocks).
func (p *Pager) PinLayer(ctx context.Context, layer int, fp []byte) ([]byte, error) {
	err := p.acquire(ctx, layer, func(e *entry, lent map[string]*tensor.Tensor) {
		for _, t := range e.resT {
			fp = binary.LittleEndian.AppendUint64(fp, uint64(t.Addr()))
		}
		for _, t := range e.strT {
			fp = binary.LittleEndian.AppendUint64(fp, uint64(t.Addr()))
		}
		for _, i := range e.shared {
			fp = binary.LittleEndian.AppendUint64(fp, uint64(lent[e.specs[i].Name].Addr()))
		}
	})
	return fp, err
}

// acquire is Acquire and PinLayer: it loads the layer if it is not on the
// device, pins it, and calls use with the layer and the tensors its
// lender lends it while it holds the lock, then starts prefetching the
// next layers in the access order.
func (p *Pager) acquire(ctx context.Context, layer int, use func(e *entry, lent map[string]*tensor.Tensor)) error {
	if layer < 0 || layer >= len(p.layers) {
		return fmt.Errorf("paging: acquire layer %d: have layers 0..%d", layer, len(p.layers)-1)
	}
	e := p.layers[layer]
	start := time.Now()
	missed, joined := false, false
	p.mu.Lock()
	for {
		if p.closed {
			p.mu.Unlock()
			return fmt.Errorf("paging: acquire layer %d: %w", layer, errClosed)
		}
		if e.loaded() {
			if err := e.awaitUploads(); err != nil {
				// The copies never landed: drop the layer's parts so that
				// no Acquire hands them out and the next one reloads them.
				p.evictHeldLocked(e)
				if e.ringLoaded() {
					p.evictRingLocked(e)
				}
				p.mu.Unlock()
				return fmt.Errorf("paging: acquire layer %d: %w", layer, err)
			}
			lent, err := p.lendLocked(ctx, e, false)
			if err == errLenderLoaded {
				continue // the lender was loaded: look again
			}
			if err != nil {
				p.mu.Unlock()
				return fmt.Errorf("paging: acquire layer %d: %w", layer, err)
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
			use(e, lent)
			p.cursor, p.advanced = layer, false
			p.prefetchLocked()
			p.mu.Unlock()
			if !missed {
				p.bg.record(Event{Kind: EventHit, Layer: layer, Pager: p.id})
			}
			return nil
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
				return fmt.Errorf("paging: acquire layer %d: %w", layer, ctx.Err())
			}
			if errors.Is(err, errPrefetchSkipped) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				continue // a load started by someone else gave up: load it ourselves
			}
			p.mu.Unlock()
			return err
		}
	}
}

// errLenderLoaded is lendLocked's word that it loaded the lender, and let
// go of the lock to do it.
var errLenderLoaded = errors.New("paging: lender loaded")

// lendLocked pins e's lender for an Acquire of e (resident: an
// AcquireResident) and returns the shared tensors it holds: its resident
// part must be on the device, and, unless the shared tensors are there or
// resident is set, its streamed part too. Layers without a lender need
// nothing. When the lender lacks a part, lendLocked loads it, holding no
// pin and letting go of the lock meanwhile, and returns errLenderLoaded:
// the caller looks at e again.
func (p *Pager) lendLocked(ctx context.Context, e *entry, resident bool) (map[string]*tensor.Tensor, error) {
	if e.lender < 0 {
		return nil, nil
	}
	a := p.layers[e.lender]
	resOnly := resident || e.lentRes
	if !a.resLoaded || !resOnly && !a.strLoaded {
		mode := loadDemand
		if resOnly {
			mode = loadResident
		}
		a.waiters++
		p.mu.Unlock()
		err := p.loadShared(ctx, a.layer, mode)
		p.mu.Lock()
		a.waiters--
		p.changedLocked()
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return nil, fmt.Errorf("the tensors it shares with layer %d: %w", a.layer, ctx.Err())
		case errors.Is(err, errPrefetchSkipped) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
			// a load started by someone else gave up: look again
		default:
			return nil, fmt.Errorf("the tensors it shares with layer %d: %w", a.layer, err)
		}
		return nil, errLenderLoaded
	}
	if err := a.awaitUploads(); err != nil {
		p.evictHeldLocked(a)
		if a.ringLoaded() {
			p.evictRingLocked(a)
		}
		return nil, fmt.Errorf("the tensors it shares with layer %d: %w", a.layer, err)
	}
	a.pins++
	a.lastUse = p.bg.Stamp()
	e.lentPins++
	lent := make(map[string]*tensor.Tensor, len(e.shared))
	for _, i := range e.shared {
		name := e.specs[i].Name
		for k, j := range a.res {
			if a.specs[j].Name == name {
				lent[name] = a.resT[k]
			}
		}
		for k, j := range a.str {
			if a.specs[j].Name == name && !resOnly {
				lent[name] = a.strT[k]
			}
		}
	}
	return lent, nil
}

// AcquireResident returns the tensors the plan keeps resident of the
// layer, loading them if they are not on the device (its streamed part is
// left as it is), and pins the layer until the matching Release, as
// Acquire does. Planned WithExpertCache, a layer's routing tensors are
// among them: a user guesses the experts of a layer ahead of it from
// these, without waiting for its streamed part. The map is the caller's.
// A layer that shares tensors with the layer before it pins that layer's
// resident part too, and its map has the shared tensors when they are
// there.
func (p *Pager) AcquireResident(ctx context.Context, layer int) (map[string]*tensor.Tensor, error) {
	if layer < 0 || layer >= len(p.layers) {
		return nil, fmt.Errorf("paging: acquire layer %d: have layers 0..%d", layer, len(p.layers)-1)
	}
	e := p.layers[layer]
	p.mu.Lock()
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, fmt.Errorf("paging: acquire the resident part of layer %d: %w", layer, errClosed)
		}
		if e.resLoaded {
			if err := e.awaitUploads(); err != nil {
				p.evictHeldLocked(e)
				if e.ringLoaded() {
					p.evictRingLocked(e)
				}
				p.mu.Unlock()
				return nil, fmt.Errorf("paging: acquire the resident part of layer %d: %w", layer, err)
			}
			lent, err := p.lendLocked(ctx, e, true)
			if err == errLenderLoaded {
				continue
			}
			if err != nil {
				p.mu.Unlock()
				return nil, fmt.Errorf("paging: acquire the resident part of layer %d: %w", layer, err)
			}
			e.pins++
			e.lastUse = p.bg.Stamp()
			m := make(map[string]*tensor.Tensor, len(e.res))
			for k, i := range e.res {
				m[e.specs[i].Name] = e.resT[k]
			}
			maps.Copy(m, lent)
			p.mu.Unlock()
			return m, nil
		}
		e.waiters++
		p.mu.Unlock()
		err := p.loadShared(ctx, layer, loadResident)
		p.mu.Lock()
		e.waiters--
		p.changedLocked()
		if err != nil {
			if ctx.Err() != nil {
				p.mu.Unlock()
				return nil, fmt.Errorf("paging: acquire the resident part of layer %d: %w", layer, ctx.Err())
			}
			if errors.Is(err, errPrefetchSkipped) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				continue // a load started by someone else gave up: load it ourselves
			}
			p.mu.Unlock()
			return nil, err
		}
	}
}

// Release unpins a layer from Acquire (or AcquireResident), and the layer
// it borrows shared tensors from. Releasing a layer that is not pinned
// does nothing (and is counted in Stats.BadReleases).
func (p *Pager) Release(layer int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if layer < 0 || layer >= len(p.layers) || p.layers[layer].pins == 0 {
		p.st.BadReleases++
		return
	}
	p.releaseLocked(layer, false)
	if e := p.layers[layer]; e.lentPins > 0 {
		e.lentPins--
		p.releaseLocked(e.lender, true)
	}
}

// releaseLocked unpins a pinned layer; lend releases a lender, which
// leaves prefetch as it is.
func (p *Pager) releaseLocked(layer int, lend bool) {
	e := p.layers[layer]
	e.pins--
	e.lastUse = p.bg.Stamp()
	if e.pins == 0 {
		p.changedLocked()
		if layer == p.cursor && !p.advanced && !lend {
			p.advanced = true
			p.prefetchLocked()
		}
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

// prefetchLocked starts loads of the layers ahead of the cursor
// (aheadLocked), in order, up to the first it cannot start: a later layer
// placed in the ring before an earlier one would leave the earlier one no
// room in the window's stretch of the ring. With PrefetchFill the layers
// past the depth ones are loaded as far as the ring has room.
func (p *Pager) prefetchLocked() {
	if p.depth <= 0 {
		return
	}
	targets, _ := p.aheadLocked()
	for i, j := range targets {
		mode := loadWindow
		if i >= p.depth {
			mode = loadFill
		}
		if !p.startPrefetchLocked(j, mode) {
			return
		}
	}
}

// startPrefetchLocked starts a background load of layer j and reports
// whether the layer is loaded or on its way with a place in the ring:
// false when there is no room, as many loads run as the group allows, or a
// load already under way has no place yet. The streamed part is placed in
// the ring here, in the order of the window, not when the load runs: loads
// run concurrently (and a queued one may run late), and parts placed out
// of order would leave a part that is not about to be used inside the
// window's stretch of the ring, where the next part may not fit. A
// prefetch load uses only the place made for it (load).
func (p *Pager) startPrefetchLocked(j int, mode loadMode) bool {
	e := p.layers[j]
	if p.closed {
		return false
	}
	if e.loaded() {
		return true
	}
	if e.loading || e.queued {
		return e.strLoaded || e.slot != nil
	}
	placed := false
	if !e.strLoaded && e.slot == nil && p.ring != nil {
		protect, _ := p.protectLocked(j, mode)
		if !p.placeLocked(e, protect, keepReserved) {
			if mode != loadFill { // the ring's end, for a fill
				p.st.PrefetchNoRoom++
			}
			return false
		}
		placed = true
	}
	if !p.pf.TryGo(func() error {
		err := p.loadShared(p.life, j, mode) // errors surface on Acquire
		p.mu.Lock()
		e.queued = false
		if p.fill && err == nil && !p.closed {
			p.prefetchLocked() // go on filling the ring: the caller may be away
		}
		p.mu.Unlock()
		return nil
	}) {
		if placed {
			p.releaseSlotLocked(e)
		}
		if mode != loadFill { // a fill goes on when a load ends
			p.st.PrefetchSkipped++
		}
		return false
	}
	e.queued = true
	p.st.Prefetches++
	return true
}

// loadMode says who asked for a load.
type loadMode int

const (
	loadDemand   loadMode = iota // Acquire
	loadWindow                   // prefetch of the depth layers after the cursor
	loadFill                     // prefetch past them, as far as the ring has room (PrefetchFill)
	loadExplicit                 // Prefetch
	loadResident                 // AcquireResident: the resident part alone
)

// protectLocked returns the layers whose ring parts a load of layer must
// not evict: for a demand load the layer and the depth layers after it,
// for a prefetch those ahead of the cursor (aheadLocked; and, for an
// explicit one, the layer; with PrefetchFill, those up to the layer).
// stale reports a window prefetch whose layer is no longer ahead.
func (p *Pager) protectLocked(layer int, mode loadMode) (protect []int, stale bool) {
	switch mode {
	case loadWindow, loadFill:
		targets, protect := p.aheadLocked()
		if p.fill {
			if i := slices.Index(protect, layer); i >= 0 {
				protect = protect[:i+1]
			}
		}
		return protect, !slices.Contains(targets, layer)
	case loadExplicit:
		_, protect := p.aheadLocked()
		return p.withLenders(append(slices.Clone(protect), layer)), false
	}
	return p.withLenders(p.window(layer)), false
}

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

// loadState is what a load has done so far: the bytes it uploaded, and the
// waits of its asynchronous uploads, which run before its tensors are used
// or freed.
type loadState struct {
	moved int64
	ready []func() error
}

// abandon runs the waits, for a load that gives up.
func (ld *loadState) abandon() {
	for _, r := range ld.ready {
		_ = r()
	}
	ld.ready = nil
}

// load brings the missing parts of a layer onto the device. On any error it
// leaves nothing behind.
//
// A prefetch never waits and never evicts the layers about to be used (the
// cursor's window); a window prefetch whose layer has left the window by
// the time it runs is dropped.
func (p *Pager) load(ctx context.Context, layer int, mode loadMode) (err error) {
	e := p.layers[layer]
	prefetch := mode != loadDemand && mode != loadResident
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return errClosed
	}
	if e.loaded() {
		p.mu.Unlock()
		return nil
	}
	protect, stale := p.protectLocked(layer, mode)
	needRes, needStr := !e.resLoaded, !e.strLoaded
	if mode == loadResident {
		needStr = false
		if !needRes {
			p.mu.Unlock()
			return nil
		}
	}
	if prefetch && needStr && e.slot == nil {
		// Its place went to a demand load, or was given back: placing
		// it now could put it before the layers due first.
		stale = true
	}
	if stale {
		p.st.PrefetchStale++
		if needStr && e.slot != nil {
			p.releaseSlotLocked(e) // placed when the prefetch started
		}
		p.mu.Unlock()
		return errPrefetchSkipped
	}
	e.loading = true
	p.inflight++
	p.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(p.life, cancel)
	committed := false
	defer func() {
		if err != nil && prefetch && !errors.Is(err, errPrefetchSkipped) {
			// an Acquire that joined this load retries with a load of its own
			err = fmt.Errorf("%w: %w", errPrefetchSkipped, err)
		}
		stop()
		cancel()
		if !committed {
			p.mu.Lock()
			p.endLoadLocked(e)
			p.mu.Unlock()
		}
	}()
	p.bg.record(Event{Kind: EventLoadStart, Layer: layer, Pager: p.id, Prefetch: prefetch})

	var resT, strT []*tensor.Tensor
	var ld loadState
	inRing := false
	fail := func(err error) error {
		ld.abandon()
		p.freeAll(resT)
		if !inRing {
			p.freeAll(strT)
		}
		if needStr {
			p.mu.Lock()
			if e.slot != nil { // reserved for this load
				p.releaseSlotLocked(e)
			}
			p.mu.Unlock()
		}
		p.bg.record(Event{Kind: EventLoadEnd, Layer: layer, Pager: p.id, Prefetch: prefetch, Bytes: ld.moved, Error: err.Error()})
		return err
	}
	evict := mayEvict
	if prefetch {
		evict = noEvict
	}
	for needRes {
		gen := p.generation()
		resT, err = p.loadResident(ctx, e, evict, &ld)
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
		inRing, err = p.ringReserve(ctx, e, protect)
		if err != nil {
			return fail(err)
		}
		if inRing {
			strT, err = p.loadStreamedInRing(ctx, e, &ld)
		} else {
			strT, err = p.loadStreamedOutside(ctx, e, &ld)
		}
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
		e.strT, e.strLoaded = strT, true
	}
	e.ready = append(e.ready, ld.ready...)
	e.lastUse = p.bg.Stamp()
	p.st.Loads++
	// The layer is evictable from now on: a load that ended is not one
	// under way.
	p.endLoadLocked(e)
	committed = true
	p.mu.Unlock()
	p.bg.record(Event{Kind: EventLoadEnd, Layer: layer, Pager: p.id, Prefetch: prefetch, Bytes: ld.moved})
	return nil
}

// endLoadLocked marks the end of a load of e.
func (p *Pager) endLoadLocked(e *entry) {
	e.loading = false
	p.inflight--
	p.changedLocked()
}

func (p *Pager) freeAll(ts []*tensor.Tensor) {
	for _, t := range ts {
		p.bg.Free(t)
	}
}

// ringReserve makes room for e's streamed part in the ring, unless a
// prefetch placed it already (startPrefetchLocked). A demand load spares
// the protected layers if it can and otherwise evicts any ring part that
// is not pinned. It returns false when no place works: the part then goes
// outside the ring.
func (p *Pager) ringReserve(ctx context.Context, e *entry, protect []int) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false, errClosed
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	switch {
	case e.slot != nil:
		return true, nil
	case p.ring == nil:
		return false, nil
	case p.placeLocked(e, protect, keepReserved), p.placeLocked(e, nil, takeReserved):
		return true, nil
	}
	p.st.OutsideRing++
	return false, nil
}

// layout lays e's streamed part out in the ring from start, each tensor at
// an aligned offset. A part that fits before the ring's end goes there
// whole, the largest tensor first. Otherwise the largest tensors that fit
// before the end go there and the others start again at offset 0, so that
// the bytes left unused at the end are fewer than the smallest tensor left
// out (wrapGaps); a part none of whose tensors fits before the end starts
// at offset 0, leaving those bytes out of its slot. It fails when the part
// would run into itself.
func (p *Pager) layout(e *entry, start int64) (*ringSlot, bool) {
	size := func(k int) int64 { return alignUp(e.specs[e.str[k]].Bytes) }
	s := &ringSlot{start: start, offs: make([]int64, len(e.str))}
	if start+e.strSlab <= p.ringCap {
		off := start
		for _, k := range e.strBySize {
			s.offs[k] = off
			off += size(k)
		}
		s.end = off
		return s, true
	}
	off := start
	var rest []int
	for _, k := range e.strBySize {
		if a := size(k); off+a <= p.ringCap {
			s.offs[k] = off
			off += a
		} else {
			rest = append(rest, k)
		}
	}
	if len(rest) == len(e.str) { // nothing before the end: start at 0
		s.start, rest = 0, e.strBySize
	}
	off = 0
	for _, k := range rest {
		s.offs[k] = off
		off += size(k)
	}
	if s.start == 0 {
		s.end = off
		return s, off <= p.ringCap
	}
	s.end = p.ringCap + off
	return s, off <= s.start
}

// placeLocked reserves room in the ring for e's streamed part, evicting the
// parts in its way, and reports whether it found any. It tries the head
// first: parts placed there one after the other, in the order they load,
// put the oldest parts in the way of a cyclic walk and leave no holes. When
// the head is blocked (the walk changed direction, several users share the
// pager) it tries offset 0 and the end of every placed part, and takes the
// place whose victims were used least recently. Parts pinned, loading,
// waited for or protected are never victims; a place reserved by a
// prefetch that has not started loading is one only with takeReserved (a
// demand load that found no other room: the prefetch, when it runs, finds
// its place gone and skips), since with concurrent users such reservations
// could otherwise fill the ring while nothing is loading.
func (p *Pager) placeLocked(e *entry, protect []int, reserved reservedPolicy) bool {
	if p.ring == nil {
		return false
	}
	type place struct {
		slot    *ringSlot
		victims []*entry
		newest  uint64 // the latest use among the victims
	}
	try := func(start int64) (place, bool) {
		s, ok := p.layout(e, start)
		if !ok {
			return place{}, false
		}
		pl := place{slot: s}
		for _, o := range p.layers {
			if o == e || o.slot == nil || !o.slot.overlaps(s, p.ringCap) {
				continue
			}
			if o.pins > 0 || o.waiters > 0 || o.loading || slices.Contains(protect, o.layer) || !o.strLoaded && reserved == keepReserved {
				return place{}, false
			}
			pl.victims = append(pl.victims, o)
			pl.newest = max(pl.newest, o.lastUse)
		}
		return pl, true
	}
	best, ok := try(p.ringHead)
	if !ok {
		starts := []int64{0}
		for _, o := range p.layers {
			if o.slot != nil {
				starts = append(starts, o.slot.end%p.ringCap)
			}
		}
		for _, st := range starts {
			if pl, found := try(st); found && (!ok || pl.newest < best.newest) {
				best, ok = pl, true
			}
		}
	}
	if !ok {
		return false
	}
	for _, v := range best.victims {
		if v.strLoaded {
			p.evictRingLocked(v)
		} else {
			p.releaseSlotLocked(v) // a prefetch's reservation
		}
	}
	e.slot = best.slot
	p.ringUsed += best.slot.end - best.slot.start
	p.ringHead = best.slot.end % p.ringCap
	return true
}

// reservedPolicy says whether placeLocked may take the places prefetches
// reserved and have not started loading into.
type reservedPolicy bool

const (
	keepReserved reservedPolicy = false
	takeReserved reservedPolicy = true
)

// releaseSlotLocked gives back a slot reserved for a load that did not
// happen. The head goes back to its start when it was the latest placed.
func (p *Pager) releaseSlotLocked(e *entry) {
	s := e.slot
	e.slot = nil
	p.ringUsed -= s.end - s.start
	if s.end%p.ringCap == p.ringHead {
		p.ringHead = s.start
	}
	p.changedLocked()
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

// evictable reports a layer whose parts hold budget bytes outside the ring
// and may be evicted now.
func (e *entry) evictable() bool {
	if e.pins > 0 || e.waiters > 0 || e.loading {
		return false
	}
	return e.resLoaded && len(e.res) > 0 || e.heldOutside()
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
			p.evictHeldLocked(e)
			return true
		}
	}
	return false
}

// evictRingLocked drops a layer's streamed part from the ring.
func (p *Pager) evictRingLocked(e *entry) {
	// Order later uses of the memory after copies still landing in it.
	_ = e.awaitUploads()
	s := e.slot
	e.strT, e.strLoaded, e.slot = nil, false, nil
	p.ringUsed -= s.end - s.start
	p.st.Evictions++
	p.changedLocked()
	p.bg.record(Event{Kind: EventEvict, Layer: e.layer, Pager: p.id, Bytes: e.strBytes})
}

// evictHeldLocked frees the parts of a layer that hold budget bytes: its
// resident part and a streamed part held outside the ring.
func (p *Pager) evictHeldLocked(e *entry) {
	_ = e.awaitUploads()
	var freed int64
	if e.resLoaded && len(e.res) > 0 {
		p.freeAll(e.resT)
		e.resT, e.resLoaded = nil, false
		freed += e.resBytes
	}
	if e.heldOutside() {
		p.freeAll(e.strT)
		e.strT, e.strLoaded = nil, false
		freed += e.strBytes
	}
	p.st.Evictions++
	p.changedLocked()
	p.bg.record(Event{Kind: EventEvict, Layer: e.layer, Pager: p.id, Bytes: freed})
}

// loadResident loads e's resident part into allocations of its own,
// charged to ResidentWeights.
func (p *Pager) loadResident(ctx context.Context, e *entry, evict evictPolicy, ld *loadState) ([]*tensor.Tensor, error) {
	ts, err := p.allocPart(e, residentPart, evict)
	if err != nil {
		return nil, err
	}
	if err := p.upload(ctx, e, residentPart, ts, ld); err != nil {
		p.freeAll(ts)
		return nil, err
	}
	return ts, nil
}

// loadStreamedOutside loads e's streamed part into allocations of its own,
// charged to StreamedWeights, when the ring has no room for it.
func (p *Pager) loadStreamedOutside(ctx context.Context, e *entry, ld *loadState) ([]*tensor.Tensor, error) {
	ts, err := p.allocPart(e, streamedPart, mayEvict)
	if err != nil {
		return nil, err
	}
	if err := p.upload(ctx, e, streamedPart, ts, ld); err != nil {
		p.freeAll(ts)
		return nil, err
	}
	return ts, nil
}

// loadStreamedInRing loads e's streamed part into its slot of the ring.
func (p *Pager) loadStreamedInRing(ctx context.Context, e *entry, ld *loadState) ([]*tensor.Tensor, error) {
	p.mu.Lock()
	s := e.slot
	p.mu.Unlock()
	ts := make([]*tensor.Tensor, 0, len(e.str))
	for k, i := range e.str {
		spec := e.specs[i]
		t, err := p.ring.View(s.offs[k], spec.DType, spec.Shape)
		if err != nil {
			return nil, fmt.Errorf("paging: layer %d tensor %s: %w", e.layer, spec.Name, err)
		}
		ts = append(ts, t)
	}
	if err := p.upload(ctx, e, streamedPart, ts, ld); err != nil {
		return nil, err
	}
	return ts, nil
}

// allocPart allocates the tensors of one part of e from the budget.
func (p *Pager) allocPart(e *entry, pt part, evict evictPolicy) ([]*tensor.Tensor, error) {
	cat := ResidentWeights
	if pt == streamedPart {
		cat = StreamedWeights
	}
	var ts []*tensor.Tensor
	for _, i := range e.tensors(pt) {
		s := e.specs[i]
		t, err := p.bg.alloc(cat, s.DType, s.Shape, e.layer, evict)
		if err != nil {
			p.freeAll(ts)
			return nil, fmt.Errorf("paging: layer %d tensor %s: %w", e.layer, s.Name, err)
		}
		ts = append(ts, t)
	}
	return ts, nil
}

// upload fills ts, the device tensors of one part of e. A streamed part
// comes from the host cache when it has it, and enters it when it has room.
//
// Uploads from pinned host memory go through the backend's AsyncUploader
// when it has one, on its copy stream; their waits are appended to
// ld.ready, and run before the tensors are used or freed. On an error the
// waits of this call's uploads have run and ts are the caller's to free.
func (p *Pager) upload(ctx context.Context, e *entry, pt part, ts []*tensor.Tensor, ld *loadState) error {
	idx := e.tensors(pt)
	nReady := len(ld.ready)
	abandon := func() {
		for _, r := range ld.ready[nReady:] {
			_ = r()
		}
		ld.ready = ld.ready[:nReady]
	}
	streamed := pt == streamedPart
	var buf []byte // the streamed part, whole, when it is or will be cached
	cached, cachedPinned, admitted, held := false, false, false, false
	if streamed {
		p.mu.Lock()
		for e.hostFilling { // HostLayer is reading it: use its copy
			if err := p.waitLocked(ctx); err != nil {
				p.mu.Unlock()
				return fmt.Errorf("paging: layer %d: waiting for its host copy: %w", e.layer, err)
			}
		}
		switch {
		case e.host != nil:
			buf, cached, cachedPinned = e.host, true, e.hostPinned
			p.st.HostCacheHits++
		case e.held || e.hostSize <= p.hostRoomLocked():
			held = e.held
			p.admitHostLocked(e, held) // returned if the load fails
			admitted = true
			p.st.HostCacheMisses++
		default:
			p.st.HostCacheMisses++
		}
		p.mu.Unlock()
	}
	if streamed && !cached && !admitted && p.stages(e) {
		return p.uploadStaged(ctx, e, ts, ld)
	}
	pinned := false
	if admitted {
		buf, pinned = p.hostAlloc(e.hostSize)
	}
	dropAdmission := func() {
		if admitted {
			p.hostFree(buf, pinned)
			p.mu.Lock()
			p.dropHostLocked(e, held)
			p.mu.Unlock()
		}
	}
	// fail waits for the copies still reading the host buffer before
	// dropAdmission frees it.
	fail := func(err error) error {
		abandon()
		dropAdmission()
		return err
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
			if err := ctx.Err(); err != nil {
				p.reads.put(tmp)
				return fail(err)
			}
			if err := p.src.ReadTensor(ctx, e.layer, s.Name, src); err != nil {
				p.reads.put(tmp)
				return fail(fmt.Errorf("paging: layer %d tensor %s: reading: %w", e.layer, s.Name, err))
			}
			p.mu.Lock()
			p.st.BytesDiskToHost += s.Bytes
			p.mu.Unlock()
		}
		var err error
		if p.async != nil && (pinned || cachedPinned) {
			var r func() error
			if r, err = p.async.UploadAsync(ctx, ts[k], 0, src); err == nil {
				ld.ready = append(ld.ready, r)
			}
		} else {
			err = p.b.Upload(ts[k], 0, src) // synchronous: src is free after it
		}
		p.reads.put(tmp)
		if err != nil {
			return fail(fmt.Errorf("paging: layer %d tensor %s: upload: %w", e.layer, s.Name, err))
		}
		p.mu.Lock()
		p.st.BytesHostToDevice += s.Bytes
		p.mu.Unlock()
		ld.moved += s.Bytes
	}
	if admitted {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			abandon() // the copies read buf
			dropAdmission()
			return nil
		}
		p.keepHostLocked(e, buf, pinned)
		p.mu.Unlock()
	}
	return nil
}

// hostRoomLocked is the room the host limit leaves for host copies: not
// held by copies, reserved for host layers or taken by the staging ring.
func (p *Pager) hostRoomLocked() int64 {
	return p.hostCap - p.hostUsed - p.hostReserved - p.stageBytes
}

// admitHostLocked counts e's host copy in the host cache's use while it is
// read: from the room reserved for it when held (a host layer), else from
// the free room, which the caller has checked.
func (p *Pager) admitHostLocked(e *entry, held bool) {
	if held {
		p.hostReserved -= e.hostSize
	}
	p.hostUsed += e.hostSize
	e.hostFilling = true
}

// dropHostLocked undoes admitHostLocked for a read that failed.
func (p *Pager) dropHostLocked(e *entry, held bool) {
	p.hostUsed -= e.hostSize
	if held {
		p.hostReserved += e.hostSize
	}
	e.hostFilling = false
	p.changedLocked()
}

// keepHostLocked makes buf, read whole, e's host copy.
func (p *Pager) keepHostLocked(e *entry, buf []byte, pinned bool) {
	e.host, e.hostPinned, e.hostFilling = buf, pinned, false
	if pinned {
		p.pinnedBytes += int64(len(buf))
	}
	p.changedLocked()
}

// HostLayer returns the layer's tensors as host tensors, for the CPU to
// compute the layer from: views into the pager's host copy of it (pinned
// memory when the backend has it), each aligned to 64 bytes. It reads the
// layer into the host cache if it is not there, and keeps it there until
// Close: a prefill that streams the layer to the device uploads from the
// same copy. The map is the caller's; the tensors stay valid until Close.
//
// Only a layer the plan streams whole can be a host layer. Its bytes count
// in the host cache's use: a layer not listed in Options.HostLayers (whose
// room NewPager reserved) fails with an error wrapping ErrHostMemory when
// the cache has no room for it. On any error nothing of the layer is held.
func (p *Pager) HostLayer(ctx context.Context, layer int) (map[string]*tensor.Tensor, error) {
	if layer < 0 || layer >= len(p.layers) {
		return nil, fmt.Errorf("paging: host layer %d: have layers 0..%d", layer, len(p.layers)-1)
	}
	e := p.layers[layer]
	if err := e.checkHostLayer(); err != nil {
		return nil, err
	}
	p.mu.Lock()
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, fmt.Errorf("paging: host layer %d: %w", layer, errClosed)
		}
		if e.host != nil || len(e.str) == 0 {
			e.held = true // an ordinary cached copy becomes a host layer's: counted already
			m, err := e.hostViews()
			p.mu.Unlock()
			return m, err
		}
		if !e.hostFilling {
			break
		}
		if err := p.waitLocked(ctx); err != nil { // a load is reading it into the cache
			p.mu.Unlock()
			return nil, fmt.Errorf("paging: host layer %d: %w", layer, err)
		}
	}
	held := e.held
	if free := p.hostRoomLocked(); !held && e.hostSize > free {
		p.mu.Unlock()
		return nil, fmt.Errorf("paging: host layer %d: %w: it takes %s (%d bytes), the host cache has %s (%d bytes) free of %s",
			layer, ErrHostMemory, FormatSize(e.hostSize), e.hostSize, FormatSize(free), free, FormatSize(p.hostCap))
	}
	p.admitHostLocked(e, held)
	p.inflight++ // Close waits for the read
	p.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(p.life, cancel)
	defer stop()
	buf, pinned := p.hostAlloc(e.hostSize)
	err := p.readHost(ctx, e, buf)
	p.mu.Lock()
	defer p.mu.Unlock()
	defer p.endReadLocked()
	if err == nil && p.closed {
		err = errClosed
	}
	if err != nil {
		p.dropHostLocked(e, held)
		if ferr := p.hostFree(buf, pinned); ferr != nil {
			err = errors.Join(err, ferr)
		}
		return nil, fmt.Errorf("paging: host layer %d: %w", layer, err)
	}
	p.keepHostLocked(e, buf, pinned)
	e.held = true
	p.st.BytesDiskToHost += e.strBytes
	p.st.HostLayerLoads++
	return e.hostViews()
}

// endReadLocked marks the end of a HostLayer read.
func (p *Pager) endReadLocked() {
	p.inflight--
	p.changedLocked()
}

// readHost reads e's streamed tensors from the source into buf, laid out
// as the host cache lays them out.
func (p *Pager) readHost(ctx context.Context, e *entry, buf []byte) error {
	for k, i := range e.str {
		s := e.specs[i]
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := p.src.ReadTensor(ctx, e.layer, s.Name, buf[e.strOff[k]:e.strOff[k]+s.Bytes]); err != nil {
			return fmt.Errorf("tensor %s: reading: %w", s.Name, err)
		}
	}
	return nil
}

// hostViews returns host tensors viewing e's host copy.
func (e *entry) hostViews() (map[string]*tensor.Tensor, error) {
	m := make(map[string]*tensor.Tensor, len(e.str))
	for k, i := range e.str {
		s := e.specs[i]
		off := e.strOff[k]
		t, err := tensor.FromBytes(s.DType, s.Shape, e.host[off:off+s.Bytes:off+s.Bytes])
		if err != nil {
			return nil, fmt.Errorf("paging: host layer %d tensor %s: %w", e.layer, s.Name, err)
		}
		m[s.Name] = t
	}
	return m, nil
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

// hostAlloc returns a host buffer of n bytes, pinned when the backend pins
// memory and grants it, and whether it is. A refusal falls back to pageable
// memory, whose uploads are synchronous and slower: it is counted in the
// stats (PinnedFallbacks), so that a slow run can be explained. It is
// called without p.mu.
func (p *Pager) hostAlloc(n int64) ([]byte, bool) {
	if p.pinned == nil {
		return make([]byte, n), false
	}
	b, err := p.pinned.AllocPinned(n)
	if err == nil && int64(len(b)) == n {
		return b, true
	}
	if err == nil {
		_ = p.pinned.FreePinned(b)
		err = fmt.Errorf("%d bytes asked, %d given", n, len(b))
	}
	p.mu.Lock()
	p.st.PinnedFallbacks++
	p.st.PinnedFallbackBytes += n
	if p.st.PinnedFallbackError == "" {
		p.st.PinnedFallbackError = err.Error()
	}
	p.mu.Unlock()
	return make([]byte, n), false
}

func (p *Pager) hostFree(b []byte, pinned bool) error {
	if pinned && b != nil {
		return p.pinned.FreePinned(b)
	}
	return nil
}

// Close frees every device tensor and pinned buffer the pager holds,
// frees the ring, stops prefetching and removes the pager from its
// budget's evictors. Tensors from Acquire are invalid afterwards. Close is
// idempotent.
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
	if p.ex != nil {
		p.ex.pf.Wait()
		p.ex.lookups.Wait()
	}
	p.mu.Lock()
	for p.inflight > 0 {
		p.cond.Wait()
	}
	p.reads.release()
	var errs []error
	if p.stage != nil {
		p.mu.Unlock()
		if err := p.stage.close(p.pinned); err != nil {
			errs = append(errs, err)
		}
		p.mu.Lock()
		p.stage, p.stageBytes = nil, 0
	}
	for _, e := range p.layers {
		if err := e.awaitUploads(); err != nil {
			errs = append(errs, fmt.Errorf("paging: layer %d: %w", e.layer, err))
		}
		p.freeAll(e.resT)
		if e.slot == nil { // views into the ring are not freed: the ring is
			p.freeAll(e.strT)
		}
		e.resT, e.strT, e.slot = nil, nil, nil
		e.resLoaded, e.strLoaded = len(e.res) == 0, len(e.str) == 0
		e.pins, e.lentPins = 0, 0
		if err := p.hostFree(e.host, e.hostPinned); err != nil {
			errs = append(errs, fmt.Errorf("paging: freeing pinned host memory of layer %d: %w", e.layer, err))
		}
		if e.hostPinned {
			p.pinnedBytes -= int64(len(e.host))
		}
		e.host, e.hostPinned = nil, false
	}
	errs = append(errs, p.closeExpertsLocked()...)
	ring := p.ring
	p.ring, p.ringUsed, p.ringHead, p.hostUsed, p.hostReserved = nil, 0, 0, 0, 0
	var slab *tensor.Tensor
	if p.ex != nil {
		slab, p.ex.slab = p.ex.slab, nil
	}
	p.mu.Unlock()
	p.bg.Free(ring)
	p.bg.Free(slab)
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
