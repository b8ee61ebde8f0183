// Kernels for quantized weights: ggml's block formats, as package
// tensor/quant defines them (its Go code is the reference for every byte
// layout below). gemv_<format>.cu and dequant_<format>.cu instantiate them
// per format:
//
//   gemv_<f>_m{1,2}     out[M,N] = x[M,K] . w[N,K]^T for decode: reads the
//                       quantized bytes directly, F32 x, F32 accumulation
//   dequant_<f>_{f32,f16}  rows of w (r0.. or ids[i]) decoded into a dense
//                       row-major output: F32 bit-exact with
//                       quant.Dequantize (Embed), F16 rounded from it (the
//                       weights of the prefill's cuBLAS products)
//
// Blocks are 18 to 210 bytes and most are not 16-byte aligned, so a warp
// never loads a block from global memory directly: it copies a piece of a
// row (PB whole blocks, of up to R rows at once) into its share of shared
// memory with aligned 16-byte loads of the granules covering it, then each
// lane decodes its own unit of the piece there, reading 32-bit words at
// any byte offset (Words) or, where a format's blocks are 16-byte aligned,
// 16 bytes at a time. A granule not wholly inside the weight tensor is
// read byte by byte, so nothing outside the tensor is read, whatever its
// alignment.
//
// The functions marked QFN compile for the host too: a host program
// (cuda/testdata/quanthost.cu, run by quanthost_test.go where nvcc exists)
// runs the same kernel bodies on CPU threads, one per GPU thread, with
// barriers for __syncwarp and __syncthreads, and checks them against
// tensor/quant without a GPU.
#pragma once

#include "common.cuh"

#ifndef __CUDA_ARCH__
#include <string.h>
#endif

#define QFN __host__ __device__ __forceinline__

// Warps per block at most (the launch bound of every kernel here).
#define QWARPS 4

// ---- exact scalar helpers (host and device)

QFN float as_float(uint32_t u) {
#ifdef __CUDA_ARCH__
	return __uint_as_float(u);
#else
	float f;
	memcpy(&f, &u, 4);
	return f;
#endif
}

QFN uint32_t as_bits(float f) {
#ifdef __CUDA_ARCH__
	return __float_as_uint(f);
#else
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
#endif
}

// half_to_f32 widens the IEEE half in the low 16 bits of h, exactly.
QFN float half_to_f32(uint32_t h) {
#ifdef __CUDA_ARCH__
	return __half2float(__ushort_as_half((unsigned short)h));
#else
	// As tensor/quant's halfToFloat: normal halves move into the float
	// fields and are rescaled by 2^-112; subnormals are 0.5 + m*2^-24 less 0.5.
	const uint32_t w = (h & 0x7fffu) << 17;
	float mag;
	if (w >= (1u << 27))
		mag = as_float((w >> 4) + 0x70000000u) * 0x1p-112f;
	else
		mag = as_float((w >> 17) | 0x3f000000u) - 0.5f;
	return as_float(((h & 0x8000u) << 16) | as_bits(mag));
#endif
}

// Products and sums rounded as written: the reference rounds each one to
// float32 and never fuses them, so dequantization must not either.
QFN float fmul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
	return __fmul_rn(a, b);
#else
	return a * b;
#endif
}
QFN float fadd_rn(float a, float b) {
#ifdef __CUDA_ARCH__
	return __fadd_rn(a, b);
#else
	return a + b;
#endif
}
QFN float fsub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
	return __fsub_rn(a, b);
#else
	return a - b;
#endif
}

QFN uint32_t funnel_r(uint32_t lo, uint32_t hi, uint32_t sh) {
#ifdef __CUDA_ARCH__
	return __funnelshift_r(lo, hi, sh);
#else
	return sh ? (lo >> sh) | (hi << (32 - sh)) : lo;
#endif
}

// Words of a staging buffer at any byte alignment. A Words for byte
// address p holds the aligned word address at or below p and the shift
// that makes word i (bytes p+4i..p+4i+3, little-endian) out of the aligned
// words i and i+1: two loads and a funnel shift, the address and shift
// computed once per block rather than per word. The aligned word after
// the last one read must lie inside the buffer (each row's share has 16
// spare bytes).
struct Words {
	const uint32_t* a;
	uint32_t sh;
};
QFN Words words_at(const uint8_t* p) {
	const uint32_t mis = (uint32_t)((uintptr_t)p & 3);
	Words w;
	w.a = reinterpret_cast<const uint32_t*>(p - mis);
	w.sh = mis * 8;
	return w;
}
QFN uint32_t word(const Words& w, int i) { return funnel_r(w.a[i], w.a[i + 1], w.sh); }

// sh_word reads the 4 bytes at p, any alignment.
QFN uint32_t sh_word(const uint8_t* p) { return word(words_at(p), 0); }

// sh_u16 reads a little-endian 16-bit field at p, any alignment.
QFN uint32_t sh_u16(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

// ---- global memory access (device: cache hints; host: plain copies that
// check what the device code relies on)

#ifndef __CUDA_ARCH__
// The host harness (testdata/quanthost.cu) defines these: qhost_violation
// counts what would be a fault or a misaligned access on the device, a read
// of global memory outside [qhost_lo, qhost_hi) (the weight tensor of the
// launch) or an unaligned vector access.
void qhost_violation();
extern const uint8_t *qhost_lo, *qhost_hi;
#endif

// ldg16 loads the 16-byte granule at g (16-byte aligned) of the weights,
// which are read once: not kept in L1.
QFN uint4 ldg16(const uint8_t* g) {
	uint4 v;
#ifdef __CUDA_ARCH__
	asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
		     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
		     : "l"(g));
#else
	if (((uintptr_t)g & 15) || g < qhost_lo || g + 16 > qhost_hi) qhost_violation();
	memcpy(&v, g, 16);
#endif
	return v;
}

