// Integer GEMV kernels for Q4_0 weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ4_0, q4_0, 4)
