package tensor

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
)

// ErrOutOfMemory is returned (wrapped) when a backend or a budget cannot
// satisfy an allocation. Callers branch on it with errors.Is.
var ErrOutOfMemory = errors.New("out of memory")

// Backend allocates tensors in its memory and runs the operations the
// decoder needs on them. Activations are F32; weight arguments (w, table,
// bias, norm weights) may be F32, F16 or BF16 and are read in their stored
// type with F32 accumulation: no F32 copy of a weight is ever made.
//
// All tensors passed to a backend's operations must have been allocated by
// that backend (or, for the CPU backend, be host tensors). Operations may run
// asynchronously on a device; Download synchronises.
type Backend interface {
	// Name identifies the backend ("cpu", "cuda:0").
	Name() string

	// Alloc returns an uninitialised tensor in the backend's memory.
	Alloc(dt DType, shape Shape) (*Tensor, error)
	// Free releases a tensor from Alloc. Freeing nil is a no-op.
	Free(t *Tensor)
	// Upload copies len(src) bytes of host memory into dst, starting at
	// byte offset off of dst.
	Upload(dst *Tensor, off int64, src []byte) error
	// Download copies src's bytes into dst (len(dst) == src.NumBytes()),
	// waiting for pending work on src.
	Download(dst []byte, src *Tensor) error

	Ops
}

// Ops are the compute operations of a Backend. Shapes are given as
// [rows, columns]; every tensor is contiguous and row-major.
type Ops interface {
	// MatMul computes out[M,N] = x[M,K] · w[N,K]ᵀ (+ bias[N] on every row
	// when bias is non-nil). w is in Hugging Face's [out_features,
	// in_features] layout.
	MatMul(out, x, w, bias *Tensor) error
	// RMSNorm computes out[i,:] = x[i,:] / sqrt(mean(x[i,:]²) + eps) * w.
	RMSNorm(out, x, w *Tensor, eps float32) error
	// Rope rotates x[T, r.Heads*r.HeadDim] in place by the rotary
	// embedding r (see Rotary).
	Rope(x *Tensor, r Rotary) error
	// SiLUMul computes out = silu(gate) * up, elementwise.
	SiLUMul(out, gate, up *Tensor) error
	// Add computes out = a + b, elementwise (out may alias a or b).
	Add(out, a, b *Tensor) error
	// Embed gathers rows: out[i,:] = table[ids[i],:] converted to F32.
	// An id outside the table is an error.
	Embed(out, table *Tensor, ids []int32) error
	// CopyRows copies n rows of src starting at row srcRow into dst starting
	// at row dstRow; both have the same row length (the product of all but
	// the first dimension) and dtype.
	CopyRows(dst *Tensor, dstRow int, src *Tensor, srcRow, n int) error
	// Attention computes causal grouped-query attention (see Attn) into
	// out [T, a.Heads*a.HeadDim] F32.
	Attention(out *Tensor, a Attn) error
}

// Rotary is the rotary position embedding of Rope. Row t of x is at
// position Pos0+t, and each of its Heads heads of HeadDim (even)
// dimensions is rotated by the angles of that position, read from the F32
// tables Cos and Sin [maxPos, HeadDim/2]. The pairs are (j, j+HeadDim/2),
// Hugging Face's rotate_half convention.
type Rotary struct {
	Cos, Sin             *Tensor
	Heads, HeadDim, Pos0 int
}

// Attn is causal grouped-query attention, for T queries at positions
// Pos0..Pos0+T-1. Q is [T, Heads*HeadDim] F32; K and V are the caches
// [maxPos, KVHeads*HeadDim] holding positions 0..Pos0+T-1, of one float
// type (a backend may read only F32 caches, and says so with an error).
// Query row t sees positions 0..Pos0+t; query head h reads KV head
// h/(Heads/KVHeads), so KVHeads divides Heads. Scores are scaled by Scale
// (not NaN) and softmaxed in F32.
type Attn struct {
	Q, K, V                       *Tensor
	Heads, KVHeads, HeadDim, Pos0 int
	Scale                         float32
}

// Optional capabilities, found by type assertion.

// Syncer is a backend whose operations run asynchronously.
type Syncer interface {
	Sync() error
}

// PinnedAllocator is a backend that can allocate page-locked host memory,
// from which copies to the device run at full link speed.
type PinnedAllocator interface {
	AllocPinned(n int64) ([]byte, error)
	FreePinned(b []byte) error
}

// AsyncUploader is a backend that can copy host memory to a tensor on a
// separate copy stream. The returned wait function blocks compute (not the
// host) until the copy has landed.
type AsyncUploader interface {
	UploadAsync(ctx context.Context, dst *Tensor, off int64, src []byte) (ready func() error, err error)
}

// ManagedAllocator is a backend with unified (managed) memory: tensors
// addressable from host and device whose pages the driver migrates on
// demand or when prefetched. Prefetches are ordered with the backend's
// compute.
type ManagedAllocator interface {
	// AllocManaged allocates managed memory. It refuses (with an error
	// wrapping ErrOutOfMemory) any request larger than the device's free
	// memory, so that managed memory never oversubscribes the device.
	AllocManaged(dt DType, shape Shape) (*Tensor, error)
	// PrefetchToDevice migrates t's pages to the device.
	PrefetchToDevice(t *Tensor) error
	// PrefetchToHost migrates t's pages to host memory.
	PrefetchToHost(t *Tensor) error
	// AdviseHost makes host memory the preferred location of t's pages.
	AdviseHost(t *Tensor) error
	// AdviseDeviceAccess maps t's pages for the device where they are, so
	// that kernels read them in place over the link instead of migrating
	// them.
	AdviseDeviceAccess(t *Tensor) error
}

// MemoryInfo is a backend that can report its device's memory.
type MemoryInfo interface {
	MemInfo() (free, total int64, err error)
}

// Registry of backends by name, with "cpu" always present.

var (
	registryMu sync.Mutex
	registry   = map[string]func() (Backend, error){}
)

// Register makes a backend constructor available by name. Backends register
// themselves from init functions; registering a name twice panics.
func Register(name string, open func() (Backend, error)) {
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := registry[name]; dup {
		panic("tensor: backend registered twice: " + name)
	}
	registry[name] = open
}

// Open returns a new instance of the named backend.
func Open(name string) (Backend, error) {
	registryMu.Lock()
	open, ok := registry[name]
	registryMu.Unlock()
	if !ok {
		return nil, fmt.Errorf("tensor: no backend %q (have %v)", name, Backends())
	}
	return open()
}

// Backends lists the registered backend names, sorted.
func Backends() []string {
	registryMu.Lock()
	defer registryMu.Unlock()
	names := make([]string, 0, len(registry))
	for n := range registry {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
