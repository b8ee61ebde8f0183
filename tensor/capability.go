package tensor

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Optional capabilities of a backend, each a small interface with one
// helper that finds it. Call the helpers rather than type-asserting: they
// look behind a front from Checked (and any other wrapper with an Unwrap()
// Backend method), where a type assertion would miss the capability and
// silently take the slow path. (GradOps, the backward operations, are found
// with CheckedGrad, which also puts the checks in front of them.)

// capability returns the first of m and the backends behind it that
// implements C.
func capability[C any](m Memory) (C, bool) {
	for m != nil {
		if c, ok := m.(C); ok {
			return c, true
		}
		u, ok := m.(interface{ Unwrap() Backend })
		if !ok {
			break
		}
		m = u.Unwrap()
	}
	var zero C
	return zero, false
}

// RowExact is a backend whose MatMulRows computes MatMul with each row of
// out bit for bit what a one-row MatMul of that row of x gives, whatever
// the number of rows: a batch of sequences then gets, row for row, what
// each sequence gets alone. (A backend's MatMul may multiply one row and
// several with different kernels, which round differently.) Call it
// through MatMulRows, which checks the arguments.
type RowExact interface {
	MatMulRows(out, x, w, bias *Tensor) error
}

// MatMulRows computes MatMul(out, x, w, bias) on b, after the checks of
// Checked, each row as a one-row product computes it when b is RowExact;
// on another backend (a GPU, whose products are exact to its tolerance
// only) it is b's MatMul.
func MatMulRows(b Backend, out, x, w, bias *Tensor) error {
	if err := checkMatMul(out, x, w, bias); err != nil {
		return err
	}
	if r, ok := capability[RowExact](b); ok {
		return r.MatMulRows(out, x, w, bias)
	}
	return b.MatMul(out, x, w, bias)
}

// Syncer is a backend whose operations run asynchronously.
type Syncer interface {
	Sync() error
}

// Sync waits for m's queued work when m runs asynchronously (Syncer) and
// returns its first asynchronous error; otherwise it returns nil.
func Sync(m Memory) error {
	if s, ok := capability[Syncer](m); ok {
		return s.Sync()
	}
	return nil
}

// PinnedAllocator is a backend that can allocate page-locked host memory,
// from which copies to the device run at full link speed.
type PinnedAllocator interface {
	AllocPinned(n int64) ([]byte, error)
	FreePinned(b []byte) error
}

// Pinned returns m's page-locked host allocator, if it has one.
func Pinned(m Memory) (PinnedAllocator, bool) { return capability[PinnedAllocator](m) }

// HostRegistrar is a backend that can page-lock host memory it did not
// allocate (a read-only mapping of a weight file, whose pages are the page
// cache's), so that copies from it run at the pinned rate with no staging
// copy on the CPU. The memory is only read by copies. unregister undoes
// the registration: call it once, after every copy from the memory has
// landed and before the memory goes away.
type HostRegistrar interface {
	RegisterHost(b []byte) (unregister func() error, err error)
}

// HostRegister returns m's host registrar, if it has one.
func HostRegister(m Memory) (HostRegistrar, bool) { return capability[HostRegistrar](m) }

// AsyncUploader is a backend that can copy host memory to a tensor on a
// separate copy stream. The returned wait function blocks compute (not the
// host) until the copy has landed.
type AsyncUploader interface {
	UploadAsync(ctx context.Context, dst *Tensor, off int64, src []byte) (ready func() error, err error)
}

// AsyncUpload returns m's asynchronous copy engine, if it has one.
func AsyncUpload(m Memory) (AsyncUploader, bool) { return capability[AsyncUploader](m) }

// StagedUploader is an AsyncUploader whose copies the host can also wait
// for, one by one: a caller that reads weights into a few pinned staging
// buffers and copies from them reuses a buffer as soon as the copies out
// of it have landed, without waiting for everything queued (Sync) and
// without making compute wait.
type StagedUploader interface {
	AsyncUploader
	// UploadStaged queues the copy UploadAsync queues, on the same terms,
	// and returns two waits. ready orders compute after the copy, as
	// UploadAsync's does. landed blocks the calling goroutine until the
	// copy has read all of src, and returns the copy's error; src may be
	// reused once it has returned. Call each at most once and both
	// eventually, in either order and from any goroutine: the backend may
	// hold what it tracks the copy with until both have run.
	UploadStaged(ctx context.Context, dst *Tensor, off int64, src []byte) (ready, landed func() error, err error)
}

