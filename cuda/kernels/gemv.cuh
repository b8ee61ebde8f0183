// Matrix-vector kernels (templates; gemv_*.cu instantiate them) for decode: out[M,N] = x[M,K] . w[N,K]^T for small
// M (1, 2 or 4 rows per launch), F32 activations x, weights w stored as F32,
// F16 or BF16, F32 accumulation. One warp per output column n reads row n
// of w once, 16 bytes per lane per load when K allows it, and reuses it for
// every row of x. The weights stream from HBM; x stays in L1/L2.
#pragma once

#include "common.cuh"

// Widens 16 bytes of weights to float.
__device__ __forceinline__ void unpack(const uint4& u, float* f /* 4 */, const float*) {
	f[0] = __uint_as_float(u.x);
	f[1] = __uint_as_float(u.y);
	f[2] = __uint_as_float(u.z);
	f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack(const uint4& u, float* f /* 8 */, const __half*) {
	const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		__half2 h2 = *reinterpret_cast<const __half2*>(&w[i]);
		const float2 p = __half22float2(h2);
		f[2 * i] = p.x;
		f[2 * i + 1] = p.y;
	}
}
__device__ __forceinline__ void unpack(const uint4& u, float* f /* 8 */, const bf16*) {
	const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		f[2 * i] = __uint_as_float(w[i] << 16);
		f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
	}
}

// Streaming load that does not keep the weights in L1. On the host (the
// harness of gemvhost_test.go) a plain load that gemvhost_check sees.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
	uint4 r;
	asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
	return r;
}
// prefetch_l2 asks for p's line in L2 without waiting for it or holding
// a register: a normed kernel's first weights, fetched while it norms x.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
void gemvhost_check(const void* p, int n);
inline uint4 load_stream(const uint4* p) {
	gemvhost_check(p, 16);
	return *p;
}
inline void prefetch_l2(const void* p) { gemvhost_check(p, 16); }
#endif

// gemv_chunk adds chunk c (E weights of row n, as 16 loaded bytes) times x
// to the M accumulators. x is read through the read-only cache (__ldg)
// unless NC is false: a kernel launched with programmatic dependent launch
// (the _pdl kernels) runs while the kernel that writes its x may still be
// running, so its x is not read-only for the kernel's lifetime, which
// ld.global.nc asks; it reads x with coherent loads (__ldca) after
// pdl_wait. (With __ldg there, the PDL GEMVs read stale x on the H200 when
// two of them ran back to back: TestGEMVVariantsChain.)
template <typename W, int M, bool NC = true>
__device__ __forceinline__ void gemv_chunk(float* acc, const uint4& wv, const float* __restrict__ x, int K, int c) {
	constexpr int E = 16 / sizeof(W);
	float wf[E];
	unpack(wv, wf, (const W*)nullptr);
#pragma unroll
	for (int m = 0; m < M; m++) {
		const float4* xr = reinterpret_cast<const float4*>(x + (long long)m * K + (long long)c * E);
#pragma unroll
		for (int e = 0; e < E / 4; e++) {
			const float4 xv = NC ? __ldg(xr + e) : __ldca(xr + e);
			acc[m] += wf[4 * e] * xv.x + wf[4 * e + 1] * xv.y + wf[4 * e + 2] * xv.z + wf[4 * e + 3] * xv.w;
		}
	}
}

// Vector path: K % (16/sizeof(W)) == 0, so every row of w and x is 16-byte
// aligned (allocations are 256-byte aligned; MatMul checks views). Each lane
// first issues U independent 16-byte loads of w, then consumes them: for
// K = 4096 in F16 that is the whole row in two rounds, so the kernel is not
// bound by one load's latency at a time. A tail loop takes the chunks that
// do not fill a batch.
template <typename W, int M>
__device__ void gemv_vec(float* out, const float* __restrict__ x, const W* __restrict__ w, int N, int K) {
	constexpr int E = 16 / sizeof(W);
	constexpr int U = M >= 4 ? 4 : 8;
	const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	const int lane = threadIdx.x & 31;
	if (n >= N) return;
	const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * K);
	const int chunks = K / E;
	float acc[M];
#pragma unroll
	for (int m = 0; m < M; m++) acc[m] = 0.0f;
	int c0 = lane;
	for (; c0 + 32 * (U - 1) < chunks; c0 += 32 * U) {
		uint4 wv[U];
#pragma unroll
		for (int u = 0; u < U; u++) wv[u] = load_stream(wr + c0 + 32 * u);
#pragma unroll
		for (int u = 0; u < U; u++) gemv_chunk<W, M>(acc, wv[u], x, K, c0 + 32 * u);
	}
	for (; c0 < chunks; c0 += 32) gemv_chunk<W, M>(acc, load_stream(wr + c0), x, K, c0);
#pragma unroll
	for (int m = 0; m < M; m++) {
		const float s = warp_sum(acc[m]);
		if (lane == 0) out[(long long)m * N + n] = s;
	}
}

