// The direct integer GEMV of quantized weights for one row of x (decode):
// no staging in shared memory. A warp takes R rows of w at a time; the 8
// lanes of a block each read one 16-byte chunk of its level bytes (the 8
// chunks are 128 contiguous bytes) and the block's 16-byte header straight
// from global memory, U steps of 4 blocks in flight at once, multiply them
// with x's levels in integer (dp2a on X16 levels, or dp4a on X8 levels),
// apply each sub-block's scale and minimum in float, and the warp adds its
// lanes' sums with one shuffle reduction a row. gemvd_<format>.cu
// instantiate it:
//
//   gemvd_<f>_r<R>u<U>   out[N] = x[K] . w[N,K]^T from the interleaved X16
//                        of x (quantx16i): x rounded to 16 bits, the error
//                        of quantx.cuh's kernels
//   gemvd8_<f>_r<R>u<U>  the same from the interleaved X8 (quantx8i): x
//                        rounded to 8 bits a 32 elements as ggml's integer
//                        kernels round it; half the x bytes and
//                        dot-product instructions, and an error about 256
//                        times X16's (quantx.cuh: 0.4% to 1.7% a product)
//
// Formats: Q4_K and Q5_K, whose 144- and 176-byte blocks are 16-byte
// multiples, so that a 16-byte aligned w has every block 16-byte aligned.
// The others keep the staged kernels of quantx.cuh.
//
// Why the layout (session 5): the first version of this kernel gave each
// lane a 32-byte unit of a different block and read x in its natural
// order, so every 16-byte load of a warp touched 32 different 128-byte
// lines of w or of x: 32 L1 wavefronts an instruction where one or four
// do, about 16 us of L1 time for Q4_K 11008x4096 (it measured 36 us against
// 6 us of DRAM time). Here a block's 8 lanes read 128 contiguous bytes of
// w per load, and x is stored interleaved (ilpos) so that their x loads
// are 128 contiguous bytes too: about 4 wavefronts a load; R rows a warp
// share each x load.
#pragma once

#include "quantx.cuh"

// dp4a_s: c plus the four signed bytes of a times those of b. Native from
// compute capability 6.1.
QFN int dp4a_s(uint32_t a, uint32_t b, int c) {
#ifdef QDP2A
	return __dp4a((int)a, (int)b, c);
#else
	for (int i = 0; i < 4; i++) c += (int)(int8_t)((a >> (8 * i)) & 0xffu) * (int)(int8_t)((b >> (8 * i)) & 0xffu);
	return c;
#endif
}

// dp4a_su: c plus the four signed bytes of a times the four unsigned
// bytes of b (Q4_K's high levels in place, up to 240).
QFN int dp4a_su(uint32_t a, uint32_t b, int c) {
#ifdef QDP2A
	int d;
	asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
	return d;
#else
	for (int i = 0; i < 4; i++) c += (int)(int8_t)((a >> (8 * i)) & 0xffu) * (int)((b >> (8 * i)) & 0xffu);
	return c;
#endif
}

// ldf2 and ldi4 read 2 floats (8-byte aligned) and 4 ints (16-byte
// aligned) of x's scales and sums.
QFN float2 ldf2(const float* p) { return ldx<float2>(p); }
QFN int4 ldi4(const int* p) { return ldx<int4>(p); }

// XD is the rounded x of one product (X16 for T = int16_t, X8 for int8_t):
// the levels, the scale of each 32 and the sum of the levels of each 16.
template <typename T>
struct XD {
	const T* q;
	const float* d;
	const int* s;
};

// ldx16b reads 16 levels of X8 (16-byte aligned).
QFN uint4 ldx16b(const int8_t* p) { return ldx<uint4>(p); }

