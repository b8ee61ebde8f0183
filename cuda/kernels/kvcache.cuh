// Reading and writing the KV cache in its stored dtype: F32, F16, BF16,
// Q8_0 (ggml's blocks of 32 values, each an F16 scale and 32 int8, 34
// bytes, laid along the cache row) or Q8_B8 (blocks of 8 values, each an
// F16 scale and 8 int8, 10 bytes: quant.Q8B8). A cache is [maxPos, stride]
// elements; kv_cache reads element e of row p widened to float, or 8
// elements at once from an element index that is a multiple of 8 (and,
// for the plain types, a row start 16-byte aligned: the caller checks the
// base pointer). The quantizers (quantize_q8_0_block, quantize_q8_b8_block,
// rope_kv_q8) write the bytes quant.QuantizeQ8_0 and quant.QuantizeQ8B8
// write.
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

// q8_b8 names a Q8_B8 cache, read as bytes.
struct q8_b8 {
	uint8_t b;
};

// kv_raw<KV> holds 8 consecutive values of a cache row as they are stored,
// so that a kernel can issue several rows' loads before it widens any
// (the decode kernel, attention_split.cuh). kv_unpack8 widens them to
// float without their block's scale and kv_scale8 is that scale: 1 for the
// plain types (a multiplication by it folds away), the block's F16 scale
// for the quantized ones, where a dot product or a weighted sum of the 8
// values takes it once instead of once a value.
template <typename KV>
struct kv_raw;
template <>
struct kv_raw<float> {
	float4 a, b;
};
template <>
struct kv_raw<__half> {
	uint4 u;
};
template <>
struct kv_raw<bf16> {
	uint4 u;
};
// The quantized blocks' 8 int8 values, 4 to a word, and the F16 scale.
struct kv_raw_q8 {
	uint32_t lo, hi;
	unsigned short d;
};
template <>
struct kv_raw<q8_0> : kv_raw_q8 {};
template <>
struct kv_raw<q8_b8> : kv_raw_q8 {};

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

// unpack4_s8 widens the 4 int8 of w to float exactly without the
// integer-to-float conversion, which issues at an eighth of the FP32 rate
// (16 a clock on an SM of compute capability 8.x and 9.0): byte b, made
// unsigned (b + 128, the sign bit flipped), becomes the low byte of the
// float 2^23 + b + 128, and 2^23 + 128 is subtracted.
__device__ __forceinline__ void unpack4_s8(uint32_t w, float f[4]) {
	w ^= 0x80808080u;
#pragma unroll
	for (int i = 0; i < 4; i++) f[i] = __uint_as_float(__byte_perm(w, 0x4b00u, 0x5440u | i)) - 8388736.0f;
}

__device__ __forceinline__ void kv_unpack8(const kv_raw<float>& r, float f[8]) {
	f[0] = r.a.x, f[1] = r.a.y, f[2] = r.a.z, f[3] = r.a.w, f[4] = r.b.x, f[5] = r.b.y, f[6] = r.b.z, f[7] = r.b.w;
}
__device__ __forceinline__ void kv_unpack8(const kv_raw<__half>& r, float f[8]) { unpack8_16(r.u, f, false); }
__device__ __forceinline__ void kv_unpack8(const kv_raw<bf16>& r, float f[8]) { unpack8_16(r.u, f, true); }
__device__ __forceinline__ void kv_unpack8(const kv_raw_q8& r, float f[8]) {
	unpack4_s8(r.lo, f);
	unpack4_s8(r.hi, f + 4);
}
__device__ __forceinline__ float kv_scale8(const kv_raw<float>&) { return 1.0f; }
__device__ __forceinline__ float kv_scale8(const kv_raw<__half>&) { return 1.0f; }
__device__ __forceinline__ float kv_scale8(const kv_raw<bf16>&) { return 1.0f; }
__device__ __forceinline__ float kv_scale8(const kv_raw_q8& r) { return __half2float(__ushort_as_half(r.d)); }

