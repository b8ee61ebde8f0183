// Dequantization kernels for Q4_0 weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ4_0, q4_0)