// XV is one lane's x for one block of a row of w: its 32 levels (ilpos:
// the 16 of its low nibbles, then the 16 of its high ones), the scales of
// its two sub-blocks and the sums of its two halves' levels. The levels
// are 32/L 16-byte loads, each, over a block's 8 lanes, 128 contiguous
// bytes.
template <typename T>
struct XV;
template <>
struct XV<int16_t> {
	uint4 p[4];
	float d0, d1;
	int s0, s1;
	// dot sets s1 to the low levels times lo, s2 to the high ones times hi
	// (unsigned byte levels): 16 dp2a.
	QFN void dot(const uint32_t (&lo)[4], const uint32_t (&hi)[4], int& s1, int& s2) const {
		s1 = dot8u(dot8u(0, p[0], lo[0], lo[1]), p[1], lo[2], lo[3]);
		s2 = dot8u(dot8u(0, p[2], hi[0], hi[1]), p[3], hi[2], hi[3]);
	}
	// load reads the lane's levels from b, its first piece (ilpos).
	QFN void load(const int16_t* b) {
#pragma unroll
		for (int j = 0; j < 4; j++) p[j] = ldq8(b + 64 * j);
	}
};
template <>
struct XV<int8_t> {
	uint4 p[2];
	float d0, d1;
	int s0, s1;
	// dot: 8 dp4a (the bytes of lo and hi unsigned).
	QFN void dot(const uint32_t (&lo)[4], const uint32_t (&hi)[4], int& s1, int& s2) const {
		s1 = dp4a_su(p[0].w, lo[3], dp4a_su(p[0].z, lo[2], dp4a_su(p[0].y, lo[1], dp4a_su(p[0].x, lo[0], 0))));
		s2 = dp4a_su(p[1].w, hi[3], dp4a_su(p[1].z, hi[2], dp4a_su(p[1].y, hi[1], dp4a_su(p[1].x, hi[0], 0))));
	}
	QFN void load(const int8_t* b) {
		p[0] = ldx16b(b);
		p[1] = ldx16b(b + 128);
	}
};

// XP is where lane m's x for a block starts (xv_load): its levels, its
// sub-blocks' scales and its halves' sums.
template <typename T>
struct XP {
	const T* q;
	const float* d;
	const int* s;
	int h;
};

// xp_at is lane m's XP for block blk.
template <typename T>
QFN XP<T> xp_at(const XD<T>& x, int blk, int m) {
	XP<T> p;
	p.q = x.q + 256LL * blk + (16 / sizeof(T)) * m;
	p.d = x.d + 8LL * blk + 2 * (m >> 1);
	p.s = x.s + 16LL * blk + 4 * (m >> 1);
	p.h = m & 1;
	return p;
}

// xv_load reads lane p's x for the block i blocks after p's.
template <typename T>
QFN XV<T> xv_load(const XP<T>& p, int i) {
	XV<T> v;
	v.load(p.q + 256 * i);
	// The lane's sub-blocks are 8blk+2g and 8blk+2g+1 of 32 elements, its
	// halves 16blk+4g+h and 16blk+4g+2+h of 16.
	const float2 d = ldf2(p.d + 8 * i);
	const int4 sm = ldi4(p.s + 16 * i);
	v.d0 = d.x;
	v.d1 = d.y;
	v.s0 = p.h ? sm.y : sm.x;
	v.s1 = p.h ? sm.w : sm.z;
	return v;
}

