// The integer GEMV of quantized weights: x rounded to 16-bit integers once
// per product, the weights' levels multiplied with them by dp2a (two int16
// times two int8 into an int32, one instruction), the blocks' scales applied
// in float once per 16 or 32 elements. quantx.cu, gemvx_<format>.cu and
// gemvxb_<format>.cu instantiate it:
//
//   quantx16            x[M,K] (F32) into X16 blocks (below), a warp a block
//   gemvx_<f>_m{1,2,4,8}  out[M,N] = x[M,K] . w[N,K]^T from the X16 blocks
//                       (gemvxb_<f>.cu: m4, m8),
//                       up to 1, 2, 4 or 8 rows of x a launch, each weight
//                       block staged and unpacked once for all of them
//
// X16, the activations of one product: for each row and each 32 elements
// of x (a block) the scale d = max|x|/32767 and the levels
// q = rint(x * (32767/max|x|)), |q| <= 32767, so x ~ d*q, and the integer
// sum of the levels of each 16 elements (the offsets and minimums of the
// weight formats multiply it). Three arrays: q (int16, K a row), d (F32,
// K/32 a row) and s (int32, K/16 a row). A block with a NaN or an
// infinity gets d = NaN, so that its row's products are NaN rather than
// silently finite.
//
// Error: rounding x to 16 bits moves each element by at most d/2, 1/65534 of
// its block's largest magnitude, so a product's relative error is about
// 1/65534/sqrt(12) times its blocks' ratio of largest to rms magnitude.
// Measured (TestActivationRounding: Q8_0, Q4_K, Q6_K rows of 4096 and 11008
// from Gaussian values, Gaussian x): 1.6e-5 to 2.4e-5, 3.4e-5 to 7e-5 with
// one outlier feature 20 times the rest in every 32; the host harness's
// cases agree. Everything after the rounding is exact in int32 (a 32-element
// sum is at most 32*128*32767 < 2^28) up to the float scales: the host
// harness finds the products within 4e-7 of the float64 product of the
// dequantized weights and d*q. 8-bit activations (dp4a, as ggml's integer
// kernels) cost 0.4% to 1.7% a product and F16 activations (HFMA2) 2e-4
// before any F16 accumulation; the F32-x kernels of quant.cuh stay for
// MatMulPrecise.
#pragma once

#include "quant.cuh"

// Rows of w a GEMV block takes at a time for up to MM rows of x: 2 for
// MM = 2 and 1 from 4 on; for one row of x, I::ROWS1 (4, or 2 for Q6_K,
// whose unit with pieces of 4 rows in flight does not fit in 128
// registers).
#define QXROWS(I, MM) ((MM) == 1 ? I::ROWS1 : (MM) == 2 ? 2 : 1)

// dp2a_lo and dp2a_hi (c plus two int16 times two signed bytes), dot4,
// dot8 and rint_i are in common.cuh, which the decode attention shares.

// dp2u_lo and dp2u_hi are dp2a_lo and dp2a_hi with the bytes of b
// unsigned (the levels of the 4-, 5- and 6-bit formats, which may sit in
// the high nibble of their bytes).
QFN int dp2u_lo(uint32_t a, uint32_t b, int c) {
#ifdef QDP2A
	int d;
	asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
	return d;
#else
	return c + (int)(int16_t)(a & 0xffffu) * (int)(b & 0xffu) + (int)(int16_t)(a >> 16) * (int)((b >> 8) & 0xffu);
#endif
}
QFN int dp2u_hi(uint32_t a, uint32_t b, int c) {
#ifdef QDP2A
	int d;
	asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
	return d;
#else
	return c + (int)(int16_t)(a & 0xffffu) * (int)((b >> 16) & 0xffu) + (int)(int16_t)(a >> 16) * (int)(b >> 24);
#endif
}

// dot4u and dot8u are common.cuh's dot4 and dot8 with the bytes of w
// unsigned.
QFN int dot4u(int s, uint32_t xa, uint32_t xb, uint32_t w) { return dp2u_hi(xb, w, dp2u_lo(xa, w, s)); }
QFN int dot8u(int s, const uint4& xv, uint32_t w0, uint32_t w1) { return dot4u(dot4u(s, xv.x, xv.y, w0), xv.z, xv.w, w1); }

