package paging

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/strata-llm/strata/tensor"
)

// Budget is the budgeted allocator of one device. Every byte it hands out is
// charged to a Category, the sum of the charges never exceeds the limit, and
// it remembers the peak. It implements Allocator, so nn takes its KV cache
// and activations from it; the Pager takes its weights from it.
//
// On a backend with a caching allocator (tensor.CachingAllocator: the CUDA
// backend) the budget holds every device byte the process takes through
// it: an allocation is charged the block the backend takes for it
// (AllocSize), the freed blocks the backend keeps for reuse are charged to
// Cached, and the memory the backend holds outside Alloc (the cuBLAS
// workspace) is charged to Workspace from NewBudget on. Use one Budget per
// such backend: the cache is the backend's, not the budget's.
//
// When an allocation does not fit, the Budget first returns the backend's
// cached blocks to the driver (Trim), then asks its Evictors (the pagers
// that use it) to evict layers that are neither pinned nor in a streaming
// ring, least recently used first across all of them; if that does not
// make room, the allocation fails with an error wrapping
// tensor.ErrOutOfMemory.
//
// A Budget is safe for concurrent use.
type Budget struct {
	b      tensor.Memory
	cache  tensor.CachingAllocator // nil when the backend keeps no freed blocks
	fixed  int64                   // device bytes held outside Alloc, reserved from NewBudget to Close
	device string
	limit  int64
	clock  atomic.Uint64 // LRU stamps shared by every evictor of this budget

	// cacheMu orders the changes the budget makes to the backend's cache
	// (a Free, then its uncharge; a Trim) with every reading of it, so that
	// no block is counted both in its category and in the cache. (An
	// allocation taking a block from the cache only lowers it.)
	cacheMu sync.Mutex

	mu      sync.Mutex
	used    int64 // bytes charged, all categories
	peak    int64
	cats    [numCategories]CategoryStats
	live    map[*tensor.Tensor]liveAlloc
	rec     *recorder
	closed  bool
	badFree int64

	rmu      sync.Mutex
	evictors []*evictorEntry
	nextPgID int
}

type liveAlloc struct {
	cat     Category
	bytes   int64 // the tensor's bytes
	charged int64 // what the device takes for it (AllocSize), charged to cat
	layer   int
}

// CategoryStats are the accounts of one category. Reserved bytes are those
// charged against the budget; Allocated bytes are those held by live
// tensors (the blocks the device takes for them). They differ for charges
// with no tensor behind them: unified memory's share of the weights, the
// device's fixed workspace, and the backend's cache of freed blocks.
type CategoryStats struct {
	Category      string `json:"category"`
	Allocated     int64  `json:"allocated_bytes"`
	PeakAllocated int64  `json:"peak_allocated_bytes"`
	Reserved      int64  `json:"reserved_bytes"`
	PeakReserved  int64  `json:"peak_reserved_bytes"`
	Allocs        int64  `json:"allocs"`
	Frees         int64  `json:"frees"`
	// Leaked bytes were still allocated when the budget was closed; Close
	// freed them.
	Leaked int64 `json:"leaked_bytes,omitempty"`
}

// ErrFixedOverBudget is wrapped by NewBudget when the memory the backend
// holds outside Alloc does not fit in the limit.
var ErrFixedOverBudget = errors.New("budget smaller than the device memory held outside allocations")

// NewBudget returns a budgeted allocator of limit bytes over backend b.
// device names the device in summaries and snapshots; empty means b.Name().
// A limit <= 0 refuses every allocation.
//
// When b holds memory outside Alloc (tensor.CachingAllocator's Fixed: the
// cuBLAS workspace), that memory is charged to Workspace at once; a limit
// smaller than it fails with an error wrapping ErrFixedOverBudget.
func NewBudget(b tensor.Memory, limit int64, device string) (*Budget, error) {
	if device == "" {
		device = b.Name()
	}
	if limit < 0 {
		limit = 0
	}
	bg := &Budget{b: b, device: device, limit: limit, live: map[*tensor.Tensor]liveAlloc{}}
	for c := range bg.cats {
		bg.cats[c].Category = Category(c).String()
	}
	if ca, ok := tensor.Caching(b); ok {
		bg.cache = ca
		bg.cats[Cached].Reserved = ca.Cached()
		bg.used = bg.cats[Cached].Reserved
		bg.peak = bg.used
		if fixed := ca.Fixed(); fixed > 0 {
			if err := bg.reserve(Workspace, fixed); err != nil {
				return nil, fmt.Errorf("paging: budget %s: %w: %s, the device holds %s outside allocations (library workspace)",
					device, ErrFixedOverBudget, FormatSize(limit), FormatSize(fixed))
			}
			bg.fixed = fixed
		}
	}
	return bg, nil
}

