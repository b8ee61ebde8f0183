// GEMV kernels for Q6_K weights; see quant.cuh.
#include "quant.cuh"

QUANT_GEMV(FmtQ6_K, q6_k)
