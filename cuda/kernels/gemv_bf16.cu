// Matrix-vector kernels for BF16 weights; see gemv.cuh.
#include "gemv.cuh"

GEMV_ALL(bf16, bf16)
