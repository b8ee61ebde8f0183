//go:build cuda

package cuda

import (
	"fmt"
	"sync"

	"github.com/strata-llm/strata/tensor"
)

// scratchBytes is the size of the arena the backend's own operations take
// their scratch from: a MatMul's activations converted for cuBLAS, a
// weight widened to F32 for the training products, an overlapping copy's
// staging, a few bytes per row for reductions. The arena is allocated once
// when the backend opens and counted in Fixed, so that a budget holds every
// byte the device holds; operations whose scratch would be larger do their
// work in pieces that fit. 32 MiB holds a 512-row MatMul's BF16 split of x
// for K up to 16384.
const scratchBytes = 32 << 20

// scratchArena is the backend's scratch memory. Every operation enqueues
// its work on the compute stream, so the arena is free for the next
// operation as soon as the previous one has enqueued the kernels that use
// it: the mutex is held from take to release, across the enqueueing only.
type scratchArena struct {
	mu   sync.Mutex
	p    uintptr
	size int64
}

// scratch takes the arena for n bytes (n <= b.scr.size); release gives it
// back once the kernels that use it are enqueued.
func (b *Backend) scratch(op string, n int64) (p uintptr, release func(), err error) {
	if n > b.scr.size {
		return 0, nil, fmt.Errorf("%s: %s: %d bytes of scratch, the arena holds %d: %w", b.name, op, n, b.scr.size, tensor.ErrOutOfMemory)
	}
	b.scr.mu.Lock()
	return b.scr.p, b.scr.mu.Unlock, nil
}