// DK45 is Q4_K (FIVE false) and Q5_K for the direct GEMV. A block (256
// elements) has 8 chunks of 16 level bytes: chunk m holds the elements
// 64g+16h+i (low nibbles, sub-block 2g) and 64g+32+16h+i (high nibbles,
// sub-block 2g+1) for i < 16, g = m/2, h = m%2; Q5_K's fifth bits of them
// are bits 2g and 2g+1 of qh bytes 16h+i. Lane m of a block's 8 lanes reads
// the block's first 16 bytes (d, dmin and the 12 scale bytes: the same
// address for the 8 lanes), its chunk and, for Q5_K, the 16 qh bytes of
// its half, each one 16-byte load; the 8 lanes' chunks are 128 contiguous
// bytes, and their x (ilpos) too.
template <bool FIVE>
struct DK45 {
	static constexpr int QK = 256, BB = FIVE ? 176 : 144, LPB = 8;
	static constexpr int QS = FIVE ? 48 : 16;
	struct Raw {
		uint4 hd, q, h;
	};
	// Lane is what a lane's chunk m fixes.
	struct Lane {
		int m, g, qoff, hoff;
	};
	static QFN Lane lane(int m) {
		Lane l;
		l.m = m;
		l.g = m >> 1;
		l.qoff = QS + 16 * m;
		l.hoff = 16 + 16 * (m & 1);
		return l;
	}
	static QFN Raw load(const uint8_t* b, const Lane& l) {
		Raw r;
		r.hd = ldg16(b);
		r.q = ldg16(b + l.qoff);
		r.h = FIVE ? ldg16(b + l.hoff) : make_uint4(0, 0, 0, 0);
		return r;
	}
	// levels puts the 16 low and 16 high levels of the 16 level bytes q
	// (and their fifth bits in h) into bytes of lo and hi; Q4_K's high
	// levels stay in place, 16 times their value.
	static QFN void levels(const uint4& q4, const uint4& h4, int g, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
		const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w}, hw[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
		for (int c = 0; c < 4; c++) {
			lo[c] = q[c] & 0x0F0F0F0Fu;
			hi[c] = FIVE ? (q[c] >> 4) & 0x0F0F0F0Fu : q[c] & 0xF0F0F0F0u;
			if (FIVE) {
				// qh bytes shifted by 2g: bit 8k is the fifth bit of byte k's
				// low nibble, bit 8k+1 of its high one.
				const uint32_t h = hw[c] >> (2 * g);
				lo[c] |= (h << 4) & 0x10101010u;
				hi[c] |= (h << 3) & 0x10101010u;
			}
		}
	}
	// dot returns the lane's chunk of block blk of the row times x, whose
	// lane's levels are xv, scales xd (its sub-blocks 2g, 2g+1) and level
	// sums xs (its two halves of 16).
	template <typename T>
	static QFN float dot(const Raw& r, const Lane& l, const XV<T>& xv) {
		const int g = l.g;
		uint32_t lo[4], hi[4];
		levels(r.q, r.h, g, lo, hi);
		int s1, s2;
		xv.dot(lo, hi, s1, s2);
		if (!FIVE) s2 >>= 4;  // exact: Q4_K's s2 is a multiple of 16
		const float d = half_to_f32(r.hd.x & 0xffffu), dmin = half_to_f32(r.hd.x >> 16);
		const uint32_t sh = (16 * g) & 31;
		const uint32_t a0 = r.hd.y >> sh, a1 = r.hd.z >> sh, a2 = r.hd.w >> sh;
		const uint32_t sc = g < 2 ? a0 & 0x3F3Fu : (a2 & 0x0F0Fu) | ((a0 >> 2) & 0x3030u);
		const uint32_t mn = g < 2 ? a1 & 0x3F3Fu : ((a2 >> 4) & 0x0F0Fu) | ((a1 >> 2) & 0x3030u);
		// In int32: 16 levels of at most 31 (Q4_K's in place: 240) times
		// |x levels| <= 32767 is below 2^24 (2^27), and s2 / 16 below 2^24,
		// times a 6-bit scale below 2^30; a sum of 16 x levels times a
		// 6-bit minimum below 2^26.
		const int v1 = s1 * (int)(sc & 0xffu), v2 = s2 * (int)(sc >> 8);
		const int x1 = xv.s0 * (int)(mn & 0xffu), x2 = xv.s1 * (int)(mn >> 8);
		return xv.d0 * (d * (float)v1 - dmin * (float)x1) + xv.d1 * (d * (float)v2 - dmin * (float)x2);
	}
};
typedef DK45<false> DQ4_K;
typedef DK45<true> DQ5_K;

// DW is the weights of one launch: up to three matrices of K columns,
// w[i] with n[i] rows (0 for none) and its output out[i], taken as one
// matrix of n[0]+n[1]+n[2] rows (MatMulMany: q, k and v, or gate and up,
// after one rounding of x).
struct DW {
	const uint8_t* w[3];
	float* out[3];
	int n[3];
};

// gemvd_rows: out_i[n] = sum_k x[k] * w_i(n, k) for the rows of the
// matrices of dw, R rows of one matrix a warp (a matrix's last group may
// be short), warp c.block*c.nwarps + c.warp taking groups from there on by
// the launch's warps. Lanes 8b..8b+7 take block b of a step of 4 blocks
// (lane m = c.lane%8 its chunk m), U steps at a time: the loads of the U
// steps of the R rows first, then the products, so that they are in
// flight together; each lane's x is read once for the R rows. A lane adds
// its blocks in order and the warp its lanes in a fixed tree, so the
// result does not depend on the grid. The weights must be 16-byte
// aligned; x is interleaved (ilpos).
#pragma nv_exec_check_disable
template <class D, typename T, int R, int U, class S>
QFN void gemvd_rows(const Ctx& c, const DW& dw, const XD<T>& x, int K) {
	const int nb = K / D::QK;
	constexpr int BPS = 32 / D::LPB;  // blocks a warp covers a step
	const typename D::Lane ln = D::lane(c.lane % D::LPB);
	const int b0 = c.lane / D::LPB;
	const long long rowBytes = (long long)nb * D::BB;
	const long long stride = (long long)c.nblocks * c.nwarps;
	const long long g0 = (dw.n[0] + R - 1) / R, g1 = (dw.n[1] + R - 1) / R, g2 = (dw.n[2] + R - 1) / R;
	for (long long grp = (long long)c.block * c.nwarps + c.warp; grp < g0 + g1 + g2; grp += stride) {
		// Selects rather than an index into dw, which would put it in local
		// memory.
		const bool m0 = grp < g0, m1 = !m0 && grp < g0 + g1;
		const long long n0 = R * (m0 ? grp : m1 ? grp - g0 : grp - g0 - g1);
		const int nm = m0 ? dw.n[0] : m1 ? dw.n[1] : dw.n[2];
		const int rows = (int)min((long long)R, nm - n0);
		const uint8_t* wr = (m0 ? dw.w[0] : m1 ? dw.w[1] : dw.w[2]) + n0 * rowBytes;
		float* out = (m0 ? dw.out[0] : m1 ? dw.out[1] : dw.out[2]) + n0;
		float acc[R];
		const uint8_t* wb[R];
#pragma unroll
		for (int r = 0; r < R; r++) {
			acc[r] = 0.0f;
			wb[r] = wr + r * rowBytes + (long long)b0 * D::BB;
		}
		XP<T> xp = xp_at<T>(x, b0, ln.m);
		for (int b = b0; b < nb; b += BPS * U) {
			typename D::Raw raw[U][R];
#pragma unroll
			for (int i = 0; i < U; i++) {
				if (b + BPS * i >= nb) continue;
#pragma unroll
				for (int r = 0; r < R; r++)
					if (r < rows) raw[i][r] = D::load(wb[r] + BPS * i * D::BB, ln);
			}
			// x after the weights' loads are in flight: it is read from L1
			// (every warp of the SM reads the same x), and holding U steps of
			// it would cost 20 registers a step.
#pragma unroll
			for (int i = 0; i < U; i++) {
				if (b + BPS * i >= nb) continue;
				const XV<T> xv = xv_load<T>(xp, BPS * i);
#pragma unroll
				for (int r = 0; r < R; r++)
					if (r < rows) acc[r] += D::template dot<T>(raw[i][r], ln, xv);
			}
#pragma unroll
			for (int r = 0; r < R; r++) wb[r] += BPS * U * D::BB;
			xp.q += 256 * BPS * U;
			xp.d += 8 * BPS * U;
			xp.s += 16 * BPS * U;
		}
#pragma unroll
		for (int r = 0; r < R; r++) {
			const float v = S::sum(acc[r]);
			if (c.lane == 0 && r < rows) out[r] = v;
		}
	}
}

