// Dequantization kernels for Q4_1 weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ4_1, q4_1)
