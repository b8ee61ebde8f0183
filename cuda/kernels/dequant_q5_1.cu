// Dequantization kernels for Q5_1 weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ5_1, q5_1)
