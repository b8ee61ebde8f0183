// GEMV kernels for Q4_K weights; see quant.cuh.
#include "quant.cuh"

QUANT_GEMV(FmtQ4_K, q4_k)
