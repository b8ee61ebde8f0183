//go:build cuda

package cuda

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
)

// Interfaces the backend implements.
var (
	_ tensor.Backend           = (*Backend)(nil)
	_ tensor.Syncer            = (*Backend)(nil)
	_ tensor.PinnedAllocator   = (*Backend)(nil)
	_ tensor.AsyncUploader     = (*Backend)(nil)
	_ tensor.StagedUploader    = (*Backend)(nil)
	_ tensor.ComputeDownloader = (*Backend)(nil)
	_ tensor.AsyncDownloader   = (*Backend)(nil)
	_ tensor.MemoryInfo        = (*Backend)(nil)
	_ tensor.ManagedAllocator  = (*Backend)(nil)
	_ tensor.CachingAllocator  = (*Backend)(nil)
	_ tensor.LaunchCounter     = (*Backend)(nil)
	_ tensor.PeerCopier        = (*Backend)(nil)
)

// Backend runs strata's tensor operations on one CUDA device. Its methods
// are safe for concurrent use; operations are queued on one compute
// stream in call order, and UploadAsync copies run on a second stream.
type Backend struct {
	ordinal int
	dev     cu.Device
	ctx     cu.CUContext
	info    DeviceInfo
	name    string

	life   sync.RWMutex // held for reading by every call, for writing by Close
	closed atomic.Bool

	compute, copy cu.Stream
	evict         cu.Stream  // copies to the host: managed pages going back, DownloadAsync
	opsMu         sync.Mutex // orders compute-stream work and guards the cuBLAS handle
	copyMu        sync.Mutex
	copyTail      cu.Event // recorded after every UploadAsync copy

	evMu       sync.Mutex
	evFree     []cu.Event
	evAll      []cu.Event
	tevFree    []cu.Event // timing events, for CopyStats
	evBlock    []cu.Event // events with blocking synchronisation, for UploadStaged
	spans      []span     // timed spans not yet read
	tl         *timeline  // with TimelineEnv set
	copyBytes  int64
	copyBusy   time.Duration
	stall      time.Duration
	modules    []module
	kernels    map[string]kfunc
	normBlocks map[string]uint32 // normedGrid's blocks a multiprocessor, by kernel
	alloc      *allocator
	pinnedMu   sync.Mutex
	pinned     map[unsafe.Pointer]int64
	pinnedSum  int64
	// registered is the host memory RegisterHost page-locked, by start.
	registered map[unsafe.Pointer]int64

	blas          cublasHandle
	blasVersion   int
	blasName      string
	blasErr       error
	workspace     uintptr
	workspaceSize int64
	scr           scratchArena
	tab           stepTables

	// counts are the launches issued so far (Launches).
	counts struct{ kernels, copies, library, graphs atomic.Int64 }
	// pdl launches a decode step's small kernels with programmatic
	// dependent launch (runStep): Open sets it on compute capability 9.0
	// and newer unless PDLEnv turns it off; pdlLaunches counts them.
	pdl         bool
	fold        bool // FoldEnv: normfused.go folds norms and adds into products
	foldMaxK    int  // the longest row whose norm it folds (foldMaxK)
	pdlLaunches atomic.Int64

	// Graph capture (graph.go): captureTid is the OS thread of the
	// goroutine inside Capture's f (0 when none), whose operations run
	// without opsMu, which Capture holds; gate keeps uploads and
	// prefetches, which touch the compute stream without opsMu, out of a
	// capture; graphs are the live graphs, destroyed by Close.
	captureTid atomic.Int64
	gate       sync.RWMutex
	graphsMu   sync.Mutex
	graphs     map[*graph]struct{}

	// peerCan is, per other backend asked about (CanCopyToPeer), whether
	// the two devices copy to each other directly (peer.go).
	peerMu  sync.Mutex
	peerCan map[*Backend]bool

	// gemvMaxRows is the largest M that MatMul sends to the GEMV kernels
	// rather than to cuBLAS: on an H200 with 4096x4096 F16 weights the
	// kernels take 13.3 and 14.4 us for M = 1 and 2, cuBLAS (with the cast
	// of x) 19.3 us, and cuBLAS wins from M = 4 on (PERF.md).
	gemvMaxRows int
	// gemvRows picks the M = 1 GEMV kernel: 0, per shape (rowsPerWarp);
	// -1, gemv_*_m1 (one row per warp); 1 or 2, gemv_*_r1 or _r2 (that
	// many rows per warp, each batch of loads in flight together;
	// kernels/gemv.cuh). BenchmarkGEMVShapes sets it on its backend to
	// compare them.
	gemvRows int
	// gemvSplit, when set, is the candidate kernel (gemvsplit.go) every
	// M = 1 product of F16 or BF16 weights runs on: MatMul, MatMulMany
	// and GateUpSiLU. Open sets it and gemvRows from GEMVEnv;
	// BenchmarkGEMVShapes sets it on its backend to compare them.
	gemvSplit *gemvVariant
	// qgemv picks the integer GEMV of one row of x for the quantized
	// formats with direct kernels (quantFormat.direct, kernels/quantd.cuh):
	// qgemvStaged (the kernels of quantx.cuh), qgemvDirect or
	// qgemvDirect8, and qgemvD the direct kernel's variant (zero: by the
	// launch's rows, gemvdAuto). Open sets them
	// from QGEMVEnv (defaultQGEMV, defaultGEMVDVariant);
	// BenchmarkQuantGEMV and TestQuantGEMVKernels set them on their
	// backend to compare them.
	qgemv  qgemvKind
	qgemvD gemvdVariant
	// splitChunk is the fewest positions a block of the decode attention
	// walks (planAttention): Open sets it from SplitChunkEnv.
	splitChunk int
	// splitCount is splitCounts int32 counts, zero between launches,
	// after the step tables: the decode attention's blocks count
	// themselves there, per head and query, so that the last merges the
	// splits (kernels/attention_split.cuh); zero for a separate merge.
	splitCount uintptr
	// qgemvWide picks, for one row of x and the formats without direct
	// kernels but with a wide staged one (quantFormat.xrowsWide > 0: Q8_0,
	// Q6_K, Q4_0, Q4_1, Q5_0, Q5_1), gemvx_<f>_m1w (twice the warps an SM,
	// fewer rows a block) instead of gemvx_<f>_m1. False until an H200
	// run (BenchmarkQuantGEMV's -wide entries) says otherwise.
	qgemvWide bool

	// gradPath is the implementation MatMulGradX and MatMulGradW use:
	// pathAuto (cuBLAS when it is loaded, else the tiled kernels) or
	// pathTiled, which tests set on a backend of their own to check the
	// fallback.
	gradPath mmPath
	// preciseChunk bounds the bytes of an F16 or BF16 weight that
	// MatMulPrecise widens to F32 at a time; 0 means gradChunkBytes. Tests
	// make it small so that several chunks run.
	preciseChunk int64
}

