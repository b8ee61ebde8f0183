// The direct integer GEMV of quantized weights for one row of x (decode):
// no staging in shared memory. A warp takes one row of w at a time; each
// lane reads units of the row straight from global memory with 16-byte
// loads (the units of U blocks in flight at once, their loads issued
// before any is used), multiplies them with the row's rounded x in integer
// (dp2a on X16 levels, or dp4a on X8 levels), applies each sub-block's
// scale and minimum in float, and the warp adds its lanes' sums with one
// shuffle reduction. gemvd_<format>.cu instantiate it:
//
//   gemvd_<f>   out[N] = x[K] . w[N,K]^T from the X16 of x (quantx16):
//               x rounded to 16 bits, the error of quantx.cuh's kernels
//   gemvd8_<f>  the same from the X8 of x (quantx8): x rounded to 8 bits a
//               32 elements as ggml's integer kernels round it; half the
//               x bytes and dot-product instructions of gemvd_<f>, and an
//               error about 256 times X16's (quantx.cuh: 0.4% to 1.7% of a
//               product)
//
// Formats: Q4_K and Q5_K, whose 144- and 176-byte blocks are 16-byte
// multiples, so that a 16-byte aligned w has every block 16-byte aligned.
// The others keep the staged kernels of quantx.cuh.
//
// Why it should be faster than gemvx_<f>_m1 (Nsight Compute on the H200:
// DRAM throughput 27%, 121 registers, achieved occupancy 22%): that kernel
// stages a piece of 4 rows in shared memory, synchronises the warp twice a
// piece and holds 128 registers (16 warps an SM), so an SM has few bytes
// in flight. Here a lane holds its units' raw bytes in registers, at most
// 64 registers a thread (32 warps an SM), and nothing waits but the
// loads: Q4_K's 2 units of 32 level bytes a lane (Q5_K's one of 32 level
// and 32 qh bytes) keep up to 32*32*64 = 64 KiB of weights an SM in
// flight, more than the ~20 KiB an H200 SM needs at full bandwidth.
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

// XD is the rounded x of one product (X16 for T = int16_t, X8 for int8_t):
// the levels, the scale of each 32 and the sum of the levels of each 16.
template <typename T>
struct XD {
	const T* q;
	const float* d;
	const int* s;
};

// ldx16b reads 16 levels of X8 (16-byte aligned; L1-cached).
QFN uint4 ldx16b(const int8_t* p) {
#ifdef __CUDA_ARCH__
	return __ldg(reinterpret_cast<const uint4*>(p));
#else
	if ((uintptr_t)p & 15) qhost_violation();
	uint4 v;
	memcpy(&v, p, 16);
	return v;
#endif
}

// xdot16 adds the 16 levels of x at p (16-byte aligned) times the 16 byte
// levels of w (each below 128, so that they read the same signed and
// unsigned) to s: 8 dp2a on X16, 4 dp4a on X8.
QFN int xdot16(int s, const int16_t* p, const uint32_t (&w)[4]) {
	const uint4 a = ldq8(p), b = ldq8(p + 8);
	return dot8u(dot8u(s, a, w[0], w[1]), b, w[2], w[3]);
}
QFN int xdot16(int s, const int8_t* p, const uint32_t (&w)[4]) {
	const uint4 a = ldx16b(p);
	return dp4a_s(a.w, w[3], dp4a_s(a.z, w[2], dp4a_s(a.y, w[1], dp4a_s(a.x, w[0], s))));
}

