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
//             gemv_gate_up_split), int32 dtype (1 F16, 2 BF16), int32 R,
//             U, S, n0, n1, n2, K, then the rows of the matrices laid end
//             to end (op 2: n0 rows of the gate, then n0 of up), then K
//             float32 x
//   response: int64 violations, then n0+n1+n2 float32 out (op 2: n0),
//             the outputs poisoned with NaN before the launch, and an
//             element past each written with a sentinel that must stay
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

template <typename W>
static bool run(int op, int R, int U, int S, int n0, int n1, int n2, int K, const W* w, const float* x, float* out) {
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
		const long long wrows = op == 2 ? 2LL * n0 : (long long)n0 + n1 + n2;
		const size_t wbytes = (size_t)wrows * K * 2;
		std::vector<uint8_t> wbuf(wbytes + 512), xbuf(4 * (size_t)K + 512);
		uint8_t* wp = wbuf.data() + ((256 - ((uintptr_t)wbuf.data() & 255)) & 255);
		uint8_t* xp = xbuf.data() + ((256 - ((uintptr_t)xbuf.data() & 255)) & 255);
		readn(wp, wbytes);
		readn(xp, 4 * (size_t)K);
		wlo = wp, whi = wp + wbytes, xlo = xp, xhi = xp + 4 * (size_t)K;
		const int outs = op == 2 ? n0 : n0 + n1 + n2;
		std::vector<float> out(outs + 3, NAN);
		out[n0] = sentinel;
		if (op == 1) out[n0 + 1 + n1] = sentinel, out[n0 + n1 + n2 + 2] = sentinel;
		violations = 0;
		bool ok = dt == 1 ? run(op, R, U, S, n0, n1, n2, K, (const __half*)wp, (const float*)xp, out.data())
				  : run(op, R, U, S, n0, n1, n2, K, (const bf16*)wp, (const float*)xp, out.data());
		if (!ok) {
			fprintf(stderr, "gemvhost: no kernel for op %d r%d u%d s%d\n", op, R, U, S);
			exit(2);
		}
		long long v = violations;
		if (out[n0] != sentinel) v++;
		if (op == 1 && (out[n0 + 1 + n1] != sentinel || out[n0 + n1 + n2 + 2] != sentinel)) v++;
		std::vector<float> res;
		res.insert(res.end(), out.begin(), out.begin() + n0);
		if (op == 1) {
			res.insert(res.end(), out.begin() + n0 + 1, out.begin() + n0 + 1 + n1);
			res.insert(res.end(), out.begin() + n0 + n1 + 2, out.begin() + n0 + n1 + 2 + n2);
		}
		fwrite(&v, 8, 1, stdout);
		fwrite(res.data(), 4, res.size(), stdout);
		fflush(stdout);
	}
}