QFN float fdiv_rn(float a, float b) {
#ifdef __CUDA_ARCH__
	return __fdiv_rn(a, b);
#else
	return a / b;
#endif
}

QFN float nan_f() { return as_float(0x7fc00000u); }

// ldq8 reads 8 levels of X16 (16-byte aligned).
QFN uint4 ldq8(const int16_t* p) { return ldx<uint4>(p); }

// ilpos is where the level of element r (r < 256) of a 256-element block
// of x goes in the interleaved X16/X8 of the direct GEMV (quantx16i,
// quantx8i), L levels to a 16-byte load (8 for int16, 16 for int8). Lane m
// (m < 8) of a block's 8 lanes takes the weights 64g+16h+i and 64g+32+16h+i
// (g = m/2, h = m%2, i < 16): the low and high nibbles of its 16 level
// bytes. Its 32 levels, in that order, go in 32/L pieces of L; piece j of
// every lane of the block is one run of 8 pieces, so that one 16-byte load
// of each of a block's 8 lanes reads 128 contiguous bytes.
template <int L>
QFN int ilpos(int r) {
	const int g = r >> 6, hi = (r >> 5) & 1, h = (r >> 4) & 1;
	const int m = 2 * g + h, t = 16 * hi + (r & 15);
	return (t / L) * 8 * L + m * L + t % L;
}

// quantx_warp rounds blocks of x (32 elements each, rows back to back)
// into levels of type T, one warp a block, blocks c.block*c.nwarps + c.warp
// and on by the launch's warps: int16_t gives X16 (above), int8_t X8, the
// same with the scale max|x|/127 and levels |q| <= 127 (the activations of
// the direct GEMV's dp4a kernels, quantd.cuh). Lane l reads element l (one
// coalesced load a block), the largest magnitude and the sums come from
// warp reductions (S::max, S::sum: the sums of up to 16 levels are
// integers below 2^24, exact in float in any order), lane l writes level
// l (at ilpos for IL), lane 0 the scale and the sums. x needs only 4-byte
// alignment.
#pragma nv_exec_check_disable
template <class S, typename T, bool IL = false>
QFN void quantx_warp(const Ctx& c, T* __restrict__ q, float* __restrict__ d, int* __restrict__ s, const float* __restrict__ x,
		     long long n) {
	const float lmax = sizeof(T) == 1 ? 127.0f : 32767.0f;
	const long long stride = (long long)c.nblocks * c.nwarps;
	for (long long i = (long long)c.block * c.nwarps + c.warp; i < n; i += stride) {
		const float v = x[32 * i + c.lane];
		const float a = fabsf(v);
		const float amax = S::max(a);
		// 1 where some lane holds a NaN or an infinity.
		const float bad = S::max(a <= 3.402823466e38f ? 0.0f : 1.0f);
		const float inv = amax > 0.0f && bad == 0.0f ? fdiv_rn(lmax, amax) : 0.0f;
		const int l = inv != 0.0f ? rint_i(fmul_rn(v, inv)) : 0;  // 0 for a NaN lane, not a conversion of NaN
		// IL: the levels of each 256 elements interleaved (ilpos) for the
		// direct GEMV; n is then a multiple of 8.
		const long long e = 32 * i + c.lane;
		q[IL ? (e & ~255LL) + ilpos<16 / sizeof(T)>((int)(e & 255)) : e] = (T)l;
		const float s0 = S::sum(c.lane < 16 ? (float)l : 0.0f), s1 = S::sum(c.lane < 16 ? 0.0f : (float)l);
		if (c.lane == 0) {
			d[i] = bad == 0.0f ? fdiv_rn(amax, lmax) : nan_f();
			s[2 * i] = (int)s0;
			s[2 * i + 1] = (int)s1;
		}
	}
}

#pragma nv_exec_check_disable
template <class S>
QFN void quantx16_warp(const Ctx& c, int16_t* __restrict__ q, float* __restrict__ d, int* __restrict__ s, const float* __restrict__ x,
		       long long n) {
	quantx_warp<S, int16_t>(c, q, d, s, x, n);
}

