// hostrt.h is what the host harnesses (attnhost.cpp, gemvhost.cpp,
// quanthost.cu) share: the barrier that stands for __syncthreads and for
// a warp's exchanges, and the reading of requests from stdin. Define
// HOSTRT_NAME (the harness's name in its messages) before including it,
// and HOSTRT_CUDA_AS_CPP for a file compiled as plain C++ (nvcc -x c++),
// which then gets the CUDA language as host C++ too: include it after
// the CUDA headers.
#pragma once

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <condition_variable>
#include <mutex>

#ifdef HOSTRT_CUDA_AS_CPP
// The CUDA language as host C++.
#undef __device__
#undef __global__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static  // one block runs at a time
#define __launch_bounds__(n)

thread_local uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

static inline float __uint_as_float(uint32_t u) {
	float f;
	memcpy(&f, &u, 4);
	return f;
}
static inline uint32_t __float_as_uint(float f) {
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}
static inline int min(int a, int b) { return a < b ? a : b; }
// One block runs at a time: loads, fences and atomics need nothing more.
template <typename T>
static inline T __ldcg(const T* p) {
	return *p;
}
static inline void __threadfence() {}
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline int max(int a, int b) { return a > b ? a : b; }
// The low 32 bits of hi:lo shifted right by s & 31.
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
	return (unsigned)((((uint64_t)hi << 32) | lo) >> (s & 31));
}
// Byte n of the result is byte (s >> 4n) & 7 of the 8 bytes y:x.
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
	const uint64_t v = (uint64_t)y << 32 | x;
	unsigned r = 0;
	for (int n = 0; n < 4; n++) r |= (unsigned)(v >> (8 * ((s >> (4 * n)) & 7)) & 0xff) << (8 * n);
	return r;
}
#endif

struct Barrier {
	std::mutex mu;
	std::condition_variable cv;
	int n, count = 0;
	long gen = 0;
	explicit Barrier(int n) : n(n) {}
	void wait() {
		std::unique_lock<std::mutex> l(mu);
		const long g = gen;
		if (++count == n) {
			count = 0;
			gen++;
			cv.notify_all();
			return;
		}
		cv.wait(l, [&] { return gen != g; });
	}
};

static void readn(void* p, size_t n) {
	if (n && fread(p, 1, n, stdin) != n) {
		fprintf(stderr, HOSTRT_NAME ": short read\n");
		exit(2);
	}
}
static int32_t read32() {
	int32_t v;
	readn(&v, 4);
	return v;
}