// Backend returns the backend the budget allocates from.
func (bg *Budget) Backend() tensor.Memory { return bg.b }

// Device returns the device name given to NewBudget.
func (bg *Budget) Device() string { return bg.device }

// Limit returns the budget in bytes.
func (bg *Budget) Limit() int64 { return bg.limit }

// Used returns the bytes charged now, all categories together.
func (bg *Budget) Used() int64 {
	bg.mu.Lock()
	defer bg.mu.Unlock()
	return bg.used
}

// UsedBy returns the bytes charged now to one category.
func (bg *Budget) UsedBy(cat Category) int64 {
	if cat < 0 || cat >= numCategories {
		return 0
	}
	bg.mu.Lock()
	defer bg.mu.Unlock()
	return bg.cats[cat].Reserved
}

// Peak returns the largest number of bytes charged at any one time.
func (bg *Budget) Peak() int64 {
	bg.mu.Lock()
	defer bg.mu.Unlock()
	return bg.peak
}

// Categories returns the accounts of every category, in Category order.
func (bg *Budget) Categories() []CategoryStats {
	bg.mu.Lock()
	defer bg.mu.Unlock()
	return slices.Clone(bg.cats[:])
}

// evictPolicy says whether a charge that does not fit may evict the
// evictors' layers to make room.
type evictPolicy bool

const (
	mayEvict evictPolicy = true  // demand: evict least recently used layers
	noEvict  evictPolicy = false // prefetch and reservations: fail instead
)

// Alloc returns a tensor charged to cat. It fails with an error wrapping
// tensor.ErrOutOfMemory when the bytes do not fit in the budget even after
// evicting unpinned layers.
func (bg *Budget) Alloc(cat Category, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	return bg.alloc(cat, dt, shape, -1, mayEvict)
}

// Free returns a tensor from Alloc to the backend and its bytes to the
// budget. Freeing nil, or a tensor this budget did not allocate, does
// nothing.
func (bg *Budget) Free(t *tensor.Tensor) {
	if t == nil {
		return
	}
	bg.mu.Lock()
	la, ok := bg.live[t]
	if !ok {
		bg.badFree++
		bg.mu.Unlock()
		return
	}
	delete(bg.live, t)
	bg.mu.Unlock()
	if bg.cache != nil {
		bg.cacheMu.Lock()
		defer bg.cacheMu.Unlock()
	}
	// Free before uncharging, so the backend never holds more than the limit.
	bg.b.Free(t)
	bg.mu.Lock()
	defer bg.mu.Unlock()
	c := &bg.cats[la.cat]
	c.Allocated -= la.charged
	c.Frees++
	c.Reserved -= la.charged
	bg.used -= la.charged
	bg.recordLocked(Event{Kind: EventFree, Category: la.cat.String(), Layer: la.layer, Bytes: la.charged, Charged: -la.charged})
	bg.syncCachedLocked() // the block may have gone to the backend's cache
}

func tensorBytes(dt tensor.DType, shape tensor.Shape) (int64, error) {
	n, err := dt.ShapeBytes(shape)
	if err != nil {
		return 0, err
	}
	if n > 1<<62 {
		return 0, fmt.Errorf("tensor %v %v too large", dt, shape)
	}
	return n, nil
}

// allocSize is what an allocation of n bytes takes from the device.
func (bg *Budget) allocSize(n int64) int64 {
	if bg.cache == nil || n == 0 {
		return n
	}
	return max(bg.cache.AllocSize(n), n)
}