// XQ is the X16 of up to MM rows of x for one launch; the rows from M on
// read row M-1 (their sums are computed and dropped).
struct XQ {
	const int16_t* q;
	const float* d;
	const int* s;
	int K, M;
};

// Element indices e within a row are ints (K < 2^31) and never negative,
// so that e/32 is a shift; the row offsets are 64-bit.
QFN long long xrow(const XQ& x, int m) { return (long long)(m < x.M ? m : x.M - 1); }
// xq8 returns the levels of elements e..e+7 (e a multiple of 8) of row m.
QFN uint4 xq8(const XQ& x, int m, int e) { return ldq8(x.q + xrow(x, m) * x.K + e); }
// xd returns the scale of the block at element e (a multiple of 32).
QFN float xd(const XQ& x, int m, int e) { return x.d[xrow(x, m) * (x.K >> 5) + (e >> 5)]; }
// xs returns the sum of the levels of elements e..e+15 (e a multiple of 16).
QFN int xs(const XQ& x, int m, int e) { return x.s[xrow(x, m) * (x.K >> 4) + (e >> 4)]; }

template <int MM, int R>
QFN void izero(int (&s)[R][MM]) {
#pragma unroll
	for (int r = 0; r < R; r++)
#pragma unroll
		for (int m = 0; m < MM; m++) s[r][m] = 0;
}

// Each format's integer unit (a lane's work, as F::dot in quant.cuh):
// idot<MM,R>(acc, bp, j, x, e) adds unit j of the R blocks at bp[r] (in
// shared memory) times rows m < MM of x (e: the block's first element) to
// acc[r][m]. The levels go into bytes: nibbles (and fifth or sixth bits)
// masked into place (unsigned; 4-bit high nibbles left in place, 16 times
// their level), Q8_0's signed bytes as they are; the formats' offsets (q-8,
// q-16, q-32) and minimums multiply the sums of x.

struct IQ8_0 {
	typedef FmtQ8_0 F;
	static constexpr int ROWS1 = 4;
	template <int MM, int R>
	static QFN void idot(float (&acc)[R][MM], const uint8_t* const (&bp)[R], int, const XQ& x, int e) {
		int s[R][MM];
		izero(s);
		Words qw[R];
#pragma unroll
		for (int r = 0; r < R; r++) qw[r] = words_at(bp[r] + 2);
#pragma unroll
		for (int c = 0; c < 4; c++) {
			uint32_t w0[R], w1[R];
#pragma unroll
			for (int r = 0; r < R; r++) {
				w0[r] = word(qw[r], 2 * c);
				w1[r] = word(qw[r], 2 * c + 1);
			}
#pragma unroll
			for (int m = 0; m < MM; m++) {
				const uint4 xv = xq8(x, m, e + 8 * c);
#pragma unroll
				for (int r = 0; r < R; r++) s[r][m] = dot8(s[r][m], xv, w0[r], w1[r]);
			}
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const float dw = half_to_f32(sh_u16(bp[r]));
#pragma unroll
			for (int m = 0; m < MM; m++) acc[r][m] += dw * xd(x, m, e) * (float)s[r][m];
		}
	}
};