// ldg8 loads one byte of the weights.
QFN uint8_t ldg8(const uint8_t* p) {
#ifdef __CUDA_ARCH__
	return __ldg(p);
#else
	if (p < qhost_lo || p >= qhost_hi) qhost_violation();
	return *p;
#endif
}

// ldx reads one V (float4, uint4, int4, float2) of the activations, their
// levels, scales or sums at p, aligned to V's size; L1-cached, as every
// warp of the SM reads the same x. On the host an unaligned p is a
// violation.
template <typename V>
QFN V ldx(const void* p) {
#ifdef __CUDA_ARCH__
	return __ldg(reinterpret_cast<const V*>(p));
#else
	if ((uintptr_t)p & (sizeof(V) - 1)) qhost_violation();
	V v;
	memcpy(&v, p, sizeof(V));
	return v;
#endif
}

// ldx4 reads 4 floats of the activations (16-byte aligned).
QFN float4 ldx4(const float* p) { return ldx<float4>(p); }

QFN void st16(void* p, uint4 v) {
#ifdef __CUDA_ARCH__
	*reinterpret_cast<uint4*>(p) = v;
#else
	if ((uintptr_t)p & 15) qhost_violation();
	memcpy(p, &v, 16);
#endif
}

// f16_bits rounds f to half precision, to nearest even.
QFN uint32_t f16_bits(float f) {
#ifdef __CUDA_ARCH__
	return __half_as_ushort(__float2half_rn(f));
#else
	const __half h = __float2half_rn(f);
	unsigned short u;
	memcpy(&u, &h, 2);
	return u;
#endif
}

// store32 writes 32 consecutive values at p (16-byte aligned).
QFN void store32(float* p, const float (&y)[32]) {
#pragma unroll
	for (int i = 0; i < 8; i++)
		st16(p + 4 * i, make_uint4(as_bits(y[4 * i]), as_bits(y[4 * i + 1]), as_bits(y[4 * i + 2]), as_bits(y[4 * i + 3])));
}
QFN void store32(__half* p, const float (&y)[32]) {
#pragma unroll
	for (int i = 0; i < 4; i++) {
		uint32_t w[4];
#pragma unroll
		for (int j = 0; j < 4; j++) w[j] = f16_bits(y[8 * i + 2 * j]) | (f16_bits(y[8 * i + 2 * j + 1]) << 16);
		st16(p + 8 * i, make_uint4(w[0], w[1], w[2], w[3]));
	}
}

// ---- the formats
//
// Each format gives its block geometry and two decoders:
//   QK, BB  elements and bytes of a block
//   UPB     GEMV units per block (a unit is one lane's work, 32 or 64
//           elements sharing their scales)
//   PB      blocks per staged piece of a row: PB*UPB = 32, one unit a lane
//   ALIGN16 whether dot needs its blocks 16-byte aligned in shared memory
//           (the 144- and 176-byte formats, whose rows are 16-byte
//           multiples: MatMul sends them here when the tensor is aligned)
//   dot<M,R>(acc, bp, j, x, K)  adds unit j of the R blocks at bp[r] (in
//           shared memory) times the M rows of x (x: the block's first
//           element in row 0; row stride K) to acc[r][m]
//   run(b, s, y)  decodes elements 32s..32s+31 of the block at b into y,
//           bit-exact with quant.Dequantize
//
// dot works on the levels v of a unit (its b-bit integers) as the floats
// f = 0.5 + v/2^(b+1): the level, shifted to the top of a byte, becomes the
// top mantissa bits of 0.5 in one byte permute (levelf), with no integer
// to float conversion and no subtraction. Then
//   sum(v*x) = 2^(b+1) * sum(f*x) - 2^b * sum(x)
// and a unit with scale d, offset o and min m adds
//   d * (2^(b+1)*sum(f*x) - (2^b + o)*sum(x)) + m*sum(x),
// the sums of x shared by the R rows. A weight costs one permute and one
// fused multiply-add, plus a share of the word-wide masks and shifts that
// gather four levels into the bytes of a word (against three instructions
// with an exact integer conversion). The rounding differs from the
// reference's order: f*x keeps the level exactly, but the subtraction
// cancels part of sum(f*x), the more the larger the mean of x. On the host
// harness's cases a row's relative error is 1e-7 to 1e-6 for centred x and
// up to 6e-6 for x offset by 0.75 of its spread (3e-7 with exact levels,
// Q8_0), within the 1e-5 the tests ask. Q8_0's 8-bit levels do not fit in
// the top of a byte; they go through 2^23 + byte (bytef) and a subtraction.

// byte_perm picks bytes of y:x by the selector's nibbles (CUDA's
// __byte_perm, default mode).
QFN uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
	return __byte_perm(x, y, s);
#else
	const uint64_t v = ((uint64_t)y << 32) | x;
	uint32_t r = 0;
	for (int i = 0; i < 4; i++) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
	return r;
#endif
}

// levelf returns 0.5 + b/256 for byte i (compile-time) of w, b < 128: the
// float 0x3F000000 | b<<16.
QFN float levelf(uint32_t w, int i) { return as_float(byte_perm(w, 0x3F000000u, 0x7054u | ((uint32_t)i << 8))); }

