// GEMV kernels for Q4_1 weights; see quant.cuh.
#include "quant.cuh"

QUANT_GEMV(FmtQ4_1, q4_1)