// alloc allocates a tensor charged to cat on behalf of layer (-1 for none);
// evict says whether the evictors' layers may be evicted to make room.
func (bg *Budget) alloc(cat Category, dt tensor.DType, shape tensor.Shape, layer int, evict evictPolicy) (*tensor.Tensor, error) {
	if cat < 0 || cat >= numCategories || cat == Cached {
		return nil, fmt.Errorf("paging: budget %s: cannot allocate for category %v", bg.device, cat)
	}
	n, err := tensorBytes(dt, shape)
	if err != nil {
		return nil, fmt.Errorf("paging: budget %s: %s: %v", bg.device, cat, err)
	}
	size := bg.allocSize(n)
	if err := bg.charge(cat, size, evict); err != nil {
		return nil, err
	}
	t, err := bg.b.Alloc(dt, shape)
	if err != nil {
		bg.uncharge(cat, size)
		return nil, fmt.Errorf("paging: budget %s: allocating %s for %s (%v %v): %w", bg.device, FormatSize(n), cat, dt, shape, err)
	}
	if bg.cache != nil {
		bg.cacheMu.Lock()
		defer bg.cacheMu.Unlock()
	}
	bg.mu.Lock()
	bg.live[t] = liveAlloc{cat: cat, bytes: n, charged: size, layer: layer}
	c := &bg.cats[cat]
	c.Allocated += size
	c.PeakAllocated = max(c.PeakAllocated, c.Allocated)
	c.Allocs++
	bg.recordLocked(Event{Kind: EventAlloc, Category: cat.String(), Layer: layer, Bytes: size, Charged: size})
	bg.syncCachedLocked() // the block may have come from the backend's cache
	bg.mu.Unlock()
	return t, nil
}

// charge counts n bytes against the budget, trimming the backend's cache
// and, when evict allows, evicting layers until they fit.
func (bg *Budget) charge(cat Category, n int64, evict evictPolicy) error {
	failed := 0
	for {
		bg.mu.Lock()
		if bg.closed {
			bg.mu.Unlock()
			return fmt.Errorf("paging: budget %s: closed", bg.device)
		}
		if n <= bg.limit-bg.used {
			bg.used += n
			bg.peak = max(bg.peak, bg.used)
			c := &bg.cats[cat]
			c.Reserved += n
			c.PeakReserved = max(c.PeakReserved, c.Reserved)
			bg.mu.Unlock()
			return nil
		}
		used, cached := bg.used, bg.cats[Cached].Reserved
		bg.mu.Unlock()
		if n > bg.limit-bg.fixed {
			return bg.oomError(cat, n, used)
		}
		if cached > 0 {
			// Freed blocks the backend keeps count against the budget:
			// give them back to the driver before evicting layers (an
			// eviction's blocks land in the cache too).
			if err := bg.trim(); err != nil {
				return fmt.Errorf("paging: budget %s: making room for %s of %s: %w", bg.device, FormatSize(n), cat, err)
			}
			bg.mu.Lock()
			trimmed := bg.cats[Cached].Reserved < cached
			bg.mu.Unlock()
			if trimmed {
				continue
			}
		}
		if evict == noEvict {
			return bg.oomError(cat, n, used)
		}
		switch bg.reclaimOne() {
		case reclaimNone:
			return bg.oomError(cat, n, used)
		case reclaimRaced:
			if failed++; failed > 64 {
				return bg.oomError(cat, n, used)
			}
		default:
			failed = 0
		}
	}
}

func (bg *Budget) oomError(cat Category, n, used int64) error {
	return fmt.Errorf("paging: budget %s: %w: %s for %s does not fit: %s of %s in use, nothing left to evict",
		bg.device, tensor.ErrOutOfMemory, FormatSize(n), cat, FormatSize(used), FormatSize(bg.limit))
}