// bytef returns byte i of w as an exact float, less bias - 2^23: the byte
// goes into the low mantissa byte of 2^23 (whose ulp is 1).
QFN float bytef(uint32_t w, int i, float bias) { return as_float(byte_perm(w, 0x4B000000u, 0x7650u | (uint32_t)i)) - bias; }

// dotf adds the four levels in the bytes of v (levelf) times the four
// values of x in each of the M rows to s[m].
template <int M>
QFN void dotf(float (&s)[M], uint32_t v, const float4 (&xv)[M]) {
	const float f0 = levelf(v, 0), f1 = levelf(v, 1), f2 = levelf(v, 2), f3 = levelf(v, 3);
#pragma unroll
	for (int m = 0; m < M; m++) {
		s[m] += f0 * xv[m].x;
		s[m] += f1 * xv[m].y;
		s[m] += f2 * xv[m].z;
		s[m] += f3 * xv[m].w;
	}
}

// sum4 adds the four values of v to s.
QFN void sum4(float& s, const float4& v) {
	s += v.x;
	s += v.y;
	s += v.z;
	s += v.w;
}

// spread4 moves bits 0..3 of b to bits 0, 8, 16, 24 (the copies of b the
// product makes land at disjoint bits, so nothing carries).
QFN uint32_t spread4(uint32_t b) { return ((b & 0xfu) * 0x00204081u) & 0x01010101u; }

template <int M, int R>
QFN void zero(float (&s)[R][M]) {
#pragma unroll
	for (int r = 0; r < R; r++)
#pragma unroll
		for (int m = 0; m < M; m++) s[r][m] = 0.0f;
}
template <int M>
QFN void zero(float (&s)[M]) {
#pragma unroll
	for (int m = 0; m < M; m++) s[m] = 0.0f;
}

// ld128 reads 16 bytes of shared memory at p (16-byte aligned).
QFN uint4 ld128(const uint8_t* p) {
#ifndef __CUDA_ARCH__
	if ((uintptr_t)p & 15) qhost_violation();
#endif
	return *reinterpret_cast<const uint4*>(p);
}

// Q8_0 (34 bytes): d (F16), 32 signed bytes. x = d*q.
struct FmtQ8_0 {
	static constexpr int QK = 32, BB = 34, UPB = 1, PB = 32;
	static constexpr bool ALIGN16 = false;
	template <int M, int R>
	static QFN void dot(float (&acc)[R][M], const uint8_t* const (&bp)[R], int, const float* __restrict__ x, int K) {
		float s[R][M];
		zero(s);
		Words qw[R];
#pragma unroll
		for (int r = 0; r < R; r++) qw[r] = words_at(bp[r] + 2);
#pragma unroll
		for (int c = 0; c < 8; c++) {
			float4 xv[M];
#pragma unroll
			for (int m = 0; m < M; m++) xv[m] = ldx4(x + (long long)m * K + 4 * c);
#pragma unroll
			for (int r = 0; r < R; r++) {
				// The byte ^ 0x80 is q + 128, read as 2^23 + q + 128.
				const uint32_t q = word(qw[r], c) ^ 0x80808080u;
				const float f0 = bytef(q, 0, 8388736.0f), f1 = bytef(q, 1, 8388736.0f);
				const float f2 = bytef(q, 2, 8388736.0f), f3 = bytef(q, 3, 8388736.0f);
#pragma unroll
				for (int m = 0; m < M; m++) {
					s[r][m] += f0 * xv[m].x;
					s[r][m] += f1 * xv[m].y;
					s[r][m] += f2 * xv[m].z;
					s[r][m] += f3 * xv[m].w;
				}
			}
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const float d = half_to_f32(sh_u16(bp[r]));
#pragma unroll
			for (int m = 0; m < M; m++) acc[r][m] += d * s[r][m];
		}
	}
	static QFN void run(const uint8_t* b, int, float (&y)[32]) {
		const float d = half_to_f32(sh_u16(b));
		const Words qw = words_at(b + 2);
#pragma unroll
		for (int c = 0; c < 8; c++) {
			const uint32_t q = word(qw, c);
#pragma unroll
			for (int k = 0; k < 4; k++) y[4 * c + k] = fmul_rn((float)(int8_t)(q >> (8 * k)), d);
		}
	}
};

// The 32-element formats with 16 bytes of nibbles at QS: byte j holds
// element j (low nibble) and j+16 (high). HAS_MIN: x = d*q + m (Q4_1,
// Q5_1); else x = d*(q - 8) or, with fifth bits, d*(q - 16). HAS_HIGH: the
// fifth bit of element j is bit j of the 32-bit field at QH (Q5_0, Q5_1).
template <int BB_, int QS, int QH, bool HAS_MIN, bool HAS_HIGH>
struct FmtNib32 {
	static constexpr int QK = 32, BB = BB_, UPB = 1, PB = 32;
	static constexpr bool ALIGN16 = false;

