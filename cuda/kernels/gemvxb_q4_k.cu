// Integer GEMV kernels for Q4_K weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ4_K, q4_k, 4)
