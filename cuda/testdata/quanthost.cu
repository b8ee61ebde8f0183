// quanthost runs the bodies of the quantized-weight kernels
// (kernels/quant.cuh) on the CPU, for quanthost_test.go: one host thread per
// GPU thread of a block, blocks one after another, with barriers for
// __syncwarp and __syncthreads and a shared array for the warp sum. The
// device-only instructions have host versions in quant.cuh that compute
// the same bits and report what would fault or be misaligned on the GPU.
//
// It reads requests from stdin and writes one response per request to
// stdout, all little-endian:
//
//   request:  int32 op (0 end, 1 gemv, 2 dequant to F32, 3 dequant to F16,
//             4 integer gemv: quantx16, then gemvx; 5 direct gemv:
//             quantx16 interleaved, then gemvd; 6 direct gemv on X8:
//             quantx8 interleaved, then gemvd8, for the formats with
//             direct kernels; 7 integer gemv
//             of one row with the rows of w a block of gemvx_<f>_m1w),
//             int32 format (the order of formats below), int32 nblocks,
//             int32 nwarps, int32 woff (the weights' byte offset from a
//             256-byte boundary), int32 N, int32 K, then
//     gemv:    int32 M, the N rows of w, M*K float32 x (both gemvs); the
//              direct gemvs have int32 R and U (the variant) after M
//     dequant: int32 rows, int32 r0, int32 nids, nids int32 ids (none: the
//              rows r0..r0+rows-1), the N rows of w
//   response: int64 violations, then M*N float32 (gemv), rows*K float32
//             (dequant to F32) or rows*K uint16 halves (to F16); the
//             integer gemv adds x's X16: M*K int16 levels, M*K/32 float32
//             scales, M*K/16 int32 sums (the direct gemvs: the same, M = 1,
//             the levels interleaved, int8 for X8)
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <thread>
#include <type_traits>
#include <vector>

#include "../kernels/quantd.cuh"

static std::atomic<long long> violations;
void qhost_violation() { violations++; }
const uint8_t *qhost_lo, *qhost_hi;

#define HOSTRT_NAME "quanthost"
#include "hostrt.h"

struct Block {
	Barrier all;
	std::vector<Barrier*> warps;
	float slots[QWARPS][32];
	explicit Block(int nwarps) : all(32 * nwarps) {
		for (int i = 0; i < nwarps; i++) warps.push_back(new Barrier(32));
	}
	~Block() {
		for (Barrier* b : warps) delete b;
	}
};

static thread_local Block* tblock;
static thread_local int twarp, tlane;

struct HostSync {
	static void warp() { tblock->warps[twarp]->wait(); }
	static void block() { tblock->all.wait(); }
	static float sum(float v) {
		tblock->slots[twarp][tlane] = v;
		warp();
		float s = 0.0f;
		for (int i = 0; i < 32; i++) s += tblock->slots[twarp][i];
		warp();
		return s;
	}
	// max as the device's shuffles: fmaxf, which drops a NaN.
	static float max(float v) {
		tblock->slots[twarp][tlane] = v;
		warp();
		float m = tblock->slots[twarp][0];
		for (int i = 1; i < 32; i++) m = fmaxf(m, tblock->slots[twarp][i]);
		warp();
		return m;
	}
};

// launch runs body(ctx, shared) for every thread of nblocks blocks of
// nwarps warps; shared is the block's shared memory, filled with garbage.
template <class Body>
static void launch(int nblocks, int nwarps, size_t shared, Body body) {
	for (int b = 0; b < nblocks; b++) {
		Block blk(nwarps);
		std::vector<uint8_t> mem(shared + 16, 0xCD);  // shared memory starts as garbage
		uint8_t* sm = mem.data() + ((16 - ((uintptr_t)mem.data() & 15)) & 15);
		std::vector<std::thread> ts;
		for (int t = 0; t < 32 * nwarps; t++)
			ts.emplace_back([&, t] {
				tblock = &blk;
				twarp = t / 32;
				tlane = t % 32;
				Ctx c;
				c.lane = tlane;
				c.warp = twarp;
				c.nwarps = nwarps;
				c.block = b;
				c.nblocks = nblocks;
				body(c, sm);
			});
		for (std::thread& t : ts) t.join();
	}
}

static void writen(const void* p, size_t n) {
	if (n && fwrite(p, 1, n, stdout) != n) {
		fprintf(stderr, "quanthost: short write\n");
		exit(2);
	}
}

