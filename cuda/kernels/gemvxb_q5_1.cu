// Integer GEMV kernels for Q5_1 weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ5_1, q5_1, 4)
