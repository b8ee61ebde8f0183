// Integer GEMV kernels for Q6_K weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ6_K, q6_k, 4)
QUANT_GEMVX_WIDE(IQ6_K, q6_k, 1)