// The 32-element nibble formats (FmtNib32): byte j holds element j (low
// nibble) and j+16 (high).
template <int BB_, int QS, int QH, bool HAS_MIN, bool HAS_HIGH>
struct INib32 {
	typedef FmtNib32<BB_, QS, QH, HAS_MIN, HAS_HIGH> F;
	static constexpr int ROWS1 = 4;
	template <int MM, int R>
	static QFN void idot(float (&acc)[R][MM], const uint8_t* const (&bp)[R], int, const XQ& x, int e) {
		int s[R][MM], sh[R][MM];  // the low and the high nibbles' sums
		izero(s);
		izero(sh);
		uint32_t qh[R];
		Words qw[R];
#pragma unroll
		for (int r = 0; r < R; r++) {
			qh[r] = HAS_HIGH ? sh_word(bp[r] + QH) : 0u;
			qw[r] = words_at(bp[r] + QS);
		}
#pragma unroll
		for (int c = 0; c < 2; c++) {  // words 2c, 2c+1: elements 8c..8c+7 and 16+8c..16+8c+7
			uint32_t l0[R], l1[R], h0[R], h1[R];
#pragma unroll
			for (int r = 0; r < R; r++) {
				const uint32_t q0 = word(qw[r], 2 * c), q1 = word(qw[r], 2 * c + 1);
				l0[r] = q0 & 0x0F0F0F0Fu;
				l1[r] = q1 & 0x0F0F0F0Fu;
				// Without fifth bits the high nibbles stay in place, 16 times
				// their level (sh below); with them they move down.
				h0[r] = HAS_HIGH ? (q0 >> 4) & 0x0F0F0F0Fu : q0 & 0xF0F0F0F0u;
				h1[r] = HAS_HIGH ? (q1 >> 4) & 0x0F0F0F0Fu : q1 & 0xF0F0F0F0u;
				if (HAS_HIGH) {
					l0[r] |= spread4(qh[r] >> (8 * c)) << 4;
					l1[r] |= spread4(qh[r] >> (8 * c + 4)) << 4;
					h0[r] |= spread4(qh[r] >> (16 + 8 * c)) << 4;
					h1[r] |= spread4(qh[r] >> (20 + 8 * c)) << 4;
				}
			}
#pragma unroll
			for (int m = 0; m < MM; m++) {
				const uint4 xl = xq8(x, m, e + 8 * c), xh = xq8(x, m, e + 16 + 8 * c);
#pragma unroll
				for (int r = 0; r < R; r++) {
					s[r][m] = dot8u(s[r][m], xl, l0[r], l1[r]);
					sh[r][m] = dot8u(sh[r][m], xh, h0[r], h1[r]);
				}
			}
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const float dw = half_to_f32(sh_u16(bp[r]));
			const float mw = HAS_MIN ? half_to_f32(sh_u16(bp[r] + 2)) : 0.0f;
#pragma unroll
			for (int m = 0; m < MM; m++) {
				// The sum of the levels times x: the high nibbles' at most
				// 16*15*16*32767 < 2^27 without fifth bits.
				const int sv = HAS_HIGH ? s[r][m] + sh[r][m] : s[r][m] + (sh[r][m] >> 4);
				const int sx = xs(x, m, e) + xs(x, m, e + 16);
				const float dx = xd(x, m, e);
				if (HAS_MIN)
					acc[r][m] += dx * (dw * (float)sv + mw * (float)sx);
				else
					acc[r][m] += dx * dw * (float)(sv - (HAS_HIGH ? 16 : 8) * sx);
			}
		}
	}
};
typedef INib32<18, 2, 0, false, false> IQ4_0;
typedef INib32<20, 4, 0, true, false> IQ4_1;
typedef INib32<22, 6, 2, false, true> IQ5_0;
typedef INib32<24, 8, 4, true, true> IQ5_1;

