// Integer GEMV kernels for Q4_K weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ4_K, q4_k, 4)
