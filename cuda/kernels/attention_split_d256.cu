// The decode kernels of attention_split.cuh for a head dimension of 256.
#include "attention_split.cuh"

SPLIT_ENTRIES(256)