// DeviceCount returns the number of CUDA devices, or an error wrapping
// ErrNoDevice when the driver cannot be initialised.
func DeviceCount() (int, error) {
	if err := initResult(); err != nil {
		return 0, fmt.Errorf("cuda: %w: the driver could not be initialised (%s): %w", ErrNoDevice, driverDescription(), err)
	}
	n, err := cu.NumDevices()
	if err != nil {
		return 0, fmt.Errorf("cuda: %w: counting devices: %w", ErrNoDevice, cuError(err))
	}
	return n, nil
}

// Available reports whether at least one CUDA device can be used.
func Available() bool {
	n, err := DeviceCount()
	return err == nil && n > 0
}

// Devices describes every CUDA device.
func Devices() ([]DeviceInfo, error) {
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	out := make([]DeviceInfo, 0, n)
	for i := range n {
		info, err := deviceInfo(i)
		if err != nil {
			return nil, err
		}
		out = append(out, info)
	}
	return out, nil
}

func driverDescription() string {
	if v := cu.Version(); v > 0 {
		return "driver supports CUDA " + versionString(v)
	}
	return "no driver version"
}

func deviceInfo(ordinal int) (DeviceInfo, error) {
	dev, err := cu.GetDevice(ordinal)
	if err != nil {
		return DeviceInfo{}, fmt.Errorf("cuda: device %d: %w", ordinal, cuError(err))
	}
	info := DeviceInfo{Ordinal: ordinal, DriverVersion: cu.Version()}
	if info.Name, err = dev.Name(); err != nil {
		return info, fmt.Errorf("cuda: device %d name: %w", ordinal, cuError(err))
	}
	if info.TotalMem, err = dev.TotalMem(); err != nil {
		return info, fmt.Errorf("cuda: device %d memory: %w", ordinal, cuError(err))
	}
	attrs := []struct {
		a cu.DeviceAttribute
		v *int
	}{{cu.ComputeCapabilityMajor, &info.Major}, {cu.ComputeCapabilityMinor, &info.Minor}, {cu.MultiprocessorCount, &info.SMs}}
	for _, at := range attrs {
		if *at.v, err = dev.Attribute(at.a); err != nil {
			return info, fmt.Errorf("cuda: device %d attribute %v: %w", ordinal, at.a, cuError(err))
		}
	}
	if v, err := dev.Attribute(cu.ConcurrentManagedAccess); err == nil {
		info.ManagedMemory = v != 0
	}
	return info, nil
}

// Open initialises device (0-based) and returns a backend on it: a context,
// a compute and a copy stream, the kernels, and cuBLAS when it can be
// loaded. Without cuBLAS, matrix products run on built-in kernels (BLAS
// says which). The environment variable STRATA_CUBLAS may name the cuBLAS
// library file to load instead of searching the versioned sonames, and
// STRATA_CUDA_GEMV (GEMVEnv) the decode GEMV kernels to use (defaultGEMV
// where it is empty, on compute capability 9.0 and newer) and
// STRATA_CUDA_QGEMV (QGEMVEnv) the integer GEMV of Q4_K and Q5_K, and
// STRATA_CUDA_SPLIT_CHUNK (SplitChunkEnv) the positions a block of the
// decode attention walks (splitChunk where it is empty),
// STRATA_CUDA_PDL=0 (PDLEnv) turns off programmatic dependent launch of a
// decode step's small kernels, and STRATA_CUDA_FOLD=0 (FoldEnv) the
// norms and adds folded into the decode step's products (=all folds the
// norms of long rows too).
func Open(device int) (*Backend, error) {
	chunk, err := splitChunkNamed(os.Getenv(SplitChunkEnv))
	if err != nil {
		return nil, err
	}
	pdl, err := pdlNamed(os.Getenv(PDLEnv))
	if err != nil {
		return nil, err
	}
	fold, foldK, err := foldNamed(os.Getenv(FoldEnv))
	if err != nil {
		return nil, err
	}
	gemvName := os.Getenv(GEMVEnv)
	split, rows, err := gemvVariantNamed(gemvName)
	if err != nil {
		return nil, err
	}
	qgemv, qgemvD, err := qgemvNamed(os.Getenv(QGEMVEnv))
	if err != nil {
		return nil, err
	}
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, fmt.Errorf("cuda: %w: the driver reports none (%s)", ErrNoDevice, driverDescription())
	}
	if device < 0 || device >= n {
		return nil, fmt.Errorf("cuda: device %d does not exist (have %d)", device, n)
	}
	info, err := deviceInfo(device)
	if err != nil {
		return nil, err
	}
	if info.Major < 7 {
		return nil, fmt.Errorf("cuda: device %d (%s) has compute capability %d.%d; strata's kernels need 7.0 or newer", device, info.Name, info.Major, info.Minor)
	}
	if gemvName == "" && info.Major >= 9 {
		split, _, _ = gemvVariantNamed(defaultGEMV)
	}
	if split != nil && split.pdl && info.Major < 9 {
		return nil, fmt.Errorf("cuda: %s=%s: the kernels need compute capability 9.0, device %d (%s) has %d.%d", GEMVEnv, split.name, device, info.Name, info.Major, info.Minor)
	}
	b := &Backend{
		ordinal: device, info: info, name: fmt.Sprintf("cuda:%d", device),
		kernels: map[string]kfunc{}, normBlocks: map[string]uint32{}, pinned: map[unsafe.Pointer]int64{}, gemvMaxRows: 2, graphs: map[*graph]struct{}{},
		gemvRows: rows, gemvSplit: split, qgemv: qgemv, qgemvD: qgemvD, splitChunk: chunk,
		pdl: pdl && info.Major >= 9, fold: fold, foldMaxK: foldK,
	}
	b.dev, _ = cu.GetDevice(device)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if b.ctx, err = b.dev.RetainPrimaryCtx(); err != nil {
		return nil, fmt.Errorf("%s: creating a context: %w", b.name, cuError(err))
	}
	if err := b.setup(); err != nil {
		b.release()
		return nil, err
	}
	return b, nil
}

func (b *Backend) setup() error {
	if err := cu.SetCurrentContext(b.ctx); err != nil {
		return fmt.Errorf("%s: making the context current: %w", b.name, cuError(err))
	}
	var err error
	if b.compute, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return fmt.Errorf("%s: creating the compute stream: %w", b.name, cuError(err))
	}
	if b.copy, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return fmt.Errorf("%s: creating the copy stream: %w", b.name, cuError(err))
	}
	if b.evict, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return fmt.Errorf("%s: creating the eviction stream: %w", b.name, cuError(err))
	}
	if b.copyTail, err = cu.MakeEvent(cu.DisableTiming); err != nil {
		return fmt.Errorf("%s: creating an event: %w", b.name, cuError(err))
	}
	if err := b.copyTail.Record(b.copy); err != nil {
		return fmt.Errorf("%s: recording an event: %w", b.name, cuError(err))
	}
	if err := b.startTimeline(); err != nil {
		return err
	}
	b.alloc = newAllocator(b.driverAlloc, func(p uintptr) error { return cuError(cu.MemFree(cu.DevicePtr(p))) }, b.syncStreams)
	p, err := b.driverAlloc(scratchBytes)
	if err != nil {
		return fmt.Errorf("%s: the scratch arena: %w", b.name, err)
	}
	b.scr.p, b.scr.size = p, scratchBytes
	if p, err = b.driverAlloc(2*tableBytes + 4*splitCounts); err != nil {
		return fmt.Errorf("%s: the step tables: %w", b.name, err)
	}
	b.tab = stepTables{p: p, attn: tableCache{p: p}, pos: tableCache{p: p + tableBytes}}
	if err := cu.MemsetD32(cu.DevicePtr(p+2*tableBytes), 0, splitCounts); err != nil {
		return fmt.Errorf("%s: the attention's split counts: %w", b.name, cuError(err))
	}
	b.splitCount = p + 2*tableBytes
	if err := b.loadKernels(); err != nil {
		return err
	}
	b.openBLAS()
	return nil
}