// kv_dot8 is the dot product of the lane's 8 values of q with 8 cache
// values as stored, times their scale: the products added in order, in
// float, then scaled once.
template <typename R>
__device__ __forceinline__ float kv_dot8(const R& r, const float q[8]) {
	float f[8];
	kv_unpack8(r, f);
	float d = 0.0f;
#pragma unroll
	for (int i = 0; i < 8; i++) d += q[i] * f[i];
	return d * kv_scale8(r);
}

// The decode kernel's calls of a reader beside load8raw: at_lane (the
// lane's constants), set_query (the lane's 8 values of q, scaled, which
// dot8 multiplies by keys), settle (what the lanes exchange once every
// lane has loaded), dot8, unpack8 and scale8. For kv_cache they are
// nothing or the functions above.
#define KV_READER_LANE                                                                                 \
	__device__ __forceinline__ void at_lane(int) {}                                                 \
	__device__ __forceinline__ void set_query(const float*) {}                                      \
	template <typename R>                                                                          \
	__device__ __forceinline__ void settle(R&) const {}                                            \
	template <typename R>                                                                          \
	__device__ __forceinline__ float dot8(const R& r, const float q[8]) const {                    \
		return kv_dot8(r, q);                                                                  \
	}                                                                                              \
	template <typename R>                                                                          \
	__device__ __forceinline__ void unpack8(const R& r, float f[8]) const {                        \
		kv_unpack8(r, f);                                                                      \
	}                                                                                              \
	template <typename R>                                                                          \
	__device__ __forceinline__ float scale8(const R& r) const {                                    \
		return kv_scale8(r);                                                                   \
	}

// kv_cache<KV> reads a cache: element e of a row widened to float (at),
// or 8 elements from an element index that is a multiple of 8, as stored
// (load8raw) or widened and scaled (load8).
template <typename KV>
struct kv_cache {
	const KV* p;
	long long stride;  // elements a row
	__device__ __forceinline__ float at(long long row, int e) const {
		KV_CHECK(p + row * stride + e, sizeof(KV), sizeof(KV));
		return to_f32(p[row * stride + e]);
	}
	// For the plain types the row start is 16-byte aligned (the caller
	// checks the base pointer).
	__device__ __forceinline__ kv_raw<KV> load8raw(long long row, int e) const {
		const uint4* r = (const uint4*)(p + row * stride + e);
		KV_CHECK(r, 16, 16);
		kv_raw<KV> k;
		k.u = *r;
		return k;
	}
	__device__ __forceinline__ void load8(long long row, int e, float f[8]) const { kv_unpack8(load8raw(row, e), f); }
	KV_READER_LANE
};

template <>
__device__ __forceinline__ kv_raw<float> kv_cache<float>::load8raw(long long row, int e) const {
	const float4* r = (const float4*)(p + row * stride + e);
	KV_CHECK(r, 32, 16);
	kv_raw<float> k;
	k.a = r[0], k.b = r[1];
	return k;
}

// q8_load8 reads the scale and the 8 values from a block at an even
// address in 16-bit loads.
__device__ __forceinline__ kv_raw_q8 q8_load8(const uint8_t* scale, const uint8_t* values) {
	KV_CHECK(scale, 2, 2);
	KV_CHECK(values, 8, 2);
	const unsigned short* v = (const unsigned short*)values;
	kv_raw_q8 r;
	r.d = *(const unsigned short*)scale;
	r.lo = (uint32_t)v[0] | (uint32_t)v[1] << 16;
	r.hi = (uint32_t)v[2] | (uint32_t)v[3] << 16;
	return r;
}

