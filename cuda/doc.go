// Package cuda is strata's GPU backend: a tensor.Backend on one NVIDIA GPU
// through the CUDA driver API (gorgonia.org/cu, plus a small cgo layer for
// the calls it lacks).
//
// It needs the build tag cuda (and cuda.h and libcuda.so at build time; on
// Debian, make cuda-deps). Without the tag the package builds to almost
// nothing and registers no driver.
//
// What it provides:
//   - the tensor.Backend operations, as kernels written in CUDA C
//     (kernels/*.cu) and embedded as PTX for compute capability 7.0, so that
//     a machine with only the driver runs them; matrix products through
//     cuBLAS (loaded at run time from libcublas.so.13, .12 or .11) with F32
//     accumulation, and a GEMV kernel for decode that reads F16/BF16 weights
//     at memory speed;
//   - a caching device allocator (Stats, Trim), so that the decode loop
//     does not call cuMemAlloc;
//   - the optional capabilities tensor.Syncer, tensor.PinnedAllocator,
//     tensor.AsyncUploader (copies on a second stream, ordered by events)
//     and tensor.MemoryInfo, and unified memory through ManagedAllocator;
//   - the backward operations of training, tensor.GradOps: their matrix
//     products on cuBLAS with F32 inputs and F32 compute (F16/BF16 weights
//     widened exactly, a bounded chunk of rows at a time), attention's
//     backward recomputing the probabilities (no T² buffer).
//
// Errors are values, never crashes: no device or no driver (ErrNoDevice),
// a driver too old for the embedded PTX (ErrDriverTooOld), out of memory
// (wrapping tensor.ErrOutOfMemory), invalid arguments.
//
// Importing the package registers the "cuda" driver with
// tensor.RegisterDriver when built with the cuda tag. Direct use:
//
//	b, err := cuda.Open(0)
//	if err != nil {
//		return err // errors.Is(err, cuda.ErrNoDevice), ...
//	}
//	defer b.Close()
//	x, err := b.Alloc(tensor.F32, tensor.Shape{1, 4096})
//	...
//	err = b.MatMul(out, x, w, nil)
//
// The kernels' PTX is generated: edit kernels/*.cu, then run make cuda-ptx
// (nvcc); TestPTXUpToDate fails while the PTX is older than its sources.
package cuda
