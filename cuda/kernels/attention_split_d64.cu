// The decode kernels of attention_split.cuh for a head dimension of 64.
#include "attention_split.cuh"

SPLIT_ENTRIES(64)
