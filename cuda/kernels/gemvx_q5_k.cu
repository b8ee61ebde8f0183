// Integer GEMV kernels for Q5_K weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ5_K, q5_k, 4)