// openBLAS loads cuBLAS and gives it a workspace from the device budget;
// failure is recorded, not fatal.
func (b *Backend) openBLAS() {
	soname, err := openCUBLAS(os.Getenv("STRATA_CUBLAS"))
	if err != nil {
		b.blasErr = fmt.Errorf("cuBLAS not loaded: %v", err)
		return
	}
	h, v, err := cublasCreate(b.compute)
	if err != nil {
		b.blasErr = fmt.Errorf("cuBLAS (%s) not usable: %v", soname, err)
		return
	}
	b.blas, b.blasVersion, b.blasName = h, v, soname
	if cublasHasWorkspace() {
		size := int64(4 << 20)
		if b.info.Major >= 9 {
			size = 32 << 20 // what cuBLAS itself would take on Hopper
		}
		if p, err := cu.MemAlloc(size); err == nil {
			if cublasSetWorkspace(h, uintptr(p), size) == nil {
				b.workspace, b.workspaceSize = uintptr(p), size
			} else {
				cu.MemFree(p)
			}
		}
	}
}

func (b *Backend) driverAlloc(n int64) (uintptr, error) {
	p, err := cu.MemAlloc(n)
	if err != nil {
		if err == cu.OutOfMemory {
			free, total, _ := cu.MemInfo()
			return 0, fmt.Errorf("cannot allocate %d bytes (%d of %d free): %w", n, free, total, tensor.ErrOutOfMemory)
		}
		return 0, fmt.Errorf("allocating %d bytes: %w", n, cuError(err))
	}
	return uintptr(p), nil
}

// enter makes the context current on a locked OS thread and holds off
// Close; every exported method that touches the device brackets its work
// with enter and leave.
func (b *Backend) enter(op string) error {
	b.life.RLock()
	if b.closed.Load() {
		b.life.RUnlock()
		return fmt.Errorf("%s: %s: %w", b.name, op, ErrClosed)
	}
	runtime.LockOSThread()
	if err := cu.SetCurrentContext(b.ctx); err != nil {
		runtime.UnlockOSThread()
		b.life.RUnlock()
		return fmt.Errorf("%s: %s: making the context current: %w", b.name, op, cuError(err))
	}
	return nil
}

func (b *Backend) leave() {
	runtime.UnlockOSThread()
	b.life.RUnlock()
}

// Name returns "cuda:N".
func (b *Backend) Name() string { return b.name }

// Info describes the backend's device.
func (b *Backend) Info() DeviceInfo { return b.info }

// BLAS says which cuBLAS library the backend uses, or why none.
func (b *Backend) BLAS() string {
	if b.blasErr != nil {
		return b.blasErr.Error() + "; matrix products use the built-in kernels"
	}
	return fmt.Sprintf("cuBLAS %d (%s)", b.blasVersion, b.blasName)
}

// Stats returns the memory accounts. After Close every byte count is zero
// unless something could not be freed.
func (b *Backend) Stats() Stats {
	s := b.alloc.snapshot()
	b.pinnedMu.Lock()
	s.Pinned = b.pinnedSum
	b.pinnedMu.Unlock()
	s.Workspace = b.Fixed()
	s.Reserved += b.Fixed()
	return s
}

// Launches counts the kernel launches, copies, cuBLAS calls and graph
// replays the backend has issued since Open (tensor.LaunchCounter). A
// graph's replay counts once; the launches captured into it counted when
// it was captured.
func (b *Backend) Launches() tensor.Launches {
	return tensor.Launches{Kernels: b.counts.kernels.Load(), Copies: b.counts.copies.Load(), Library: b.counts.library.Load(), Graphs: b.counts.graphs.Load()}
}

// Trim returns the cached device blocks to the driver and reports how many
// bytes it released.
func (b *Backend) Trim() (int64, error) {
	if err := b.enter("Trim"); err != nil {
		return 0, err
	}
	defer b.leave()
	n, err := b.alloc.trim()
	if err != nil {
		return n, fmt.Errorf("%s: Trim: %w", b.name, err)
	}
	return n, nil
}

// AllocSize is the device bytes an Alloc of n bytes takes: the caching
// allocator's block for it, rounded up (under 1/64 more, at least 512
// bytes), or nothing for an empty tensor.
func (b *Backend) AllocSize(n int64) int64 { return allocSize(n) }

// Cached is the device bytes of freed blocks the allocator keeps for reuse
// (Stats.Cached), which Trim returns to the driver. Operations take their
// scratch from a fixed arena instead (Fixed).
func (b *Backend) Cached() int64 { return b.alloc.snapshot().Cached }

// Fixed is the device memory the backend holds outside Alloc from Open to
// Close (Stats.Workspace): the cuBLAS workspace, when cuBLAS is loaded,
// the arena its operations take their scratch from and the step tables
// (with the decode attention's split counts).
// (The driver's own context memory is in no account.)
func (b *Backend) Fixed() int64 {
	n := b.workspaceSize + b.scr.size
	if b.tab.p != 0 {
		n += 2*tableBytes + 4*splitCounts
	}
	return n
}

// MemInfo reports the device's free and total memory, as the driver sees
// it (other processes' allocations included).
func (b *Backend) MemInfo() (free, total int64, err error) {
	if err := b.enter("MemInfo"); err != nil {
		return 0, 0, err
	}
	defer b.leave()
	free, total, err = cu.MemInfo()
	if err != nil {
		return 0, 0, fmt.Errorf("%s: MemInfo: %w", b.name, cuError(err))
	}
	return free, total, nil
}

// Alloc returns an uninitialised device tensor. Memory comes from the
// caching allocator; an allocation the device cannot hold returns an error
// wrapping tensor.ErrOutOfMemory.
func (b *Backend) Alloc(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	bytes, err := dt.ShapeBytes(shape)
	if err != nil {
		return nil, fmt.Errorf("%s: Alloc: %w", b.name, err)
	}
	if bytes == 0 {
		return tensor.NewDevice(dt, shape, 0), nil
	}
	if err := b.enter("Alloc"); err != nil {
		return nil, err
	}
	defer b.leave()
	p, err := b.alloc.get(bytes)
	if err != nil {
		return nil, fmt.Errorf("%s: Alloc %v %v: %w", b.name, dt, shape, err)
	}
	return tensor.NewDevice(dt, shape, p), nil
}

