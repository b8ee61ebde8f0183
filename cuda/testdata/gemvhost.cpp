// gemvhost runs the bodies of the candidate decode GEMVs
// (kernels/gemv_split.cuh) on the CPU, for gemvhost_test.go: compiled as
// plain C++ (nvcc -x c++), one host thread per GPU thread of a block, the
// blocks of a launch one after another, so that a function's static
// arrays serve as the block's shared memory; barriers stand for
// __syncthreads and for the lanes of a warp exchanging values
// (__shfl_xor_sync). gemvhost_check counts every weight load outside the
// weights or not 16-byte aligned, and every x load outside x.
//
// Requests on stdin, responses on stdout, all little-endian:
//   request:  int32 op (0 end, 1 gemv_split over three matrices, 2
//             gemv_gate_up_split, 3 and 4 the same normed (GEMV_NORM), 5
//             gemv_split adding to its outputs (GEMV_ACC)), int32 dtype (1
//             F16, 2 BF16), int32 R, U, S, n0, n1, n2, K, then the rows of
//             the matrices laid end to end (ops 2 and 4: n0 rows of the
//             gate, then n0 of up), then K float32 x; ops 3 and 4 then K
//             norm weights of the dtype and a float32 eps, op 5 the
//             outputs' n0+n1+n2 float32 values before the launch
//   response: int64 violations, then n0+n1+n2 float32 out (ops 2 and 4:
//             n0), the outputs poisoned with NaN before the launch (op 5:
//             set as given), and an element past each written with a
//             sentinel that must stay
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <atomic>
#include <thread>
#include <vector>

#define HOSTRT_NAME "gemvhost"
#define HOSTRT_CUDA_AS_CPP
#include "hostrt.h"

// cuda_fp16.h declares this one for the device only outside nvcc's CUDA
// mode (newer ones for the host too): the harness's goes by another name,
// and the kernels' calls are renamed to it.
static inline float2 host_half22float2(__half2 h) {
	__half lo, hi;
	memcpy(&lo, &h, 2);
	memcpy(&hi, (const char*)&h + 2, 2);
	return make_float2(__half2float(lo), __half2float(hi));
}
#define __half22float2 host_half22float2

static const uint8_t *wlo, *whi, *xlo, *xhi;
static std::atomic<long long> violations;
void gemvhost_check(const void* p, int n) {
	const uint8_t* b = (const uint8_t*)p;
	if (b < wlo || b + n > whi || (uintptr_t)b % 16 != 0) violations++;
}
template <typename T>
static inline T __ldg(const T* p) {
	const uint8_t* b = (const uint8_t*)p;
	if (b < xlo || b + sizeof(T) > xhi || (uintptr_t)b % sizeof(T) != 0) violations++;
	return *p;
}
template <typename T>
static inline T __ldca(const T* p) {
	return __ldg(p);
}
static inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }

struct Warp {
	Barrier bar{32};
	float f[32];
};

struct Block {
	Barrier all;
	std::vector<Warp*> warps;
	explicit Block(int nthreads) : all(nthreads) {
		for (int i = 0; i < nthreads / 32; i++) warps.push_back(new Warp);
	}
	~Block() {
		for (Warp* w : warps) delete w;
	}
};
static thread_local Block* tblock;

static inline void __syncthreads() { tblock->all.wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
	Warp* w = tblock->warps[threadIdx.x / 32];
	const int lane = threadIdx.x & 31;
	w->f[lane] = v;
	w->bar.wait();
	const float r = w->f[lane ^ o];
	w->bar.wait();
	return r;
}

#include "../kernels/gemv_split.cuh"

// launch runs kernel() for every thread of grid blocks of threads, a block
// at a time.
template <class K>
static void launch(unsigned grid, int threads, K kernel) {
	gridDim = dim3(grid, 1, 1);
	blockDim = dim3(threads, 1, 1);
	for (unsigned x = 0; x < grid; x++) {
		Block blk(threads);
		std::vector<std::thread> ts;
		for (int t = 0; t < threads; t++)
			ts.emplace_back([&, t] {
				tblock = &blk;
				threadIdx = make_uint3(t, 0, 0);
				blockIdx = make_uint3(x, 0, 0);
				kernel();
			});
		for (std::thread& t : ts) t.join();
	}
}


// The grids ops.go and fused.go launch (gemvVariant.grid, gateUpGrid).
static unsigned grid_of(int rows, int per) { return (unsigned)((rows + per - 1) / per); }

// normed_grid is a normed kernel's grid of units blocks cut to 3, so that
// blocks take several units, as they do on the device (normfused.go
// launches as many blocks as it holds at once).
static unsigned normed_grid(unsigned units) { return units < 3 ? units : 3; }

