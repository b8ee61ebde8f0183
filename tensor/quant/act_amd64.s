//go:build amd64 && !purego

#include "textflag.h"
#include "reduce_amd64.h"

// The activations' quantization for x86-64 with AVX2 (act.go): the same
// bits as the Go loops it stands in for.

DATA absmask<>+0(SB)/4, $0x7fffffff
GLOBL absmask<>(SB), RODATA|NOPTR, $4

DATA magic<>+0(SB)/4, $0x4b400000 // 1.5·2^23 (roundMagic) as float32
GLOBL magic<>(SB), RODATA|NOPTR, $4

// func maxAbsBitsAVX2(x *float32, n int) uint32
// The largest of x[j]'s bits with the sign cleared, n a multiple of 16:
// as integers they order the magnitudes, and a NaN or an infinity is at
// least 0x7f800000.
TEXT ·maxAbsBitsAVX2(SB), NOSPLIT, $0-20
	MOVQ x+0(FP), SI
	MOVQ n+8(FP), CX
	VPBROADCASTD absmask<>(SB), Y15
	VPXOR Y0, Y0, Y0
	VPXOR Y1, Y1, Y1
maxloop:
	VPAND (SI), Y15, Y2
	VPAND 32(SI), Y15, Y3
	VPMAXUD Y2, Y0, Y0
	VPMAXUD Y3, Y1, Y1
	ADDQ $64, SI
	SUBQ $16, CX
	JNZ maxloop
	VPMAXUD Y1, Y0, Y0
	REDUCE8(VPMAXUD, Y0, X0, X1)
	VMOVD X0, AX
	MOVL AX, ret+16(FP)
	VZEROUPPER
	RET

// func roundActAVX2(q *byte, x *float32, n int, id float32)
// q[j] (int16, little-endian) = float32(float32(x[j]·id)+roundMagic) -
// roundMagic for j < n, n a multiple of 16: x[j]·id rounded to an integer,
// ties to even, as roundAct computes it (each product and sum rounded to
// float32, no fused multiply-add); |x[j]·id| <= ActMax packs without
// saturation.
TEXT ·roundActAVX2(SB), NOSPLIT, $0-28
	MOVQ q+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ n+16(FP), CX
	VBROADCASTSS id+24(FP), Y15
	VBROADCASTSS magic<>(SB), Y14
roundloop:
	VMULPS (SI), Y15, Y0
	VMULPS 32(SI), Y15, Y1
	VADDPS Y14, Y0, Y0
	VADDPS Y14, Y1, Y1
	VSUBPS Y14, Y0, Y0
	VSUBPS Y14, Y1, Y1
	VCVTTPS2DQ Y0, Y0
	VCVTTPS2DQ Y1, Y1
	VPACKSSDW Y1, Y0, Y0 // per 128-bit lane: 4 of Y0, 4 of Y1
	VPERMQ $0xd8, Y0, Y0 // back in order
	VMOVDQU Y0, (DI)
	ADDQ $64, SI
	ADDQ $32, DI
	SUBQ $16, CX
	JNZ roundloop
	VZEROUPPER
	RET

DATA ones16<>+0(SB)/2, $1
GLOBL ones16<>(SB), RODATA|NOPTR, $2

// func groupSumsAVX2(q *byte, dst *byte, groups int)
// dst[4j:4j+4] (int32, little-endian) = the sum of the 32 int16 quants of
// group j of q, for j < groups: integer sums, as the Go loop's.
TEXT ·groupSumsAVX2(SB), NOSPLIT, $0-24
	MOVQ q+0(FP), SI
	MOVQ dst+8(FP), DI
	MOVQ groups+16(FP), CX
	VPBROADCASTW ones16<>(SB), Y15
sumloop:
	VPMADDWD (SI), Y15, Y0
	VPMADDWD 32(SI), Y15, Y1
	VPADDD Y1, Y0, Y0
	REDUCE8(VPADDD, Y0, X0, X1)
	VMOVD X0, (DI)
	ADDQ $64, SI
	ADDQ $4, DI
	DECQ CX
	JNZ sumloop
	VZEROUPPER
	RET