	template <int M, int R>
	static QFN void dot(float (&acc)[R][M], const uint8_t* const (&bp)[R], int, const float* __restrict__ x, int K) {
		// Levels of b = 4 or 5 bits; f = 0.5 + v/S.
		const float S = HAS_HIGH ? 64.0f : 32.0f;
		const float C = S * 0.5f + (HAS_MIN ? 0.0f : (HAS_HIGH ? 16.0f : 8.0f));
		float s[R][M], sx[M];
		zero(s);
		zero(sx);
		uint32_t qh[R];
		Words qw[R];
#pragma unroll
		for (int r = 0; r < R; r++) {
			qh[r] = HAS_HIGH ? sh_word(bp[r] + QH) : 0u;
			qw[r] = words_at(bp[r] + QS);
		}
#pragma unroll
		for (int c = 0; c < 4; c++) {  // bytes 4c..4c+3: elements 4c+k and 16+4c+k
			float4 xl[M], xh[M];
#pragma unroll
			for (int m = 0; m < M; m++) {
				xl[m] = ldx4(x + (long long)m * K + 4 * c);
				xh[m] = ldx4(x + (long long)m * K + 16 + 4 * c);
				sum4(sx[m], xl[m]);
				sum4(sx[m], xh[m]);
			}
#pragma unroll
			for (int r = 0; r < R; r++) {
				const uint32_t q = word(qw[r], c);
				uint32_t lo, hi;  // the levels of bytes 4c..4c+3, top bit at bit 6
				if (HAS_HIGH) {
					lo = ((q << 2) & 0x3C3C3C3Cu) | (spread4(qh[r] >> (4 * c)) << 6);
					hi = ((q >> 2) & 0x3C3C3C3Cu) | (spread4(qh[r] >> (16 + 4 * c)) << 6);
				} else {
					lo = (q << 3) & 0x78787878u;
					hi = (q >> 1) & 0x78787878u;
				}
				dotf(s[r], lo, xl);
				dotf(s[r], hi, xh);
			}
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const float d = half_to_f32(sh_u16(bp[r]));
			const float mn = HAS_MIN ? half_to_f32(sh_u16(bp[r] + 2)) : 0.0f;
#pragma unroll
			for (int m = 0; m < M; m++) {
				acc[r][m] += d * (S * s[r][m] - C * sx[m]);
				if (HAS_MIN) acc[r][m] += mn * sx[m];
			}
		}
	}

	static QFN void run(const uint8_t* b, int, float (&y)[32]) {
		const float d = half_to_f32(sh_u16(b));
		const float mn = HAS_MIN ? half_to_f32(sh_u16(b + 2)) : 0.0f;
		const uint32_t qh = HAS_HIGH ? sh_word(b + QH) : 0u;
		const int off = HAS_MIN ? 0 : (HAS_HIGH ? 16 : 8);
		const Words qw = words_at(b + QS);
#pragma unroll
		for (int c = 0; c < 4; c++) {
			const uint32_t q = word(qw, c);
#pragma unroll
			for (int k = 0; k < 4; k++) {
				const int j = 4 * c + k;
				int vl = (q >> (8 * k)) & 0xf, vh = (q >> (8 * k + 4)) & 0xf;
				if (HAS_HIGH) {
					vl |= ((qh >> j) & 1) << 4;
					vh |= ((qh >> (j + 16)) & 1) << 4;
				}
				if (HAS_MIN) {
					y[j] = fadd_rn(fmul_rn((float)vl, d), mn);
					y[j + 16] = fadd_rn(fmul_rn((float)vh, d), mn);
				} else {
					y[j] = fmul_rn((float)(vl - off), d);
					y[j + 16] = fmul_rn((float)(vh - off), d);
				}
			}
		}
	}
};

// Q4_0 (18 bytes): d, 16 bytes of nibbles; x = d*(q-8).
typedef FmtNib32<18, 2, 0, false, false> FmtQ4_0;
// Q4_1 (20 bytes): d, m, 16 bytes of nibbles; x = d*q + m.
typedef FmtNib32<20, 4, 0, true, false> FmtQ4_1;
// Q5_0 (22 bytes): d, qh (32 fifth bits), 16 bytes of nibbles; x = d*(q-16).
typedef FmtNib32<22, 6, 2, false, true> FmtQ5_0;
// Q5_1 (24 bytes): d, m, qh, 16 bytes of nibbles; x = d*q + m.
typedef FmtNib32<24, 8, 4, true, true> FmtQ5_1;

// scale_min_k4 unpacks the 6-bit scale and min of sub-block j (0..7) from
// the 12 packed bytes at q (Q4_K, Q5_K; quant's scaleMinK4).
QFN void scale_min_k4(const uint8_t* q, int j, uint32_t& sc, uint32_t& mn) {
	if (j < 4) {
		sc = q[j] & 63u;
		mn = q[j + 4] & 63u;
	} else {
		sc = (q[j + 4] & 0xfu) | ((uint32_t)(q[j - 4] >> 6) << 4);
		mn = (q[j + 4] >> 4) | ((uint32_t)(q[j] >> 6) << 4);
	}
}

// Q4_K (144 bytes) and Q5_K (176): d, dmin (F16), 12 bytes of scales and
// mins, [Q5_K: 32 bytes qh,] 128 bytes of nibbles. Group g (elements
// 64g..64g+63) is 32 bytes: element 64g+l in the low nibble of byte l
// (sub-block 2g), 64g+32+l in the high one (sub-block 2g+1); Q5_K's fifth
// bits are bits 2g and 2g+1 of qh[l]. x = d*sc*q - dmin*m.
// A GEMV unit is a group: lane u of a piece takes group u%4 of block u/4
// and reads its fields with 16-byte loads (the blocks are 16-byte aligned;
// each quarter-warp's 8 loads fall on distinct banks).
template <bool FIVE>
struct FmtK45 {
	static constexpr int QK = 256, BB = FIVE ? 176 : 144, UPB = 4, PB = 8;
	static constexpr bool ALIGN16 = true;
	static constexpr int QS = FIVE ? 48 : 16;