// StagedUpload returns m's asynchronous copy engine with host-side waits,
// if it has one.
func StagedUpload(m Memory) (StagedUploader, bool) { return capability[StagedUploader](m) }

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

// Managed returns m's unified-memory allocator, if it has one.
func Managed(m Memory) (ManagedAllocator, bool) { return capability[ManagedAllocator](m) }

// MemoryInfo is a backend that can report its device's memory.
type MemoryInfo interface {
	MemInfo() (free, total int64, err error)
}

// FreeMemory reports the free and total bytes of m's device (MemoryInfo),
// as the driver sees them. A backend that cannot tell returns an error
// wrapping errors.ErrUnsupported.
func FreeMemory(m Memory) (free, total int64, err error) {
	mi, ok := capability[MemoryInfo](m)
	if !ok {
		return 0, 0, fmt.Errorf("tensor: %s cannot report its memory: %w", m.Name(), errors.ErrUnsupported)
	}
	return mi.MemInfo()
}

// CopyTimer is a backend that times its asynchronous uploads: the bytes
// copied so far, the time its copy stream was busy with them, and the time
// its compute waited for copies (the part of the copy time not hidden).
type CopyTimer interface {
	CopyStats() (bytes int64, busy, stall time.Duration)
}

// CopyStats returns m's copy statistics (CopyTimer), or ok false when m
// does not time its copies.
func CopyStats(m Memory) (bytes int64, busy, stall time.Duration, ok bool) {
	ct, ok := capability[CopyTimer](m)
	if !ok {
		return 0, 0, 0, false
	}
	bytes, busy, stall = ct.CopyStats()
	return bytes, busy, stall, true
}

// ComputeTimer is a backend that times a stretch of its compute queue with
// events, without waiting in between: StartCompute marks the queue, and the
// stop it returns marks it again, waits for the compute queued before that
// mark (copies no compute waits for go on) and returns the device time
// between the two marks. One pair of marks a batched step costs nothing
// beside the step; a mark per operation would.
type ComputeTimer interface {
	StartCompute() (stop func() (time.Duration, error), err error)
}

// StartCompute starts timing m's compute queue (ComputeTimer); ok is false
// when m does not time it (the CPU backend computes as operations are
// called: their wall time is its device time).
func StartCompute(m Memory) (stop func() (time.Duration, error), ok bool, err error) {
	ct, ok := capability[ComputeTimer](m)
	if !ok {
		return nil, false, nil
	}
	stop, err = ct.StartCompute()
	return stop, true, err
}

// CachingAllocator is a backend whose memory holds more device bytes than
// its live tensors: allocations rounded up to the allocator's block sizes,
// freed blocks kept for reuse, and memory the backend keeps for itself. A
// budget that is to hold every device byte charges AllocSize for each
// Alloc, counts Cached as held, charges Fixed from the start, and Trims the
// cache before evicting anything.
type CachingAllocator interface {
	// AllocSize is the bytes an Alloc of n bytes takes from the device.
	AllocSize(n int64) int64
	// Cached is the bytes of freed blocks kept for reuse.
	Cached() int64
	// Trim returns the cached blocks to the device and reports the bytes
	// released.
	Trim() (int64, error)
	// Fixed is the device memory the backend holds outside Alloc for its
	// whole life (a library's workspace, say).
	Fixed() int64
}

// Caching returns m's caching allocator, if it has one.
func Caching(m Memory) (CachingAllocator, bool) { return capability[CachingAllocator](m) }

// Launches counts the work a backend's host side has issued to its device
// since it opened: each is one call into the driver or a library that the
// host pays for (about 5 us through cgo on an H200), so that a decode
// step's count says how launch-bound it is.
type Launches struct {
	Kernels int64 `json:"kernels"` // kernel launches
	Copies  int64 `json:"copies"`  // copies and memsets on the device's streams
	Library int64 `json:"library"` // calls into a library that launch work of their own (cuBLAS)
	Graphs  int64 `json:"graphs"`  // replays of a captured graph, each counted once whatever it holds
}

// Total is every launch of l.
func (l Launches) Total() int64 { return l.Kernels + l.Copies + l.Library + l.Graphs }

// Sub is the launches between o and l (l taken after o).
func (l Launches) Sub(o Launches) Launches {
	return Launches{Kernels: l.Kernels - o.Kernels, Copies: l.Copies - o.Copies, Library: l.Library - o.Library, Graphs: l.Graphs - o.Graphs}
}

