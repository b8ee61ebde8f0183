// Integer GEMV kernels for Q4_1 weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ4_1, q4_1, 4)
QUANT_GEMVX_WIDE(IQ4_1, q4_1, 2)
