// genptx-arch: compute_90
// The split attention and merge for a head dimension of 256 as
// programmatic-dependent-launch twins (step.cuh): attention_split_*_d256_pdl.
#define STEP_PDL
#include "attention_split_d256.cu"