// Scalar path for any K and 1 <= M <= 4.
template <typename W>
__device__ void gemv_any(float* out, const float* __restrict__ x, const W* __restrict__ w, int M, int N, int K) {
	const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	const int lane = threadIdx.x & 31;
	if (n >= N) return;
	const W* wr = w + (long long)n * K;
	float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
	for (int k = lane; k < K; k += 32) {
		const float wv = to_f32(wr[k]);
#pragma unroll
		for (int m = 0; m < 4; m++)
			if (m < M) acc[m] += wv * x[(long long)m * K + k];
	}
#pragma unroll
	for (int m = 0; m < 4; m++) {
		const float s = warp_sum(acc[m]);
		if (m < M && lane == 0) out[(long long)m * N + n] = s;
	}
}

// Several products of one x in one launch, M = 1 (tensor.MatMulMany: a
// decoder block's q, k and v): warp g takes row g of the matrices laid end
// to end, so the grid covers n0+n1+n2 rows instead of three launches of
// fewer rows each (N = 4096 is one wave of warps, too short to keep HBM
// busy). Each row is summed as gemv_vec sums it, so the products are
// those of three gemv_*_m1 launches. Matrices past the first count may be
// empty (n = 0).
template <typename W>
__device__ void gemv_many(float* out0, float* out1, float* out2, const float* __restrict__ x, const W* __restrict__ w0,
			  const W* __restrict__ w1, const W* __restrict__ w2, int n0, int n1, int n2, int K) {
	int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	float* out = out0;
	const W* w = w0;
	int N = n0;
	if (g >= n0) {
		g -= n0, out = out1, w = w1, N = n1;
		if (g >= n1) g -= n1, out = out2, w = w2, N = n2;
	}
	if (g >= N) return;
	// gemv_vec<W, 1> for the row: blockIdx and threadIdx name the row
	// there, so its loop is repeated here with the row given.
	constexpr int E = 16 / sizeof(W);
	constexpr int U = 8;
	const int lane = threadIdx.x & 31;
	const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)g * K);
	const int chunks = K / E;
	float acc = 0.0f;
	int c0 = lane;
	for (; c0 + 32 * (U - 1) < chunks; c0 += 32 * U) {
		uint4 wv[U];
#pragma unroll
		for (int u = 0; u < U; u++) wv[u] = load_stream(wr + c0 + 32 * u);
#pragma unroll
		for (int u = 0; u < U; u++) gemv_chunk<W, 1>(&acc, wv[u], x, K, c0 + 32 * u);
	}
	for (; c0 < chunks; c0 += 32) gemv_chunk<W, 1>(&acc, load_stream(wr + c0), x, K, c0);
	const float s = warp_sum(acc);
	if (lane == 0) out[g] = s;
}

#define GEMV_MANY(T, SUFFIX)                                                                                                \
	extern "C" __global__ void gemv_many_##SUFFIX(float* out0, float* out1, float* out2, const float* x, const T* w0,   \
						      const T* w1, const T* w2, int n0, int n1, int n2, int K) {               \
		gemv_many<T>(out0, out1, out2, x, w0, w1, w2, n0, n1, n2, K);                                            \
	}

// R rows of w per warp, M = 1, with the loads of a batch in flight
// together. ptxas 11.8 schedules gemv_vec's eight loads of a batch next
// to their uses (two or three in flight per warp, the SASS shows), to
// save registers; here every accumulator passes through a select on a
// value of every load of the batch (a select that never changes it, as
// sentinel never matches in practice and adding 0 keeps the value), so no
// product can start before the whole batch has landed and ptxas issues
// the 8 loads back to back. With R = 2 each lane also reads its x once
// for both rows. A warp whose rows pass N reads row N-1 in their place
// and writes only its rows below N. Each row's sum is accumulated as
// gemv_vec accumulates it. (Backend.gemvRows selects it;
// BenchmarkGEMVShapes measures it against gemv_vec.)
template <typename W, int R>
__device__ void gemv_rows(float* out, const float* __restrict__ x, const W* __restrict__ w, int N, int K) {
	const int sentinel = ~N;
	constexpr int E = 16 / sizeof(W);
	constexpr int U = 8 / R;
	const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
	const int lane = threadIdx.x & 31;
	if (n0 >= N) return;
	const uint4* wr[R];
#pragma unroll
	for (int r = 0; r < R; r++) wr[r] = reinterpret_cast<const uint4*>(w + (long long)min(n0 + r, N - 1) * K);
	const int chunks = K / E;
	float acc[R];
#pragma unroll
	for (int r = 0; r < R; r++) acc[r] = 0.0f;
	int c0 = lane;
	for (; c0 + 32 * (U - 1) < chunks; c0 += 32 * U) {
		uint4 wv[U][R];
#pragma unroll
		for (int u = 0; u < U; u++)
#pragma unroll
			for (int r = 0; r < R; r++) wv[u][r] = load_stream(wr[r] + c0 + 32 * u);
		unsigned landed = 0;
#pragma unroll
		for (int u = 0; u < U; u++)
#pragma unroll
			for (int r = 0; r < R; r++) landed ^= wv[u][r].x;
#pragma unroll
		for (int r = 0; r < R; r++) acc[r] = landed == (unsigned)sentinel ? acc[r] + 0.0f : acc[r];
#pragma unroll
		for (int u = 0; u < U; u++)
#pragma unroll
			for (int r = 0; r < R; r++) gemv_chunk<W, 1>(&acc[r], wv[u][r], x, K, c0 + 32 * u);
	}
	for (; c0 < chunks; c0 += 32)
#pragma unroll
		for (int r = 0; r < R; r++) gemv_chunk<W, 1>(&acc[r], load_stream(wr[r] + c0), x, K, c0);
#pragma unroll
	for (int r = 0; r < R; r++) {
		const float s = warp_sum(acc[r]);
		if (lane == 0 && n0 + r < N) out[n0 + r] = s;
	}
}