// Q4_K and Q5_K (FmtK45): unit g is group g, elements 64g..64g+63, read
// with 16-byte loads (16-byte aligned blocks); sub-block 2g (the low
// nibbles) and 2g+1 (the high ones) are one block of x each.
template <bool FIVE>
struct IK45 {
	typedef FmtK45<FIVE> F;
	static constexpr int ROWS1 = 4;
	template <int MM, int R>
	static QFN void idot(float (&acc)[R][MM], const uint8_t* const (&bp)[R], int g, const XQ& x, int e) {
		int s1[R][MM], s2[R][MM];
		izero(s1);
		izero(s2);
		const int eg = e + 64 * g;
#pragma unroll 1
		for (int part = 0; part < 2; part++) {  // bytes 16part..16part+15 of the group
			uint32_t lo[R][4], hi[R][4];
#pragma unroll
			for (int r = 0; r < R; r++) {
				const uint4 q4 = ld128(bp[r] + F::QS + 32 * g + 16 * part);
				const uint4 h4 = FIVE ? ld128(bp[r] + 16 + 16 * part) : make_uint4(0, 0, 0, 0);
				const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w}, hw[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
				for (int c = 0; c < 4; c++) {
					// Q4_K's high nibbles stay in place, 16 times their level.
					lo[r][c] = q[c] & 0x0F0F0F0Fu;
					hi[r][c] = FIVE ? (q[c] >> 4) & 0x0F0F0F0Fu : q[c] & 0xF0F0F0F0u;
					if (FIVE) {
						// qh bytes shifted by 2g: bit 8k is the fifth bit of
						// byte k's low nibble, bit 8k+1 of its high one.
						const uint32_t h = hw[c] >> (2 * g);
						lo[r][c] |= (h << 4) & 0x10101010u;
						hi[r][c] |= (h << 3) & 0x10101010u;
					}
				}
			}
#pragma unroll
			for (int m = 0; m < MM; m++)
#pragma unroll
				for (int cc = 0; cc < 2; cc++) {
					const uint4 xl = xq8(x, m, eg + 16 * part + 8 * cc), xh = xq8(x, m, eg + 32 + 16 * part + 8 * cc);
#pragma unroll
					for (int r = 0; r < R; r++) {
						s1[r][m] = dot8u(s1[r][m], xl, lo[r][2 * cc], lo[r][2 * cc + 1]);
						s2[r][m] = dot8u(s2[r][m], xh, hi[r][2 * cc], hi[r][2 * cc + 1]);
					}
				}
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const uint4 hd = ld128(bp[r]);  // d, dmin, then the 12 scale bytes
			const float d = half_to_f32(hd.x & 0xffffu), dmin = half_to_f32(hd.x >> 16);
			const uint32_t sh = (16 * g) & 31;
			const uint32_t a0 = hd.y >> sh, a1 = hd.z >> sh, a2 = hd.w >> sh;
			const uint32_t sc = g < 2 ? a0 & 0x3F3Fu : (a2 & 0x0F0Fu) | ((a0 >> 2) & 0x3030u);
			const uint32_t mn = g < 2 ? a1 & 0x3F3Fu : ((a2 >> 4) & 0x0F0Fu) | ((a1 >> 2) & 0x3030u);
			const int sc1 = (int)(sc & 0xffu), sc2 = (int)(sc >> 8), mn1 = (int)(mn & 0xffu), mn2 = (int)(mn >> 8);
#pragma unroll
			for (int m = 0; m < MM; m++) {
				// Scales and minimums in int32: a sub-block's sum is at most
				// 32*31*32767 < 2^25, times a 6-bit scale < 2^31; the sums of
				// x at most 32*32767, times a 6-bit minimum.
				const int v1 = s1[r][m] * sc1, v2 = (FIVE ? s2[r][m] : s2[r][m] >> 4) * sc2;
				const int x1 = (xs(x, m, eg) + xs(x, m, eg + 16)) * mn1, x2 = (xs(x, m, eg + 32) + xs(x, m, eg + 48)) * mn2;
				acc[r][m] += xd(x, m, eg) * (d * (float)v1 - dmin * (float)x1);
				acc[r][m] += xd(x, m, eg + 32) * (d * (float)v2 - dmin * (float)x2);
			}
		}
	}
};
typedef IK45<false> IQ4_K;
typedef IK45<true> IQ5_K;