	template <int M, int R>
	static QFN void dot(float (&acc)[R][M], const uint8_t* const (&bp)[R], int g, const float* __restrict__ x, int K) {
		const float S = FIVE ? 64.0f : 32.0f;  // f = 0.5 + v/S
		float s1[R][M], s2[R][M], sx1[M], sx2[M];
		zero(s1);
		zero(s2);
		zero(sx1);
		zero(sx2);
		const float* xg = x + 64 * g;
#pragma unroll 1
		for (int part = 0; part < 2; part++) {  // words 4*part..4*part+3 of the group
			float4 xl[4][M], xh[4][M];
#pragma unroll
			for (int c = 0; c < 4; c++)
#pragma unroll
				for (int m = 0; m < M; m++) {
					xl[c][m] = ldx4(xg + (long long)m * K + 16 * part + 4 * c);
					xh[c][m] = ldx4(xg + (long long)m * K + 32 + 16 * part + 4 * c);
					sum4(sx1[m], xl[c][m]);
					sum4(sx2[m], xh[c][m]);
				}
#pragma unroll
			for (int r = 0; r < R; r++) {
				const uint4 q4 = ld128(bp[r] + QS + 32 * g + 16 * part);
				const uint4 h4 = FIVE ? ld128(bp[r] + 16 + 16 * part) : make_uint4(0, 0, 0, 0);
				const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w}, hw[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
				for (int c = 0; c < 4; c++) {
					uint32_t lo, hi;  // the levels of the word's 4 bytes, top bit at bit 6
					if (FIVE) {
						// qh bytes shifted by 2g: bit 8k is the fifth bit of byte
						// k's low nibble, bit 8k+1 of its high one.
						const uint32_t h = hw[c] >> (2 * g);
						lo = ((q[c] << 2) & 0x3C3C3C3Cu) | ((h << 6) & 0x40404040u);
						hi = ((q[c] >> 2) & 0x3C3C3C3Cu) | ((h << 5) & 0x40404040u);
					} else {
						lo = (q[c] << 3) & 0x78787878u;
						hi = (q[c] >> 1) & 0x78787878u;
					}
					dotf(s1[r], lo, xl[c]);
					dotf(s2[r], hi, xh[c]);
				}
			}
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const uint4 hd = ld128(bp[r]);  // d, dmin, then the 12 scale bytes
			const float d = half_to_f32(hd.x & 0xffffu), dmin = half_to_f32(hd.x >> 16);
			// Sub-blocks 2g and 2g+1: scale_min_k4's bytes, the pair at once.
			const uint32_t sh = (16 * g) & 31;
			const uint32_t a0 = hd.y >> sh, a1 = hd.z >> sh, a2 = hd.w >> sh;
			const uint32_t sc = g < 2 ? a0 & 0x3F3Fu : (a2 & 0x0F0Fu) | ((a0 >> 2) & 0x3030u);
			const uint32_t mn = g < 2 ? a1 & 0x3F3Fu : ((a2 >> 4) & 0x0F0Fu) | ((a1 >> 2) & 0x3030u);
			const float d1 = fmul_rn(d, (float)(sc & 0xffu)), m1 = fmul_rn(dmin, (float)(mn & 0xffu));
			const float d2 = fmul_rn(d, (float)(sc >> 8)), m2 = fmul_rn(dmin, (float)(mn >> 8));
#pragma unroll
			for (int m = 0; m < M; m++) {
				acc[r][m] += d1 * (S * s1[r][m] - 0.5f * S * sx1[m]);
				acc[r][m] -= m1 * sx1[m];
				acc[r][m] += d2 * (S * s2[r][m] - 0.5f * S * sx2[m]);
				acc[r][m] -= m2 * sx2[m];
			}
		}
	}

	// run decodes sub-block s: the low (s even) or high nibbles of group s/2.
	static QFN void run(const uint8_t* b, int s, float (&y)[32]) {
		const float d = half_to_f32(sh_u16(b)), dmin = half_to_f32(sh_u16(b + 2));
		uint32_t sc, mn;
		scale_min_k4(b + 4, s, sc, mn);
		const float d1 = fmul_rn(d, (float)sc), m1 = fmul_rn(dmin, (float)mn);
		const int g = s >> 1, sh = 4 * (s & 1);
		const Words qw = words_at(b + QS + 32 * g), hw = words_at(b + 16);
#pragma unroll
		for (int c = 0; c < 8; c++) {
			const uint32_t q = word(qw, c);
			const uint32_t h = FIVE ? word(hw, c) >> s : 0u;
#pragma unroll
			for (int k = 0; k < 4; k++) {
				uint32_t v = (q >> (8 * k + sh)) & 0xfu;
				if (FIVE) v |= ((h >> (8 * k)) & 1u) << 4;
				y[4 * c + k] = fsub_rn(fmul_rn(d1, (float)v), m1);
			}
		}
	}
};
typedef FmtK45<false> FmtQ4_K;
typedef FmtK45<true> FmtQ5_K;