// load8 of the quantized caches: the value times its block's scale.
__device__ __forceinline__ void q8_scaled8(const kv_raw_q8& r, float f[8]) {
	kv_unpack8(r, f);
	const float d = kv_scale8(r);
#pragma unroll
	for (int i = 0; i < 8; i++) f[i] *= d;
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
	__device__ __forceinline__ kv_raw<q8_0> load8raw(long long row, int e) const {
		const uint8_t* b = block(row, e);
		kv_raw<q8_0> r;
		static_cast<kv_raw_q8&>(r) = q8_load8(b, b + 2 + (e & 31));
		return r;
	}
	__device__ __forceinline__ void load8(long long row, int e, float f[8]) const { q8_scaled8(load8raw(row, e), f); }
	KV_READER_LANE
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
	__device__ __forceinline__ kv_raw<q8_b8> load8raw(long long row, int e) const {
		const uint8_t* b = block(row, e);
		kv_raw<q8_b8> r;
		static_cast<kv_raw_q8&>(r) = q8_load8(b, b + 2);
		return r;
	}
	__device__ __forceinline__ void load8(long long row, int e, float f[8]) const { q8_scaled8(load8raw(row, e), f); }
	KV_READER_LANE
};

// kv_cache_q8w reads a Q8_0 cache whose heads start 8-byte aligned (a
// head of a multiple of 128 values: 4 blocks, 136 bytes) for the decode
// kernel, whose lane groups read a position's head 8 values a lane. Each
// lane loads the aligned 8-byte word its values start in and, unless they
// start on one, the next: two loads of 8 bytes where 16-bit loads took
// five, which filled the load pipe (a warp's 16-bit load touches a line
// or two of each of its two positions, as an 8-byte one does). Where the
// values start in the words, and which lane holds the scale of the
// lane's block, depend on the lane only (at_lane). The scale comes by a
// shuffle in settle, which every lane of the warp runs: from the first
// lane of each of 4 blocks for the first 3 (its words start at the block),
// from the last lane of the third block (its second word) for the fourth.
//
// Its keys are multiplied in integers (dot8): set_query rounds the lane's
// 8 values of q to int16 levels of their largest magnitude (qd, the
// level's size), and dp2a multiplies two of them by two int8 keys a
// clock, exactly into an int32: 4 instructions for the 8 products where
// widening the keys and multiplying in float took 24, in a kernel bound
// by its instructions. The rounding is the only error, at most half a
// level: 1.5e-5 of the lane's largest |q| a value (quantx16 rounds the
// activations of the quantized GEMVs the same way).
struct kv_raw_q8w {
	uint32_t x[4];  // the two words
	uint32_t d;     // the block's scale (low 16 bits), set by settle
};