// LaunchCounter is a backend that counts its launches (Launches).
type LaunchCounter interface {
	Launches() Launches
}

// CountLaunches returns m's launches so far (LaunchCounter), or ok false
// when m does not count them (the CPU backend launches nothing).
func CountLaunches(m Memory) (Launches, bool) {
	lc, ok := capability[LaunchCounter](m)
	if !ok {
		return Launches{}, false
	}
	return lc.Launches(), true
}

// ComputeDownloader is a backend whose DownloadComputed copies src into dst
// once the compute queued before the call has finished, without waiting
// for UploadAsync copies that no compute has been ordered after (Download
// waits for every queued copy). Handing an activation from the device to
// the host then leaves the copies of layers still to come running: the
// copy engine streams them while the host computes.
type ComputeDownloader interface {
	DownloadComputed(dst []byte, src *Tensor) error
}

// DownloadComputed copies src into dst with m's DownloadComputed when m is
// a ComputeDownloader, else with its Download.
func DownloadComputed(m Memory, dst []byte, src *Tensor) error {
	if d, ok := capability[ComputeDownloader](m); ok {
		return d.DownloadComputed(dst, src)
	}
	return m.Download(dst, src)
}

// AsyncDownloader is a backend that can copy a tensor into host memory on
// a stream of its own, without the host waiting: a block whose keys and
// values go back to the host (a hybrid twin's) then leaves the compute
// stream and the host free to queue the next blocks while the copy runs.
type AsyncDownloader interface {
	// DownloadAsync queues the copy of src into dst after the compute
	// queued before the call (which wrote src) and returns at once. ready
	// makes the compute queued after it wait for the copy: call it before
	// queuing work that overwrites src. landed blocks the calling
	// goroutine until dst holds the copy and returns the copy's error:
	// call it before the host reads dst or lets it go. Call each at most
	// once and both eventually, in either order and from any goroutine.
	DownloadAsync(dst []byte, src *Tensor) (ready, landed func() error, err error)
}

// AsyncDownload returns m's asynchronous download, if it has one.
func AsyncDownload(m Memory) (AsyncDownloader, bool) { return capability[AsyncDownloader](m) }

// PeerCopier is a backend that can copy one of its tensors straight into a
// tensor of another device (a peer copy, over NVLink or PCIe), without the
// round trip through host memory that a Download and an Upload make.
type PeerCopier interface {
	// CanCopyToPeer reports whether CopyToPeer can copy into to's tensors.
	// The first call for a device may set up the access (the driver's
	// peer mappings, both ways); later calls are cheap.
	CanCopyToPeer(to Memory) bool
	// CopyToPeer copies src, a tensor of this backend, into dst, a tensor
	// of to with the same byte size. The copy runs after the work queued
	// on both devices before the call (which may still read dst), and the
	// work queued on to after the call runs after the copy; the call may
	// return before the copy lands.
	CopyToPeer(to Memory, dst, src *Tensor) error
}

// PeerCopy returns from's peer copier when it can copy into to's tensors
// (PeerCopier.CanCopyToPeer); ok is false otherwise, and a hand-over goes
// through host memory.
func PeerCopy(from, to Memory) (PeerCopier, bool) {
	pc, ok := capability[PeerCopier](from)
	if !ok || !pc.CanCopyToPeer(to) {
		return nil, false
	}
	return pc, true
}

// Marker is a backend that can keep a timeline of its work for measuring
// (the CUDA backend's, under STRATA_CUDA_TIMELINE): Mark adds the host's
// time now to it, labelled, beside the copies and downloads it records.
// Without a timeline Mark does nothing, at the cost of a check.
type Marker interface{ Mark(label string) }

// Mark adds the host's time now, labelled, to m's timeline when m keeps
// one (Marker); else it does nothing.
func Mark(m Memory, label string) {
	if mk, ok := capability[Marker](m); ok {
		mk.Mark(label)
	}
}

// Argmaxer is a backend that finds the largest logits where they are:
// Argmax returns, for each row of x (F32 [rows, n], or [n] as one row),
// the index of its largest element, the lowest on ties, or -1 when the row
// holds a NaN or an infinity; it waits for the result. Greedy decoding
// then downloads an id instead of a row of logits (nn.Session.Greedy).
type Argmaxer interface {
	Argmax(x *Tensor) ([]int32, error)
}

// Argmaxers returns m's Argmaxer, if it has one.
func Argmaxers(m Memory) (Argmaxer, bool) { return capability[Argmaxer](m) }
