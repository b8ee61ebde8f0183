// Dequantization kernels for Q4_K weights; see quant.cuh.
#include "quant.cuh"

QUANT_DEQUANT(FmtQ4_K, q4_k)
