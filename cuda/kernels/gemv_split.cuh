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
#include "norm.cuh"

#define GEMV_SPLIT_THREADS 256

// What a split kernel does besides its product (gemv_split's MODE):
// nothing; normalise x first, as rmsnorm_* would (the normed kernels,
// whose x is the residual stream and g the norm's weights: tensor's
// NormMatMulMany and NormGateUpSiLU); or add the product to its output
// (out += x . w^T: tensor's MatMulAdd, the residual add of the o and down
// products).
#define GEMV_PLAIN 0
#define GEMV_NORM 1
#define GEMV_ACC 2

// GEMV_NORM_MAX_K is the longest row the normed kernels take: the block
// holds the normed row of x in shared memory.
#define GEMV_NORM_MAX_K 8192

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

// gemv_chunk_sh is gemv_chunk (M = 1) with x in shared memory (the
// normed kernels' row): the same products, added in the same order.
template <typename W>
__device__ __forceinline__ void gemv_chunk_sh(float* acc, const uint4& wv, const float* xs, int c) {
	constexpr int E = 16 / sizeof(W);
	float wf[E];
	unpack(wv, wf, (const W*)nullptr);
	const float4* xr = reinterpret_cast<const float4*>(xs + c * E);
#pragma unroll
	for (int e = 0; e < E / 4; e++) {
		const float4 xv = xr[e];
		*acc += wf[4 * e] * xv.x + wf[4 * e + 1] * xv.y + wf[4 * e + 2] * xv.z + wf[4 * e + 3] * xv.w;
	}
}

// split_dot adds to acc[r] the products of lane's chunks c0, c0+step, ...
// below chunks of rows wr[r] with x, U chunks of every row in flight at a
// time; with SH, x is in shared memory.
// With PDL, the first batch's loads are issued before pdl_wait.
template <typename W, int R, int U, bool PDL = false, bool SH = false>
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
			for (int r = 0; r < R; r++) {
				if constexpr (SH)
					gemv_chunk_sh<W>(&acc[r], wv[u][r], x, c + step * u);
				else
					gemv_chunk<W, 1, !PDL>(&acc[r], wv[u][r], x, K, c + step * u);
			}
	}
	pdl_wait<PDL>();
	for (; c < chunks; c += step)
#pragma unroll
		for (int r = 0; r < R; r++) {
			if constexpr (SH)
				gemv_chunk_sh<W>(&acc[r], load_stream(wr[r] + c), x, c);
			else
				gemv_chunk<W, 1, !PDL>(&acc[r], load_stream(wr[r] + c), x, K, c);
		}
}

// gemv_norm_x writes xs = x / sqrt(mean(x^2) + eps) * g, one row of K
// elements (K a multiple of 4, x 16-byte aligned, g aligned for load4),
// bit for bit as rmsnorm_* and add_rmsnorm_* (fused.cu) compute a row
// with the normThreads(K) threads the backend launches them with (vt):
// thread t of this block plays threads t, t + GEMV_SPLIT_THREADS, ... of
// that one, each summing its NORM_VEC float4 in order, then the sums go
// over each warp and over the warps as block_sum adds them. The block
// reads x once, coherently (a PDL kernel's x may have been written by the
// kernel just before), into xs, and norms it there: every block of a
// normed grid reads x, so its reads are the norm's traffic through L2.
// Every thread of the block calls it; it returns with the block
// synchronised.
template <typename NW>
__device__ void gemv_norm_x(float* xs, const float* x, const NW* g, int K, float eps) {
	const int n4 = K >> 2;
	const int vt = min(max((((K + 4 * NORM_VEC - 1) / (4 * NORM_VEC)) + 31) & ~31, 32), 1024);
	const int lane = threadIdx.x & 31;
	const float4* x4 = reinterpret_cast<const float4*>(x);
	float4* xs4 = reinterpret_cast<float4*>(xs);
	__shared__ float partial[32];
	for (int i = threadIdx.x; i < n4; i += GEMV_SPLIT_THREADS) xs4[i] = __ldca(x4 + i);
	__syncthreads();
	for (int v = threadIdx.x; v < vt; v += GEMV_SPLIT_THREADS) {  // the same trips for a warp's lanes: vt is whole warps
		float s = 0.0f;
#pragma unroll
		for (int u = 0; u < NORM_VEC; u++) {
			const int i = v + u * vt;
			if (i < n4) s += sumsq4(xs4[i]);
		}
		s = warp_sum(s);
		if (lane == 0) partial[v >> 5] = s;
	}
	__syncthreads();
	float s = lane < (vt >> 5) ? partial[lane] : 0.0f;
	s = warp_sum(s);
	const float r = rsqrtf(s / (float)K + eps);
	for (int i = threadIdx.x; i < n4; i += GEMV_SPLIT_THREADS) {
		const float4 v = xs4[i], w = load4(g, i);
		xs4[i] = make_float4(v.x * r * w.x, v.y * r * w.y, v.z * r * w.z, v.w * r * w.w);
	}
	__syncthreads();
}