// Q6_K (210 bytes): ql[128] low nibbles, qh[64] top bit pairs, 16 signed
// byte scales, d (F16). Half h (elements 128h..128h+127): ql[64h+l] holds
// elements 128h+l (low nibble) and 128h+64+l (high), ql[64h+32+l] holds
// 128h+32+l and 128h+96+l, for l < 32; qh[32h+l] holds their top two bits
// at bits 0, 2, 4, 6 for 128h+l, +32, +64, +96. Element 128h+32k+l has
// scale sc[8h+2k+l/16]. x = d*sc*(q-32).
// A GEMV unit (j = 2h+kk) is the 32 bytes ql[64h+32kk..]: elements
// 128h+32kk+l (low nibbles, qh bits 2kk) and 128h+64+32kk+l (high
// nibbles, qh bits 2kk+4), four scales.
struct FmtQ6_K {
	static constexpr int QK = 256, BB = 210, UPB = 4, PB = 8;
	static constexpr bool ALIGN16 = false;

	template <int M, int R>
	static QFN void dot(float (&acc)[R][M], const uint8_t* const (&bp)[R], int j, const float* __restrict__ x, int K) {
		const int h = j >> 1, kk = j & 1;
		const float* xb = x + 128 * h + 32 * kk;
		Words qw[R], hw[R];
#pragma unroll
		for (int r = 0; r < R; r++) {
			qw[r] = words_at(bp[r] + 64 * h + 32 * kk);
			hw[r] = words_at(bp[r] + 128 + 32 * h);
		}
#pragma unroll 1
		for (int hf = 0; hf < 2; hf++) {  // l < 16, then l >= 16: one scale each
			float sl[R][M], sh[R][M], sxl[M], sxh[M];
			zero(sl);
			zero(sh);
			zero(sxl);
			zero(sxh);
			// Words 4hf..4hf+3 (the pointers move on after each half).
#pragma unroll
			for (int c = 0; c < 4; c++) {
				float4 xl[M], xh[M];
#pragma unroll
				for (int m = 0; m < M; m++) {
					xl[m] = ldx4(xb + (long long)m * K + 4 * c);
					xh[m] = ldx4(xb + (long long)m * K + 64 + 4 * c);
					sum4(sxl[m], xl[m]);
					sum4(sxh[m], xh[m]);
				}
#pragma unroll
				for (int r = 0; r < R; r++) {
					const uint32_t q = word(qw[r], c);
					// qh bytes 4c..4c+3 shifted by 2kk: the low nibbles' top
					// bits at 8k..8k+1, the high nibbles' at 8k+4..8k+5.
					const uint32_t t = word(hw[r], c) >> (2 * kk);
					// 6-bit levels, top bit at bit 6 of each byte.
					const uint32_t lo = ((q << 1) & 0x1E1E1E1Eu) | ((t << 5) & 0x60606060u);
					const uint32_t hi = ((q >> 3) & 0x1E1E1E1Eu) | ((t << 1) & 0x60606060u);
					dotf(sl[r], lo, xl);
					dotf(sh[r], hi, xh);
				}
			}
#pragma unroll
			for (int r = 0; r < R; r++) {
				const float d = half_to_f32(sh_u16(bp[r] + 208));
				const uint8_t* sc = bp[r] + 192 + 8 * h + 2 * kk + hf;
				const float dl = fmul_rn(d, (float)(int8_t)sc[0]), dh = fmul_rn(d, (float)(int8_t)sc[4]);
				// f = 0.5 + v/128: sum((v-32)*x) = 128*sum(f*x) - 96*sum(x).
#pragma unroll
				for (int m = 0; m < M; m++) {
					acc[r][m] += dl * (128.0f * sl[r][m] - 96.0f * sxl[m]);
					acc[r][m] += dh * (128.0f * sh[r][m] - 96.0f * sxh[m]);
				}
				qw[r].a += 4;
				hw[r].a += 4;
			}
			xb += 16;
		}
	}

	// run decodes elements 32s..32s+31: half s/4, quarter k = s%4.
	static QFN void run(const uint8_t* b, int s, float (&y)[32]) {
		const int h = s >> 2, k = s & 3;
		const float d = half_to_f32(sh_u16(b + 208));
		const float d0 = fmul_rn(d, (float)(int8_t)b[192 + 8 * h + 2 * k]);
		const float d1 = fmul_rn(d, (float)(int8_t)b[192 + 8 * h + 2 * k + 1]);
		const int nsh = 4 * (k >> 1);
		const Words qw = words_at(b + 64 * h + 32 * (k & 1)), hw = words_at(b + 128 + 32 * h);
#pragma unroll
		for (int c = 0; c < 8; c++) {
			const uint32_t q = word(qw, c);
			const uint32_t t = word(hw, c) >> (2 * k);
#pragma unroll
			for (int i = 0; i < 4; i++) {
				const int v = (int)(((q >> (8 * i + nsh)) & 0xfu) | (((t >> (8 * i)) & 3u) << 4));
				y[4 * c + i] = fmul_rn(c < 4 ? d0 : d1, (float)(v - 32));
			}
		}
	}
};

// ---- the kernels' bodies, shared by the device kernels and the host
// harness. Ctx is the thread's place in the launch; S provides the warp
// and block barriers and the warp sum.

struct Ctx {
	int lane, warp, nwarps, block, nblocks;
};

// Staging geometry of a format with R rows per warp: a piece of a row is
// LEN bytes at any alignment, so at most G granules; each row has REG
// bytes of shared memory (G granules and 16 spare bytes for the word
// reads past the last block); a lane loads at most T granules per row.
template <class F, int R>
struct Geo {
	static constexpr int LEN = F::PB * F::BB;
	static constexpr int G = (LEN + 15 + 15) / 16;
	static constexpr int REG = 16 * G + 16;
	static constexpr int T = (G + 31) / 32;
	static constexpr int BYTES = R * REG;
};