#define GEMV_ROWS(T, SUFFIX, R)                                                                                     \
	extern "C" __global__ void gemv_##SUFFIX##_r##R(float* out, const float* x, const T* w, int N, int K) { \
		gemv_rows<T, R>(out, x, w, N, K);                                                                   \
	}

// Gate and up products of a gated MLP in one pass (tensor.GateUpSiLU):
// out[m,n] = silu(x[m,:] . wg[n,:]) * (x[m,:] . wu[n,:]). One warp per
// row n reads row n of both matrices, U/2 loads of each in flight, and
// accumulates each product in the order gemv_vec does, so the two dot
// products are those of two gemv_vec launches.
template <typename W, int M>
__device__ void gemv_gate_up(float* out, const float* __restrict__ x, const W* __restrict__ wg, const W* __restrict__ wu, int N, int K) {
	constexpr int E = 16 / sizeof(W);
	constexpr int U = 4;
	const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	const int lane = threadIdx.x & 31;
	if (n >= N) return;
	const uint4* gr = reinterpret_cast<const uint4*>(wg + (long long)n * K);
	const uint4* ur = reinterpret_cast<const uint4*>(wu + (long long)n * K);
	const int chunks = K / E;
	float ag[M], au[M];
#pragma unroll
	for (int m = 0; m < M; m++) ag[m] = au[m] = 0.0f;
	int c0 = lane;
	for (; c0 + 32 * (U - 1) < chunks; c0 += 32 * U) {
		uint4 gv[U], uv[U];
#pragma unroll
		for (int u = 0; u < U; u++) {
			gv[u] = load_stream(gr + c0 + 32 * u);
			uv[u] = load_stream(ur + c0 + 32 * u);
		}
#pragma unroll
		for (int u = 0; u < U; u++) {
			gemv_chunk<W, M>(ag, gv[u], x, K, c0 + 32 * u);
			gemv_chunk<W, M>(au, uv[u], x, K, c0 + 32 * u);
		}
	}
	for (; c0 < chunks; c0 += 32) {
		gemv_chunk<W, M>(ag, load_stream(gr + c0), x, K, c0);
		gemv_chunk<W, M>(au, load_stream(ur + c0), x, K, c0);
	}
#pragma unroll
	for (int m = 0; m < M; m++) {
		const float g = warp_sum(ag[m]);
		const float u = warp_sum(au[m]);
		if (lane == 0) out[(long long)m * N + n] = g / (1.0f + expf(-g)) * u;
	}
}

#define GEMV_GATE_UP(T, SUFFIX, M)                                                                                            \
	extern "C" __global__ void gemv_gate_up_##SUFFIX##_m##M(float* out, const float* x, const T* wg, const T* wu, int N, int K) { \
		gemv_gate_up<T, M>(out, x, wg, wu, N, K);                                                                     \
	}

#define GEMV_VEC(T, SUFFIX, M)                                                                                \
	extern "C" __global__ void gemv_##SUFFIX##_m##M(float* out, const float* x, const T* w, int N, int K) { \
		gemv_vec<T, M>(out, x, w, N, K);                                                                \
	}
#define GEMV_ALL(T, SUFFIX)                                                                                          \
	GEMV_VEC(T, SUFFIX, 1)                                                                                       \
	GEMV_VEC(T, SUFFIX, 2)                                                                                       \
	GEMV_VEC(T, SUFFIX, 4)                                                                                       \
	GEMV_GATE_UP(T, SUFFIX, 1)                                                                                   \
	GEMV_GATE_UP(T, SUFFIX, 2)                                                                                   \
	GEMV_ROWS(T, SUFFIX, 1)                                                                                      \
	GEMV_ROWS(T, SUFFIX, 2)                                                                                      \
	GEMV_MANY(T, SUFFIX)                                                                                         \
	extern "C" __global__ void gemv_##SUFFIX##_any(float* out, const float* x, const T* w, int M, int N, int K) { \
		gemv_any<T>(out, x, w, M, N, K);                                                                     \
	}