// Q6_K (FmtQ6_K): unit j = 2h+kk is the 32 bytes ql[64h+32kk..]: elements
// 128h+32kk+l (low nibbles, qh bits 2kk) and 128h+64+32kk+l (high, qh
// bits 2kk+4), a scale each 16; levels q-32 by the sums of x.
struct IQ6_K {
	typedef FmtQ6_K F;
	static constexpr int ROWS1 = 2;
	template <int MM, int R>
	static QFN void idot(float (&acc)[R][MM], const uint8_t* const (&bp)[R], int j, const XQ& x, int e) {
		const int h = j >> 1, kk = j & 1;
		const int el = e + 128 * h + 32 * kk, eh = el + 64;
		Words qw[R], hw[R];
#pragma unroll
		for (int r = 0; r < R; r++) {
			qw[r] = words_at(bp[r] + 64 * h + 32 * kk);
			hw[r] = words_at(bp[r] + 128 + 32 * h);
			// The shift by 2kk joins the funnel shift (at most 24 + 2): the
			// bits it brings in from the next byte are masked off below.
			hw[r].sh += 2 * kk;
		}
		constexpr int HF_UNROLL = MM <= 2 ? 2 : 1;  // the 8-row kernel spills when unrolled
#pragma unroll HF_UNROLL
		for (int hf = 0; hf < 2; hf++) {  // l < 16, then l >= 16: one scale each
			int sl[R][MM], shh[R][MM];
			izero(sl);
			izero(shh);
#pragma unroll
			for (int cc = 0; cc < 2; cc++) {
				uint32_t lo[R][2], hi[R][2];
#pragma unroll
				for (int r = 0; r < R; r++)
#pragma unroll
					for (int i = 0; i < 2; i++) {
						const int c = 2 * cc + i;
						const uint32_t q = word(qw[r], c);
						// qh bytes shifted by 2kk: the low nibbles' top bits at
						// 8k..8k+1, the high nibbles' at 8k+4..8k+5.
						const uint32_t t = word(hw[r], c);
						lo[r][i] = (q & 0x0F0F0F0Fu) | ((t << 4) & 0x30303030u);
						hi[r][i] = ((q >> 4) & 0x0F0F0F0Fu) | (t & 0x30303030u);
					}
#pragma unroll
				for (int m = 0; m < MM; m++) {
					const uint4 xl = xq8(x, m, el + 16 * hf + 8 * cc), xh = xq8(x, m, eh + 16 * hf + 8 * cc);
#pragma unroll
					for (int r = 0; r < R; r++) {
						sl[r][m] = dot8(sl[r][m], xl, lo[r][0], lo[r][1]);
						shh[r][m] = dot8(shh[r][m], xh, hi[r][0], hi[r][1]);
					}
				}
			}
#pragma unroll
			for (int r = 0; r < R; r++) {
				const float d = half_to_f32(sh_u16(bp[r] + 208));
				const uint8_t* sc = bp[r] + 192 + 8 * h + 2 * kk + hf;
				const float dl = fmul_rn(d, (float)(int8_t)sc[0]), dh = fmul_rn(d, (float)(int8_t)sc[4]);
#pragma unroll
				for (int m = 0; m < MM; m++) {
					acc[r][m] += xd(x, m, el) * dl * (float)(sl[r][m] - 32 * xs(x, m, el + 16 * hf));
					acc[r][m] += xd(x, m, eh) * dh * (float)(shh[r][m] - 32 * xs(x, m, eh + 16 * hf));
				}
				qw[r].a += 4;
				hw[r].a += 4;
			}
		}
	}
};

// Staged is a piece of R rows on its way to shared memory (stage in
// quant.cuh, split in two): stage_issue issues the 16-byte loads of the
// rows whose granules lie wholly inside the tensor into v; stage_commit
// stores them, and reads the other rows byte by byte. Between the two the
// warp computes on the previous piece, so a warp always has a piece in
// flight. Both work out where each row's granules are from the same
// arguments (stage_rows), so that only the loaded granules stay in
// registers meanwhile.
template <class F, int R>
struct Staged {
	uint4 v[R][Geo<F, R>::T];
};

// stage_row returns the first granule of row r of the piece at src and how
// many granules cover it (0 for rows past nvalid), and whether they all lie
// inside [lo, hi).
QFN const uint8_t* stage_row(const uint8_t* src, long long stride, int len, int nvalid, const uint8_t* lo, const uint8_t* hi, int r,
			     int& ng, bool& fast) {
	const uint8_t* s = src + r * stride;
	const int off = (int)((uintptr_t)s & 15);
	ng = r < nvalid ? (off + len + 15) >> 4 : 0;
	const uint8_t* a = s - off;
	fast = ng > 0 && a >= lo && a + 16 * ng <= hi;
	return a;
}

template <class F, int R>
QFN void stage_issue(Staged<F, R>& st, const uint8_t* src, long long stride, int len, int nvalid, const uint8_t* lo,
		     const uint8_t* hi, int lane) {
	typedef Geo<F, R> Gm;
#pragma unroll
	for (int r = 0; r < R; r++) {
		int ng;
		bool fast;
		const uint8_t* a = stage_row(src, stride, len, nvalid, lo, hi, r, ng, fast);
		if (fast) {
			// Lanes past the last granule load it again (a request the lane
			// that needs it makes too), so that every v is defined.
#pragma unroll
			for (int t = 0; t < Gm::T; t++) st.v[r][t] = ldg16(a + 16 * min(lane + 32 * t, ng - 1));
		}
	}
}

