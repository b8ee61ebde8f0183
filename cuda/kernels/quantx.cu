// The activations of the integer GEMV (quantx.cuh): x rounded to X16.
#include "quantx.cuh"

// quantx16 rounds n blocks of 32 elements of x (rows back to back) into
// the X16 arrays q, d, s; one thread a block.
extern "C" __global__ void quantx16(int16_t* q, float* d, int* s, const float* x, long long n) {
	GRID_STRIDE(i, n) quantx16_block(q, d, s, x, i);
}
