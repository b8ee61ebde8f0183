// Integer GEMV kernels for Q8_0 weights; see quantx.cuh.
#include "quantx.cuh"

QUANT_GEMVX(IQ8_0, q8_0, 4)
QUANT_GEMVX_WIDE(IQ8_0, q8_0, 2)