// stage_commit writes the piece stage_issue loaded (same arguments) to sm:
// row r's granules from sm + r*REG, so that its first byte lands at its
// address modulo 16.
template <class F, int R>
QFN void stage_commit(const Staged<F, R>& st, uint8_t* sm, const uint8_t* src, long long stride, int len, int nvalid, const uint8_t* lo,
		      const uint8_t* hi, int lane) {
	typedef Geo<F, R> Gm;
#pragma unroll
	for (int r = 0; r < R; r++) {
		int ng;
		bool fast;
		const uint8_t* a = stage_row(src, stride, len, nvalid, lo, hi, r, ng, fast);
		if (fast) {
#pragma unroll
			for (int t = 0; t < Gm::T; t++) {
				const int g = lane + 32 * t;
				if (g < ng) st16(sm + r * Gm::REG + 16 * g, st.v[r][t]);
			}
		} else {
#pragma unroll 1
			for (int g = lane; g < ng; g += 32)
#pragma unroll 1
				for (int k = 0; k < 16; k++) {
					const uint8_t* p = a + 16 * g + k;
					sm[r * Gm::REG + 16 * g + k] = p >= lo && p < hi ? ldg8(p) : 0;
				}
		}
	}
}

// gemvx_block: out[m*N + n] = sum_k x[m*K + k] * w(n, k) for the rows m <
// x.M (at most MM) of x, from their X16 levels. The work is laid out as
// gemv_block's (quant.cuh): R rows of w a block at a time (grid-stride over
// the row groups), the warps taking the pieces of those rows in turn, each
// lane one unit of each row, the warps' sums added in warp order (so the
// result does not depend on the grid). Each warp issues the loads of its
// next piece, of this group or the block's next one, before it computes on
// the current one.
#pragma nv_exec_check_disable
template <class I, int MM, int R, class S>
QFN void gemvx_block(const Ctx& c, uint8_t* stage_mem, float* red, float* __restrict__ out, const XQ& x,
		     const uint8_t* __restrict__ w, int N) {
	typedef typename I::F F;
	typedef Geo<F, R> Gm;
	const int K = x.K;
	uint8_t* sm = stage_mem + c.warp * Gm::BYTES;
	const int nb = K / F::QK, pieces = (nb + F::PB - 1) / F::PB;
	const long long rowBytes = (long long)nb * F::BB;
	const uint8_t* lo = w;
	const uint8_t* hi = w + (long long)N * rowBytes;
	const int groups = (N + R - 1) / R;
	Staged<F, R> st;
	auto issue = [&](int grp, int p) {
		const long long n0 = (long long)grp * R;
		const int b0 = p * F::PB, cnt = min(F::PB, nb - b0);
		stage_issue<F, R>(st, w + n0 * rowBytes + (long long)b0 * F::BB, rowBytes, cnt * F::BB, (int)min((long long)R, N - n0), lo, hi,
				  c.lane);
	};
	if (c.block < groups && c.warp < pieces) issue(c.block, c.warp);
	for (int grp = c.block; grp < groups; grp += c.nblocks) {
		const long long n0 = (long long)grp * R;
		const int nvalid = (int)min((long long)R, N - n0);
		float acc[R][MM];
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int m = 0; m < MM; m++) acc[r][m] = 0.0f;
		for (int p = c.warp; p < pieces; p += c.nwarps) {
			const int b0 = p * F::PB, cnt = min(F::PB, nb - b0);
			int off[R];
			stage_commit<F, R>(st, sm, w + n0 * rowBytes + (long long)b0 * F::BB, rowBytes, cnt * F::BB, nvalid, lo, hi, c.lane);
#pragma unroll
			for (int r = 0; r < R; r++) off[r] = (int)((uintptr_t)(w + (n0 + r) * rowBytes + (long long)b0 * F::BB) & 15);
			S::warp();
			if (p + c.nwarps < pieces)
				issue(grp, p + c.nwarps);
			else if (grp + c.nblocks < groups)
				issue(grp + c.nblocks, c.warp);
			for (int u = c.lane; u < cnt * F::UPB; u += 32) {
				const int blk = u / F::UPB, j = u % F::UPB;
				const uint8_t* bp[R];
#pragma unroll
				for (int r = 0; r < R; r++) bp[r] = sm + r * Gm::REG + off[r] + blk * F::BB;
				I::template idot<MM, R>(acc, bp, j, x, (b0 + blk) * F::QK);
			}
			S::warp();
		}
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int m = 0; m < MM; m++) {
				const float s = S::sum(acc[r][m]);
				if (c.lane == 0) red[(c.warp * R + r) * MM + m] = s;
			}
		S::block();
		const int t = c.warp * 32 + c.lane;
		if (t < R * MM) {
			const int r = t / MM, m = t % MM;
			float s = 0.0f;
			for (int i = 0; i < c.nwarps; i++) s += red[(i * R + r) * MM + m];
			if (r < nvalid && m < x.M) out[(long long)m * N + n0 + r] = s;
		}
		S::block();  // red is rewritten by the next group
	}
}

