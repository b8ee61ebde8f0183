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

// load4 reads w[4i..4i+3] as floats with one load: w 8-byte (2-byte
// types) or 16-byte (float) aligned at 4i.
__device__ __forceinline__ float4 load4(const float* w, int i) { return ((const float4*)w)[i]; }
__device__ __forceinline__ float half_bits(uint32_t b) {
	__half_raw r;
	r.x = (unsigned short)b;
	return __half2float(__half(r));
}
__device__ __forceinline__ float4 load4(const __half* w, int i) {
	const uint2 u = ((const uint2*)w)[i];
	return make_float4(half_bits(u.x), half_bits(u.x >> 16), half_bits(u.y), half_bits(u.y >> 16));
}
__device__ __forceinline__ float4 load4(const bf16* w, int i) {
	const uint2 u = ((const uint2*)w)[i];
	return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
			   __uint_as_float(u.y & 0xffff0000u));
}

// aligned4 reports whether rows of n elements at x (floats) and w can be
// read four elements a load (load4, float4).
template <typename W>
__device__ __forceinline__ bool aligned4(const void* x, const W* w, int n) {
	return (n & 3) == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & (4 * sizeof(W) - 1)) == 0;
}

// NORM_VEC is how many float4 of a row each thread of a norm kernel holds
// between its two passes: rows up to 4*NORM_VEC*blockDim.x elements are
// read once, every load of a thread issued before the block's sum.
#define NORM_VEC 2

// sumsq4 is v's sum of squares, in the order the norm kernels add them.
__device__ __forceinline__ float sumsq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// norm_rows4 ends a norm kernel's row held in registers (NORM_VEC float4 a
// thread, v the row and wv the weights, n4 float4 in all): the block's sum
// of this thread's s, then out = v * rsqrt(mean + eps) * w as float4.
__device__ __forceinline__ void norm_rows4(float* orow, const float4 v[NORM_VEC], const float4 wv[NORM_VEC], float s, int n, int n4,
					   float eps) {
	s = block_sum(s);
	const float r = rsqrtf(s / (float)n + eps);
#pragma unroll
	for (int u = 0; u < NORM_VEC; u++) {
		const int i = threadIdx.x + u * blockDim.x;
		if (i < n4)
			((float4*)orow)[i] = make_float4(v[u].x * r * wv[u].x, v[u].y * r * wv[u].y, v[u].z * r * wv[u].z, v[u].w * r * wv[u].w);
	}
}

// Grid-stride loop over n elements with 64-bit indices.
#define GRID_STRIDE(i, n) \
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); i += (long long)blockDim.x * gridDim.x)
