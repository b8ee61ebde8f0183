//go:build cuda

package cuda

// The C side of the backend: the calls gorgonia.org/cu does not wrap
// (pinned host allocation, managed-memory prefetch and advice, kernel
// launch with a packed parameter buffer, module load with the JIT error
// log) and cuBLAS, opened at run time with dlopen so that one binary works
// with cuBLAS 11 to 13 and builds without it.

/*
#cgo LDFLAGS: -lcuda -ldl
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// gorgonia.org/cu calls cuInit from its package init and exits the process
// when it fails, which would turn "no GPU here" into a crash before main.
// This definition interposes cuInit for the whole executable: it records
// the real result for strata_init_result and reports success, so that Open
// and DeviceCount return ErrNoDevice instead. Every other caller of the
// driver resolves cuInit through its own dlopen and reaches the real one.
static int strata_init_code = CUDA_ERROR_NOT_INITIALIZED;
static int strata_init_done = 0;

CUresult cuInit(unsigned int flags) {
	CUresult (*real)(unsigned int) = (CUresult (*)(unsigned int))dlsym(RTLD_NEXT, "cuInit");
	if (real == NULL) {
		strata_init_code = CUDA_ERROR_NOT_INITIALIZED;
	} else {
		strata_init_code = real(flags);
	}
	strata_init_done = 1;
	return CUDA_SUCCESS;
}

static int strata_init_result(void) {
	if (!strata_init_done) cuInit(0);
	return strata_init_code;
}

static const char* strata_error_name(CUresult r) {
	const char* s = NULL;
	if (cuGetErrorName(r, &s) != CUDA_SUCCESS || s == NULL) return "CUDA_ERROR_UNKNOWN_CODE";
	return s;
}

static const char* strata_error_string(CUresult r) {
	const char* s = NULL;
	if (cuGetErrorString(r, &s) != CUDA_SUCCESS || s == NULL) return "unknown error";
	return s;
}

static CUresult strata_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
			      unsigned shmem, CUstream s, void* args, size_t size) {
	void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, args, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
	return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, NULL, extra);
}

// strata_launch_pdl launches as strata_launch, with programmatic stream
// serialization allowed (programmatic dependent launch, compute
// capability 9.0): the kernel may start before the one queued before it
// completes, and waits for it with griddepcontrol.wait. cuLaunchKernelEx
// is looked up at run time, so that a driver without it (before CUDA 12)
// still loads the binary and only this launch fails.
static CUresult strata_launch_pdl(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
				  unsigned shmem, CUstream s, void* args, size_t size) {
	typedef CUresult (*launch_ex)(const CUlaunchConfig*, CUfunction, void**, void**);
	static launch_ex fn = NULL;
	if (fn == NULL) fn = (launch_ex)dlsym(RTLD_DEFAULT, "cuLaunchKernelEx");
	if (fn == NULL) return CUDA_ERROR_NOT_SUPPORTED;
	CUlaunchAttribute attr;
	memset(&attr, 0, sizeof attr);
	attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
	attr.value.programmaticStreamSerializationAllowed = 1;
	CUlaunchConfig cfg;
	memset(&cfg, 0, sizeof cfg);
	cfg.gridDimX = gx, cfg.gridDimY = gy, cfg.gridDimZ = gz;
	cfg.blockDimX = bx, cfg.blockDimY = by, cfg.blockDimZ = bz;
	cfg.sharedMemBytes = shmem, cfg.hStream = s;
	cfg.attrs = &attr, cfg.numAttrs = 1;
	void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, args, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
	return fn(&cfg, f, NULL, extra);
}

static CUresult strata_module_load(CUmodule* m, const char* image, char* log, unsigned logSize) {
	CUjit_option opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
	void* vals[2] = {log, (void*)(uintptr_t)logSize};
	return cuModuleLoadDataEx(m, image, 2, opts, vals);
}

static CUresult strata_host_alloc(void** p, size_t n) { return cuMemHostAlloc(p, n, CU_MEMHOSTALLOC_PORTABLE); }

static CUresult strata_host_register(void* p, size_t n) {
	return cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
}

static CUresult strata_host_unregister(void* p) { return cuMemHostUnregister(p); }

static CUresult strata_prefetch(CUdeviceptr p, size_t n, CUdevice dev, CUstream s) { return cuMemPrefetchAsync(p, n, dev, s); }

static CUresult strata_advise_host(CUdeviceptr p, size_t n) {
	return cuMemAdvise(p, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU);
}

static CUresult strata_advise(CUdeviceptr p, size_t n, int advice, CUdevice dev) {
	return cuMemAdvise(p, n, (CUmem_advise)advice, dev);
}

static int strata_cpu_device(void) { return CU_DEVICE_CPU; }

// Stream capture into graphs (graph.go). Thread-local mode: a call that
// is unsafe during capture (cuMemAlloc, a synchronisation) fails on the
// capturing thread and leaves other threads alone.
static CUresult strata_begin_capture(CUstream s) { return cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL); }

static CUresult strata_end_capture(CUstream s, CUgraph* g) { return cuStreamEndCapture(s, g); }

static CUresult strata_graph_instantiate(CUgraphExec* e, CUgraph g) { return cuGraphInstantiateWithFlags(e, g, 0); }

static CUresult strata_graph_nodes(CUgraph g, size_t* n) { return cuGraphGetNodes(g, NULL, n); }

// cuBLAS, declared here so that its header is not needed at build time.
// The enum values are those of cuBLAS 11 and later.
typedef void* cublasHandle_t;
typedef int (*cublasCreate_t)(cublasHandle_t*);
typedef int (*cublasDestroy_t)(cublasHandle_t);
typedef int (*cublasSetStream_t)(cublasHandle_t, CUstream);
typedef int (*cublasGetVersion_t)(cublasHandle_t, int*);
typedef int (*cublasSetWorkspace_t)(cublasHandle_t, void*, size_t);
typedef int (*cublasGemmEx_t)(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
			      const void*, void*, int, int, int, int);

static void* cublas_lib;
static char cublas_soname[64];
static cublasCreate_t p_cublasCreate;
static cublasDestroy_t p_cublasDestroy;
static cublasSetStream_t p_cublasSetStream;
static cublasGetVersion_t p_cublasGetVersion;
static cublasSetWorkspace_t p_cublasSetWorkspace;
static cublasGemmEx_t p_cublasGemmEx;

// strata_cublas_open loads cuBLAS from path, or else from the first of the
// versioned sonames that dlopen finds. It returns 0 on success and writes a
// reason into err otherwise.
static int strata_cublas_open(const char* path, char* err, size_t errlen) {
	if (cublas_lib != NULL) return 0;
	static const char* names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"};
	void* h = NULL;
	const char* used = NULL;
	err[0] = 0;
	if (path != NULL && path[0] != 0) {
		h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
		used = path;
		if (h == NULL) snprintf(err, errlen, "%s", dlerror());
	} else {
		for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && h == NULL; i++) {
			h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
			used = names[i];
		}
		if (h == NULL) snprintf(err, errlen, "none of libcublas.so.13, .12, .11 or libcublas.so could be opened (last: %s)", dlerror());
	}
	if (h == NULL) return -1;
	p_cublasCreate = (cublasCreate_t)dlsym(h, "cublasCreate_v2");
	p_cublasDestroy = (cublasDestroy_t)dlsym(h, "cublasDestroy_v2");
	p_cublasSetStream = (cublasSetStream_t)dlsym(h, "cublasSetStream_v2");
	p_cublasGetVersion = (cublasGetVersion_t)dlsym(h, "cublasGetVersion_v2");
	p_cublasSetWorkspace = (cublasSetWorkspace_t)dlsym(h, "cublasSetWorkspace_v2");  // cuBLAS 11.4+
	p_cublasGemmEx = (cublasGemmEx_t)dlsym(h, "cublasGemmEx");
	if (!p_cublasCreate || !p_cublasDestroy || !p_cublasSetStream || !p_cublasGetVersion || !p_cublasGemmEx) {
		snprintf(err, errlen, "%s lacks cublasCreate_v2, cublasSetStream_v2 or cublasGemmEx", used);
		dlclose(h);
		return -1;
	}
	snprintf(cublas_soname, sizeof(cublas_soname), "%s", used);
	cublas_lib = h;
	return 0;
}

static const char* strata_cublas_soname(void) { return cublas_soname; }
static int strata_cublas_create(cublasHandle_t* h) { return p_cublasCreate(h); }
static int strata_cublas_destroy(cublasHandle_t h) { return p_cublasDestroy(h); }
static int strata_cublas_set_stream(cublasHandle_t h, CUstream s) { return p_cublasSetStream(h, s); }
static int strata_cublas_version(cublasHandle_t h, int* v) { return p_cublasGetVersion(h, v); }
static int strata_cublas_has_workspace(void) { return p_cublasSetWorkspace != NULL; }
static int strata_cublas_set_workspace(cublasHandle_t h, CUdeviceptr p, size_t n) { return p_cublasSetWorkspace(h, (void*)p, n); }

// out[M,N] (row-major, F32) = x[M,K] . w[N,K]^T, with x and w of cuBLAS data
// type xt and wt (CUDA_R_32F 0, CUDA_R_16F 2, CUDA_R_16BF 14) and F32
// compute (CUBLAS_COMPUTE_32F 68). In cuBLAS's column-major terms this is
// out^T[N,M] = w[N,K] . x^T[K,M] with w read transposed.
static int strata_cublas_matmul(cublasHandle_t h, CUdeviceptr out, CUdeviceptr x, int xt, CUdeviceptr w, int wt, int M, int N, int K, int accumulate) {
	const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
	return p_cublasGemmEx(h, 1, 0, N, M, K, &alpha, (const void*)w, wt, K, (const void*)x, xt, K, &beta, (void*)out, 0, N, 68, -1);
}

// C[m,n] (column-major F32, leading dimension ldc) = op(A)[m,k] . op(B)[k,n]
// + beta C, with A and B of cuBLAS data types at and bt, op = transpose
// when transa/transb is 1, and F32 compute (CUBLAS_COMPUTE_32F, no TF32).
static int strata_cublas_gemm(cublasHandle_t h, int transa, int transb, int m, int n, int k, CUdeviceptr A, int at, int lda, CUdeviceptr B,
			      int bt, int ldb, float beta, CUdeviceptr C, int ldc) {
	const float alpha = 1.0f;
	return p_cublasGemmEx(h, transa, transb, m, n, k, &alpha, (const void*)A, at, lda, (const void*)B, bt, ldb, &beta, (void*)C, 0, ldc, 68, -1);
}

// Allows a kernel up to bytes of dynamic shared memory (above 48 KiB needs
// this opt-in).
static CUresult strata_func_max_shared(CUfunction f, int bytes) {
	return cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
}

// How many blocks of f, threads each, a multiprocessor runs at once.
static CUresult strata_blocks_per_sm(CUfunction f, int threads, int *blocks) {
	return cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks, f, threads, 0);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"reflect"
	"unsafe"

	"gorgonia.org/cu"
)

// driverError turns a CUresult into an error with the driver's name and
// description for it; nil for CUDA_SUCCESS.
func driverError(r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return &DriverError{Code: int(r), Name: C.GoString(C.strata_error_name(r)), Msg: C.GoString(C.strata_error_string(r))}
}

// cuError converts an error from gorgonia.org/cu (its CUresult type, an
// integer under the hood) into a DriverError with the driver's own name and
// message.
func cuError(err error) error {
	if err == nil {
		return nil
	}
	v := reflect.ValueOf(err)
	if v.Type().PkgPath() == "gorgonia.org/cu" && v.Kind() == reflect.Int {
		return driverError(C.CUresult(v.Int()))
	}
	return err
}

// isOOM reports whether err is the driver's out-of-memory result.
func isOOM(err error) bool {
	if err == cu.OutOfMemory {
		return true
	}
	de, ok := err.(*DriverError)
	return ok && de.Code == C.CUDA_ERROR_OUT_OF_MEMORY
}

// initResult is the real cuInit result (see the interposer above).
func initResult() error { return driverError(C.CUresult(C.strata_init_result())) }

// module and kfunc are loaded PTX modules and their kernels.
type (
	module = C.CUmodule
	kfunc  = C.CUfunction
)

func streamC(s cu.Stream) C.CUstream { return C.CUstream(unsafe.Pointer(s.C())) }

// launch runs f with the packed parameters on stream s.
func launch(f kfunc, grid, block [3]uint32, shmem uint32, s cu.Stream, a *args) error {
	var p unsafe.Pointer
	if a.n > 0 {
		p = unsafe.Pointer(&a.buf[0])
	}
	r := C.strata_launch(f, C.uint(grid[0]), C.uint(grid[1]), C.uint(grid[2]), C.uint(block[0]), C.uint(block[1]), C.uint(block[2]),
		C.uint(shmem), streamC(s), p, C.size_t(a.n))
	return driverError(r)
}

// launchPDL is launch with programmatic dependent launch allowed
// (strata_launch_pdl).
func launchPDL(f kfunc, grid, block [3]uint32, s cu.Stream, a *args) error {
	var p unsafe.Pointer
	if a.n > 0 {
		p = unsafe.Pointer(&a.buf[0])
	}
	r := C.strata_launch_pdl(f, C.uint(grid[0]), C.uint(grid[1]), C.uint(grid[2]), C.uint(block[0]), C.uint(block[1]), C.uint(block[2]),
		0, streamC(s), p, C.size_t(a.n))
	return driverError(r)
}

// loadModule loads a NUL-free PTX image; on failure the JIT log is part of
// the returned message.
func loadModule(ptx string) (C.CUmodule, string, error) {
	const logSize = 8192
	img := C.CString(ptx)
	defer C.free(unsafe.Pointer(img))
	log := (*C.char)(C.calloc(logSize, 1))
	defer C.free(unsafe.Pointer(log))
	var m C.CUmodule
	r := C.strata_module_load(&m, img, log, logSize)
	return m, C.GoString(log), driverError(r)
}

func unloadModule(m C.CUmodule) error { return driverError(C.cuModuleUnload(m)) }

func moduleFunction(m C.CUmodule, name string) (C.CUfunction, error) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	var f C.CUfunction
	return f, driverError(C.cuModuleGetFunction(&f, m, cs))
}

func hostAlloc(n int64) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	r := C.strata_host_alloc(&p, C.size_t(n))
	return p, driverError(r)
}

func hostRegister(p unsafe.Pointer, n int64) error {
	return driverError(C.strata_host_register(p, C.size_t(n)))
}

func hostUnregister(p unsafe.Pointer) error { return driverError(C.strata_host_unregister(p)) }

func prefetch(p uintptr, n int64, dev int, s cu.Stream) error {
	return driverError(C.strata_prefetch(C.CUdeviceptr(p), C.size_t(n), C.CUdevice(dev), streamC(s)))
}

func cpuDevice() int { return int(C.strata_cpu_device()) }

// adviseAccessedBy is CU_MEM_ADVISE_SET_ACCESSED_BY, for memAdvise.
const adviseAccessedBy = 5

func memAdvise(p uintptr, n int64, advice, dev int) error {
	return driverError(C.strata_advise(C.CUdeviceptr(p), C.size_t(n), C.int(advice), C.CUdevice(dev)))
}

func adviseHost(p uintptr, n int64) error {
	return driverError(C.strata_advise_host(C.CUdeviceptr(p), C.size_t(n)))
}

// cuBLAS data types (cudaDataType_t).
const (
	cublasR32F  = 0
	cublasR16F  = 2
	cublasR16BF = 14
)

type cublasHandle = C.cublasHandle_t

// openCUBLAS loads the library (once per process). path, when not empty,
// is tried instead of the sonames.
func openCUBLAS(path string) (soname string, err error) {
	var cpath *C.char
	if path != "" {
		cpath = C.CString(path)
		defer C.free(unsafe.Pointer(cpath))
	}
	var buf [512]C.char
	if C.strata_cublas_open(cpath, &buf[0], C.size_t(len(buf))) != 0 {
		return "", fmt.Errorf("%s", C.GoString(&buf[0]))
	}
	return C.GoString(C.strata_cublas_soname()), nil
}

func cublasCreate(s cu.Stream) (cublasHandle, int, error) {
	var h C.cublasHandle_t
	if st := C.strata_cublas_create(&h); st != 0 {
		return nil, 0, fmt.Errorf("cublasCreate: status %d", int(st))
	}
	if st := C.strata_cublas_set_stream(h, streamC(s)); st != 0 {
		C.strata_cublas_destroy(h)
		return nil, 0, fmt.Errorf("cublasSetStream: status %d", int(st))
	}
	var v C.int
	C.strata_cublas_version(h, &v)
	return h, int(v), nil
}

func cublasDestroy(h cublasHandle) { C.strata_cublas_destroy(h) }

func cublasHasWorkspace() bool { return C.strata_cublas_has_workspace() != 0 }

func cublasSetWorkspace(h cublasHandle, p uintptr, n int64) error {
	if st := C.strata_cublas_set_workspace(h, C.CUdeviceptr(p), C.size_t(n)); st != 0 {
		return fmt.Errorf("cublasSetWorkspace: status %d", int(st))
	}
	return nil
}

// cublasMatMul computes out = x·wᵀ, or out += x·wᵀ when accumulate is set.
func cublasMatMul(h cublasHandle, out, x uintptr, xt int, w uintptr, wt int, m, n, k int, accumulate bool) error {
	acc := 0
	if accumulate {
		acc = 1
	}
	if st := C.strata_cublas_matmul(h, C.CUdeviceptr(out), C.CUdeviceptr(x), C.int(xt), C.CUdeviceptr(w), C.int(wt), C.int(m), C.int(n), C.int(k), C.int(acc)); st != 0 {
		return &blasError{call: fmt.Sprintf("cublasGemmEx(M=%d N=%d K=%d)", m, n, k), status: int(st)}
	}
	return nil
}

// cublasGemm computes, in cuBLAS's column-major terms, C[m,n] = op(A)[m,k]
// · op(B)[k,n] + beta·C with F32 C and F32 compute; op transposes when
// transA (transB) is set. at and bt are cuBLAS data types (cublasR32F, ...).
func cublasGemm(h cublasHandle, transA, transB bool, m, n, k int, a uintptr, at, lda int, bm uintptr, bt, ldb int, beta float32, c uintptr, ldc int) error {
	ta, tb := 0, 0
	if transA {
		ta = 1
	}
	if transB {
		tb = 1
	}
	st := C.strata_cublas_gemm(h, C.int(ta), C.int(tb), C.int(m), C.int(n), C.int(k), C.CUdeviceptr(a), C.int(at), C.int(lda),
		C.CUdeviceptr(bm), C.int(bt), C.int(ldb), C.float(beta), C.CUdeviceptr(c), C.int(ldc))
	if st != 0 {
		return &blasError{call: fmt.Sprintf("cublasGemmEx(%c%c, m=%d n=%d k=%d)", "NT"[ta], "NT"[tb], m, n, k), status: int(st)}
	}
	return nil
}

type (
	cuGraph     = C.CUgraph
	cuGraphExec = C.CUgraphExec
)

func beginCapture(s cu.Stream) error { return driverError(C.strata_begin_capture(streamC(s))) }

func endCapture(s cu.Stream) (cuGraph, error) {
	var g C.CUgraph
	err := driverError(C.strata_end_capture(streamC(s), &g))
	return g, err
}

func graphInstantiate(g cuGraph) (cuGraphExec, error) {
	var e C.CUgraphExec
	return e, driverError(C.strata_graph_instantiate(&e, g))
}

func graphNodes(g cuGraph) (int, error) {
	var n C.size_t
	err := driverError(C.strata_graph_nodes(g, &n))
	return int(n), err
}

func graphLaunch(e cuGraphExec, s cu.Stream) error {
	return driverError(C.cuGraphLaunch(e, streamC(s)))
}

func graphExecDestroy(e cuGraphExec) error { return driverError(C.cuGraphExecDestroy(e)) }

func graphDestroy(g cuGraph) error { return driverError(C.cuGraphDestroy(g)) }

// setMaxShared lets f launch with up to bytes of dynamic shared memory.
func setMaxShared(f kfunc, bytes int) error {
	return driverError(C.strata_func_max_shared(f, C.int(bytes)))
}

// blocksPerSM is how many blocks of f, threads each and no dynamic shared
// memory, a multiprocessor of the current context's device runs at once.
func blocksPerSM(f kfunc, threads int) (int, error) {
	var n C.int
	if err := driverError(C.strata_blocks_per_sm(f, C.int(threads), &n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

// args packs kernel parameters with their natural alignment, as
// CU_LAUNCH_PARAM_BUFFER_POINTER expects.
type args struct {
	buf [128]byte
	n   int
}

func (a *args) align(k int) { a.n = (a.n + k - 1) &^ (k - 1) }

func (a *args) ptr(p uintptr) *args {
	a.align(8)
	*(*uint64)(unsafe.Pointer(&a.buf[a.n])) = uint64(p)
	a.n += 8
	return a
}

func (a *args) i32(v int) *args {
	a.align(4)
	*(*int32)(unsafe.Pointer(&a.buf[a.n])) = int32(v)
	a.n += 4
	return a
}

func (a *args) i64(v int64) *args {
	a.align(8)
	*(*int64)(unsafe.Pointer(&a.buf[a.n])) = v
	a.n += 8
	return a
}

func (a *args) f32(v float32) *args {
	a.align(4)
	*(*float32)(unsafe.Pointer(&a.buf[a.n])) = v
	a.n += 4
	return a
}

// isBLASNotSupported reports a CUBLAS_STATUS_NOT_SUPPORTED (15) failure.
func isBLASNotSupported(err error) bool {
	var be *blasError
	return errors.As(err, &be) && be.status == 15
}

type blasError struct {
	call   string
	status int
}

func (e *blasError) Error() string { return fmt.Sprintf("%s: cuBLAS status %d", e.call, e.status) }