// uncharge returns the bytes of a charge whose allocation failed.
func (bg *Budget) uncharge(cat Category, n int64) {
	if bg.cache != nil {
		bg.cacheMu.Lock()
		defer bg.cacheMu.Unlock()
	}
	bg.mu.Lock()
	defer bg.mu.Unlock()
	bg.used -= n
	bg.cats[cat].Reserved -= n
	bg.syncCachedLocked() // a failed allocation may have trimmed the backend's cache
}

// reserve charges n bytes with no tensor behind them (unified memory's
// share of the weights, the device's fixed workspace), never evicting.
func (bg *Budget) reserve(cat Category, n int64) error {
	if err := bg.charge(cat, n, noEvict); err != nil {
		return err
	}
	bg.record(Event{Kind: EventReserve, Category: cat.String(), Layer: -1, Bytes: n, Charged: n})
	return nil
}

// unreserve returns bytes charged by reserve.
func (bg *Budget) unreserve(cat Category, n int64) {
	bg.mu.Lock()
	defer bg.mu.Unlock()
	bg.used -= n
	bg.cats[cat].Reserved -= n
	bg.recordLocked(Event{Kind: EventUnreserve, Category: cat.String(), Layer: -1, Bytes: n, Charged: -n})
}

// trim returns the backend's cached blocks to the driver.
func (bg *Budget) trim() error {
	if bg.cache == nil {
		return nil
	}
	bg.cacheMu.Lock()
	defer bg.cacheMu.Unlock()
	_, err := bg.cache.Trim()
	bg.mu.Lock()
	bg.syncCachedLocked()
	bg.mu.Unlock()
	return err
}

// syncCachedLocked charges the backend's cache of freed blocks as it is
// now; the caller holds cacheMu and mu. Allocations charge their whole
// block before taking it, from the cache or the driver, and frees uncharge
// it after it went to the cache, so the charges never fall below what the
// device holds.
func (bg *Budget) syncCachedLocked() {
	if bg.cache == nil {
		return
	}
	now := bg.cache.Cached()
	c := &bg.cats[Cached]
	d := now - c.Reserved
	if d == 0 {
		return
	}
	c.Reserved = now
	c.PeakReserved = max(c.PeakReserved, now)
	bg.used += d
	bg.peak = max(bg.peak, bg.used)
	bg.recordLocked(Event{Kind: EventCache, Category: Cached.String(), Layer: -1, Bytes: max(d, -d), Charged: d})
}

// Evictor is what holds budget bytes it can give back: a Pager's layers
// that are neither pinned nor in its ring. When a charge does not fit, the
// budget asks every registered evictor for its least recently used
// evictable bytes and evicts the oldest of all, until the charge fits or
// nothing is left.
//
// Uses are stamped with the budget's Stamp, so that the evictors of one
// budget are compared on one clock. The budget calls the methods from the
// goroutine whose charge does not fit, holding none of its locks; they must
// not wait for that charge.
type Evictor interface {
	// Oldest returns the stamp of the least recently used bytes the
	// evictor could free now, and false when it has none.
	Oldest() (stamp uint64, ok bool)
	// Evict frees the bytes stamped stamp, if they are still evictable,
	// and reports whether it freed any.
	Evict(stamp uint64) bool
}

type evictorEntry struct{ e Evictor }

// Register adds an evictor the budget may ask for room, until the returned
// function (idempotent) removes it. Whoever registers an evictor
// unregisters it before closing the budget: Close reports evictors still
// registered. An evictor that also has a Stats() Stats method (a Pager)
// appears in Summary and Snapshot.
func (bg *Budget) Register(e Evictor) (unregister func()) {
	r := &evictorEntry{e}
	bg.rmu.Lock()
	bg.evictors = append(bg.evictors, r)
	bg.rmu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			bg.rmu.Lock()
			bg.evictors = slices.DeleteFunc(bg.evictors, func(q *evictorEntry) bool { return q == r })
			bg.rmu.Unlock()
		})
	}
}

// Stamp returns a new stamp of the budget's clock, later than every stamp
// before it: evictors stamp each use with it.
func (bg *Budget) Stamp() uint64 { return bg.clock.Add(1) }

