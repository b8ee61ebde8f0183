// genptx-arch: compute_80
//
// The prefill kernels of flash_attention.cuh for a BF16 cache (BF16 multiplies).
#include "flash_attention.cuh"

FLASH_ENTRY(bf16, bf16, 64, true)
FLASH_ENTRY(bf16, bf16, 128, true)
