// Shared helpers of strata's CUDA kernels. Weight-like operands come in
// three storage types (F32, F16, BF16) and are always widened to float
// before arithmetic; activations are float.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

// bf16 is storage only: compute_70 has no bfloat16 arithmetic, and the
// conversions are bit shifts anyway.
struct bf16 {
	uint16_t bits;
};

// dp2a_lo and dp2a_hi: c plus the two int16 of a times bytes 0, 1 (lo) or
// 2, 3 (hi) of b, signed. Native from compute capability 6.1 (the PTX is
// for 7.0); the plain version serves the host (the harnesses of
// cuda/testdata) and older device passes.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
#define QDP2A 1
#endif
__host__ __device__ __forceinline__ int dp2a_lo(uint32_t a, uint32_t b, int c) {
#ifdef QDP2A
	return __dp2a_lo((int)a, (int)b, c);
#else
	return c + (int)(int16_t)(a & 0xffffu) * (int)(int8_t)(b & 0xffu) + (int)(int16_t)(a >> 16) * (int)(int8_t)((b >> 8) & 0xffu);
#endif
}
__host__ __device__ __forceinline__ int dp2a_hi(uint32_t a, uint32_t b, int c) {
#ifdef QDP2A
	return __dp2a_hi((int)a, (int)b, c);
#else
	return c + (int)(int16_t)(a & 0xffffu) * (int)(int8_t)((b >> 16) & 0xffu) + (int)(int16_t)(a >> 16) * (int)(int8_t)(b >> 24);
#endif
}

// dot4 adds the four signed bytes of w times the four int16 in xa (low,
// high) and xb to s: two instructions. dot8 adds the bytes of w0 and w1
// times the 8 int16 of xv.
__host__ __device__ __forceinline__ int dot4(int s, uint32_t xa, uint32_t xb, uint32_t w) { return dp2a_hi(xb, w, dp2a_lo(xa, w, s)); }
__host__ __device__ __forceinline__ int dot8(int s, const uint4& xv, uint32_t w0, uint32_t w1) {
	return dot4(dot4(s, xv.x, xv.y, w0), xv.z, xv.w, w1);
}

// rint_i rounds f to the nearest integer, ties to even.
__host__ __device__ __forceinline__ int rint_i(float f) {
#ifdef __CUDA_ARCH__
	return __float2int_rn(f);
#else
	return (int)nearbyintf(f);
#endif
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((uint32_t)v.bits) << 16); }

// bf16 from float, rounding to nearest even; NaN stays a quiet NaN.
__device__ __forceinline__ bf16 bf16_from_f32(float f) {
	uint32_t b = __float_as_uint(f);
	bf16 r;
	if ((b & 0x7fffffffu) > 0x7f800000u) {
		r.bits = (uint16_t)((b >> 16) | 0x40u);
		return r;
	}
	b += 0x7fffu + ((b >> 16) & 1u);
	r.bits = (uint16_t)(b >> 16);
	return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
	for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

// warp_max returns the maximum of v over the warp to every lane.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
	for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

// block_sum returns the sum of v over the block to every thread. blockDim.x
// must be a multiple of 32 and at most 1024.
__device__ __forceinline__ float block_sum(float v) {
	__shared__ float partial[32];
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = warp_sum(v);
	__syncthreads();  // partial may still be read by a previous call
	if (lane == 0) partial[warp] = v;
	__syncthreads();
	const int nwarps = blockDim.x >> 5;
	v = lane < nwarps ? partial[lane] : 0.0f;
	return warp_sum(v);
}

// Where rope_pair finds row t's position: p0+t (rope_from), or pos[t]
// (rope_rows, each row of a batched step at its own).
struct rope_from {
	long long p0;
	__device__ __forceinline__ long long operator()(long long t) const { return p0 + t; }
};
struct rope_rows {
	const int* pos;
	__device__ __forceinline__ long long operator()(long long t) const { return pos[t]; }
};

// rope_pair rotates pair i of x[T, heads*headDim] in place, as Rope does:
// elements j and j+half of its head (j = i % half), row t = i / half /
// heads at position at(t); cos and sin are [maxPos, half].
template <typename P>
__device__ __forceinline__ void rope_pair(float* x, const float* cosT, const float* sinT, long long i, int heads, int headDim, P at) {
	const int half = headDim / 2;
	const int j = (int)(i % half);
	const long long th = i / half;  // t*heads + h
	float* p = x + th * headDim;
	const long long ci = at(th / heads) * half + j;
	const float c = cosT[ci], s = sinT[ci];
	const float x1 = p[j], x2 = p[j + half];
	p[j] = x1 * c - x2 * s;
	p[j + half] = x2 * c + x1 * s;
}

// Grid-stride loop over n elements with 64-bit indices.
#define GRID_STRIDE(i, n) \
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); i += (long long)blockDim.x * gridDim.x)