// Free returns t's memory to the cache (or, for a managed tensor, to the
// driver). Freeing nil, a zero-size tensor, a view, or a tensor freed
// before is a no-op.
func (b *Backend) Free(t *tensor.Tensor) {
	if t == nil || t.Ptr() == 0 || b.closed.Load() {
		return
	}
	if err := b.enter("Free"); err != nil {
		return
	}
	defer b.leave()
	blk, ok := b.alloc.put(t.Ptr())
	if ok && blk.managed {
		// Not while another goroutine captures: the synchronisation would
		// end its capture. (Inside a capture it ends this one's.)
		if capt := b.capturing(); !capt {
			b.gate.RLock()
			defer b.gate.RUnlock()
		}
		b.syncStreams()
		cu.MemFree(cu.DevicePtr(t.Ptr()))
	}
}

// device checks that t is a device tensor of this backend, views included.
func (b *Backend) device(op, name string, t *tensor.Tensor) error {
	if t == nil {
		return fmt.Errorf("cuda: %s: %s is nil", op, name)
	}
	if t.NumBytes() == 0 {
		return nil
	}
	if t.Ptr() == 0 {
		return fmt.Errorf("cuda: %s: %s is a host tensor; Alloc it on %s and Upload", op, name, b.name)
	}
	if _, _, ok := b.alloc.find(t.Ptr(), t.NumBytes()); !ok {
		return fmt.Errorf("cuda: %s: %s (%v) is not live memory of %s", op, name, t, b.name)
	}
	return nil
}

// Upload copies src into dst at byte offset off. It returns once src may
// be reused; the copy is ordered after the operations queued before it.
func (b *Backend) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	const op = "Upload"
	if err := b.device(op, "dst", dst); err != nil {
		return err
	}
	if off < 0 || off+int64(len(src)) > dst.NumBytes() {
		return fmt.Errorf("cuda: %s: %d bytes at offset %d do not fit in %v (%d bytes)", op, len(src), off, dst, dst.NumBytes())
	}
	if len(src) == 0 {
		return nil
	}
	return b.ops(op, func() error {
		b.counts.copies.Add(1)
		if err := cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(off)), unsafe.Pointer(&src[0]), int64(len(src)), b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		// A copy from pageable memory returns once the driver has staged
		// src; one from pinned memory may still be reading it.
		if b.isPinned(uintptr(unsafe.Pointer(&src[0]))) {
			if err := b.compute.Synchronize(); err != nil {
				return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
			}
		}
		return nil
	})
}

// Download copies src into dst after the work queued before it, including
// UploadAsync copies, has finished.
func (b *Backend) Download(dst []byte, src *tensor.Tensor) error {
	return b.download("Download", dst, src, afterCopies)
}

// DownloadComputed copies src into dst after the compute queued before it
// has finished; UploadAsync copies that no compute waits for go on
// (tensor.ComputeDownloader). A hand-over of the hidden state to the CPU
// uses it, so that prefetch copies stream while the CPU computes.
func (b *Backend) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	return b.download("DownloadComputed", dst, src, computeOnly)
}

// DownloadAsync copies src into dst on the stream that copies to the host
// (the one managed pages go back on, idle with explicit copies), after the
// compute queued before the call, and returns at once
// (tensor.AsyncDownloader): the compute queued after it and the
// UploadAsync copies run beside it, on the other copy engine. ready makes
// the compute stream wait for the copy; landed blocks the calling
// goroutine (sleeping, on an event with blocking synchronisation) until
// dst holds the copy. A hybrid twin's keys and values go back to the host
// this way. The event goes back to its pool once both waits have run.
func (b *Backend) DownloadAsync(dst []byte, src *tensor.Tensor) (ready, landed func() error, err error) {
	const op = "DownloadAsync"
	if err := b.device(op, "src", src); err != nil {
		return nil, nil, err
	}
	if int64(len(dst)) != src.NumBytes() {
		return nil, nil, fmt.Errorf("cuda: %s: destination has %d bytes, %v has %d", op, len(dst), src, src.NumBytes())
	}
	if len(dst) == 0 {
		nop := func() error { return nil }
		return nop, nop, nil
	}
	if b.capturing() {
		return nil, nil, fmt.Errorf("%s: %s: %w", b.name, op, errCapturing)
	}
	if err := b.enter(op); err != nil {
		return nil, nil, err
	}
	defer b.leave()
	b.gate.RLock() // not into a capture on the compute stream
	defer b.gate.RUnlock()
	before, err := b.getEvent()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %s: %v", b.name, op, err)
	}
	defer b.putEvent(before)
	done, err := b.getBlockingEvent()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %s: %v", b.name, op, err)
	}
	b.opsMu.Lock()
	err = before.Record(b.compute)
	b.opsMu.Unlock()
	if err == nil {
		b.copyMu.Lock()
		err = b.evict.Wait(before, 0)
		if err == nil {
			b.counts.copies.Add(1)
			err = cu.MemcpyDtoHAsync(unsafe.Pointer(&dst[0]), cu.DevicePtr(src.Ptr()), int64(len(dst)), b.evict)
		}
		if err == nil {
			err = done.Record(b.evict)
		}
		b.copyMu.Unlock()
	}
	if err != nil {
		b.putBlockingEvent(done)
		return nil, nil, fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
	}
	release := releaseAfter(2, done, b.putBlockingEvent)
	return b.computeWait(op, done, release, false), b.landedWait(op, done, release), nil
}

// releaseAfter returns the function that gives done back to its pool
// (put) at its n-th call: once each of the n waits on done has run.
func releaseAfter(n int32, done cu.Event, put func(cu.Event)) func() {
	var users atomic.Int32
	users.Store(n)
	return func() {
		if users.Add(-1) == 0 {
			put(done)
		}
	}
}

// computeWait is an asynchronous copy's ready: it makes the compute
// stream wait for done (recorded after the copy), the first time it is
// called, and returns the error; release runs once, after. With stall the
// wait is timed as a span of the compute stream waiting for a copy
// (CopyStats' stall).
func (b *Backend) computeWait(op string, done cu.Event, release func(), stall bool) func() error {
	var once sync.Once
	var rerr error
	return func() error {
		once.Do(func() {
			defer release()
			if b.capturing() {
				rerr = fmt.Errorf("%s: %s ready: %w", b.name, op, errCapturing)
				return
			}
			if rerr = b.enter(op + " ready"); rerr != nil {
				return
			}
			defer b.leave()
			var sStart, sEnd cu.Event
			got := false
			if stall {
				sStart, sEnd, got = b.timedPair()
			}
			timed := got
			queued := b.tlNow()
			b.opsMu.Lock()
			if timed {
				timed = sStart.Record(b.compute) == nil
			}
			if err := b.compute.Wait(done, 0); err != nil {
				rerr = fmt.Errorf("%s: %s ready: %w", b.name, op, cuError(err))
			}
			if timed {
				timed = sEnd.Record(b.compute) == nil
			}
			b.opsMu.Unlock()
			b.addSpan(sStart, sEnd, got, timed && rerr == nil, 0, true, queued)
		})
		return rerr
	}
}

