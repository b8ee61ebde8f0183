// genptx-arch: compute_90
// The row kernels of a decode step (fused.cu) as programmatic-dependent-
// launch twins (step.cuh): rmsnorm_*_pdl, add_rmsnorm_*_pdl, rope_kv_*_pdl,
// rope_f32_at_pdl, add_f32_pdl.
#define STEP_PDL
#include "fused.cu"