func (bg *Budget) registered() []Evictor {
	bg.rmu.Lock()
	defer bg.rmu.Unlock()
	out := make([]Evictor, len(bg.evictors))
	for i, r := range bg.evictors {
		out[i] = r.e
	}
	return out
}

// newPagerID numbers the pagers of the budget, for events and statistics.
func (bg *Budget) newPagerID() int {
	bg.rmu.Lock()
	defer bg.rmu.Unlock()
	bg.nextPgID++
	return bg.nextPgID - 1
}

type reclaimResult int

const (
	reclaimNone reclaimResult = iota
	reclaimRaced
	reclaimDone
)

// reclaimOne evicts the least recently used evictable bytes among all
// registered evictors.
func (bg *Budget) reclaimOne() reclaimResult {
	var best Evictor
	var bestStamp uint64
	for _, e := range bg.registered() {
		if s, ok := e.Oldest(); ok && (best == nil || s < bestStamp) {
			best, bestStamp = e, s
		}
	}
	if best == nil {
		return reclaimNone
	}
	if best.Evict(bestStamp) {
		return reclaimDone
	}
	return reclaimRaced
}

// ErrLeak is wrapped by Budget.Close when tensors were still allocated,
// evictors still registered or bytes still reserved.
var ErrLeak = errors.New("allocations still live")

// Close frees every tensor still allocated from the budget and returns the
// backend's cached blocks to the driver. It does not close the pagers that
// use the budget: whoever made a pager closes it first. Tensors still
// allocated, evictors still registered and reservations still charged are
// reported as an error wrapping ErrLeak: whoever made them forgot to free,
// close or return them. Close is idempotent; after it every allocation
// fails.
func (bg *Budget) Close() error {
	bg.mu.Lock()
	if bg.closed {
		bg.mu.Unlock()
		return nil
	}
	bg.closed = true
	var leaked [numCategories]int64
	var count int
	var ts []*tensor.Tensor
	for t, la := range bg.live {
		leaked[la.cat] += la.charged
		count++
		ts = append(ts, t)
	}
	for c, n := range leaked {
		bg.cats[c].Leaked += n
	}
	bg.mu.Unlock()
	for _, t := range ts {
		bg.Free(t)
	}
	var errs []error
	if err := bg.trim(); err != nil {
		errs = append(errs, fmt.Errorf("paging: budget %s: returning the cached blocks at Close: %w", bg.device, err))
	}
	if bg.fixed > 0 {
		bg.unreserve(Workspace, bg.fixed)
	}
	evictors := len(bg.registered())
	bg.mu.Lock()
	if c := bg.cats[Cached].Reserved; c > 0 { // held by other users of the backend: no longer this budget's
		bg.cats[Cached].Reserved = 0
		bg.used -= c
		bg.recordLocked(Event{Kind: EventCache, Category: Cached.String(), Layer: -1, Bytes: c, Charged: -c})
	}
	var reserved [numCategories]int64
	var reservedAll int64
	for c := range bg.cats {
		reserved[c] = bg.cats[c].Reserved
		reservedAll += reserved[c]
	}
	bg.mu.Unlock()
	var parts []string
	if count > 0 {
		var cats []string
		for c, n := range leaked {
			if n > 0 {
				cats = append(cats, fmt.Sprintf("%s %s", FormatSize(n), Category(c)))
			}
		}
		parts = append(parts, fmt.Sprintf("%d tensors (%s), freed now", count, strings.Join(cats, ", ")))
	}
	if evictors > 0 {
		parts = append(parts, fmt.Sprintf("%d evictors still registered (close the pagers before their budget)", evictors))
	}
	if reservedAll > 0 {
		var cats []string
		for c, n := range reserved {
			if n > 0 {
				cats = append(cats, fmt.Sprintf("%s %s", FormatSize(n), Category(c)))
			}
		}
		parts = append(parts, fmt.Sprintf("reservations still charged (%s)", strings.Join(cats, ", ")))
	}
	if len(parts) > 0 {
		errs = append(errs, fmt.Errorf("paging: budget %s: %w at Close: %s", bg.device, ErrLeak, strings.Join(parts, "; ")))
	}
	return errors.Join(errs...)
}