// DK45 is Q4_K (FIVE false) and Q5_K for the direct GEMV. A block (256
// elements) has 4 units: unit g is group g's 32 level bytes, elements
// 64g+i (low nibbles, sub-block 2g) and 64g+32+i (high nibbles, sub-block
// 2g+1) for i < 32; Q5_K's fifth bits of them are bits 2g and 2g+1 of the
// 32 qh bytes. A unit reads the block's first 16 bytes (d, dmin and the 12
// scale bytes: the same address for the block's 4 lanes, one request), its
// 32 level bytes and, for Q5_K, the 32 qh bytes, in 16-byte loads; the
// header's decoding and x's scales serve 64 weights.
template <bool FIVE>
struct DK45 {
	static constexpr int QK = 256, BB = FIVE ? 176 : 144, UPB = 4;
	static constexpr int QS = FIVE ? 48 : 16;
	// Units a lane has in flight within 64 registers.
	template <typename T>
	static constexpr __host__ __device__ int units() {
		return FIVE ? 1 : 2;
	}
	struct Raw {
		uint4 hd, q0, q1, h0, h1;
	};
	// Lane is what a lane's unit g fixes: a lane takes the same unit of
	// every block it reads (32 lanes, 4 units a block).
	struct Lane {
		int g, qoff, xoff;
	};
	static QFN Lane lane(int g) {
		Lane l;
		l.g = g;
		l.qoff = QS + 32 * g;
		l.xoff = 64 * g;
		return l;
	}
	static QFN Raw load(const uint8_t* b, const Lane& l) {
		Raw r;
		r.hd = ldg16(b);
		r.q0 = ldg16(b + l.qoff);
		r.q1 = ldg16(b + l.qoff + 16);
		r.h0 = FIVE ? ldg16(b + 16) : make_uint4(0, 0, 0, 0);
		r.h1 = FIVE ? ldg16(b + 32) : make_uint4(0, 0, 0, 0);
		return r;
	}
	// levels puts the 16 low and 16 high levels of the 16 level bytes q
	// (and their fifth bits in h) into bytes of lo and hi.
	static QFN void levels(const uint4& q4, const uint4& h4, int g, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
		const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w}, hw[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
		for (int c = 0; c < 4; c++) {
			lo[c] = q[c] & 0x0F0F0F0Fu;
			hi[c] = (q[c] >> 4) & 0x0F0F0F0Fu;
			if (FIVE) {
				// qh bytes shifted by 2g: bit 8k is the fifth bit of byte k's
				// low nibble, bit 8k+1 of its high one.
				const uint32_t h = hw[c] >> (2 * g);
				lo[c] |= (h << 4) & 0x10101010u;
				hi[c] |= (h << 3) & 0x10101010u;
			}
		}
	}
	// dot returns the lane's unit of the block whose first element is e
	// times x.
	template <typename T>
	static QFN float dot(const Raw& r, const Lane& l, const XD<T>& x, int e) {
		const int g = l.g;
		const int el = e + l.xoff, eh = el + 32;
		uint32_t lo[4], hi[4];
		levels(r.q0, r.h0, g, lo, hi);
		int s1 = xdot16(0, x.q + el, lo), s2 = xdot16(0, x.q + eh, hi);
		levels(r.q1, r.h1, g, lo, hi);
		s1 = xdot16(s1, x.q + el + 16, lo);
		s2 = xdot16(s2, x.q + eh + 16, hi);
		const float d = half_to_f32(r.hd.x & 0xffffu), dmin = half_to_f32(r.hd.x >> 16);
		const uint32_t sh = (16 * g) & 31;
		const uint32_t a0 = r.hd.y >> sh, a1 = r.hd.z >> sh, a2 = r.hd.w >> sh;
		const uint32_t sc = g < 2 ? a0 & 0x3F3Fu : (a2 & 0x0F0Fu) | ((a0 >> 2) & 0x3030u);
		const uint32_t mn = g < 2 ? a1 & 0x3F3Fu : ((a2 >> 4) & 0x0F0Fu) | ((a1 >> 2) & 0x3030u);
		// In int32: 32 levels of at most 31 times |x levels| <= 32767 is
		// below 2^25, times a 6-bit scale below 2^31; a sum of 32 x levels
		// times a 6-bit minimum below 2^27.
		const int v1 = s1 * (int)(sc & 0xffu), v2 = s2 * (int)(sc >> 8);
		const int x1 = (x.s[el >> 4] + x.s[(el >> 4) + 1]) * (int)(mn & 0xffu);
		const int x2 = (x.s[eh >> 4] + x.s[(eh >> 4) + 1]) * (int)(mn >> 8);
		return x.d[el >> 5] * (d * (float)v1 - dmin * (float)x1) + x.d[eh >> 5] * (d * (float)v2 - dmin * (float)x2);
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
// matrices of dw, warp c.block*c.nwarps + c.warp taking rows from there on
// by the launch's warps. Lane l takes units l, l+32, ... of the row, U at a
// time: the U loads first, then the U products, so that they are in
// flight together. A lane adds its units in order and the warp its lanes
// in a fixed tree, so the result does not depend on the grid. The weights
// must be 16-byte aligned.
#pragma nv_exec_check_disable
template <class D, typename T, int U, class S>
QFN void gemvd_rows(const Ctx& c, const DW& dw, const XD<T>& x, int K) {
	const int nb = K / D::QK;
	constexpr int BPW = 32 / D::UPB;  // blocks a warp covers a step
	const typename D::Lane ln = D::lane(c.lane % D::UPB);
	const int b0 = c.lane / D::UPB;
	const long long rowBytes = (long long)nb * D::BB;
	const long long stride = (long long)c.nblocks * c.nwarps;
	const long long rows = (long long)dw.n[0] + dw.n[1] + dw.n[2];
	for (long long row = (long long)c.block * c.nwarps + c.warp; row < rows; row += stride) {
		// Selects rather than an index into dw, which would put it in local
		// memory.
		const bool m0 = row < dw.n[0], m1 = !m0 && row < (long long)dw.n[0] + dw.n[1];
		const long long n = m0 ? row : m1 ? row - dw.n[0] : row - dw.n[0] - dw.n[1];
		const uint8_t* wr = (m0 ? dw.w[0] : m1 ? dw.w[1] : dw.w[2]) + n * rowBytes;
		float* out = m0 ? dw.out[0] : m1 ? dw.out[1] : dw.out[2];
		float acc = 0.0f;
		for (int b = b0; b < nb; b += BPW * U) {
			typename D::Raw raw[U];
#pragma unroll
			for (int i = 0; i < U; i++)
				if (b + BPW * i < nb) raw[i] = D::load(wr + (b + BPW * i) * D::BB, ln);
#pragma unroll
			for (int i = 0; i < U; i++)
				if (b + BPW * i < nb) acc += D::template dot<T>(raw[i], ln, x, (b + BPW * i) * D::QK);
		}
		acc = S::sum(acc);
		if (c.lane == 0) out[n] = acc;
	}
}

// Warps a block of the direct GEMV, and the blocks an SM holds (the launch
// bound: 64 registers a thread). MatMul launches a warp a row of w
// (gemvdWarps in quantfmt.go).
#define QDWARPS 4
#define QDMINB 8

template <class D, typename T>
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
	gemvd_rows<D, T, D::template units<T>(), DevSync>(dev_ctx(), dw, x, K);
}

// gemvd_<f>(o0, o1, o2, xq, xd, xs, w0, w1, w2, n0, n1, n2, K) and
// gemvd8_<f>: one row of x, from its X16 or X8, times up to three
// matrices (DW). Launch with at most QDWARPS warps a block.
#define QUANT_GEMVD1(D, NAME, T)                                                                                                          \
	extern "C" __global__ void __launch_bounds__(32 * QDWARPS, QDMINB)                                                                \
	    NAME(float* o0, float* o1, float* o2, const T* xq, const float* xd, const int* xs, const uint8_t* w0, const uint8_t* w1,      \
		 const uint8_t* w2, int n0, int n1, int n2, int K) {                                                                     \
		gemvd_q<D, T>(o0, o1, o2, xq, xd, xs, w0, w1, w2, n0, n1, n2, K);                                                        \
	}
#define QUANT_GEMVD(D, NAME)                        \
	QUANT_GEMVD1(D, gemvd_##NAME, int16_t) \
	QUANT_GEMVD1(D, gemvd8_##NAME, int8_t)
