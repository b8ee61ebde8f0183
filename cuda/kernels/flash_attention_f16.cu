// genptx-arch: compute_80
//
// The prefill kernels of flash_attention.cuh for a F16 cache (F16 multiplies).
#include "flash_attention.cuh"

FLASH_ENTRY(f16, __half, 64, false)
FLASH_ENTRY(f16, __half, 128, false)
