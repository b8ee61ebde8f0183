// genptx-arch: compute_80
//
// The prefill kernels of flash_attention.cuh for a F32 cache (F16 multiplies).
#include "flash_attention.cuh"

FLASH_ENTRY(f32, float, 64, false)
FLASH_ENTRY(f32, float, 128, false)
