// Experimental F16 M=1 GEMV variants, timed against gemv_f16_m1 by
// BenchmarkGEMVVariants. Not used by MatMul.
#include "gemv.cuh"

// The first version: one 16-byte load per loop step, unrolled by 4.
extern "C" __global__ void gemvx_loop_f16(float* out, const float* __restrict__ x, const __half* __restrict__ w, int N, int K) {
	const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	const int lane = threadIdx.x & 31;
	if (n >= N) return;
	const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * K);
	const int chunks = K / 8;
	float acc[1] = {0.0f};
#pragma unroll 4
	for (int c = lane; c < chunks; c += 32) gemv_chunk<__half, 1>(acc, load_stream(wr + c), x, K, c);
	const float s = warp_sum(acc[0]);
	if (lane == 0) out[n] = s;
}

// Split-K: two warps per row, so twice the warps (full occupancy for
// N = 4096); partial sums meet in shared memory. Block: 8 warps, 4 rows.
extern "C" __global__ void gemvx_split_f16(float* out, const float* __restrict__ x, const __half* __restrict__ w, int N, int K) {
	__shared__ float part[8];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int n = blockIdx.x * 4 + (warp >> 1);
	const int half = warp & 1;
	float acc[1] = {0.0f};
	if (n < N) {
		const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * K);
		const int chunks = K / 8;
#pragma unroll 4
		for (int c = half * 32 + lane; c < chunks; c += 64) gemv_chunk<__half, 1>(acc, load_stream(wr + c), x, K, c);
	}
	const float s = warp_sum(acc[0]);
	if (lane == 0) part[warp] = s;
	__syncthreads();
	if (threadIdx.x < 4) {
		const int r = blockIdx.x * 4 + threadIdx.x;
		if (r < N) out[r] = part[2 * threadIdx.x] + part[2 * threadIdx.x + 1];
	}
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Batches of 8 chunks per lane; while one batch is consumed, the next one
// is prefetched into L2 (prefetches block nothing, unlike loads whose
// results the scheduler waits for).
extern "C" __global__ void gemvx_pf_f16(float* out, const float* __restrict__ x, const __half* __restrict__ w, int N, int K) {
	const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	const int lane = threadIdx.x & 31;
	if (n >= N) return;
	const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)n * K);
	const int chunks = K / 8;
	float acc[1] = {0.0f};
#pragma unroll
	for (int u = 0; u < 8; u++)
		if (lane + 32 * u < chunks) prefetch_l2(wr + lane + 32 * u);
	int c0 = lane;
	for (; c0 + 32 * 7 < chunks; c0 += 32 * 8) {
#pragma unroll
		for (int u = 8; u < 16; u++)
			if (c0 + 32 * u < chunks) prefetch_l2(wr + c0 + 32 * u);
		uint4 v[8];
#pragma unroll
		for (int u = 0; u < 8; u++) v[u] = load_stream(wr + c0 + 32 * u);
#pragma unroll
		for (int u = 0; u < 8; u++) gemv_chunk<__half, 1>(acc, v[u], x, K, c0 + 32 * u);
	}
	for (; c0 < chunks; c0 += 32) gemv_chunk<__half, 1>(acc, load_stream(wr + c0), x, K, c0);
	const float s = warp_sum(acc[0]);
	if (lane == 0) out[n] = s;
}
