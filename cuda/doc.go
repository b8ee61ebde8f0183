// Package cuda is strata's GPU backend: a tensor.Backend on one NVIDIA GPU
// through the CUDA driver API (gorgonia.org/cu, plus a small cgo layer for
// the calls it lacks). It builds with the tag cuda (cuda.h and libcuda.so at
// build time; on Debian, make cuda-deps). Without the tag it builds to
// almost nothing (its error types and the pure-Go caching allocator, whose
// accounting is tested there) and registers no driver.
//
// What it owns:
//
//   - the "cuda" device driver, registered with tensor.RegisterDriver from
//     init: a program links it in with a blank import and opens devices by
//     name, tensor.OpenDevice("cuda:1");
//   - the kernels of tensor.Kernels and tensor.GradOps, in CUDA C
//     (kernels/*.cu) embedded as PTX for compute capability 7.0, so that a
//     machine with only the driver runs them; matrix products through
//     cuBLAS (loaded at run time from libcublas.so.13, .12 or .11) with F32
//     accumulation, GEMV kernels for decode that read F16/BF16 weights at
//     memory speed, and the backward's products in F32 (F16/BF16 weights
//     widened exactly, a bounded chunk of rows at a time);
//   - quantized weights (ggml's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K
//     and Q6_K blocks, quant.go and kernels/quant*.cuh): GEMV kernels for
//     decode that read the blocks themselves, integer products (dp2a) on x
//     rounded to 16 bits a 32 elements, up to 8 rows of x a read of the
//     weights (MatMulPrecise: F32 activations and accumulation), prefill
//     through cuBLAS on weights dequantized to F16
//     a block of rows at a time, Embed of quantized tables dequantized
//     exactly;
//   - attention over long contexts (ops.go's Attention, attnplan.go's
//     choice): a tiled prefill kernel on tensor cores (mma.sync with F16,
//     or BF16 for a BF16 cache, F32 softmax; PTX for compute capability
//     8.0, loaded only where the device has it), a decode kernel that
//     splits the cache's positions across blocks and merges their partial
//     softmax, and the first kernel, one block a query, for the rest; KV
//     caches in F32, F16, BF16, Q8_0 or Q8_B8, appended by CopyRows;
//   - decode without the host's launch cost: graph capture
//     (tensor.Grapher, graph.go: Capture records the operations of a
//     function through the driver's stream capture, Replay launches them
//     as one graph; Rope, RopeKV and Attention read their position from
//     device memory through PosAt, so a captured decode step stays valid
//     from token to token), fused operations (tensor.AddRMSNorm, RopeKV,
//     GateUpSiLU; fused.go, kernels/fused.cu), and counts of every kernel
//     launch, copy, cuBLAS call and graph replay (tensor.LaunchCounter);
//   - the device's memory: a caching allocator, so that the decode loop
//     does not call cuMemAlloc, reported as a tensor.CachingAllocator
//     (AllocSize, Cached, Trim, and Fixed for the cuBLAS workspace) for a
//     budget that holds every device byte; pinned host memory
//     (tensor.PinnedAllocator); uploads on a copy stream ordered by events
//     and timed (tensor.AsyncUploader, tensor.CopyTimer), which the host
//     can also wait for one by one, to reuse a pinned staging buffer once
//     its copy has landed (tensor.StagedUploader); unified memory
//     (tensor.ManagedAllocator); tensor.Syncer and tensor.MemoryInfo.
//
// What it must not know: the rules of the operations' arguments (shapes,
// dtypes, ranges, aliasing), which tensor.Checked checks in front of it, so
// that its kernels check only what they need to stay inside memory of their
// own (that every operand is live memory of this device) and their own
// limits (a head of at most 256 dimensions, at most 65535 queries a call
// to the one-block-a-query kernel);
// models, layers and budgets; and who uses it: nothing imports it but
// through the blank import of a main package.
//
// Errors are values, never crashes: no device or no driver (ErrNoDevice),
// a driver too old for the embedded PTX (ErrDriverTooOld), out of memory
// (wrapping tensor.ErrOutOfMemory), a closed backend (ErrClosed).
//
// Example, in a main package:
//
//	import _ "github.com/strata-llm/strata/cuda" // the "cuda" driver, with -tags cuda
//
//	b, err := tensor.OpenDevice("cuda", tensor.DeviceOptions{})
//	if err != nil {
//		return err // no such driver without -tags cuda; no device; driver too old
//	}
//	defer b.Close()
//	k := tensor.Checked(b)
//	x, err := b.Alloc(tensor.F32, tensor.Shape{1, 4096})
//	...
//	err = k.MatMul(out, x, w, nil)
//
// The package's own tests open a device with Open, which returns the
// *Backend with its Stats, Info and BLAS.
//
// The kernels' PTX is generated: edit kernels/*.cu, then run make cuda-ptx
// (nvcc); TestPTXUpToDate fails while the PTX is older than its sources.
// Where nvcc is installed, TestQuantKernelsOnHost also runs the quantized
// kernels' bodies on CPU threads (testdata/quanthost.cu) against
// tensor/quant, without a GPU, and TestQuantSASS counts the instructions a
// weight of their GEMVs in the sm_90 SASS (testdata/quantprobe.cu).
package cuda
