// Integer GEMV kernels for Q5_0 weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ5_0, q5_0, 4)
