// Direct integer GEMV kernels for Q4_K weights, one row of x; see quantd.cuh.
#include "quantd.cuh"

QUANT_GEMVD(DQ4_K, q4_k)