// landedWait is an asynchronous copy's landed: it blocks the calling
// goroutine until done (recorded after the copy, with blocking
// synchronisation) has happened and returns the copy's error; release
// runs once, after the wait.
func (b *Backend) landedWait(op string, done cu.Event, release func()) func() error {
	var once sync.Once
	var lerr error
	return func() error {
		once.Do(func() {
			defer release()
			if b.capturing() {
				lerr = fmt.Errorf("%s: %s landed: %w", b.name, op, errCapturing)
				return
			}
			if lerr = b.enter(op + " landed"); lerr != nil {
				return
			}
			defer b.leave()
			b.gate.RLock() // a synchronisation would end another goroutine's capture
			defer b.gate.RUnlock()
			if err := done.Synchronize(); err != nil {
				lerr = fmt.Errorf("%s: %s landed: %w", b.name, op, cuError(err))
			}
		})
		return lerr
	}
}

// downloadWait says what a download waits for besides the compute queued
// before it.
type downloadWait bool

const (
	afterCopies downloadWait = true  // every UploadAsync copy queued so far
	computeOnly downloadWait = false // nothing more
)

func (b *Backend) download(op string, dst []byte, src *tensor.Tensor, wait downloadWait) error {
	if err := b.device(op, "src", src); err != nil {
		return err
	}
	if int64(len(dst)) != src.NumBytes() {
		return fmt.Errorf("cuda: %s: destination has %d bytes, %v has %d", op, len(dst), src, src.NumBytes())
	}
	if len(dst) == 0 {
		return nil
	}
	return b.ops(op, func() error {
		var err error
		if wait == afterCopies {
			b.copyMu.Lock()
			err = b.compute.Wait(b.copyTail, 0)
			b.copyMu.Unlock()
		}
		after, done := b.tlDownload(int64(len(dst)))
		if err == nil {
			b.counts.copies.Add(1)
			err = cu.MemcpyDtoHAsync(unsafe.Pointer(&dst[0]), cu.DevicePtr(src.Ptr()), int64(len(dst)), b.compute)
		}
		after()
		if err == nil {
			// While the device gets to the copy: the spans reached so far,
			// which the copies' timing would otherwise drain (timedPair).
			b.evMu.Lock()
			b.drainSpansLocked(-1)
			b.evMu.Unlock()
			err = b.compute.Synchronize()
		}
		done()
		if err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		return nil
	})
}

// Sync waits for all queued work on both streams and reports the first
// asynchronous error (a faulting kernel, say).
func (b *Backend) Sync() error {
	if b.capturing() {
		return fmt.Errorf("%s: Sync: %w", b.name, errCapturing)
	}
	if err := b.enter("Sync"); err != nil {
		return err
	}
	defer b.leave()
	b.gate.RLock() // a synchronisation would end another goroutine's capture
	defer b.gate.RUnlock()
	if err := b.syncStreams(); err != nil {
		return fmt.Errorf("%s: Sync: %w", b.name, err)
	}
	return nil
}

func (b *Backend) syncStreams() error {
	err1 := b.compute.Synchronize()
	err2 := b.copy.Synchronize()
	err3 := b.evict.Synchronize()
	if err1 != nil {
		return cuError(err1)
	}
	if err2 != nil {
		return cuError(err2)
	}
	return cuError(err3)
}

// AllocPinned returns n bytes of page-locked host memory, from which
// UploadAsync copies run at full link speed. Free it with FreePinned
// (Close frees what is left).
func (b *Backend) AllocPinned(n int64) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: AllocPinned: invalid size %d", n)
	}
	if err := b.enter("AllocPinned"); err != nil {
		return nil, err
	}
	defer b.leave()
	p, err := hostAlloc(n)
	if err != nil {
		if isOOM(err) {
			return nil, fmt.Errorf("%s: AllocPinned %d bytes: %w: %w", b.name, n, err, tensor.ErrOutOfMemory)
		}
		return nil, fmt.Errorf("%s: AllocPinned %d bytes: %w", b.name, n, err)
	}
	b.pinnedMu.Lock()
	b.pinned[p] = n
	b.pinnedSum += n
	b.pinnedMu.Unlock()
	return unsafe.Slice((*byte)(p), n), nil
}

// FreePinned releases memory from AllocPinned after the copies queued from
// it have finished. buf must start where AllocPinned's slice started.
func (b *Backend) FreePinned(buf []byte) error {
	if len(buf) == 0 {
		return fmt.Errorf("cuda: FreePinned: empty buffer")
	}
	p := unsafe.Pointer(&buf[0])
	if b.capturing() {
		return fmt.Errorf("%s: FreePinned: %w", b.name, errCapturing)
	}
	if err := b.enter("FreePinned"); err != nil {
		return err
	}
	defer b.leave()
	b.gate.RLock() // its synchronisation would end another goroutine's capture
	defer b.gate.RUnlock()
	b.pinnedMu.Lock()
	n, ok := b.pinned[p]
	if ok {
		delete(b.pinned, p)
		b.pinnedSum -= n
	}
	b.pinnedMu.Unlock()
	if !ok {
		return fmt.Errorf("%s: FreePinned: %p is not the start of a buffer from AllocPinned", b.name, p)
	}
	serr := b.syncStreams()
	if err := cu.MemFreeHost(p); err != nil {
		return fmt.Errorf("%s: FreePinned: %w", b.name, cuError(err))
	}
	if serr != nil {
		return fmt.Errorf("%s: FreePinned: waiting for copies: %w", b.name, serr)
	}
	return nil
}

func (b *Backend) isPinned(p uintptr) bool {
	b.pinnedMu.Lock()
	defer b.pinnedMu.Unlock()
	for _, m := range []map[unsafe.Pointer]int64{b.pinned, b.registered} {
		for base, n := range m {
			if p >= uintptr(base) && p < uintptr(base)+uintptr(n) {
				return true
			}
		}
	}
	return false
}

// RegisterHost page-locks buf, host memory the caller owns (a read-only
// mapping of a weight file: its pages are the page cache's), read-only,
// so that copies from it (UploadAsync, UploadStaged) run at the pinned
// rate with no staging copy on the CPU (tensor.HostRegistrar).
// unregister waits for the copies queued and undoes it; Close undoes what
// is left. It is not counted in Stats' Pinned: the memory is not the
// backend's.
func (b *Backend) RegisterHost(buf []byte) (unregister func() error, err error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("cuda: RegisterHost: empty buffer")
	}
	p := unsafe.Pointer(&buf[0])
	if err := b.enter("RegisterHost"); err != nil {
		return nil, err
	}
	defer b.leave()
	if err := hostRegister(p, int64(len(buf))); err != nil {
		return nil, fmt.Errorf("%s: RegisterHost %d bytes: %w", b.name, len(buf), err)
	}
	b.pinnedMu.Lock()
	if b.registered == nil {
		b.registered = map[unsafe.Pointer]int64{}
	}
	b.registered[p] = int64(len(buf))
	b.pinnedMu.Unlock()
	var once sync.Once
	return func() error {
		err := fmt.Errorf("cuda: RegisterHost's unregister called twice")
		once.Do(func() { err = b.unregisterHost(p) })
		return err
	}, nil
}