// aligned returns n bytes at a 256-byte boundary plus off inside buf, with
// the bytes around them poisoned.
static uint8_t* aligned(std::vector<uint8_t>& buf, size_t n, int off) {
	buf.assign(n + off + 512, 0xA5);
	uint8_t* p = buf.data() + ((256 - ((uintptr_t)buf.data() & 255)) & 255);
	return p + off;
}

template <class F>
static void gemv(int nblocks, int nwarps, int woff, int N, int K) {
	const int M = read32();
	const long long wbytes = (long long)N * (K / F::QK) * F::BB;
	std::vector<uint8_t> wbuf, xbuf, obuf;
	uint8_t* w = aligned(wbuf, wbytes, woff);
	readn(w, wbytes);
	float* x = (float*)aligned(xbuf, (size_t)M * K * 4, 0);
	readn(x, (size_t)M * K * 4);
	float* out = (float*)aligned(obuf, (size_t)M * N * 4, 0);
	qhost_lo = w;
	qhost_hi = w + wbytes;
	violations = 0;
	constexpr size_t stage = QWARPS * Geo<F, 4>::BYTES; // enough for QROWS(1) and QROWS(2)
	auto run = [&](auto mtag) {
		constexpr int MM = decltype(mtag)::value;
		launch(nblocks, nwarps, stage + QWARPS * 4 * 4, [&](const Ctx& c, uint8_t* sm) {
			gemv_block<F, MM, QROWS(MM), HostSync>(c, sm, (float*)(sm + stage), out, x, w, N, K);
		});
	};
	switch (M) {
	case 1:
		run(std::integral_constant<int, 1>());
		break;
	case 2:
		run(std::integral_constant<int, 2>());
		break;
	default:
		fprintf(stderr, "quanthost: M = %d\n", M);
		exit(2);
	}
	const long long v = violations;
	writen(&v, 8);
	writen(out, (size_t)M * N * 4);
}

// gemvx runs the integer GEMV of M rows of x (1 to 8) with the kernel of
// the fewest rows that holds them, as MatMul does: quantx16 (on a grid of
// 2 blocks of nwarps warps, so that warps loop), then the GEMV.
// WideRows is the R of gemvx_<f>_m1w (QUANT_GEMVX_WIDE in gemvx_<f>.cu).
template <class I>
struct WideRows {
	static constexpr int R = 2;
};
template <>
struct WideRows<IQ6_K> {
	static constexpr int R = 1;
};

// gemvx with wide set runs one row of x as gemvx_<f>_m1w does (op 7).
template <class I>
static void gemvx(int nblocks, int nwarps, int woff, int N, int K, bool wide = false) {
	typedef typename I::F F;
	const int M = read32();
	if (M < 1 || M > 8) {
		fprintf(stderr, "quanthost: M = %d\n", M);
		exit(2);
	}
	const long long wbytes = (long long)N * (K / F::QK) * F::BB;
	std::vector<uint8_t> wbuf, xbuf, qbuf, dbuf, sbuf, obuf;
	uint8_t* w = aligned(wbuf, wbytes, woff);
	readn(w, wbytes);
	float* x = (float*)aligned(xbuf, (size_t)M * K * 4, 0);
	readn(x, (size_t)M * K * 4);
	int16_t* q = (int16_t*)aligned(qbuf, (size_t)M * K * 2, 0);
	float* d = (float*)aligned(dbuf, (size_t)M * K / 32 * 4, 0);
	int* s = (int*)aligned(sbuf, (size_t)M * K / 16 * 4, 0);
	float* out = (float*)aligned(obuf, (size_t)M * N * 4, 0);
	launch(2, nwarps, 0, [&](const Ctx& c, uint8_t*) { quantx16_warp<HostSync>(c, q, d, s, x, (long long)M * K / 32); });
	qhost_lo = w;
	qhost_hi = w + wbytes;
	violations = 0;
	XQ xq;
	xq.q = q;
	xq.d = d;
	xq.s = s;
	xq.K = K;
	xq.M = M;
	constexpr size_t stage = QWARPS * Geo<F, 4>::BYTES;  // enough for every QXROWS
	auto run = [&](auto mtag) {
		constexpr int MM = decltype(mtag)::value;
		launch(nblocks, nwarps, stage + QWARPS * 8 * 4, [&](const Ctx& c, uint8_t* sm) {
			gemvx_block<I, MM, QXROWS(I, MM), HostSync>(c, sm, (float*)(sm + stage), out, xq, w, N);
		});
	};
	if (M == 1 && wide)
		launch(nblocks, nwarps, stage + QWARPS * 8 * 4, [&](const Ctx& c, uint8_t* sm) {
			gemvx_block<I, 1, WideRows<I>::R, HostSync>(c, sm, (float*)(sm + stage), out, xq, w, N);
		});
	else if (M == 1)
		run(std::integral_constant<int, 1>());
	else if (M == 2)
		run(std::integral_constant<int, 2>());
	else if (M <= 4)
		run(std::integral_constant<int, 4>());
	else
		run(std::integral_constant<int, 8>());
	const long long v = violations;
	writen(&v, 8);
	writen(out, (size_t)M * N * 4);
	writen(q, (size_t)M * K * 2);
	writen(d, (size_t)M * K / 32 * 4);
	writen(s, (size_t)M * K / 16 * 4);
}

