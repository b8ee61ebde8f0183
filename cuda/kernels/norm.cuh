// The norm kernels' row held in registers (rmsnorm and
// add_rmsnorm in fused.cu): its loads, four elements at a time, and its
// end. Not in common.cuh, which the host harnesses compile as C++.
#pragma once

#include "common.cuh"

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
