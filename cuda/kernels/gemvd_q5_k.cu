// Direct integer GEMV kernels for Q5_K weights, one row of x; see quantd.cuh.
#include "quantd.cuh"

QUANT_GEMVD(DQ5_K, q5_k)
