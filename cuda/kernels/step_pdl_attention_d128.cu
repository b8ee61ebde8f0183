// genptx-arch: compute_90
// The split attention and merge for a head dimension of 128 as
// programmatic-dependent-launch twins (step.cuh): attention_split_*_d128_pdl.
#define STEP_PDL
#include "attention_split_d128.cu"
