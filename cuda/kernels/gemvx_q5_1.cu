// Integer GEMV kernels for Q5_1 weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ5_1, q5_1, 4)
QUANT_GEMVX_WIDE(IQ5_1, q5_1, 2)