func (b *Backend) unregisterHost(p unsafe.Pointer) error {
	if b.capturing() {
		return fmt.Errorf("%s: unregistering host memory: %w", b.name, errCapturing)
	}
	if err := b.enter("UnregisterHost"); err != nil {
		return err
	}
	defer b.leave()
	b.gate.RLock() // its synchronisation would end another goroutine's capture
	defer b.gate.RUnlock()
	b.pinnedMu.Lock()
	_, ok := b.registered[p]
	delete(b.registered, p)
	b.pinnedMu.Unlock()
	if !ok {
		return nil // Close undid it
	}
	serr := b.syncStreams()
	if err := hostUnregister(p); err != nil {
		return fmt.Errorf("%s: unregistering host memory: %w", b.name, err)
	}
	if serr != nil {
		return fmt.Errorf("%s: unregistering host memory: waiting for copies: %w", b.name, serr)
	}
	return nil
}

// span is a stretch of one stream between two timing events: an
// asynchronous copy on the copy stream, or the compute stream waiting for
// one (stall).
type span struct {
	start, end cu.Event
	bytes      int64
	stall      bool
	host       time.Duration // when it was queued, on the timeline (TimelineEnv)
}

// popEventLocked takes an event from pool, or makes one with flags (kept in
// evAll for Close); the caller holds evMu.
func (b *Backend) popEventLocked(pool *[]cu.Event, flags cu.EventFlags) (cu.Event, error) {
	if n := len(*pool); n > 0 {
		ev := (*pool)[n-1]
		*pool = (*pool)[:n-1]
		return ev, nil
	}
	ev, err := cu.MakeEvent(flags)
	if err != nil {
		return ev, cuError(err)
	}
	b.evAll = append(b.evAll, ev)
	return ev, nil
}

// getTimedEventLocked returns an event that records time; the caller holds
// evMu.
func (b *Backend) getTimedEventLocked() (cu.Event, error) {
	return b.popEventLocked(&b.tevFree, cu.DefaultEvent)
}

// spansPerPair bounds the spans timedPair drains, and only when its pool
// of timing events runs short: two, as many as a pair makes. The host
// drains the spans reached while it waits for a download (download), so
// that no copy waits for a long drain: draining every span reached in
// timedPair cost the first copy of each sparse block of a mixture of
// experts its previous block's dozen copies and stalls, a query and an
// elapsed time each: 43 us on the H200 (session 8), while the link idled.
const spansPerPair = 2

// timedPair returns two timing events, or ok false when none can be made
// (timing is then skipped, never the copy).
func (b *Backend) timedPair() (start, end cu.Event, ok bool) {
	b.evMu.Lock()
	defer b.evMu.Unlock()
	if len(b.tevFree) < 2 {
		b.drainSpansLocked(spansPerPair)
	}
	var err error
	if start, err = b.getTimedEventLocked(); err != nil {
		return start, end, false
	}
	if end, err = b.getTimedEventLocked(); err != nil {
		b.tevFree = append(b.tevFree, start)
		return start, end, false
	}
	return start, end, true
}

// drainSpansLocked adds up the first spans whose end has been reached, in
// order, at most n of them (n < 0: all), and returns their events to the
// pool.
func (b *Backend) drainSpansLocked(n int) {
	i := 0
	for ; i < len(b.spans) && (n < 0 || i < n); i++ {
		sp := b.spans[i]
		if sp.end.Query() != nil { // not reached yet (or failed: dropped at Close)
			break
		}
		b.tlSpanLocked(sp)
		ms, err := sp.start.Elapsed(sp.end)
		if err == nil && ms > 0 {
			d := time.Duration(ms * float64(time.Millisecond))
			if sp.stall {
				b.stall += d
			} else {
				b.copyBusy += d
				b.copyBytes += sp.bytes
			}
		}
		b.tevFree = append(b.tevFree, sp.start, sp.end)
	}
	b.spans = append(b.spans[:0], b.spans[i:]...)
}

var _ tensor.ComputeTimer = (*Backend)(nil)

// StartCompute records a timing event on the compute stream; the stop it
// returns records a second one, waits for it and returns the device time
// between the two (tensor.ComputeTimer). Neither waits for the copy
// stream. Not while capturing a graph.
func (b *Backend) StartCompute() (func() (time.Duration, error), error) {
	const op = "StartCompute"
	if b.capturing() {
		return nil, fmt.Errorf("%s: %s: %w", b.name, op, errCapturing)
	}
	if err := b.enter(op); err != nil {
		return nil, err
	}
	defer b.leave()
	start, end, ok := b.timedPair()
	if !ok {
		return nil, fmt.Errorf("%s: %s: no timing events", b.name, op)
	}
	giveBack := func() {
		b.evMu.Lock()
		b.tevFree = append(b.tevFree, start, end)
		b.evMu.Unlock()
	}
	b.opsMu.Lock()
	err := start.Record(b.compute)
	b.opsMu.Unlock()
	if err != nil {
		giveBack()
		return nil, fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
	}
	var once sync.Once
	var d time.Duration
	var serr error
	stop := func() (time.Duration, error) {
		once.Do(func() {
			defer giveBack()
			if b.capturing() {
				serr = fmt.Errorf("%s: %s stop: %w", b.name, op, errCapturing)
				return
			}
			if serr = b.enter(op + " stop"); serr != nil {
				return
			}
			defer b.leave()
			b.opsMu.Lock()
			err := end.Record(b.compute)
			b.opsMu.Unlock()
			if err == nil {
				b.gate.RLock() // a synchronisation would end another goroutine's capture
				err = end.Synchronize()
				b.gate.RUnlock()
			}
			var ms float64
			if err == nil {
				ms, err = start.Elapsed(end)
			}
			if err != nil {
				serr = fmt.Errorf("%s: %s stop: %w", b.name, op, cuError(err))
				return
			}
			d = time.Duration(ms * float64(time.Millisecond))
		})
		return d, serr
	}
	return stop, nil
}

// addSpan keeps a recorded span for CopyStats, or returns its events to the
// pool when it was not recorded.
func (b *Backend) addSpan(start, end cu.Event, got, recorded bool, bytes int64, stall bool, host time.Duration) {
	if !got {
		return
	}
	b.evMu.Lock()
	defer b.evMu.Unlock()
	if !recorded {
		b.tevFree = append(b.tevFree, start, end)
		return
	}
	b.spans = append(b.spans, span{start: start, end: end, bytes: bytes, stall: stall, host: host})
}

// CopyStats reports the asynchronous uploads so far: bytes copied, the time
// the copy stream spent copying them, and the time the compute stream spent
// waiting for copies (the part of the copy time not hidden behind compute).
// Spans still in flight are not counted yet; Sync first for a full account.
func (b *Backend) CopyStats() (bytes int64, busy, stall time.Duration) {
	if err := b.enter("CopyStats"); err != nil {
		return 0, 0, 0
	}
	defer b.leave()
	b.evMu.Lock()
	defer b.evMu.Unlock()
	b.drainSpansLocked(-1)
	return b.copyBytes, b.copyBusy, b.stall
}

