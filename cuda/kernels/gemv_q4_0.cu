// GEMV kernels for Q4_0 weights; see quant.cuh.
#include "quant.cuh"

QUANT_GEMV(FmtQ4_0, q4_0)
