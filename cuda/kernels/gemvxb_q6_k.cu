// Integer GEMV kernels for Q6_K weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ6_K, q6_k, 4)