// gemv_norm_buf is the block's normed row of x (the normed kernels').
__device__ __forceinline__ float* gemv_norm_buf() {
	__shared__ __align__(16) float xs[GEMV_NORM_MAX_K];
	return xs;
}

// split_dot_norm is split_dot for the normed kernels, x the row before
// its norm: the first batch of weights is asked into L2 (before pdl_wait,
// prefetch_l2: unlike a plain kernel's batch, held in registers through
// the norm it would double the kernel's registers and halve the blocks a
// multiprocessor runs), the block writes the normed row to shared memory
// (gemv_norm_x), and the products read it there, added in split_dot's
// order. Every thread of the block calls it.
template <typename W, int R, int U, bool PDL, typename NW>
__device__ __forceinline__ void split_dot_norm(float* acc, const uint4* const* wr, const float* x, const NW* g, float eps, int K,
					       int chunks, int c0, int step) {
	float* xs = gemv_norm_buf();
#pragma unroll
	for (int u = 0; u < U; u++)
#pragma unroll
		for (int r = 0; r < R; r++)
			if (c0 + step * u < chunks) prefetch_l2(wr[r] + c0 + step * u);
	pdl_wait<PDL>();
	gemv_norm_x(xs, x, g, K, eps);
	split_dot<W, R, U, false, true>(acc, wr, xs, K, chunks, c0, step);
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

// split_unit is gemv_split's work for the G row groups of unit (its
// block's, or for a normed grid one of several): first is the block's
// first unit, which a normed kernel norms x for.
template <typename W, int R, int U, int S, bool PDL, int MODE, typename NW>
__device__ __forceinline__ void split_unit(int unit, bool first, float* out0, float* out1, float* out2, const float* __restrict__ x,
					   const W* __restrict__ w0, const W* __restrict__ w1, const W* __restrict__ w2, int n0, int n1,
					   int n2, int K, const NW* g, float eps) {
	constexpr int E = 16 / sizeof(W);
	constexpr int G = GEMV_SPLIT_THREADS / 32 / S;  // row groups per block
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int rows = n0 + n1 + n2;
	const int g0 = (unit * G + warp / S) * R;
	const uint4* wr[R];
	float* op[R];
#pragma unroll
	for (int r = 0; r < R; r++) {
		int gr = min(g0 + r, rows - 1);
		const W* w = w0;
		float* o = out0;
		if (gr >= n0) {
			gr -= n0, w = w1, o = out1;
			if (gr >= n1) gr -= n1, w = w2, o = out2;
		}
		wr[r] = reinterpret_cast<const uint4*>(w + (long long)gr * K);
		op[r] = g0 + r < rows ? o + gr : nullptr;
	}
	float acc[R];
#pragma unroll
	for (int r = 0; r < R; r++) acc[r] = 0.0f;
	const int c0 = 32 * (warp % S) + lane;
	if constexpr (MODE == GEMV_NORM) {
		if (first)
			split_dot_norm<W, R, U, PDL>(acc, wr, x, g, eps, K, K / E, c0, 32 * S);
		else
			split_dot<W, R, U, false, true>(acc, wr, gemv_norm_buf(), K, K / E, c0, 32 * S);
	} else if (g0 < rows)
		split_dot<W, R, U, PDL>(acc, wr, x, K, K / E, c0, 32 * S);
	pdl_wait<PDL>();
	if (!split_sum<R, S>(acc)) return;
#pragma unroll
	for (int r = 0; r < R; r++)
		if (op[r] != nullptr) *op[r] = MODE == GEMV_ACC ? *op[r] + acc[r] : acc[r];
}

// gemv_split computes out_i = x . w_i^T for up to three matrices (rows n0,
// n1, n2; empty ones last). Row group g of the grid takes rows gR..gR+R-1
// of the matrices laid end to end; a group past the last row reads the
// last row in its place and writes nothing. MODE GEMV_NORM multiplies by
// x's row normed with weights g and eps (gemv_norm_x; K at most
// GEMV_NORM_MAX_K); GEMV_ACC adds the products to out_i.
template <typename W, int R, int U, int S, bool PDL = false, int MODE = GEMV_PLAIN, typename NW = W>
__device__ void gemv_split(float* out0, float* out1, float* out2, const float* __restrict__ x, const W* __restrict__ w0,
			   const W* __restrict__ w1, const W* __restrict__ w2, int n0, int n1, int n2, int K, const NW* g = nullptr,
			   float eps = 0.0f) {
	pdl_trigger<PDL>();
	if constexpr (MODE == GEMV_NORM) {
		// A block takes every gridDim.x-th unit of G row groups (one norm
		// a block for several units: the backend launches about as many
		// blocks as the device holds at once).
		constexpr int G = GEMV_SPLIT_THREADS / 32 / S;
		const int units = (n0 + n1 + n2 + G * R - 1) / (G * R);
		for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
			split_unit<W, R, U, S, PDL, MODE>(unit, unit == (int)blockIdx.x, out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K, g, eps);
			if (S > 1) __syncthreads();  // split_sum's partial sums are the next unit's
		}
		pdl_wait<PDL>();
	} else
		split_unit<W, R, U, S, PDL, MODE>(blockIdx.x, true, out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K, g, eps);
}