struct kv_cache_q8w {
	const q8_0* p;
	long long stride;  // elements a row, a multiple of 128
	int sh;            // the byte where the lane's values start in its words
	int from;          // the lane that gives this lane's scale
	int give;          // which scale the lane gives: 1-3 its block's from w0, 4 the next block's from w1, 0 none (what it passes is unread)
	uint32_t qi[4];    // the lane's q as int16 levels, two a word (set_query)
	float qd;          // their level's size
	__device__ __forceinline__ void set_query(const float q[8]) {
		float a = 0.0f, s = 0.0f;
#pragma unroll
		for (int i = 0; i < 8; i++) a = fmaxf(a, fabsf(q[i])), s += q[i];
		const float inv = a > 0.0f ? 32767.0f / a : 0.0f;
		// A NaN or infinite q makes every score NaN, as the products in
		// float would.
		qd = s - s == 0.0f ? a / 32767.0f : NAN;
#pragma unroll
		for (int j = 0; j < 4; j++) qi[j] = (uint32_t)(rint_i(q[2 * j] * inv) & 0xffff) | (uint32_t)rint_i(q[2 * j + 1] * inv) << 16;
	}
	// at_lane sets the lane's constants for element e of a row.
	__device__ __forceinline__ void at_lane(int e) {
		const int k = (e & 31) >> 3, j = (e >> 5) & 3;  // the lane's 8 of its block, the block's place in 4
		sh = (2 * j + 2 + 8 * k) & 7;
		from = (threadIdx.x & 31) - k - (j == 3);
		give = k == 0 && j < 3 ? j + 1 : k == 3 && j == 2 ? 4 : 0;
	}
	__device__ __forceinline__ kv_raw_q8w load8raw(long long row, int e) const {
		const uint8_t* a = (const uint8_t*)p + row * (stride / 32 * 34) + 34 * (e >> 5) + 2 + (e & 31);  // the values
		const uint2* w = (const uint2*)(a - sh);
		KV_CHECK(w, sh ? 16 : 8, 8);
		const uint2 w0 = w[0], w1 = sh ? w[1] : make_uint2(0, 0);
		kv_raw_q8w r;
		r.x[0] = w0.x, r.x[1] = w0.y, r.x[2] = w1.x, r.x[3] = w1.y;
		return r;
	}
	__device__ __forceinline__ void settle(kv_raw_q8w& r) const {
		// The scale at the block's start is 2j bytes into w0 (k = 0,
		// j < 3); the next block's is 6 bytes into w1 (k = 3, j = 2).
		const uint32_t g = give == 1 ? r.x[0] : give == 2 ? r.x[0] >> 16 : give == 3 ? r.x[1] : r.x[3] >> 16;
		r.d = (uint32_t)__shfl_sync(0xffffffffu, (int)g, from);
	}
	// words gives the lane's 8 values, 4 a word.
	__device__ __forceinline__ void words(const kv_raw_q8w& r, uint32_t& w0, uint32_t& w1) const {
		const int s = 8 * (sh & 3);
		const bool hi = sh >= 4;
		const uint32_t a0 = hi ? r.x[1] : r.x[0], a1 = hi ? r.x[2] : r.x[1], a2 = hi ? r.x[3] : r.x[2];
		w0 = __funnelshift_r(a0, a1, s);
		w1 = __funnelshift_r(a1, a2, s);
	}
	__device__ __forceinline__ void unpack8(const kv_raw_q8w& r, float f[8]) const {
		uint32_t w0, w1;
		words(r, w0, w1);
		unpack4_s8(w0, f);
		unpack4_s8(w1, f + 4);
	}
	// dot8 is q·k for set_query's q (the float q it is given is unread).
	__device__ __forceinline__ float dot8(const kv_raw_q8w& r, const float*) const {
		uint32_t w0, w1;
		words(r, w0, w1);
		return (float)::dot8(0, make_uint4(qi[0], qi[1], qi[2], qi[3]), w0, w1) * (qd * scale8(r));
	}
	__device__ __forceinline__ float scale8(const kv_raw_q8w& r) const { return __half2float(__ushort_as_half((unsigned short)r.d)); }
};

// split_reader is the cache reader of the decode kernel for a head of D
// values: kv_cache_q8w for Q8_0 heads of a multiple of 128, kv_cache
// otherwise.
template <typename KV, int D>
struct split_reader {
	typedef kv_cache<KV> type;
	static __device__ __forceinline__ type of(kv_cache<KV> c) { return c; }
};
template <>
struct split_reader<q8_0, 128> {
	typedef kv_cache_q8w type;
	static __device__ __forceinline__ type of(kv_cache<q8_0> c) { return {c.p, c.stride}; }
};
template <>
struct split_reader<q8_0, 256> : split_reader<q8_0, 128> {};

// A block's scale as stored (F16 bits) and the reciprocal its values are
// multiplied by before rounding, from the block's largest magnitude: Q8_0
// takes the reciprocal of the unrounded d = amax/127 (quant.QuantizeQ8_0),
// Q8_B8 of d rounded to F16 (quant.QuantizeQ8B8).
struct q8_scale {
	unsigned short bits;
	float id;
};
template <int BS>
__device__ __forceinline__ q8_scale q8_scale_of(float amax) {
	const __half h = __float2half_rn(amax / 127.0f);
	const float d = BS == 32 ? amax / 127.0f : __half2float(h);
	return {__half_as_ushort(h), d != 0.0f ? 1.0f / d : 0.0f};
}
// q8_code is a value's byte: round(x*id), ties away from zero, clamped to
// [-127, 127] for Q8_B8 (Q8_0's scale keeps it there).
template <int BS>
__device__ __forceinline__ unsigned short q8_code(float x, float id) {
	float q = roundf(__fmul_rn(x, id));
	if (BS != 32) q = fminf(fmaxf(q, -127.0f), 127.0f);
	return (uint8_t)(int8_t)q;
}

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
	const q8_scale sc = q8_scale_of<8>(amax);
	unsigned short* w = reinterpret_cast<unsigned short*>(b);
	w[0] = sc.bits;
	for (int j = 0; j < 4; j++) w[1 + j] = q8_code<8>(x[2 * j], sc.id) | q8_code<8>(x[2 * j + 1], sc.id) << 8;
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
	const q8_scale sc = q8_scale_of<32>(amax);
	// One 16-bit store of the scale (a block is 34 bytes from a row start
	// aligned to 2): on the H200 the two byte stores of it left the low
	// byte 0.
	*reinterpret_cast<unsigned short*>(b) = sc.bits;
	for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)q8_code<32>(x[j], sc.id);
}

