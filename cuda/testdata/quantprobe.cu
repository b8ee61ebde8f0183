// quantprobe compiles one lane's unit of each quantized GEMV (the F32-x
// dot of quant.cuh and the integer idot of quantx.cuh) into a kernel of its
// own, for quantsass_test.go to count the instructions per weight in the
// SASS. The blocks are read from shared memory at lane-dependent offsets,
// as in the GEMV; one row of x; the rows of w the kernels take (4, or
// I::ROWS1).
#include "../kernels/quantx.cuh"

template <int R>
__device__ __forceinline__ void rows(const uint8_t* (&bp)[R], const uint8_t* sm, int j) {
#pragma unroll
	for (int r = 0; r < R; r++) bp[r] = sm + r * 2048 + 16 * (j & 7);
}

template <class I, int R>
__device__ __forceinline__ void unit_x16(float* out, const XQ& x, int j, int e) {
	__shared__ __align__(16) uint8_t sm[4 * 2048];
	const uint8_t* bp[R];
	rows(bp, sm, threadIdx.x);
	float acc[R][1];
#pragma unroll
	for (int r = 0; r < R; r++) acc[r][0] = 0.0f;
	I::template idot<1, R>(acc, bp, j, x, e);
#pragma unroll
	for (int r = 0; r < R; r++) out[r] = acc[r][0];
}

template <class F, int R>
__device__ __forceinline__ void unit_f32(float* out, const float* x, int j, int K) {
	__shared__ __align__(16) uint8_t sm[4 * 2048];
	const uint8_t* bp[R];
	rows(bp, sm, threadIdx.x);
	float acc[R][1];
#pragma unroll
	for (int r = 0; r < R; r++) acc[r][0] = 0.0f;
	F::template dot<1, R>(acc, bp, j, x, K);
#pragma unroll
	for (int r = 0; r < R; r++) out[r] = acc[r][0];
}

// x16_<f>_<R>_<QK of a unit> and f32_<f>_<R>_<QK of a unit>: the unit's
// weights are R times the second number.
#define PROBE(I, F, NAME, UQ)                                                                                                           \
	extern "C" __global__ void x16_##NAME##_r##UQ(float* out, XQ x, int j, int e) { unit_x16<I, I::ROWS1>(out, x, threadIdx.x & 3, e); } \
	extern "C" __global__ void f32_##NAME##_r##UQ(float* out, const float* x, int j, int K) { unit_f32<F, 4>(out, x, threadIdx.x & 3, K); }

PROBE(IQ8_0, FmtQ8_0, q8_0, 32)
PROBE(IQ4_0, FmtQ4_0, q4_0, 32)
PROBE(IQ4_1, FmtQ4_1, q4_1, 32)
PROBE(IQ5_0, FmtQ5_0, q5_0, 32)
PROBE(IQ5_1, FmtQ5_1, q5_1, 32)
PROBE(IQ4_K, FmtQ4_K, q4_k, 64)
PROBE(IQ5_K, FmtQ5_K, q5_k, 64)
PROBE(IQ6_K, FmtQ6_K, q6_k, 64)
