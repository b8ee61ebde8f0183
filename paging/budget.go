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
// When an allocation does not fit, the Budget asks its Evictors (the
// pagers that use it) to evict layers that are neither pinned nor in a
// streaming ring, least recently used first across all of them; if that
// does not make room, the allocation fails with an error wrapping
// tensor.ErrOutOfMemory.
//
// A Budget is safe for concurrent use.
type Budget struct {
	b      tensor.Memory
	device string
	limit  int64
	clock  atomic.Uint64 // LRU stamps shared by every evictor of this budget

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
	cat   Category
	bytes int64
	layer int
}

// CategoryStats are the accounts of one category. Reserved bytes are those
// charged against the budget; Allocated bytes are those held by live
// tensors. They differ for charges with no tensor behind them: unified
// memory's share of the weights.
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

// NewBudget returns a budgeted allocator of limit bytes over backend b.
// device names the device in summaries and snapshots; empty means b.Name().
// A limit <= 0 refuses every allocation.
func NewBudget(b tensor.Memory, limit int64, device string) *Budget {
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
	return bg
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
	// Free before uncharging, so the backend never holds more than the limit.
	bg.b.Free(t)
	bg.mu.Lock()
	defer bg.mu.Unlock()
	c := &bg.cats[la.cat]
	c.Allocated -= la.bytes
	c.Frees++
	c.Reserved -= la.bytes
	bg.used -= la.bytes
	bg.recordLocked(Event{Kind: EventFree, Category: la.cat.String(), Layer: la.layer, Bytes: la.bytes, Charged: -la.bytes})
}

func tensorBytes(dt tensor.DType, shape tensor.Shape) (int64, error) {
	n := shape.NumElements()
	if n < 0 || dt.Size() == 0 {
		return 0, fmt.Errorf("invalid tensor %v %v", dt, shape)
	}
	if n > (1<<62)/int64(dt.Size()) {
		return 0, fmt.Errorf("tensor %v %v too large", dt, shape)
	}
	return n * int64(dt.Size()), nil
}

// alloc allocates a tensor charged to cat on behalf of layer (-1 for none);
// evict says whether the evictors' layers may be evicted to make room.
func (bg *Budget) alloc(cat Category, dt tensor.DType, shape tensor.Shape, layer int, evict evictPolicy) (*tensor.Tensor, error) {
	if cat < 0 || cat >= numCategories {
		return nil, fmt.Errorf("paging: budget %s: unknown category %d", bg.device, int(cat))
	}
	n, err := tensorBytes(dt, shape)
	if err != nil {
		return nil, fmt.Errorf("paging: budget %s: %s: %v", bg.device, cat, err)
	}
	if err := bg.charge(cat, n, evict); err != nil {
		return nil, err
	}
	t, err := bg.b.Alloc(dt, shape)
	if err != nil {
		bg.uncharge(cat, n)
		return nil, fmt.Errorf("paging: budget %s: allocating %s for %s (%v %v): %w", bg.device, FormatSize(n), cat, dt, shape, err)
	}
	bg.mu.Lock()
	bg.live[t] = liveAlloc{cat: cat, bytes: n, layer: layer}
	c := &bg.cats[cat]
	c.Allocated += n
	c.PeakAllocated = max(c.PeakAllocated, c.Allocated)
	c.Allocs++
	bg.recordLocked(Event{Kind: EventAlloc, Category: cat.String(), Layer: layer, Bytes: n, Charged: n})
	bg.mu.Unlock()
	return t, nil
}

// charge counts n bytes against the budget, evicting layers until they fit
// when evict allows.
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
		used := bg.used
		bg.mu.Unlock()
		if n > bg.limit || evict == noEvict {
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
	bg.mu.Lock()
	defer bg.mu.Unlock()
	bg.used -= n
	bg.cats[cat].Reserved -= n
}

// reserve charges n bytes with no tensor behind them (unified memory's
// share of the weights), never evicting.
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

// Close frees every tensor still allocated from the budget. It does not
// close the pagers that use the budget: whoever made a pager closes it
// first. Tensors still
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
		leaked[la.cat] += la.bytes
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
	evictors := len(bg.registered())
	bg.mu.Lock()
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
		return fmt.Errorf("paging: budget %s: %w at Close: %s", bg.device, ErrLeak, strings.Join(parts, "; "))
	}
	return nil
}