template <class I, int MM, int R = QXROWS(I, MM)>
__device__ __forceinline__ void gemvx_q(float* out, const int16_t* xq, const float* xdp, const int* xsp, const uint8_t* w, int N, int K, int M) {
	__shared__ __align__(16) uint8_t stage_mem[QWARPS * Geo<typename I::F, R>::BYTES];
	__shared__ float red[QWARPS * R * MM];
	XQ x;
	x.q = xq;
	x.d = xdp;
	x.s = xsp;
	x.K = K;
	x.M = M;
	gemvx_block<I, MM, R, DevSync>(dev_ctx(), stage_mem, red, out, x, w, N);
}

// gemvx_<f>_m<MM>(out, xq, xd, xs, w, N, K, M): M (1..MM) rows of x. Launch
// with at most QWARPS warps a block. MINB blocks of QWARPS warps an SM bound
// the registers: 4 for every format (128 registers, 16 warps an SM; the
// piece in flight takes up to 48 of them), which MatMul's grid assumes
// (quantSMWarps in quantfmt.go).
#define QUANT_GEMVX1(I, NAME, MM, MINB)                                                                                                               \
	extern "C" __global__ void __launch_bounds__(32 * QWARPS, MINB)                                                                               \
	    gemvx_##NAME##_m##MM(float* out, const int16_t* xq, const float* xd, const int* xs, const uint8_t* w, int N, int K, int M) { \
		gemvx_q<I, MM>(out, xq, xd, xs, w, N, K, M);                                                                                  \
	}
// gemvx_<f>.cu has the kernels for 1 and 2 rows, gemvxb_<f>.cu those for
// 4 and 8 (batched decode), to keep each PTX file small.
#define QUANT_GEMVX(I, NAME, MINB)     \
	QUANT_GEMVX1(I, NAME, 1, MINB) \
	QUANT_GEMVX1(I, NAME, 2, MINB)
// gemvx_<f>_m1w: the kernel for one row of x with 8 blocks of QWARPS
// warps an SM (64 registers, no spills), twice the warps of gemvx_<f>_m1,
// and R (2, Q6_K 1: quantFormat.xrowsWide) rows of w a block instead of I::ROWS1 for
// the registers; for the formats without direct kernels (quantd.cuh),
// where MatMul runs it if Backend.qgemvWide says so (BenchmarkQuantGEMV
// compares the two).
#define QUANT_GEMVX_WIDE(I, NAME, R)                                                                                                    \
	extern "C" __global__ void __launch_bounds__(32 * QWARPS, 8)                                                                    \
	    gemvx_##NAME##_m1w(float* out, const int16_t* xq, const float* xd, const int* xs, const uint8_t* w, int N, int K, int M) { \
		gemvx_q<I, 1, R>(out, xq, xd, xs, w, N, K, M);                                                                          \
	}
#define QUANT_GEMVX_BATCH(I, NAME, MINB) \
	QUANT_GEMVX1(I, NAME, 4, MINB)   \
	QUANT_GEMVX1(I, NAME, 8, MINB)