// gate_up_unit is gemv_gate_up_split's work for the G rows of unit, as
// split_unit is gemv_split's.
template <typename W, int U, int S, bool PDL, bool NORM, typename NW>
__device__ __forceinline__ void gate_up_unit(int unit, bool first, float* out, const float* __restrict__ x, const W* __restrict__ wg,
					     const W* __restrict__ wu, int N, int K, const NW* g, float eps) {
	constexpr int E = 16 / sizeof(W);
	constexpr int G = GEMV_SPLIT_THREADS / 32 / S;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int n = unit * G + warp / S;
	const long long row = (long long)min(n, N - 1) * K;
	const uint4* wr[2] = {reinterpret_cast<const uint4*>(wg + row), reinterpret_cast<const uint4*>(wu + row)};
	float acc[2] = {0.0f, 0.0f};
	const int c0 = 32 * (warp % S) + lane;
	if constexpr (NORM) {
		if (first)
			split_dot_norm<W, 2, U, PDL>(acc, wr, x, g, eps, K, K / E, c0, 32 * S);
		else
			split_dot<W, 2, U, false, true>(acc, wr, gemv_norm_buf(), K, K / E, c0, 32 * S);
	} else if (n < N)
		split_dot<W, 2, U, PDL>(acc, wr, x, K, K / E, c0, 32 * S);
	pdl_wait<PDL>();
	if (!split_sum<2, S>(acc)) return;
	if (n < N) out[n] = acc[0] / (1.0f + expf(-acc[0])) * acc[1];
}

