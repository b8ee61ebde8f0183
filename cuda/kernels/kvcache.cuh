// Reading the KV cache in its stored dtype: F32, F16, BF16, Q8_0
// (ggml's blocks of 32 values, each an F16 scale and 32 int8, 34 bytes,
// laid along the cache row) or Q8_B8 (blocks of 8 values, each an F16
// scale and 8 int8, 10 bytes: quant.Q8B8). A cache is [maxPos, stride] elements; kv_cache
// reads element e of row p widened to float, or 8 elements at once from
// an element index that is a multiple of 8 (and, for the plain types, a
// row start 16-byte aligned: the caller checks the base pointer).
#pragma once

#include "common.cuh"

// KV_CHECK(p, n, align) is nothing on the device. The host harness
// (testdata/attnhost.cpp) runs the kernels' bodies on the CPU and defines
// kvhost_check, which counts a read of n bytes at p outside the cache rows
// written so far, or not aligned to align bytes, as the GPU would fault on
// or read garbage from.
#ifdef __CUDA_ARCH__
#define KV_CHECK(p, n, align)
#else
void kvhost_check(const void* p, int n, int align);
#define KV_CHECK(p, n, align) kvhost_check(p, n, align)
#endif

// q8_0 names a Q8_0 cache, read as bytes.
struct q8_0 {
	uint8_t b;
};

template <typename KV>
struct kv_cache {
	const KV* p;
	long long stride;  // elements a row
	__device__ __forceinline__ float at(long long row, int e) const {
		KV_CHECK(p + row * stride + e, sizeof(KV), sizeof(KV));
		return to_f32(p[row * stride + e]);
	}
	__device__ __forceinline__ void load8(long long row, int e, float f[8]) const {
		const KV* r = p + row * stride + e;
		KV_CHECK(r, 8 * sizeof(KV), sizeof(KV));
#pragma unroll
		for (int i = 0; i < 8; i++) f[i] = to_f32(r[i]);
	}
};

template <>
__device__ __forceinline__ void kv_cache<float>::load8(long long row, int e, float f[8]) const {
	const float4* r = (const float4*)(p + row * stride + e);
	KV_CHECK(r, 32, 16);
	const float4 a = r[0], b = r[1];
	f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

__device__ __forceinline__ void unpack8_16(uint4 u, float f[8], bool bf) {
	const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		if (bf) {
			f[2 * i] = __uint_as_float(w[i] << 16);
			f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
		} else {
			f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
			f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
		}
	}
}

template <>
__device__ __forceinline__ void kv_cache<__half>::load8(long long row, int e, float f[8]) const {
	KV_CHECK(p + row * stride + e, 16, 16);
	unpack8_16(*(const uint4*)(p + row * stride + e), f, false);
}

template <>
__device__ __forceinline__ void kv_cache<bf16>::load8(long long row, int e, float f[8]) const {
	KV_CHECK(p + row * stride + e, 16, 16);
	unpack8_16(*(const uint4*)(p + row * stride + e), f, true);
}

template <>
struct kv_cache<q8_0> {
	const q8_0* p;
	long long stride;  // elements a row, a multiple of 32
	__device__ __forceinline__ const uint8_t* block(long long row, int e) const {
		return (const uint8_t*)p + row * (stride / 32 * 34) + 34 * (e >> 5);
	}
	__device__ __forceinline__ float at(long long row, int e) const {
		const uint8_t* b = block(row, e);
		KV_CHECK(b, 2, 2);
		KV_CHECK(b + 2 + (e & 31), 1, 1);
		return __half2float(*(const __half*)b) * (float)(int8_t)b[2 + (e & 31)];
	}
	// Blocks sit at even offsets: the scale and the 8 values come in 16-bit loads.
	__device__ __forceinline__ void load8(long long row, int e, float f[8]) const {
		const uint8_t* b = block(row, e);
		KV_CHECK(b, 2, 2);
		const float d = __half2float(*(const __half*)b);
		const unsigned short* v = (const unsigned short*)(b + 2 + (e & 31));
		KV_CHECK(v, 8, 2);
#pragma unroll
		for (int i = 0; i < 4; i++) {
			const unsigned short w = v[i];
			f[2 * i] = d * (float)(int8_t)(w & 0xff);
			f[2 * i + 1] = d * (float)(int8_t)(w >> 8);
		}
	}
};