// rope_kv_q8 is rope_kv (fused.cu) into Q8_0 (BS 32) or Q8_B8 (BS 8)
// caches at position p0: q[T, heads*headDim] rotated in place, k's rows
// rotated and v's copied into rows p0.. of the caches, each block
// quantized as quantize_q8_0_block or quantize_q8_b8_block quantizes it,
// to the same bytes for finite values (a NaN makes its block's scale NaN).
// One pass of the grid: first a thread a value of k's and v's T rows, in
// whole warps, a block of BS values BS lanes that find its largest
// magnitude by shuffles, then the pairs of q. Blocks of the launch are a
// multiple of 32 threads, so that a warp's lanes are 32 consecutive
// values; kvHeads*headDim is a multiple of BS.
template <int BS>
__device__ void rope_kv_q8(float* q, const float* k, const float* v, uint8_t* kc, uint8_t* vc, const float* cosT, const float* sinT, int T,
			   int heads, int kvHeads, int headDim, int p0) {
	const int half = headDim / 2;
	const long long kvDim = (long long)kvHeads * headDim;
	const long long nk = T * kvDim, nkv = 2 * nk;
	const long long nw = (nkv + 31) / 32 * 32;  // k and v in whole warps
	const long long nq = (long long)T * heads * half;
	const long long rowBytes = kvDim / BS * (BS + 2);
	GRID_STRIDE(i, nw + nq) {
		if (i < nw) {
			// Every lane of the warp is here: the shuffles need them all.
			const bool in = i < nkv, isV = i >= nk;
			const long long e = isV ? i - nk : i;  // the value's index in k or v
			const long long t = e / kvDim, c = e % kvDim;
			float y = 0.0f;
			if (in && isV) {
				y = v[e];
			} else if (in) {
				const int j = (int)(c % headDim), jj = j < half ? j : j - half;
				const float* src = k + e - j;  // the value's head
				const long long ci = (p0 + t) * half + jj;
				const float cs = cosT[ci], sn = sinT[ci];
				const float x1 = src[jj], x2 = src[jj + half];
				y = j < half ? x1 * cs - x2 * sn : x2 * cs + x1 * sn;
			}
			float amax = fabsf(y);
#pragma unroll
			for (int o = BS / 2; o > 0; o >>= 1) {
				const float a = __shfl_xor_sync(0xffffffffu, amax, o);
				amax = amax != amax || a != a ? NAN : fmaxf(amax, a);
			}
			// Lane pairs store their two bytes at once (blocks sit at
			// even offsets), the block's first lane its scale.
			const float y2 = __shfl_xor_sync(0xffffffffu, y, 1);
			if (in && (c & 1) == 0) {
				const q8_scale sc = q8_scale_of<BS>(amax);
				uint8_t* b = (isV ? vc : kc) + (p0 + t) * rowBytes + c / BS * (BS + 2);
				unsigned short* w = reinterpret_cast<unsigned short*>(b);
				const int o = (int)(c % BS);
				if (o == 0) w[0] = sc.bits;
				w[1 + o / 2] = q8_code<BS>(y, sc.id) | q8_code<BS>(y2, sc.id) << 8;
			}
		} else {
			rope_pair(q, cosT, sinT, i - nw, heads, headDim, rope_from{p0});
		}
	}
}
