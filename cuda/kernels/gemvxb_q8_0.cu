// Integer GEMV kernels for Q8_0 weights, 4 and 8 rows of x; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX_BATCH(IQ8_0, q8_0, 4)
