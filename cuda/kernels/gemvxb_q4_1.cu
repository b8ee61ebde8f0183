// Integer GEMV kernels for Q4_1 weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ4_1, q4_1, 4)