func (b *Backend) getEvent() (cu.Event, error) {
	b.evMu.Lock()
	defer b.evMu.Unlock()
	return b.popEventLocked(&b.evFree, cu.DisableTiming)
}

// getBlockingEvent returns an event the host waits on by sleeping
// (UploadStaged's landed), from a pool of its own.
func (b *Backend) getBlockingEvent() (cu.Event, error) {
	b.evMu.Lock()
	defer b.evMu.Unlock()
	return b.popEventLocked(&b.evBlock, cu.DisableTiming|cu.BlockingSyncEvent)
}

func (b *Backend) putBlockingEvent(ev cu.Event) {
	b.evMu.Lock()
	b.evBlock = append(b.evBlock, ev)
	b.evMu.Unlock()
}

// putEvent returns an event to the pool. Re-recording it later does not
// disturb waits already queued on it.
func (b *Backend) putEvent(ev cu.Event) {
	b.evMu.Lock()
	b.evFree = append(b.evFree, ev)
	b.evMu.Unlock()
}

// UploadAsync copies src into dst at byte offset off on the copy stream
// and returns at once. The copy first waits for the compute work queued
// before the call (which may still read dst's old contents); compute work
// queued after the call runs alongside it. ready makes the compute stream
// wait for the copy: call it before queuing the operations that read dst.
// src must not change until the copy has landed, which Sync or a Download
// after ready guarantees; from pinned memory (AllocPinned) the copy runs
// at full link speed.
func (b *Backend) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (ready func() error, err error) {
	ready, _, err = b.uploadAsync(ctx, "UploadAsync", dst, off, src, false)
	return ready, err
}

// UploadStaged queues the copy UploadAsync queues and also returns landed,
// which blocks the calling goroutine until the copy has finished (an event
// recorded after it on the copy stream, with blocking synchronisation, so
// that the waiting thread sleeps rather than spins) and returns its error:
// src may then be reused. The event goes back to the backend's pool once
// both ready and landed have run.
func (b *Backend) UploadStaged(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (ready, landed func() error, err error) {
	return b.uploadAsync(ctx, "UploadStaged", dst, off, src, true)
}

// uploadAsync is UploadAsync, and with staged UploadStaged.
func (b *Backend) uploadAsync(ctx context.Context, op string, dst *tensor.Tensor, off int64, src []byte, staged bool) (ready, landed func() error, err error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, fmt.Errorf("cuda: %s: %w", op, err)
	}
	if err := b.device(op, "dst", dst); err != nil {
		return nil, nil, err
	}
	if off < 0 || off+int64(len(src)) > dst.NumBytes() {
		return nil, nil, fmt.Errorf("cuda: %s: %d bytes at offset %d do not fit in %v (%d bytes)", op, len(src), off, dst, dst.NumBytes())
	}
	if len(src) == 0 {
		nop := func() error { return nil }
		return nop, nop, nil
	}
	if b.capturing() {
		return nil, nil, fmt.Errorf("%s: %s: %w", b.name, op, errCapturing)
	}
	b.Mark("h2d:called") // on a timeline: where a copy's host time goes
	if err := b.enter(op); err != nil {
		return nil, nil, err
	}
	defer b.leave()
	b.gate.RLock() // not into a capture on the compute stream
	defer b.gate.RUnlock()
	before, err := b.getEvent()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %s: %v", b.name, op, err)
	}
	defer b.putEvent(before)
	getDone, putDone := b.getEvent, b.putEvent
	if staged {
		getDone, putDone = b.getBlockingEvent, b.putBlockingEvent
	}
	done, err := getDone()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %s: %v", b.name, op, err)
	}
	tStart, tEnd, got := b.timedPair()
	timed := got
	b.copyMu.Lock()
	b.Mark("h2d:locked")
	err = before.Record(b.compute)
	if err == nil {
		err = b.copy.Wait(before, 0)
	}
	if err == nil && timed {
		timed = tStart.Record(b.copy) == nil
	}
	queued := b.tlNow()
	if err == nil {
		b.counts.copies.Add(1)
		err = cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(off)), unsafe.Pointer(&src[0]), int64(len(src)), b.copy)
	}
	if err == nil && timed {
		timed = tEnd.Record(b.copy) == nil
	}
	b.addSpan(tStart, tEnd, got, timed && err == nil, int64(len(src)), false, queued)
	if err == nil {
		err = done.Record(b.copy)
	}
	if err == nil {
		err = b.copyTail.Record(b.copy)
	}
	b.copyMu.Unlock()
	if err != nil {
		putDone(done)
		return nil, nil, fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
	}
	// done goes back to its pool when the last of the waits has run.
	waits := int32(1)
	if staged {
		waits = 2
	}
	release := releaseAfter(waits, done, putDone)
	ready = b.computeWait(op, done, release, true)
	if !staged {
		return ready, nil, nil
	}
	return ready, b.landedWait(op, done, release), nil
}

// AllocManaged allocates managed (unified) memory for a tensor. It refuses
// requests larger than the device's free memory less a 64 MiB margin, so
// that managed memory never oversubscribes the GPU, and devices without
// concurrent managed access.
func (b *Backend) AllocManaged(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	const op = "AllocManaged"
	bytes, err := dt.ShapeBytes(shape)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", b.name, op, err)
	}
	if bytes == 0 {
		return tensor.NewDevice(dt, shape, 0), nil
	}
	if !b.info.ManagedMemory {
		return nil, fmt.Errorf("%s: %s: the device does not support concurrent managed access", b.name, op)
	}
	if err := b.enter(op); err != nil {
		return nil, err
	}
	defer b.leave()
	free, total, err := cu.MemInfo()
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
	}
	const margin = 64 << 20
	if bytes > free-margin {
		return nil, fmt.Errorf("%s: %s %v %v: %d bytes exceed the device's free memory (%d of %d free, less a %d MiB margin): %w",
			b.name, op, dt, shape, bytes, free, total, margin>>20, tensor.ErrOutOfMemory)
	}
	p, err := cu.MemAllocManaged(bytes, cu.AttachGlobal)
	if err != nil {
		if err == cu.OutOfMemory {
			return nil, fmt.Errorf("%s: %s %d bytes: %w", b.name, op, bytes, tensor.ErrOutOfMemory)
		}
		return nil, fmt.Errorf("%s: %s %d bytes: %w", b.name, op, bytes, cuError(err))
	}
	b.alloc.addManaged(uintptr(p), bytes)
	return tensor.NewDevice(dt, shape, uintptr(p)), nil
}

func (b *Backend) managed(op string, t *tensor.Tensor) error {
	if t == nil {
		return fmt.Errorf("cuda: %s: tensor is nil", op)
	}
	if t.NumBytes() == 0 {
		return nil
	}
	_, blk, ok := b.alloc.find(t.Ptr(), t.NumBytes())
	if !ok || !blk.managed {
		return fmt.Errorf("%s: %s: %v is not a managed tensor from AllocManaged", b.name, op, t)
	}
	return nil
}