// q8_b8 names a Q8_B8 cache, read as bytes.
struct q8_b8 {
	uint8_t b;
};

template <>
struct kv_cache<q8_b8> {
	const q8_b8* p;
	long long stride;  // elements a row, a multiple of 8
	__device__ __forceinline__ const uint8_t* block(long long row, int e) const {
		return (const uint8_t*)p + row * (stride / 8 * 10) + 10 * (e >> 3);
	}
	__device__ __forceinline__ float at(long long row, int e) const {
		const uint8_t* b = block(row, e);
		KV_CHECK(b, 2, 2);
		KV_CHECK(b + 2 + (e & 7), 1, 1);
		return __half2float(*(const __half*)b) * (float)(int8_t)b[2 + (e & 7)];
	}
	// e is a multiple of 8: the 8 values are one block, whose scale and
	// values come in 16-bit loads (blocks of 10 bytes sit at even offsets).
	__device__ __forceinline__ void load8(long long row, int e, float f[8]) const {
		const unsigned short* w = (const unsigned short*)block(row, e);
		KV_CHECK(w, 10, 2);
		const float d = __half2float(__ushort_as_half(w[0]));
#pragma unroll
		for (int i = 0; i < 4; i++) {
			const unsigned short u = w[1 + i];
			f[2 * i] = d * (float)(int8_t)(u & 0xff);
			f[2 * i + 1] = d * (float)(int8_t)(u >> 8);
		}
	}
};

// quantize_q8_b8_block writes one Q8_B8 block of the 8 values x as
// quant.QuantizeQ8B8 does: d = max|x|/127 rounded to F16, q = round(x/d)
// (ties away from zero) with the reciprocal of the rounded d, clamped to
// [-127, 127]. The block is written in 16-bit stores (see below).
__device__ __forceinline__ void quantize_q8_b8_block(uint8_t* b, const float* x) {
	float amax = 0.0f;
	for (int j = 0; j < 8; j++) {
		const float a = fabsf(x[j]);
		if (!(amax > a)) amax = a;
	}
	const __half h = __float2half_rn(amax / 127.0f);
	const float d = __half2float(h);
	const float id = d != 0.0f ? 1.0f / d : 0.0f;
	unsigned short* w = reinterpret_cast<unsigned short*>(b);
	w[0] = __half_as_ushort(h);
	for (int j = 0; j < 4; j++) {
		const float q0 = fminf(fmaxf(roundf(__fmul_rn(x[2 * j], id)), -127.0f), 127.0f);
		const float q1 = fminf(fmaxf(roundf(__fmul_rn(x[2 * j + 1], id)), -127.0f), 127.0f);
		w[1 + j] = (unsigned short)(uint8_t)(int8_t)q0 | (unsigned short)((uint8_t)(int8_t)q1) << 8;
	}
}

// quantize_q8_0_block writes one Q8_0 block of the 32 values x as
// quant.QuantizeQ8_0 does: d = max|x|/127 stored as F16, q = round(x/d)
// (ties away from zero) with the reciprocal of the unrounded d.
__device__ __forceinline__ void quantize_q8_0_block(uint8_t* b, const float* x) {
	float amax = 0.0f;
	for (int j = 0; j < 32; j++) {
		const float a = fabsf(x[j]);
		if (!(amax > a)) amax = a;
	}
	const float d = amax / 127.0f;
	const float id = d != 0.0f ? 1.0f / d : 0.0f;
	// One 16-bit store of the scale (a block is 34 bytes from a row start
	// aligned to 2): on the H200 the two byte stores of it left the low
	// byte 0.
	*reinterpret_cast<unsigned short*>(b) = __half_as_ushort(__float2half_rn(d));
	for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)roundf(__fmul_rn(x[j], id));
}
