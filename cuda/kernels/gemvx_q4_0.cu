// Integer GEMV kernels for Q4_0 weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ4_0, q4_0, 4)
QUANT_GEMVX_WIDE(IQ4_0, q4_0, 2)
