package cuda

import (
	"errors"
	"fmt"
	"math/bits"
	"sort"
	"sync"

	"github.com/strata-llm/strata/tensor"
)

// allocator is the caching layer between Backend.Alloc/Free and the
// driver. Freed blocks go to a free list keyed by their rounded size and
// are handed out again for any request of that size, so that the decode
// loop, which allocates the same shapes every step, stops calling the
// driver after its first step. trim returns the cached blocks to the
// driver. It is pure Go: the driver calls are injected, which lets the
// accounting be tested without a GPU.
type allocator struct {
	malloc func(n int64) (uintptr, error) // errors wrap tensor.ErrOutOfMemory when the device is full
	mfree  func(p uintptr) error
	sync   func() error // waits for queued device work before blocks go back to the driver

	mu    sync.Mutex
	free  map[int64][]uintptr // rounded size -> cached blocks
	live  map[uintptr]block   // handed-out blocks by base address
	bases []uintptr           // sorted bases of live, for range lookups
	stats Stats
}

type block struct {
	size    int64 // requested bytes
	rounded int64 // bytes taken from the driver
	managed bool  // from AllocManaged: freed to the driver, never cached
}

func newAllocator(malloc func(int64) (uintptr, error), mfree func(uintptr) error, sync func() error) *allocator {
	return &allocator{malloc: malloc, mfree: mfree, sync: sync, free: map[int64][]uintptr{}, live: map[uintptr]block{}}
}

// roundSize is the block size serving a request of n bytes: at least 512
// bytes, and a multiple of 1/64 of the largest power of two not above n,
// so a block wastes under 1/64 (1.6%) and requests of similar size share
// free lists.
func roundSize(n int64) int64 {
	const minBlock = 512
	if n <= minBlock {
		return minBlock
	}
	pow := int64(1) << (bits.Len64(uint64(n)) - 1)
	g := max(minBlock, pow/64)
	return (n + g - 1) / g * g
}

// allocSize is the device bytes a request of n bytes takes: its block's
// rounded size, or nothing for an empty request (Backend.Alloc makes an
// empty tensor without the allocator).
func allocSize(n int64) int64 {
	if n <= 0 {
		return 0
	}
	return roundSize(n)
}

// get returns a block of at least n bytes, from the cache when it can.
// When the driver is out of memory it trims the cache and tries once more.
func (a *allocator) get(n int64) (uintptr, error) {
	r := roundSize(n)
	a.mu.Lock()
	defer a.mu.Unlock()
	if list := a.free[r]; len(list) > 0 {
		p := list[len(list)-1]
		a.free[r] = list[:len(list)-1]
		a.stats.Cached -= r
		a.stats.CacheHits++
		a.insert(p, block{size: n, rounded: r})
		return p, nil
	}
	p, err := a.malloc(r)
	if err != nil && errors.Is(err, tensor.ErrOutOfMemory) && a.stats.Cached > 0 {
		if terr := a.trimLocked(); terr != nil {
			return 0, fmt.Errorf("%w (trimming the cache after it also failed: %v)", err, terr)
		}
		p, err = a.malloc(r)
	}
	if err != nil {
		return 0, err
	}
	a.stats.DriverAllocs++
	a.stats.Reserved += r
	a.insert(p, block{size: n, rounded: r})
	return p, nil
}

// addManaged records a managed allocation so that lookups and Free see it.
func (a *allocator) addManaged(p uintptr, n int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stats.Managed += n
	a.insert(p, block{size: n, rounded: n, managed: true})
}

// put takes back the block at base p. It returns the block and whether p
// was a live block; a managed block is removed but left for the caller to
// free.
func (a *allocator) put(p uintptr) (block, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	b, ok := a.live[p]
	if !ok {
		return block{}, false
	}
	a.remove(p)
	if b.managed {
		a.stats.Managed -= b.size
		return b, true
	}
	a.stats.InUse -= b.rounded
	a.stats.Cached += b.rounded
	a.free[b.rounded] = append(a.free[b.rounded], p)
	return b, true
}

// trim returns every cached block to the driver and reports the bytes
// released.
func (a *allocator) trim() (int64, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	before := a.stats.Cached
	err := a.trimLocked()
	return before - a.stats.Cached, err
}

func (a *allocator) trimLocked() error {
	if a.stats.Cached == 0 {
		return nil
	}
	var first error
	if a.sync != nil {
		first = a.sync()
	}
	for r, list := range a.free {
		for _, p := range list {
			if err := a.mfree(p); err != nil && first == nil {
				first = err
			}
			a.stats.Cached -= r
			a.stats.Reserved -= r
		}
		delete(a.free, r)
	}
	return first
}

// releaseAll frees every block, live or cached, for Close; managed blocks
// are freed with mfreeManaged.
func (a *allocator) releaseAll(mfreeManaged func(uintptr) error) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var first error
	keep := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	keep(a.trimLocked())
	for p, b := range a.live {
		if b.managed {
			keep(mfreeManaged(p))
			a.stats.Managed -= b.size
		} else {
			keep(a.mfree(p))
			a.stats.InUse -= b.rounded
			a.stats.Reserved -= b.rounded
		}
	}
	a.live = map[uintptr]block{}
	a.bases = nil
	return first
}

// find returns the live block containing the n bytes at p, with its base.
func (a *allocator) find(p uintptr, n int64) (uintptr, block, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	i := sort.Search(len(a.bases), func(i int) bool { return a.bases[i] > p }) - 1
	if i < 0 {
		return 0, block{}, false
	}
	base := a.bases[i]
	b := a.live[base]
	if p+uintptr(n) > base+uintptr(b.size) {
		return 0, block{}, false
	}
	return base, b, true
}

func (a *allocator) snapshot() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats
}

func (a *allocator) insert(p uintptr, b block) {
	a.live[p] = b
	if !b.managed {
		a.stats.InUse += b.rounded
		a.stats.PeakInUse = max(a.stats.PeakInUse, a.stats.InUse)
	}
	i := sort.Search(len(a.bases), func(i int) bool { return a.bases[i] >= p })
	a.bases = append(a.bases, 0)
	copy(a.bases[i+1:], a.bases[i:])
	a.bases[i] = p
}

func (a *allocator) remove(p uintptr) {
	delete(a.live, p)
	i := sort.Search(len(a.bases), func(i int) bool { return a.bases[i] >= p })
	if i < len(a.bases) && a.bases[i] == p {
		a.bases = append(a.bases[:i], a.bases[i+1:]...)
	}
}
