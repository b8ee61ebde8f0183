// Dequantization kernels for Q5_0 weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ5_0, q5_0)