// prefetch migrates a managed tensor's pages. To the device, the migration
// runs on the copy stream, overlapping compute, and the compute queued
// after the call waits for it (so kernels find the pages in place rather
// than faulting them in). To the host, it runs on the eviction stream after
// the compute queued before the call, so pages leave only once the kernels
// that read them are done, and the two directions of the link work at once.
func (b *Backend) prefetch(op string, t *tensor.Tensor, toDevice bool) error {
	if err := b.managed(op, t); err != nil || t.NumBytes() == 0 {
		return err
	}
	if b.capturing() {
		return fmt.Errorf("%s: %s: %w", b.name, op, errCapturing)
	}
	if err := b.enter(op); err != nil {
		return err
	}
	defer b.leave()
	b.gate.RLock() // not into a capture on the compute stream
	defer b.gate.RUnlock()
	ev, err := b.getEvent()
	if err != nil {
		return fmt.Errorf("%s: %s: %w", b.name, op, err)
	}
	defer b.putEvent(ev)
	if toDevice {
		b.copyMu.Lock()
		err = prefetch(t.Ptr(), t.NumBytes(), b.ordinal, b.copy)
		if err == nil {
			err = cuError(ev.Record(b.copy))
		}
		if err == nil {
			err = cuError(b.copyTail.Record(b.copy))
		}
		b.copyMu.Unlock()
		if err == nil {
			b.opsMu.Lock()
			err = cuError(b.compute.Wait(ev, 0))
			b.opsMu.Unlock()
		}
	} else {
		b.opsMu.Lock()
		err = cuError(ev.Record(b.compute))
		b.opsMu.Unlock()
		if err == nil {
			b.copyMu.Lock()
			err = cuError(b.evict.Wait(ev, 0))
			if err == nil {
				err = prefetch(t.Ptr(), t.NumBytes(), cpuDevice(), b.evict)
			}
			b.copyMu.Unlock()
		}
	}
	if err != nil {
		return fmt.Errorf("%s: %s: %w", b.name, op, err)
	}
	return nil
}

// PrefetchToDevice migrates a managed tensor's pages to the GPU on the copy
// stream; compute queued afterwards waits for them.
func (b *Backend) PrefetchToDevice(t *tensor.Tensor) error {
	return b.prefetch("PrefetchToDevice", t, true)
}

// PrefetchToHost migrates a managed tensor's pages back to host memory once
// the compute queued before the call is done.
func (b *Backend) PrefetchToHost(t *tensor.Tensor) error {
	return b.prefetch("PrefetchToHost", t, false)
}

// AdviseHost makes host memory the preferred location of a managed
// tensor's pages.
func (b *Backend) AdviseHost(t *tensor.Tensor) error {
	const op = "AdviseHost"
	if err := b.managed(op, t); err != nil || t.NumBytes() == 0 {
		return err
	}
	if err := b.enter(op); err != nil {
		return err
	}
	defer b.leave()
	if err := adviseHost(t.Ptr(), t.NumBytes()); err != nil {
		return fmt.Errorf("%s: %s: %w", b.name, op, err)
	}
	return nil
}

// AdviseDeviceAccess maps a managed tensor's pages for this device where
// they are (accessed-by advice): kernels read host-resident pages in place
// over the link, without faults or migrations.
func (b *Backend) AdviseDeviceAccess(t *tensor.Tensor) error {
	const op = "AdviseDeviceAccess"
	if err := b.managed(op, t); err != nil || t.NumBytes() == 0 {
		return err
	}
	if err := b.enter(op); err != nil {
		return err
	}
	defer b.leave()
	if err := memAdvise(t.Ptr(), t.NumBytes(), adviseAccessedBy, b.ordinal); err != nil {
		return fmt.Errorf("%s: %s: %w", b.name, op, err)
	}
	return nil
}

// Close waits for queued work and frees everything the backend holds:
// device tensors (those not freed become invalid), cached blocks, managed
// and pinned memory, streams, events, kernels and cuBLAS. Closing twice is
// a no-op.
func (b *Backend) Close() error {
	b.life.Lock()
	defer b.life.Unlock()
	if b.closed.Swap(true) {
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.SetCurrentContext(b.ctx); err != nil {
		return fmt.Errorf("%s: Close: %w", b.name, cuError(err))
	}
	if err := b.release(); err != nil {
		return fmt.Errorf("%s: Close: %w", b.name, err)
	}
	return nil
}

// release frees what setup created; the context must be current.
func (b *Backend) release() error {
	var errs []error
	keep := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	if b.compute != (cu.Stream{}) {
		keep(cuError(b.compute.Synchronize()))
	}
	if b.copy != (cu.Stream{}) {
		keep(cuError(b.copy.Synchronize()))
	}
	if b.evict != (cu.Stream{}) {
		keep(cuError(b.evict.Synchronize()))
	}
	keep(b.releaseGraphs())
	if b.blas != nil {
		cublasDestroy(b.blas)
		b.blas = nil
	}
	if b.workspace != 0 {
		keep(cuError(cu.MemFree(cu.DevicePtr(b.workspace))))
		b.workspace, b.workspaceSize = 0, 0
	}
	if b.scr.p != 0 {
		keep(cuError(cu.MemFree(cu.DevicePtr(b.scr.p))))
		b.scr.p, b.scr.size = 0, 0
	}
	if b.tab.p != 0 {
		keep(cuError(cu.MemFree(cu.DevicePtr(b.tab.p))))
		b.tab, b.splitCount = stepTables{}, 0
	}
	if b.alloc != nil {
		keep(b.alloc.releaseAll(func(p uintptr) error { return cuError(cu.MemFree(cu.DevicePtr(p))) }))
	}
	b.pinnedMu.Lock()
	for p, n := range b.pinned {
		keep(cuError(cu.MemFreeHost(p)))
		b.pinnedSum -= n
	}
	b.pinned = map[unsafe.Pointer]int64{}
	for p := range b.registered {
		keep(hostUnregister(p))
	}
	b.registered = nil
	b.pinnedMu.Unlock()
	b.evMu.Lock()
	b.drainSpansLocked(-1)
	keep(b.writeTimelineLocked())
	for i := range b.evAll {
		keep(cuError(cu.DestroyEvent(&b.evAll[i])))
	}
	b.evAll, b.evFree, b.tevFree, b.evBlock, b.spans = nil, nil, nil, nil, nil
	b.evMu.Unlock()
	if b.copyTail != (cu.Event{}) {
		keep(cuError(cu.DestroyEvent(&b.copyTail)))
	}
	for _, m := range b.modules {
		keep(unloadModule(m))
	}
	b.modules = nil
	if b.compute != (cu.Stream{}) {
		keep(cuError(b.compute.Destroy()))
	}
	if b.copy != (cu.Stream{}) {
		keep(cuError(b.copy.Destroy()))
	}
	if b.evict != (cu.Stream{}) {
		keep(cuError(b.evict.Destroy()))
	}
	keep(cuError(b.dev.ReleasePrimaryCtx()))
	return errors.Join(errs...)
}