// Direct is the direct GEMV's format (quantd.cuh) of an integer one, or
// void where it has none.
template <class I>
struct Direct {
	typedef void D;
};
template <>
struct Direct<IQ4_K> {
	typedef DQ4_K D;
};
template <>
struct Direct<IQ5_K> {
	typedef DQ5_K D;
};

// gemvd runs the direct GEMV of one row of x with levels T, as MatMul
// does: quantx_warp (on a grid of 2 blocks of nwarps warps), then
// gemvd_rows on nblocks blocks of nwarps warps, the N rows of w split
// into three matrices.
template <class D, typename T>
static void gemvd(int nblocks, int nwarps, int woff, int N, int K) {
	const int M = read32(), R = read32(), U = read32();
	if (M != 1) {
		fprintf(stderr, "quanthost: direct gemv of M = %d\n", M);
		exit(2);
	}
	const long long wbytes = (long long)N * (K / D::QK) * D::BB;
	std::vector<uint8_t> wbuf, xbuf, qbuf, dbuf, sbuf, obuf;
	uint8_t* w = aligned(wbuf, wbytes, woff);
	readn(w, wbytes);
	float* x = (float*)aligned(xbuf, (size_t)K * 4, 0);
	readn(x, (size_t)K * 4);
	T* q = (T*)aligned(qbuf, (size_t)K * sizeof(T), 0);
	float* d = (float*)aligned(dbuf, (size_t)K / 32 * 4, 0);
	int* s = (int*)aligned(sbuf, (size_t)K / 16 * 4, 0);
	float* out = (float*)aligned(obuf, (size_t)N * 4, 0);
	launch(2, nwarps, 0, [&](const Ctx& c, uint8_t*) { quantx_warp<HostSync, T, true>(c, q, d, s, x, (long long)K / 32); });
	qhost_lo = w;
	qhost_hi = w + wbytes;
	violations = 0;
	XD<T> xd;
	xd.q = q;
	xd.d = d;
	xd.s = s;
	// The rows as three matrices (the last two empty for N < 3), as
	// MatMulMany launches q, k and v.
	DW dw;
	const long long rowBytes = (long long)(K / D::QK) * D::BB;
	dw.n[0] = N / 3;
	dw.n[1] = N / 4;
	dw.n[2] = N - dw.n[0] - dw.n[1];
	dw.w[0] = w;
	dw.out[0] = out;
	for (int i = 1; i < 3; i++) {
		dw.w[i] = dw.w[i - 1] + dw.n[i - 1] * rowBytes;
		dw.out[i] = dw.out[i - 1] + dw.n[i - 1];
	}
	// The variants of QUANT_GEMVD (quantd.cuh).
	auto run = [&](auto rt, auto ut) {
		constexpr int RR = decltype(rt)::value, UU = decltype(ut)::value;
		launch(nblocks, nwarps, 0, [&](const Ctx& c, uint8_t*) { gemvd_rows<D, T, RR, UU, HostSync>(c, dw, xd, K); });
	};
	using I1 = std::integral_constant<int, 1>;
	using I2 = std::integral_constant<int, 2>;
	using I4 = std::integral_constant<int, 4>;
	if (R == 1 && U == 2)
		run(I1(), I2());
	else if (R == 2 && U == 1)
		run(I2(), I1());
	else if (R == 2 && U == 2)
		run(I2(), I2());
	else if (R == 4 && U == 1)
		run(I4(), I1());
	else if (R == 1 && U == 4)
		run(I1(), I4());
	else {
		fprintf(stderr, "quanthost: no direct gemv r%du%d\n", R, U);
		exit(2);
	}
	const long long v = violations;
	writen(&v, 8);
	writen(out, (size_t)N * 4);
	writen(q, (size_t)K * sizeof(T));
	writen(d, (size_t)K / 32 * 4);
	writen(s, (size_t)K / 16 * 4);
}

