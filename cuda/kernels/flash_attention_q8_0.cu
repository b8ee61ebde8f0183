// genptx-arch: compute_80
//
// The prefill kernels of flash_attention.cuh for a Q8_0 cache (F16 multiplies).
#include "flash_attention.cuh"

FLASH_ENTRY(q8_0, q8_0, 64, false)
FLASH_ENTRY(q8_0, q8_0, 128, false)
