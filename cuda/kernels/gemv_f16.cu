// Matrix-vector kernels for F16 weights; see gemv.cuh.
#include "gemv.cuh"

GEMV_ALL(__half, f16)
