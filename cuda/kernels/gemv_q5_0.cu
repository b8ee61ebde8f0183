// GEMV kernels for Q5_0 weights; see quant.cuh.
#include "quant.cuh"

QUANT_GEMV(FmtQ5_0, q5_0)
