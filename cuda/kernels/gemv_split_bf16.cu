// Candidate decode GEMVs for BF16 weights; see gemv_split.cuh.
#include "gemv_split.cuh"

GEMV_SPLIT_ALL(bf16, bf16)
