// genptx-arch: compute_90
// Candidate decode GEMVs for F16 weights with programmatic dependent
// launch (compute capability 9.0); see gemv_split.cuh.
#include "gemv_split.cuh"

GEMV_SPLIT_PDL_ALL(__half, f16)
