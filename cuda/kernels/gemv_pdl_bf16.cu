// genptx-arch: compute_90
// Candidate decode GEMVs for BF16 weights with programmatic dependent
// launch (compute capability 9.0); see gemv_split.cuh.
#include "gemv_split.cuh"

GEMV_SPLIT_PDL_ALL(bf16, bf16)