// stage copies bytes [src + r*stride, +len) of rows r < nvalid into the
// warp's shared memory sm (row r at sm + r*REG + off[r], where off[r] is the
// row's start modulo 16) by the 16-byte granules covering them; lo and hi
// bound the weight tensor. Every lane computes the same off. A row whose
// granules lie inside the tensor (all but, at times, the first and the
// last) is loaded with 16-byte loads, issued for up to 12 granules a lane
// (RW rows) before the first store; the others byte by byte, leaving the
// bytes outside the tensor as zero.
template <class F, int R>
QFN void stage(uint8_t* sm, const uint8_t* src, long long stride, int len, int nvalid, const uint8_t* lo, const uint8_t* hi,
	       int lane, int (&off)[R]) {
	typedef Geo<F, R> Gm;
	constexpr int RW = R < 12 / Gm::T ? R : (12 / Gm::T > 0 ? 12 / Gm::T : 1);
#pragma unroll
	for (int r0 = 0; r0 < R; r0 += RW) {
		uint4 v[RW][Gm::T];
		int ng[RW];
		bool fast[RW];
#pragma unroll
		for (int i = 0; i < RW; i++) {
			const int r = r0 + i;
			if (r >= R) break;
			const uint8_t* s = src + r * stride;
			off[r] = (int)((uintptr_t)s & 15);
			ng[i] = r < nvalid ? (off[r] + len + 15) >> 4 : 0;
			const uint8_t* a = s - off[r];
			fast[i] = ng[i] > 0 && a >= lo && a + 16 * ng[i] <= hi;
			if (fast[i]) {
				// Lanes past the last granule load it again (a request the
				// lane that needs it makes too), so that every v is defined.
#pragma unroll
				for (int t = 0; t < Gm::T; t++) v[i][t] = ldg16(a + 16 * min(lane + 32 * t, ng[i] - 1));
			} else {
#pragma unroll 1
				for (int g = lane; g < ng[i]; g += 32)
#pragma unroll 1
					for (int k = 0; k < 16; k++) {
						const uint8_t* p = a + 16 * g + k;
						sm[r * Gm::REG + 16 * g + k] = p >= lo && p < hi ? ldg8(p) : 0;
					}
			}
		}
#pragma unroll
		for (int i = 0; i < RW; i++) {
			const int r = r0 + i;
			if (r >= R) break;
			if (!fast[i]) continue;
#pragma unroll
			for (int t = 0; t < Gm::T; t++) {
				const int g = lane + 32 * t;
				if (g < ng[i]) st16(sm + r * Gm::REG + 16 * g, v[i][t]);
			}
		}
	}
}

// Rows of w a GEMV block takes at a time for M rows of x: 4 for one, 2 for
// two, so that both keep 4 sums a lane.
#define QROWS(M) (4 / (M))

// gemv_block: out[m*N + n] = sum_k x[m*K + k] * w(n, k) for M rows of x.
// A block takes R rows of w at a time (grid-stride over row groups); its
// warps take the row pieces in turn (piece p to warp p % nwarps), each
// lane one unit of each of the R rows, which share its loads of x; the
// warps' sums meet in red, added in warp order, so the result does not
// depend on timing. x is 16-byte aligned; so is w when F::ALIGN16.
// S's functions are __device__ for the kernels, __host__ for the harness.
#pragma nv_exec_check_disable
template <class F, int M, int R, class S>
QFN void gemv_block(const Ctx& c, uint8_t* stage_mem, float* red, float* __restrict__ out, const float* __restrict__ x,
		    const uint8_t* __restrict__ w, int N, int K) {
	typedef Geo<F, R> Gm;
	uint8_t* sm = stage_mem + c.warp * Gm::BYTES;
	const int nb = K / F::QK, pieces = (nb + F::PB - 1) / F::PB;
	const long long rowBytes = (long long)nb * F::BB;
	const uint8_t* lo = w;
	const uint8_t* hi = w + (long long)N * rowBytes;
	const int groups = (N + R - 1) / R;
	for (int grp = c.block; grp < groups; grp += c.nblocks) {
		const long long n0 = (long long)grp * R;
		const int nvalid = (int)min((long long)R, N - n0);
		float acc[R][M];
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
		for (int p = c.warp; p < pieces; p += c.nwarps) {
			const int b0 = p * F::PB, cnt = min(F::PB, nb - b0);
			int off[R];
			stage<F, R>(sm, w + n0 * rowBytes + (long long)b0 * F::BB, rowBytes, cnt * F::BB, nvalid, lo, hi, c.lane, off);
			S::warp();
			for (int u = c.lane; u < cnt * F::UPB; u += 32) {
				const int blk = u / F::UPB, j = u % F::UPB;
				const uint8_t* bp[R];
#pragma unroll
				for (int r = 0; r < R; r++) bp[r] = sm + r * Gm::REG + off[r] + blk * F::BB;
				F::template dot<M, R>(acc, bp, j, x + (long long)(b0 + blk) * F::QK, K);
			}
			S::warp();
		}
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int m = 0; m < M; m++) {
				const float s = S::sum(acc[r][m]);
				if (c.lane == 0) red[(c.warp * R + r) * M + m] = s;
			}
		S::block();
		const int t = c.warp * 32 + c.lane;
		if (t < R * M) {
			const int r = t / M, m = t % M;
			float s = 0.0f;
			for (int i = 0; i < c.nwarps; i++) s += red[(i * R + r) * M + m];
			if (r < nvalid) out[(long long)m * N + n0 + r] = s;
		}
		S::block();  // red is rewritten by the next group
	}
}

