// Integer GEMV kernels for Q5_K weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ5_K, q5_k, 4)
