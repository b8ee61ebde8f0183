// Candidate decode GEMVs (M = 1) for F16 and BF16 weights, parameterised
// so that one GPU run can compare them (Backend.gemvVariant selects one;
// BenchmarkGEMVShapes times each on the 7B and 1.1B shapes):
//   R  rows of w per warp (each lane reads its x once for all R rows),
//   U  16-byte loads per row and lane issued back to back before any is
//      used (the batch's loads are all in flight together: see gemv_rows
//      for the select that keeps ptxas from spreading them out),
//   S  warps per row: the warps of a row split its chunks, interleaved
//      (warp s takes chunks 32s+lane, 32s+lane+32S, ...), and their sums
//      are added in warp order through shared memory. S > 1 puts more
//      warps on short grids (N = 2048 or 4096 leaves most of an H200's
//      warp slots empty) and shortens each warp's chain of batches on long
//      rows (K = 11008).
// With S = 1 each row is summed in gemv_vec's order, so the products are
// bit for bit those of gemv_*_m1; with S > 1 they differ in rounding only.
// The MatMul kernel takes up to three matrices laid end to end as
// gemv_many does (MatMul passes one, MatMulMany three), the gate-up kernel
// the two rows of GateUpSiLU. Blocks are GEMV_SPLIT_THREADS threads; K is
// a multiple of 16/sizeof(W) and the rows 16-byte aligned (the callers
// check).
#pragma once

#include "gemv.cuh"

#define GEMV_SPLIT_THREADS 256

// Programmatic dependent launch (compute capability 9.0; the _pdl kernels
// of gemv_pdl_*.cu, launched with programmatic stream serialization): a
// kernel lets the next one launch from its start (pdl_trigger), and waits
// for the kernel before it to complete, its writes visible, in pdl_wait.
// A PDL kernel issues its first batch of weight loads before pdl_wait, so
// that they overlap the tail of the kernel before (the weights are never
// written by the kernels of a step), and reads x and writes its output
// only after it. Every thread waits, so a PDL grid completes only after
// the grid before it (and so, in turn, every one before that).
template <bool PDL>
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
template <bool PDL>
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// split_dot adds to acc[r] the products of lane's chunks c0, c0+step, ...
// below chunks of rows wr[r] with x, U chunks of every row in flight at a
// time.
// With PDL, the first batch's loads are issued before pdl_wait.
template <typename W, int R, int U, bool PDL = false>
__device__ __forceinline__ void split_dot(float* acc, const uint4* const* wr, const float* __restrict__ x, int K, int chunks, int c0,
					  int step) {
	int c = c0;
	bool waited = false;
	for (; c + step * (U - 1) < chunks; c += step * U) {
		uint4 wv[U][R];
#pragma unroll
		for (int u = 0; u < U; u++)
#pragma unroll
			for (int r = 0; r < R; r++) wv[u][r] = load_stream(wr[r] + c + step * u);
		// Every accumulator depends on every load of the batch (a select
		// that never changes it): no product starts before the batch has
		// landed, so ptxas issues its loads back to back.
		unsigned landed = 0;
#pragma unroll
		for (int u = 0; u < U; u++)
#pragma unroll
			for (int r = 0; r < R; r++) landed ^= wv[u][r].x;
#pragma unroll
		for (int r = 0; r < R; r++) acc[r] = landed == (unsigned)~K ? acc[r] + 0.0f : acc[r];
		if (PDL && !waited) {
			pdl_wait<PDL>();
			waited = true;
		}
#pragma unroll
		for (int u = 0; u < U; u++)
#pragma unroll
			for (int r = 0; r < R; r++) gemv_chunk<W, 1, !PDL>(&acc[r], wv[u][r], x, K, c + step * u);
	}
	pdl_wait<PDL>();
	for (; c < chunks; c += step)
#pragma unroll
		for (int r = 0; r < R; r++) gemv_chunk<W, 1, !PDL>(&acc[r], load_stream(wr[r] + c), x, K, c);
}

// split_sum reduces acc[r] over the warp, then over the S warps of the
// row group (in warp order) into the group's first warp; it returns
// whether the calling lane holds the sums (lane 0 of warp 0 of the group).
// Every thread of the block must call it (it synchronises when S > 1).
template <int R, int S>
__device__ __forceinline__ bool split_sum(float* acc) {
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
	for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
	if (S == 1) return lane == 0;
	__shared__ float part[GEMV_SPLIT_THREADS / 32][R];
	if (lane == 0)
#pragma unroll
		for (int r = 0; r < R; r++) part[warp][r] = acc[r];
	__syncthreads();
	if (lane != 0 || warp % S != 0) return false;
#pragma unroll
	for (int r = 0; r < R; r++) {
		float s = part[warp][r];
#pragma unroll
		for (int i = 1; i < S; i++) s += part[warp + i][r];
		acc[r] = s;
	}
	return true;
}

