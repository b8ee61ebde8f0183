// The activations of the integer GEMV (quantx.cuh): x rounded to X16, or
// to X8 for the direct dp4a kernels (quantd.cuh).
#include "quantx.cuh"

// quantx16 rounds n blocks of 32 elements of x (rows back to back) into
// the X16 arrays q, d, s; a warp a block, blocks of up to 8 warps.
extern "C" __global__ void __launch_bounds__(256) quantx16(int16_t* q, float* d, int* s, const float* x, long long n) {
	quantx16_warp<DevSync>(dev_ctx(), q, d, s, x, n);
}

// quantx8 rounds n blocks of 32 elements of x into the X8 arrays q, d, s;
// a warp a block, blocks of up to 8 warps.
extern "C" __global__ void __launch_bounds__(256) quantx8(int8_t* q, float* d, int* s, const float* x, long long n) {
	quantx_warp<DevSync, int8_t>(dev_ctx(), q, d, s, x, n);
}

// quantx16i and quantx8i round n blocks of 32 elements of one row of x (n
// a multiple of 8) as quantx16 and quantx8 do, the levels of each 256
// elements interleaved for the direct GEMV (quantd.cuh, ilpos).
extern "C" __global__ void __launch_bounds__(256) quantx16i(int16_t* q, float* d, int* s, const float* x, long long n) {
	quantx_warp<DevSync, int16_t, true>(dev_ctx(), q, d, s, x, n);
}
extern "C" __global__ void __launch_bounds__(256) quantx8i(int8_t* q, float* d, int* s, const float* x, long long n) {
	quantx_warp<DevSync, int8_t, true>(dev_ctx(), q, d, s, x, n);
}
