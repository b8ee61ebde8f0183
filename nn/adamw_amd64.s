#include "textflag.h"

// func adamAVX2(w, grad, m, v *float32, n int, c *adamConsts)
// n is a multiple of 8. See adamUpdate for the update.
TEXT ·adamAVX2(SB), NOSPLIT, $0-48
	MOVQ w+0(FP), DI
	MOVQ grad+8(FP), SI
	MOVQ m+16(FP), R8
	MOVQ v+24(FP), R9
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), AX
	VBROADCASTSS 0(AX), Y8   // b1
	VBROADCASTSS 4(AX), Y9   // 1-b1
	VBROADCASTSS 8(AX), Y10  // b2
	VBROADCASTSS 12(AX), Y11 // 1-b2
	VBROADCASTSS 16(AX), Y12 // decay
	VBROADCASTSS 20(AX), Y13 // stepSize
	VBROADCASTSS 24(AX), Y14 // 1/sqrt(bc2)
	VBROADCASTSS 28(AX), Y15 // eps
	XORQ BX, BX
loop:
	CMPQ BX, CX
	JGE done
	VMOVUPS (SI)(BX*4), Y0         // g
	VMULPS (R8)(BX*4), Y8, Y1      // b1·m
	VFMADD231PS Y0, Y9, Y1         // m = b1·m + (1-b1)·g
	VMULPS Y0, Y0, Y2              // g²
	VMULPS (R9)(BX*4), Y10, Y3     // b2·v
	VFMADD231PS Y2, Y11, Y3        // v = b2·v + (1-b2)·g²
	VMOVUPS Y1, (R8)(BX*4)
	VMOVUPS Y3, (R9)(BX*4)
	VSQRTPS Y3, Y4
	VFMADD213PS Y15, Y14, Y4       // sqrt(v)/sqrt(bc2) + eps
	VDIVPS Y4, Y1, Y5              // m / denom
	VMULPS (DI)(BX*4), Y12, Y6     // w·decay
	VFNMADD231PS Y5, Y13, Y6       // - stepSize·m/denom
	VMOVUPS Y6, (DI)(BX*4)
	ADDQ $8, BX
	JMP loop
done:
	VZEROUPPER
	RET
