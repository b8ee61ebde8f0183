// The activations of the integer GEMV (quantx.cuh): x rounded to X16.
#include "quantx.cuh"

// quantx16 rounds n blocks of 32 elements of x (rows back to back) into
// the X16 arrays q, d, s; a warp a block, blocks of up to 8 warps.
extern "C" __global__ void __launch_bounds__(256) quantx16(int16_t* q, float* d, int* s, const float* x, long long n) {
	quantx16_warp<DevSync>(dev_ctx(), q, d, s, x, n);
}
