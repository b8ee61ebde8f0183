// Matrix-vector kernels for F32 weights; see gemv.cuh.
#include "gemv.cuh"

GEMV_ALL(float, f32)
