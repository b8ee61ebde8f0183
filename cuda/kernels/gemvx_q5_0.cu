// Integer GEMV kernels for Q5_0 weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ5_0, q5_0, 4)
QUANT_GEMVX_WIDE(IQ5_0, q5_0, 2)