template <class D, typename T>
struct GemvdOp {
	static void run(int nblocks, int nwarps, int woff, int N, int K) { gemvd<D, T>(nblocks, nwarps, woff, N, K); }
};
template <typename T>
struct GemvdOp<void, T> {
	static void run(int, int, int, int, int) {
		fprintf(stderr, "quanthost: no direct gemv for this format\n");
		exit(2);
	}
};

template <class F, typename T>
static void dequant(int nblocks, int nwarps, int woff, int N, int K) {
	const int rows = read32(), r0 = read32(), nids = read32();
	std::vector<int> ids(nids);
	readn(ids.data(), (size_t)nids * 4);
	const long long wbytes = (long long)N * (K / F::QK) * F::BB;
	std::vector<uint8_t> wbuf, obuf;
	uint8_t* w = aligned(wbuf, wbytes, woff);
	readn(w, wbytes);
	T* out = (T*)aligned(obuf, (size_t)rows * K * sizeof(T), 0);
	qhost_lo = w;
	qhost_hi = w + wbytes;
	violations = 0;
	launch(nblocks, nwarps, QWARPS * Geo<F, 1>::BYTES, [&](const Ctx& c, uint8_t* sm) {
		dequant_block<F, T, HostSync>(c, sm, out, w, nids ? ids.data() : nullptr, r0, rows, K, N);
	});
	const long long v = violations;
	writen(&v, 8);
	writen(out, (size_t)rows * K * sizeof(T));
}

template <class I>
static void serve(int op, int nblocks, int nwarps, int woff, int N, int K) {
	typedef typename I::F F;
	switch (op) {
	case 1:
		gemv<F>(nblocks, nwarps, woff, N, K);
		break;
	case 2:
		dequant<F, float>(nblocks, nwarps, woff, N, K);
		break;
	case 3:
		dequant<F, __half>(nblocks, nwarps, woff, N, K);
		break;
	case 4:
		gemvx<I>(nblocks, nwarps, woff, N, K);
		break;
	case 7:
		gemvx<I>(nblocks, nwarps, woff, N, K, true);
		break;
	case 5:
		GemvdOp<typename Direct<I>::D, int16_t>::run(nblocks, nwarps, woff, N, K);
		break;
	case 6:
		GemvdOp<typename Direct<I>::D, int8_t>::run(nblocks, nwarps, woff, N, K);
		break;
	default:
		fprintf(stderr, "quanthost: op %d\n", op);
		exit(2);
	}
}

int main() {
	for (;;) {
		const int op = read32();
		if (op == 0) break;
		const int format = read32(), nblocks = read32(), nwarps = read32(), woff = read32(), N = read32(), K = read32();
		if (nwarps < 1 || nwarps > QWARPS) {
			fprintf(stderr, "quanthost: %d warps\n", nwarps);
			return 2;
		}
		switch (format) {
		case 0:
			serve<IQ8_0>(op, nblocks, nwarps, woff, N, K);
			break;
		case 1:
			serve<IQ4_0>(op, nblocks, nwarps, woff, N, K);
			break;
		case 2:
			serve<IQ4_1>(op, nblocks, nwarps, woff, N, K);
			break;
		case 3:
			serve<IQ5_0>(op, nblocks, nwarps, woff, N, K);
			break;
		case 4:
			serve<IQ5_1>(op, nblocks, nwarps, woff, N, K);
			break;
		case 5:
			serve<IQ4_K>(op, nblocks, nwarps, woff, N, K);
			break;
		case 6:
			serve<IQ5_K>(op, nblocks, nwarps, woff, N, K);
			break;
		case 7:
			serve<IQ6_K>(op, nblocks, nwarps, woff, N, K);
			break;
		default:
			fprintf(stderr, "quanthost: format %d\n", format);
			return 2;
		}
		fflush(stdout);
	}
	return 0;
}
