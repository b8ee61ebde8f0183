package cuda

import (
	"errors"
	"fmt"
)

// Errors callers branch on with errors.Is. Out-of-memory conditions wrap
// tensor.ErrOutOfMemory instead.
var (
	// ErrNoDevice means the driver could not be initialised or reports no
	// GPU.
	ErrNoDevice = errors.New("no CUDA device")
	// ErrDriverTooOld means the installed driver cannot run the embedded
	// kernels (their PTX needs a newer CUDA version) or lacks a needed call.
	ErrDriverTooOld = errors.New("CUDA driver too old")
	// ErrClosed is returned by a Backend's methods after Close.
	ErrClosed = errors.New("backend is closed")
)

// DeviceInfo describes one GPU as the driver reports it.
type DeviceInfo struct {
	Ordinal       int    // device number, as passed to Open
	Name          string // marketing name, e.g. "NVIDIA H200"
	Major, Minor  int    // compute capability
	TotalMem      int64  // bytes of device memory
	SMs           int    // multiprocessors
	DriverVersion int    // CUDA version the driver supports, 1000*major + 10*minor (13000 = 13.0)
	// ManagedMemory reports concurrent managed access: managed memory can
	// be prefetched and advised (tensor.ManagedAllocator).
	ManagedMemory bool
}

// Stats are a Backend's memory accounts. Device bytes are counted in the
// caching allocator's rounded block sizes.
type Stats struct {
	Reserved     int64 // device bytes obtained from the driver (in use + cached)
	InUse        int64 // device bytes in tensors handed out and not freed
	Cached       int64 // device bytes in free lists, ready for reuse
	PeakInUse    int64 // high-water mark of InUse
	Pinned       int64 // page-locked host bytes from AllocPinned not yet freed
	Managed      int64 // managed (unified) bytes from AllocManaged not yet freed
	DriverAllocs int64 // cuMemAlloc calls so far (each cache miss is one)
	CacheHits    int64 // allocations served from the free lists
	Workspace    int64 // device bytes the backend keeps for itself (cuBLAS workspace), included in Reserved
}

// DriverError is a failed CUDA driver API call, found with errors.As in the
// errors this package returns.
type DriverError struct {
	Code int    // the CUresult
	Name string // e.g. CUDA_ERROR_ILLEGAL_ADDRESS
	Msg  string // the driver's description
}

func (e *DriverError) Error() string { return fmt.Sprintf("%s (%d): %s", e.Name, e.Code, e.Msg) }
