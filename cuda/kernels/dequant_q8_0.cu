// Dequantization kernels for Q8_0 weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ8_0, q8_0)
