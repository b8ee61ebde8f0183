// GEMV kernels for Q5_K weights; see quant.cuh.
#include "quant.cuh"

QUANT_GEMV(FmtQ5_K, q5_k)