template <typename W>
static bool run(int op, int R, int U, int S, int n0, int n1, int n2, int K, const W* w, const float* x, float* out, const W* g, float eps) {
	const int rows = n0 + n1 + n2;
	const W* w1 = w + (long long)n0 * K;
	const W* w2 = w1 + (long long)n1 * K;
	float *o1 = out + n0 + 1, *o2 = o1 + n1 + 1;  // a sentinel after each
	const int T = GEMV_SPLIT_THREADS;
#define SPLIT(RR, UU, SS)                                                                                                     \
	if (op == 1 && R == RR && U == UU && S == SS) {                                                                       \
		launch(grid_of(rows, T / 32 / SS * RR), T, [&] { gemv_split<W, RR, UU, SS>(out, o1, o2, x, w, w1, w2, n0, n1, n2, K); }); \
		return true;                                                                                                  \
	}
#define GATE_UP(UU, SS)                                                                                                   \
	if (op == 2 && U == UU && S == SS) {                                                                                  \
		launch(grid_of(n0, T / 32 / SS), T, [&] { gemv_gate_up_split<W, UU, SS>(out, x, w, w1, n0, K); });          \
		return true;                                                                                              \
	}
#define SPLIT_MODE(RR, UU, SS)                                                                                                 \
	if (op == 3 && R == RR && U == UU && S == SS) {                                                                        \
		launch(normed_grid(grid_of(rows, T / 32 / SS * RR)), T,                                                        \
		       [&] { gemv_split<W, RR, UU, SS, false, GEMV_NORM>(out, o1, o2, x, w, w1, w2, n0, n1, n2, K, g, eps); });     \
		return true;                                                                                                   \
	}                                                                                                                      \
	if (op == 5 && R == RR && U == UU && S == SS) {                                                                        \
		launch(grid_of(rows, T / 32 / SS * RR), T,                                                                     \
		       [&] { gemv_split<W, RR, UU, SS, false, GEMV_ACC>(out, o1, o2, x, w, w1, w2, n0, n1, n2, K); });              \
		return true;                                                                                                   \
	}
#define GATE_UP_NORM(UU, SS)                                                                                                   \
	if (op == 4 && U == UU && S == SS) {                                                                                   \
		launch(normed_grid(grid_of(n0, T / 32 / SS)), T, [&] { gemv_gate_up_split<W, UU, SS, false, true>(out, x, w, w1, n0, K, g, eps); }); \
		return true;                                                                                                   \
	}
	SPLIT_MODE(1, 8, 1)
	SPLIT_MODE(1, 8, 2)
	SPLIT_MODE(1, 4, 4)
	GATE_UP_NORM(4, 1)
	GATE_UP_NORM(4, 2)
	GATE_UP_NORM(2, 4)
	SPLIT(1, 8, 1)
	SPLIT(1, 16, 1)
	SPLIT(2, 8, 1)
	SPLIT(1, 8, 2)
	SPLIT(1, 4, 4)
	GATE_UP(4, 1)
	GATE_UP(8, 1)
	GATE_UP(4, 2)
	GATE_UP(2, 4)
	return false;
}

int main() {
	const float sentinel = 1234.5f;
	for (;;) {
		const int op = read32();
		if (op == 0) return 0;
		const int dt = read32(), R = read32(), U = read32(), S = read32(), n0 = read32(), n1 = read32(), n2 = read32(), K = read32();
		const bool gateUp = op == 2 || op == 4, many = !gateUp;
		const long long wrows = gateUp ? 2LL * n0 : (long long)n0 + n1 + n2;
		const size_t wbytes = (size_t)wrows * K * 2;
		std::vector<uint8_t> wbuf(wbytes + 512), xbuf(4 * (size_t)K + 512), gbuf(2 * (size_t)K + 512);
		uint8_t* wp = wbuf.data() + ((256 - ((uintptr_t)wbuf.data() & 255)) & 255);
		uint8_t* xp = xbuf.data() + ((256 - ((uintptr_t)xbuf.data() & 255)) & 255);
		uint8_t* gp = gbuf.data() + ((256 - ((uintptr_t)gbuf.data() & 255)) & 255);
		readn(wp, wbytes);
		readn(xp, 4 * (size_t)K);
		float eps = 0.0f;
		if (op == 3 || op == 4) {
			readn(gp, 2 * (size_t)K);
			readn(&eps, 4);
		}
		wlo = wp, whi = wp + wbytes, xlo = xp, xhi = xp + 4 * (size_t)K;
		const int outs = gateUp ? n0 : n0 + n1 + n2;
		std::vector<float> out(outs + 3, NAN);
		if (op == 5) {
			readn(out.data(), 4 * (size_t)n0);
			readn(out.data() + n0 + 1, 4 * (size_t)n1);
			readn(out.data() + n0 + n1 + 2, 4 * (size_t)n2);
		}
		out[n0] = sentinel;
		if (many) out[n0 + 1 + n1] = sentinel, out[n0 + n1 + n2 + 2] = sentinel;
		violations = 0;
		bool ok = dt == 1 ? run(op, R, U, S, n0, n1, n2, K, (const __half*)wp, (const float*)xp, out.data(), (const __half*)gp, eps)
				  : run(op, R, U, S, n0, n1, n2, K, (const bf16*)wp, (const float*)xp, out.data(), (const bf16*)gp, eps);
		if (!ok) {
			fprintf(stderr, "gemvhost: no kernel for op %d r%d u%d s%d\n", op, R, U, S);
			exit(2);
		}
		long long v = violations;
		if (out[n0] != sentinel) v++;
		if (many && (out[n0 + 1 + n1] != sentinel || out[n0 + n1 + n2 + 2] != sentinel)) v++;
		std::vector<float> res;
		res.insert(res.end(), out.begin(), out.begin() + n0);
		if (many) {
			res.insert(res.end(), out.begin() + n0 + 1, out.begin() + n0 + 1 + n1);
			res.insert(res.end(), out.begin() + n0 + n1 + 2, out.begin() + n0 + n1 + 2 + n2);
		}
		fwrite(&v, 8, 1, stdout);
		fwrite(res.data(), 4, res.size(), stdout);
		fflush(stdout);
	}
}
