// genptx-arch: compute_80
//
// The prefill kernels of flash_attention.cuh for a Q8_B8 cache (F16 multiplies).
#include "flash_attention.cuh"

FLASH_ENTRY(q8_b8, q8_b8, 64, false)
FLASH_ENTRY(q8_b8, q8_b8, 128, false)
