//go:build cuda

package cuda

import (
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
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

// tableBytes is the device room of each of the step tables: 128 Ki
// entries, a batched step of 16,384 rows over 16,384 blocks of its
// sequences' tables (a larger table goes through the scratch arena).
const tableBytes = 512 << 10

// stepTables are the small int32 tables a batched step's operations read,
// kept on the device from one call to the next beside their host copies:
// AttentionBlocks' block tables (attn) and RopeRows' positions (pos). Every
// layer of a step reads the same tables, so only the first layer uploads
// them. The memory is allocated when the backend opens and counted in
// Fixed.
type stepTables struct {
	p         uintptr // attn at p, pos at p+tableBytes
	attn, pos tableCache
}

// tableCache is one table's device room and what it holds.
type tableCache struct {
	p    uintptr
	host []int32 // the device's contents; nil when unknown
}

// putTable makes c's device room hold v, uploading it unless it already does
// (the upload is ordered on the compute stream after the kernels queued
// before, which read the previous contents). The caller holds opsMu.
func (b *Backend) putTable(op string, c *tableCache, v []int32) error {
	if slices.Equal(c.host, v) && c.host != nil {
		return nil
	}
	c.host = c.host[:0]
	b.counts.copies.Add(1)
	if err := cu.MemcpyHtoDAsync(cu.DevicePtr(c.p), unsafe.Pointer(&v[0]), int64(len(v))*4, b.compute); err != nil {
		c.host = nil
		return fmt.Errorf("%s: %s tables: %w", b.name, op, cuError(err))
	}
	c.host = append(c.host, v...)
	return nil
}

// table returns device memory holding v for the kernels queued next: the
// step table c when v fits it, else the scratch arena (release gives it
// back once they are queued). The caller holds opsMu.
func (b *Backend) table(op string, c *tableCache, v []int32) (p uintptr, release func(), err error) {
	if b.capturing() {
		// A graph would replay whatever the room holds then.
		return 0, nil, fmt.Errorf("%s: %s tables: %w", b.name, op, errCapturing)
	}
	n := int64(len(v)) * 4
	if c.p != 0 && n <= tableBytes {
		return c.p, func() {}, b.putTable(op, c, v)
	}
	p, release, err = b.scratch(op, n)
	if err != nil {
		return 0, nil, err
	}
	b.counts.copies.Add(1)
	if err := cu.MemcpyHtoDAsync(cu.DevicePtr(p), unsafe.Pointer(&v[0]), n, b.compute); err != nil {
		release()
		return 0, nil, fmt.Errorf("%s: %s tables: %w", b.name, op, cuError(err))
	}
	return p, release, nil
}
