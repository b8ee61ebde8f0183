package paging

import (
	"errors"
	"fmt"
	"sync"

	"github.com/strata-llm/strata/tensor"
)

// arenaChunk is the size of the page-locked buffers a pinnedArena takes
// from the backend at a time. Page-locking is paid per call as well as per
// byte: the expert cache pinned each expert's host copy (a few MiB) with a
// call of its own, and a first pass over every expert of a large model
// spent most of its time there.
const arenaChunk = 256 << 20

// pinnedArena hands out pieces of large page-locked buffers for host copies
// that live until the pager closes (the expert cache's: an expert, once in
// the host cache, stays there). Pieces are never freed one by one; Close
// frees the chunks. It has a lock of its own so that pinning a new chunk
// does not hold up the pager.
type pinnedArena struct {
	mu     sync.Mutex
	pinned tensor.PinnedAllocator
	chunks [][]byte
	free   []byte // the unused tail of the last chunk, hostAlign-aligned
	// limit bounds the chunks' bytes together; bytes is their sum.
	limit, bytes int64
	failed       bool // the backend refused a chunk: pageable from now on
}

func newPinnedArena(pinned tensor.PinnedAllocator, limit int64) *pinnedArena {
	return &pinnedArena{pinned: pinned, limit: limit}
}

// alloc returns n bytes of page-locked memory, or nil when the arena has no
// room within its limit or the backend refuses (the caller then uses
// pageable memory). grown is the bytes newly pinned for it (0 or a chunk).
func (a *pinnedArena) alloc(n int64) (buf []byte, grown int64) {
	if a == nil || n <= 0 {
		return nil, 0
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if int64(len(a.free)) < n {
		size := max(int64(arenaChunk), n)
		size = min(size, a.limit-a.bytes)
		if a.failed || size < n {
			return nil, 0
		}
		c, err := a.pinned.AllocPinned(size)
		if err != nil || int64(len(c)) != size {
			if err == nil {
				_ = a.pinned.FreePinned(c)
			}
			a.failed = true
			return nil, 0
		}
		a.chunks = append(a.chunks, c)
		a.bytes += size
		a.free, grown = c, size
	}
	buf = a.free[:n:n]
	skip := min((n+hostAlign-1)/hostAlign*hostAlign, int64(len(a.free)))
	a.free = a.free[skip:]
	return buf, grown
}

// close frees every chunk and returns the bytes freed.
func (a *pinnedArena) close() (int64, error) {
	if a == nil {
		return 0, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	for _, c := range a.chunks {
		if err := a.pinned.FreePinned(c); err != nil {
			errs = append(errs, fmt.Errorf("paging: freeing a pinned host chunk of %s: %w", FormatSize(int64(len(c))), err))
		}
	}
	freed := a.bytes
	a.chunks, a.free, a.bytes = nil, nil, 0
	return freed, errors.Join(errs...)
}