// dequant_block writes rows i < rows of the output (row stride K): source
// row ids[i], or r0+i when ids is null, of w (N rows), decoded exactly to
// float (T float) or rounded to half (T __half). Work items are (row,
// piece) pairs, one warp each; a source row outside [0, N) decodes as
// zero bytes, never read. out is 16-byte aligned.
// S's functions are __device__ for the kernels, __host__ for the harness.
#pragma nv_exec_check_disable
template <class F, typename T, class S>
QFN void dequant_block(const Ctx& c, uint8_t* stage_mem, T* __restrict__ out, const uint8_t* __restrict__ w,
		       const int* __restrict__ ids, int r0, int rows, int K, int N) {
	typedef Geo<F, 1> Gm;
	constexpr int RPB = F::QK / 32;  // runs of 32 elements per block
	uint8_t* sm = stage_mem + c.warp * Gm::BYTES;
	const int nb = K / F::QK, pieces = (nb + F::PB - 1) / F::PB;
	const long long rowBytes = (long long)nb * F::BB;
	const uint8_t* lo = w;
	const uint8_t* hi = w + (long long)N * rowBytes;
	const long long items = (long long)rows * pieces;
	for (long long it = (long long)c.block * c.nwarps + c.warp; it < items; it += (long long)c.nblocks * c.nwarps) {
		const int i = (int)(it / pieces), p = (int)(it % pieces);
		const long long src = ids ? (long long)ids[i] : (long long)r0 + i;
		const int b0 = p * F::PB, cnt = min(F::PB, nb - b0);
		int off[1];
		stage<F, 1>(sm, w + src * rowBytes + (long long)b0 * F::BB, rowBytes, cnt * F::BB, 1, lo, hi, c.lane, off);
		S::warp();
		T* o = out + (long long)i * K + (long long)b0 * F::QK;
		for (int s = c.lane; s < cnt * RPB; s += 32) {
			const int blk = s / RPB, j = s % RPB;
			float y[32];
			F::run(sm + off[0] + blk * F::BB, j, y);
			store32(o + blk * F::QK + 32 * j, y);
		}
		S::warp();
	}
}

// ---- device entry points

struct DevSync {
	static __device__ __forceinline__ void warp() { __syncwarp(); }
	static __device__ __forceinline__ void block() { __syncthreads(); }
	static __device__ __forceinline__ float sum(float v) { return warp_sum(v); }
	static __device__ __forceinline__ float max(float v) { return warp_max(v); }
};

__device__ __forceinline__ Ctx dev_ctx() {
	Ctx c;
	c.lane = threadIdx.x & 31;
	c.warp = threadIdx.x >> 5;
	c.nwarps = blockDim.x >> 5;
	c.block = blockIdx.x;
	c.nblocks = gridDim.x;
	return c;
}

template <class F, int M>
__device__ __forceinline__ void gemv_q(float* out, const float* x, const uint8_t* w, int N, int K) {
	constexpr int R = QROWS(M);
	__shared__ __align__(16) uint8_t stage_mem[QWARPS * Geo<F, R>::BYTES];
	__shared__ float red[QWARPS * R * M];
	gemv_block<F, M, R, DevSync>(dev_ctx(), stage_mem, red, out, x, w, N, K);
}

template <class F, typename T>
__device__ __forceinline__ void dequant_q(T* out, const uint8_t* w, const int* ids, int r0, int rows, int K, int N) {
	__shared__ __align__(16) uint8_t stage_mem[QWARPS * Geo<F, 1>::BYTES];
	dequant_block<F, T, DevSync>(dev_ctx(), stage_mem, out, w, ids, r0, rows, K, N);
}

// Launch with at most QWARPS warps per block (the bound makes a larger
// launch fail rather than overrun the shared arrays). The GEMV's second
// bound caps the registers at 128, so that 16 warps fit on an SM: without
// it ptxas takes up to 200 to hoist every load of a unit, and the SM holds
// 8 or 10 warps, too few to keep enough loads in flight. Each format's
// GEMV kernels and its dequantization kernels are in files of their own
// (gemv_<f>.cu, dequant_<f>.cu), to keep each PTX file small.
#define QUANT_GEMV(F, NAME)                                                                                                 \
	extern "C" __global__ void __launch_bounds__(32 * QWARPS, 4)                                                        \
	    gemv_##NAME##_m1(float* out, const float* x, const uint8_t* w, int N, int K) { gemv_q<F, 1>(out, x, w, N, K); } \
	extern "C" __global__ void __launch_bounds__(32 * QWARPS, 4)                                                        \
	    gemv_##NAME##_m2(float* out, const float* x, const uint8_t* w, int N, int K) { gemv_q<F, 2>(out, x, w, N, K); }

#define QUANT_DEQUANT(F, NAME)                                                                                    \
	extern "C" __global__ void __launch_bounds__(32 * QWARPS)                                                 \
	    dequant_##NAME##_f32(float* out, const uint8_t* w, const int* ids, int r0, int rows, int K, int N) {  \
		dequant_q<F, float>(out, w, ids, r0, rows, K, N);                                                 \
	}                                                                                                         \
	extern "C" __global__ void __launch_bounds__(32 * QWARPS)                                                 \
	    dequant_##NAME##_f16(__half* out, const uint8_t* w, const int* ids, int r0, int rows, int K, int N) { \
		dequant_q<F, __half>(out, w, ids, r0, rows, K, N);                                                \
	}