// gemv_gate_up_split computes out[n] = silu(x . wg[n,:]) * (x . wu[n,:]),
// the two rows of n read together (R = 2 of split_dot), U loads of each in
// flight, S warps per row; NORM multiplies by x's row normed with weights
// g and eps (gemv_norm_x).
template <typename W, int U, int S, bool PDL = false, bool NORM = false, typename NW = W>
__device__ void gemv_gate_up_split(float* out, const float* __restrict__ x, const W* __restrict__ wg, const W* __restrict__ wu, int N,
				   int K, const NW* g = nullptr, float eps = 0.0f) {
	pdl_trigger<PDL>();
	if constexpr (NORM) {
		constexpr int G = GEMV_SPLIT_THREADS / 32 / S;  // units of G rows, as gemv_split's
		const int units = (N + G - 1) / G;
		for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
			gate_up_unit<W, U, S, PDL, NORM>(unit, unit == (int)blockIdx.x, out, x, wg, wu, N, K, g, eps);
			if (S > 1) __syncthreads();  // split_sum's partial sums are the next unit's
		}
		pdl_wait<PDL>();
	} else
		gate_up_unit<W, U, S, PDL, NORM>(blockIdx.x, true, out, x, wg, wu, N, K, g, eps);
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

// The PDL variants' normed and adding twins (GEMV_NORM, GEMV_ACC), the
// norm's weights of the weights' type.
#define GEMV_SPLIT_NORM_PDL(T, SFX, R, U, S)                                                                                        \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_split_pdl_norm_##SFX##_r##R##u##U##s##S(float* out0, float* out1, float* out2, const float* x, const T* w0,          \
							 const T* w1, const T* w2, int n0, int n1, int n2, int K, const T* g,     \
							 float eps) {                                                             \
		gemv_split<T, R, U, S, true, GEMV_NORM>(out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K, g, eps);                    \
	}                                                                                                                           \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_split_pdl_acc_##SFX##_r##R##u##U##s##S(float* out0, float* out1, float* out2, const float* x, const T* w0,           \
							const T* w1, const T* w2, int n0, int n1, int n2, int K) {                \
		gemv_split<T, R, U, S, true, GEMV_ACC>(out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K);                              \
	}
#define GEMV_GATE_UP_SPLIT_NORM_PDL(T, SFX, U, S)                                                                                    \
	extern "C" __global__ void __launch_bounds__(GEMV_SPLIT_THREADS)                                                            \
	    gemv_gate_up_split_pdl_norm_##SFX##_u##U##s##S(float* out, const float* x, const T* wg, const T* wu, int N, int K,       \
							   const T* g, float eps) {                                               \
		gemv_gate_up_split<T, U, S, true, true>(out, x, wg, wu, N, K, g, eps);                                                 \
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
#define GEMV_SPLIT_PDL_ALL(T, SFX)               \
	GEMV_SPLIT_PDL(T, SFX, 1, 8, 1)          \
	GEMV_SPLIT_PDL(T, SFX, 1, 8, 2)          \
	GEMV_SPLIT_PDL(T, SFX, 1, 4, 4)          \
	GEMV_GATE_UP_SPLIT_PDL(T, SFX, 4, 1)     \
	GEMV_GATE_UP_SPLIT_PDL(T, SFX, 4, 2)     \
	GEMV_GATE_UP_SPLIT_PDL(T, SFX, 2, 4)     \
	GEMV_SPLIT_NORM_PDL(T, SFX, 1, 8, 1)     \
	GEMV_SPLIT_NORM_PDL(T, SFX, 1, 8, 2)     \
	GEMV_SPLIT_NORM_PDL(T, SFX, 1, 4, 4)     \
	GEMV_GATE_UP_SPLIT_NORM_PDL(T, SFX, 4, 1) \
	GEMV_GATE_UP_SPLIT_NORM_PDL(T, SFX, 4, 2) \
	GEMV_GATE_UP_SPLIT_NORM_PDL(T, SFX, 2, 4)
