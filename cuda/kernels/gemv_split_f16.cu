// Candidate decode GEMVs for F16 weights; see gemv_split.cuh.
#include "gemv_split.cuh"

GEMV_SPLIT_ALL(__half, f16)
