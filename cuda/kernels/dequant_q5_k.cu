// Dequantization kernels for Q5_K weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ5_K, q5_k)