// gemv_split computes out_i = x . w_i^T for up to three matrices (rows n0,
// n1, n2; empty ones last). Row group g of the grid takes rows gR..gR+R-1
// of the matrices laid end to end; a group past the last row reads the
// last row in its place and writes nothing.
template <typename W, int R, int U, int S, bool PDL = false>
__device__ void gemv_split(float* out0, float* out1, float* out2, const float* __restrict__ x, const W* __restrict__ w0,
			   const W* __restrict__ w1, const W* __restrict__ w2, int n0, int n1, int n2, int K) {
	pdl_trigger<PDL>();
	constexpr int E = 16 / sizeof(W);
	constexpr int G = GEMV_SPLIT_THREADS / 32 / S;  // row groups per block
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int rows = n0 + n1 + n2;
	const int g0 = (blockIdx.x * G + warp / S) * R;
	const uint4* wr[R];
	float* op[R];
#pragma unroll
	for (int r = 0; r < R; r++) {
		int g = min(g0 + r, rows - 1);
		const W* w = w0;
		float* o = out0;
		if (g >= n0) {
			g -= n0, w = w1, o = out1;
			if (g >= n1) g -= n1, w = w2, o = out2;
		}
		wr[r] = reinterpret_cast<const uint4*>(w + (long long)g * K);
		op[r] = g0 + r < rows ? o + g : nullptr;
	}
	float acc[R];
#pragma unroll
	for (int r = 0; r < R; r++) acc[r] = 0.0f;
	if (g0 < rows) split_dot<W, R, U, PDL>(acc, wr, x, K, K / E, 32 * (warp % S) + lane, 32 * S);
	pdl_wait<PDL>();
	if (!split_sum<R, S>(acc)) return;
#pragma unroll
	for (int r = 0; r < R; r++)
		if (op[r] != nullptr) *op[r] = acc[r];
}

// gemv_gate_up_split computes out[n] = silu(x . wg[n,:]) * (x . wu[n,:]),
// the two rows of n read together (R = 2 of split_dot), U loads of each in
// flight, S warps per row.
template <typename W, int U, int S, bool PDL = false>
__device__ void gemv_gate_up_split(float* out, const float* __restrict__ x, const W* __restrict__ wg, const W* __restrict__ wu, int N,
				   int K) {
	pdl_trigger<PDL>();
	constexpr int E = 16 / sizeof(W);
	constexpr int G = GEMV_SPLIT_THREADS / 32 / S;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int n = blockIdx.x * G + warp / S;
	const long long row = (long long)min(n, N - 1) * K;
	const uint4* wr[2] = {reinterpret_cast<const uint4*>(wg + row), reinterpret_cast<const uint4*>(wu + row)};
	float acc[2] = {0.0f, 0.0f};
	if (n < N) split_dot<W, 2, U, PDL>(acc, wr, x, K, K / E, 32 * (warp % S) + lane, 32 * S);
	pdl_wait<PDL>();
	if (!split_sum<2, S>(acc)) return;
	if (n < N) out[n] = acc[0] / (1.0f + expf(-acc[0])) * acc[1];
}

#define GEMV_SPLIT(T, SFX, R, U, S)                                                                                                  \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_split_##SFX##_r##R##u##U##s##S(float* out0, float* out1, float* out2, const float* x, const T* w0, const T* w1,     \
						const T* w2, int n0, int n1, int n2, int K) {                                           \
		gemv_split<T, R, U, S>(out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K);                                              \
	}
#define GEMV_GATE_UP_SPLIT(T, SFX, U, S)                                                                                             \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_gate_up_split_##SFX##_u##U##s##S(float* out, const float* x, const T* wg, const T* wu, int N, int K) {               \
		gemv_gate_up_split<T, U, S>(out, x, wg, wu, N, K);                                                                     \
	}

#define GEMV_SPLIT_PDL(T, SFX, R, U, S)                                                                                             \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_split_pdl_##SFX##_r##R##u##U##s##S(float* out0, float* out1, float* out2, const float* x, const T* w0, const T* w1, \
						    const T* w2, int n0, int n1, int n2, int K) {                                       \
		gemv_split<T, R, U, S, true>(out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K);                                        \
	}
#define GEMV_GATE_UP_SPLIT_PDL(T, SFX, U, S)                                                                                         \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_gate_up_split_pdl_##SFX##_u##U##s##S(float* out, const float* x, const T* wg, const T* wu, int N, int K) {           \
		gemv_gate_up_split<T, U, S, true>(out, x, wg, wu, N, K);                                                               \
	}

// The variants Backend.gemvVariants names (ops.go); keep the two lists
// together.
#define GEMV_SPLIT_ALL(T, SFX)                 \
	GEMV_SPLIT(T, SFX, 1, 8, 1)            \
	GEMV_SPLIT(T, SFX, 1, 16, 1)           \
	GEMV_SPLIT(T, SFX, 2, 8, 1)            \
	GEMV_SPLIT(T, SFX, 1, 8, 2)            \
	GEMV_SPLIT(T, SFX, 1, 4, 4)            \
	GEMV_GATE_UP_SPLIT(T, SFX, 4, 1)       \
	GEMV_GATE_UP_SPLIT(T, SFX, 8, 1)       \
	GEMV_GATE_UP_SPLIT(T, SFX, 4, 2)       \
	GEMV_GATE_UP_SPLIT(T, SFX, 2, 4)

// The PDL variants (pdl set in gemvVariants), for compute_90 modules.
#define GEMV_SPLIT_PDL_ALL(T, SFX)          \
	GEMV_SPLIT_PDL(T, SFX, 1, 8, 1)     \
	GEMV_SPLIT_PDL(T, SFX, 1, 8, 2)     \
	GEMV_SPLIT_PDL(T, SFX, 1, 4, 4)     \
	GEMV_GATE_UP_SPLIT_PDL(T, SFX, 4, 1) \
	GEMV_GATE_UP_SPLIT_PDL(T, SFX, 4, 2) \
	GEMV_GATE_UP_SPLIT_PDL(T, SFX, 2, 4)