// Warps a block of the direct GEMV, and the blocks an SM holds (the launch
// bound: 64 registers a thread at 8, 80 at 6, 96 at 5). MatMul launches a warp a
// group of rows of w (gemvdWarps in quantfmt.go).
#define QDWARPS 4

template <class D, typename T, int R, int U>
__device__ __forceinline__ void gemvd_q(float* o0, float* o1, float* o2, const T* xq, const float* xdp, const int* xsp, const uint8_t* w0,
					const uint8_t* w1, const uint8_t* w2, int n0, int n1, int n2, int K) {
	XD<T> x;
	x.q = xq;
	x.d = xdp;
	x.s = xsp;
	DW dw;
	dw.w[0] = w0;
	dw.w[1] = w1;
	dw.w[2] = w2;
	dw.out[0] = o0;
	dw.out[1] = o1;
	dw.out[2] = o2;
	dw.n[0] = n0;
	dw.n[1] = n1;
	dw.n[2] = n2;
	gemvd_rows<D, T, R, U, DevSync>(dev_ctx(), dw, x, K);
}

// gemvd_<f>_r<R>u<U>(o0, o1, o2, xq, xd, xs, w0, w1, w2, n0, n1, n2, K)
// and gemvd8_<f>_r<R>u<U>: one row of x, from its interleaved X16 or X8
// (quantx16i, quantx8i), times up to three matrices (DW), R rows of w a
// warp, U steps of loads in flight. Launch with at most QDWARPS warps a
// block.
#define QUANT_GEMVD1(D, NAME, T, R, U, MINB)                                                                                          \
	extern "C" __global__ void __launch_bounds__(32 * QDWARPS, MINB)                                                                \
	    NAME##_r##R##u##U(float* o0, float* o1, float* o2, const T* xq, const float* xd, const int* xs, const uint8_t* w0,          \
			      const uint8_t* w1, const uint8_t* w2, int n0, int n1, int n2, int K) {                                  \
		gemvd_q<D, T, R, U>(o0, o1, o2, xq, xd, xs, w0, w1, w2, n0, n1, n2, K);                                                 \
	}
// The variants BenchmarkQuantGEMV compares (quantfmt.go gemvdVariants).
#define QUANT_GEMVD(D, NAME)                         \
	QUANT_GEMVD1(D, gemvd_##NAME, int16_t, 1, 2, 8) \
	QUANT_GEMVD1(D, gemvd_##NAME, int16_t, 2, 1, 8) \
	QUANT_GEMVD1(D, gemvd_##NAME, int16_t, 2, 2, 5) \
	QUANT_GEMVD1(D, gemvd_##NAME, int16_t, 4, 1, 5) \
	QUANT_GEMVD1(D, gemvd_##NAME, int16_t, 1, 4, 5) \
	QUANT_GEMVD1(D, gemvd8_##NAME, int8_t, 2, 2, 5)
