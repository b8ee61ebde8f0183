//go:build amd64 && !purego

#include "textflag.h"

// The integer products for x86-64, in the order the package documentation
// defines (doc.go, "The integer product"): AVX2 with F16C, and the same
// with AVX512_VNNI's fused integer multiply-adds on 256-bit registers.
// Each gemv function computes rows products of nb blocks: out[r] for the
// weight rows laid one after the other from w, with the activation blocks
// at x. The rows are taken one at a time: a single sequential stream of
// weights is what the hardware prefetchers follow best (four rows
// interleaved, sharing the activation loads, ran 1.25x faster from the L2
// cache but at 0.55x the speed from memory; two rows at 0.45x). The Go
// wrappers in vecdot_amd64.go check the lengths.
//
// The integer lanes come from VPMADDUBSW, which multiplies unsigned bytes
// by signed bytes and adds adjacent pairs into 16-bit words, then
// VPMADDWD, which multiplies words (by 1, or by the sub-block scale) and
// adds adjacent pairs into 32-bit lanes: lane k of a 32-byte register
// holds bytes 4k..4k+3, as the lanes are defined. Neither saturates: the
// unsigned operands are levels of at most 63 (pairs within ±2·63·128), or
// |w| <= 128 against activation quants with w's sign (the sign trick,
// VPABSB and VPSIGNB: pairs between -2·128·128 = -32768 and 2·128·127).
//
// The VNNI kernels replace VPMADDUBSW and VPMADDWD by ones with VPDPBUSD
// (Q8_0), and VPMADDWD by the scales and the VPADDD that accumulates with
// VPDPWSSD (the K formats): the lanes hold the same exact integers, so
// the results are the AVX2 kernels'. On Zen 4 (which runs 512-bit
// operations in two halves) these kernels are 3% to 7% faster than AVX2,
// while versions on 512-bit registers (two Q8_0 blocks or two Q4_K
// sub-blocks a register) were 22% and 8% slower than AVX2.
// Each function's body is a macro of the multiply-add it uses.
//
// Floats: VCVTDQ2PS (exact, every lane is below 2^24 in magnitude, or
// rounded as Go's conversion rounds), VMULPS by the block's scale
// broadcast, VADDPS into the accumulator; never an FMA, so that each
// product is rounded as the Go code rounds it. HSUM reduces the
// accumulator as hsum8 does.

// HSUM leaves ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) of the accumulator y
// (x its low half) in the low lane of x; t is scratch.
#define HSUM(y, x, t) \
	VEXTRACTF128 $1, y, t; \
	VADDPS t, x, x; \
	VMOVHLPS x, x, t; \
	VADDPS t, x, x; \
	VMOVSHDUP x, t; \
	VADDSS t, x, x

// BROADCAST32 sets all 32-bit lanes of y (x its low half) to the constant c.
#define BROADCAST32(c, x, y) \
	MOVL c, AX; \
	VMOVD AX, x; \
	VPBROADCASTD x, y

// SCALES32 leaves in Y5 eight copies of the F16 weight scale at wp times
// the F16 activation scale at xp.
#define SCALES32(wp, xp) \
	VPBROADCASTW xp, X6; \
	VCVTPH2PS X6, Y6; \
	VPBROADCASTW wp, X5; \
	VCVTPH2PS X5, Y5; \
	VMULPS Y6, Y5, Y5

// ADDLANES converts the integer lanes in t, multiplies them by Y5 and adds
// them to Y0.
#define ADDLANES(t) \
	VCVTDQ2PS t, t; \
	VMULPS Y5, t, t; \
	VADDPS t, Y0, Y0

// DOTAVX2 and DOTVNNI set the lanes of dst to the sums of four products of
// the unsigned bytes of u and the signed bytes of s (Y15 holds sixteen
// 1s for DOTAVX2); dst is not u or s.
#define DOTAVX2(u, s, dst) \
	VPMADDUBSW s, u, dst; \
	VPMADDWD Y15, dst, dst

#define DOTVNNI(u, s, dst) \
	VPXOR dst, dst, dst; \
	VPDPBUSD s, u, dst

// MADDAVX2 and MADDVNNI add to the lanes of acc the products of the words
// of s and q summed in pairs (q is scratch).
#define MADDAVX2(s, q, acc) \
	VPMADDWD s, q, q; \
	VPADDD q, acc, acc

#define MADDVNNI(s, q, acc) \
	VPDPWSSD s, q, acc

// Q8_0BLK adds the Q8_0 block at wo(SI) times the activation block at
// xo(BX) to Y0, by the sign trick: |w| times x negated where w < 0.
#define Q8_0BLK(wo, xo, DOT) \
	SCALES32(wo(SI), xo(BX)); \
	VMOVDQU xo+2(BX), Y4; \
	VPABSB wo+2(SI), Y7; \
	VPSIGNB wo+2(SI), Y4, Y8; \
	DOT(Y7, Y8, Y9); \
	ADDLANES(Y9)

// GEMVQ8_0 is the body of a Q8_0 kernel: two blocks an iteration.
#define GEMVQ8_0(DOT) \
	MOVQ out+0(FP), DI; \
	MOVQ w+8(FP), SI; \
	MOVQ rows+24(FP), R12; \
	MOVQ nb+32(FP), R13; \
	BROADCAST32($0x00010001, X15, Y15); \
row: \
	MOVQ x+16(FP), BX; \
	MOVQ R13, CX; \
	VXORPS Y0, Y0, Y0; \
	SHRQ $1, CX; \
	JZ one; \
pair: \
	Q8_0BLK(0, 0, DOT); \
	Q8_0BLK(34, 34, DOT); \
	ADDQ $68, BX; \
	ADDQ $68, SI; \
	DECQ CX; \
	JNZ pair; \
one: \
	TESTQ $1, R13; \
	JZ sum; \
	Q8_0BLK(0, 0, DOT); \
	ADDQ $34, BX; \
	ADDQ $34, SI; \
sum: \
	HSUM(Y0, X0, X8); \
	MOVSS X0, 0(DI); \
	ADDQ $4, DI; \
	DECQ R12; \
	JNZ row; \
	VZEROUPPER; \
	RET

// func gemvQ8_0AVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ8_0AVX2(SB), NOSPLIT, $0-40
	GEMVQ8_0(DOTAVX2)

// func gemvQ8_0VNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ8_0VNNI(SB), NOSPLIT, $0-40
	GEMVQ8_0(DOTVNNI)

// Q4_0BLK adds the Q4_0 block at wo(SI): its levels unpacked into element
// order (the low nibbles of its 16 bytes, then the high), times the
// activation quants, less 8 times their pair sums. Y14 holds bytes 0x0f,
// Y12 bytes 8.
#define Q4_0BLK(wo, xo) \
	SCALES32(wo(SI), xo(BX)); \
	VMOVDQU xo+2(BX), Y4; \
	VMOVDQU wo+2(SI), X7; \
	VPSRLW $4, X7, X8; \
	VINSERTI128 $1, X8, Y7, Y7; \
	VPAND Y14, Y7, Y7; \
	VPMADDUBSW Y4, Y7, Y7; \
	VPMADDUBSW Y4, Y12, Y9; \
	VPSUBW Y9, Y7, Y7; \
	VPMADDWD Y15, Y7, Y7; \
	ADDLANES(Y7)

// func gemvQ4_0AVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_0AVX2(SB), NOSPLIT, $0-40
	MOVQ out+0(FP), DI
	MOVQ w+8(FP), SI
	MOVQ rows+24(FP), R12
	MOVQ nb+32(FP), R13
	BROADCAST32($0x00010001, X15, Y15)
	BROADCAST32($0x0f0f0f0f, X14, Y14)
	BROADCAST32($0x08080808, X12, Y12)

row:
	MOVQ x+16(FP), BX
	MOVQ R13, CX
	VXORPS Y0, Y0, Y0
	SHRQ $1, CX
	JZ one

pair:
	Q4_0BLK(0, 0)
	Q4_0BLK(18, 34)
	ADDQ $68, BX
	ADDQ $36, SI
	DECQ CX
	JNZ pair

one:
	TESTQ $1, R13
	JZ sum
	Q4_0BLK(0, 0)
	ADDQ $34, BX
	ADDQ $18, SI

sum:
	HSUM(Y0, X0, X8)
	MOVSS X0, 0(DI)
	ADDQ $4, DI
	DECQ R12
	JNZ row
	VZEROUPPER
	RET

// wordsel<> holds the VPSHUFB controls that broadcast one 16-bit word of
// each 128-bit lane: at 32·j, word j in both lanes (for the eight Q4_K and
// Q5_K sub-block scales, duplicated in both lanes); at 256+32·c, word 2c
// in the low lane and 2c+1 in the high (for Q6_K's pairs of scales).
#define SEL(off, lo, hi) \
	DATA wordsel<>+off+0(SB)/8, $(lo*0x0202020202020202+0x0100010001000100); \
	DATA wordsel<>+off+8(SB)/8, $(lo*0x0202020202020202+0x0100010001000100); \
	DATA wordsel<>+off+16(SB)/8, $(hi*0x0202020202020202+0x0100010001000100); \
	DATA wordsel<>+off+24(SB)/8, $(hi*0x0202020202020202+0x0100010001000100)

SEL(0, 0, 0)
SEL(32, 1, 1)
SEL(64, 2, 2)
SEL(96, 3, 3)
SEL(128, 4, 4)
SEL(160, 5, 5)
SEL(192, 6, 6)
SEL(224, 7, 7)
SEL(256, 0, 1)
SEL(288, 2, 3)
SEL(320, 4, 5)
SEL(352, 6, 7)
GLOBL wordsel<>(SB), RODATA|NOPTR, $384

// kscale<> holds the constants of KSCALES: two VPSHUFB controls (0x80
// makes a zero byte) and three masks.
DATA kscale<>+0(SB)/8, $0x0b0a090803020100
DATA kscale<>+8(SB)/8, $0x0b0a090807060504
DATA kscale<>+16(SB)/8, $0x0302010080808080
DATA kscale<>+24(SB)/8, $0x0706050480808080
DATA kscale<>+32(SB)/8, $0x0f0f0f0f3f3f3f3f
DATA kscale<>+40(SB)/8, $0x000000003f3f3f3f
DATA kscale<>+48(SB)/8, $0x0000000000000000
DATA kscale<>+56(SB)/8, $0x0f0f0f0f00000000
DATA kscale<>+64(SB)/8, $0x3030303000000000
DATA kscale<>+72(SB)/8, $0x3030303000000000
GLOBL kscale<>(SB), RODATA|NOPTR, $80

// KSCALES unpacks the packed 6-bit scales and mins of the Q4_K or Q5_K
// super-block at SI: Y4 receives the eight scales as words, in both
// 128-bit lanes; Y3 the eight min terms, min_j times the sum of the
// activation's two 16-element sums of sub-block j (exact 32-bit
// integers). For j < 4 scale j and min j are the low six bits of bytes j
// and j+4; for j >= 4 the low four bits are the nibbles of byte j+4 and
// the top two the top bits of bytes j-4 (scale) and j (min). The 16 bytes
// from 4(SI) are rearranged as [b0..b3, b8..b11, b4..b7, b8..b11] and
// masked (low six bits, low nibble, low six bits, high nibble), and the
// top bits of b0..b7 moved in: X7 = [scales 0..7, mins 0..7].
#define KSCALES \
	VMOVDQU 4(SI), X3; \
	VPSHUFB kscale<>+0(SB), X3, X4; \
	VPAND kscale<>+32(SB), X4, X7; \
	VPSRLW $4, X4, X4; \
	VPAND kscale<>+48(SB), X4, X4; \
	VPOR X4, X7, X7; \
	VPSHUFB kscale<>+16(SB), X3, X3; \
	VPSRLW $2, X3, X3; \
	VPAND kscale<>+64(SB), X3, X3; \
	VPOR X3, X7, X7; \
	VPMOVZXBW X7, X4; \
	VINSERTI128 $1, X4, Y4, Y4; \
	VPUNPCKHBW X7, X7, X3; \
	VPMOVZXBW X3, Y3; \
	VPMADDWD 260(BX), Y3, Y3

// KDSCALE leaves in Y5 eight copies of the F16 d at SI times the
// activation's F32 scale, and in Y2 eight of the F16 dmin at 2(SI) times
// it.
#define KDSCALE \
	VMOVD (SI), X5; \
	VCVTPH2PS X5, X5; \
	VBROADCASTSS (BX), X6; \
	VMULPS X6, X5, X5; \
	VMOVSHDUP X5, X2; \
	VBROADCASTSS X2, Y2; \
	VBROADCASTSS X5, Y5

// KMIN takes the min terms (Y3) times dmin·dx (Y2) away from Y0.
#define KMIN \
	VCVTDQ2PS Y3, Y3; \
	VMULPS Y2, Y3, Y3; \
	VSUBPS Y3, Y0, Y0

// Q4_KGRP adds to Y10 and Y11 the scaled lanes of group g of a Q4_K
// super-block (sub-blocks 2g and 2g+1: the low and high nibbles of the
// 32 bytes at qo(SI)) times the activation quants at xo(BX) (elements 64g
// on), the scales selected from Y4 by the controls at s0 and s1. Y14
// holds bytes 0x0f.
#define Q4_KGRP(qo, xo, s0, s1, MADD) \
	VMOVDQU qo(SI), Y6; \
	VPSRLW $4, Y6, Y7; \
	VPAND Y14, Y6, Y6; \
	VPAND Y14, Y7, Y7; \
	VPMADDUBSW xo(BX), Y6, Y6; \
	VPMADDUBSW xo+32(BX), Y7, Y7; \
	VPSHUFB wordsel<>+s0(SB), Y4, Y8; \
	MADD(Y8, Y6, Y10); \
	VPSHUFB wordsel<>+s1(SB), Y4, Y9; \
	MADD(Y9, Y7, Y11)

// KLOOP is the row and super-block loops of the Q4_K and Q5_K kernels,
// around the four groups GROUPS of a super-block of bb bytes.
#define KLOOP(bb, GROUPS) \
row: \
	MOVQ x+16(FP), BX; \
	MOVQ R13, CX; \
	VXORPS Y0, Y0, Y0; \
block: \
	KDSCALE; \
	KSCALES; \
	VPXOR Y10, Y10, Y10; \
	VPXOR Y11, Y11, Y11; \
	GROUPS; \
	VPADDD Y11, Y10, Y10; \
	ADDLANES(Y10); \
	KMIN; \
	ADDQ $292, BX; \
	ADDQ $bb, SI; \
	DECQ CX; \
	JNZ block; \
	HSUM(Y0, X0, X8); \
	MOVSS X0, 0(DI); \
	ADDQ $4, DI; \
	DECQ R12; \
	JNZ row; \
	VZEROUPPER; \
	RET

#define ARGS \
	MOVQ out+0(FP), DI; \
	MOVQ w+8(FP), SI; \
	MOVQ rows+24(FP), R12; \
	MOVQ nb+32(FP), R13

#define Q4_KGROUPS(MADD) \
	Q4_KGRP(16, 4, 0, 32, MADD); \
	Q4_KGRP(48, 68, 64, 96, MADD); \
	Q4_KGRP(80, 132, 128, 160, MADD); \
	Q4_KGRP(112, 196, 192, 224, MADD)

// func gemvQ4_KAVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_KAVX2(SB), NOSPLIT, $0-40
	ARGS
	BROADCAST32($0x0f0f0f0f, X14, Y14)
	KLOOP(144, Q4_KGROUPS(MADDAVX2))

// func gemvQ4_KVNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_KVNNI(SB), NOSPLIT, $0-40
	ARGS
	BROADCAST32($0x0f0f0f0f, X14, Y14)
	KLOOP(144, Q4_KGROUPS(MADDVNNI))

// Q5_KGRP is Q4_KGRP for Q5_K: the levels' fifth bits, bit j of each of
// the 32 bytes in Y12 for sub-block j, are moved to bit 4 (a word shift by
// sh0 or sh1, left or right as SH0 and SH1 say, then the mask 0x10 in
// Y13) and added.
#define Q5_KGRP(qo, xo, s0, s1, SH0, sh0, SH1, sh1, MADD) \
	VMOVDQU qo(SI), Y6; \
	VPSRLW $4, Y6, Y7; \
	VPAND Y14, Y6, Y6; \
	VPAND Y14, Y7, Y7; \
	SH0 $sh0, Y12, Y8; \
	VPAND Y13, Y8, Y8; \
	VPOR Y8, Y6, Y6; \
	SH1 $sh1, Y12, Y9; \
	VPAND Y13, Y9, Y9; \
	VPOR Y9, Y7, Y7; \
	VPMADDUBSW xo(BX), Y6, Y6; \
	VPMADDUBSW xo+32(BX), Y7, Y7; \
	VPSHUFB wordsel<>+s0(SB), Y4, Y8; \
	MADD(Y8, Y6, Y10); \
	VPSHUFB wordsel<>+s1(SB), Y4, Y9; \
	MADD(Y9, Y7, Y11)

#define Q5_KGROUPS(MADD) \
	VMOVDQU 16(SI), Y12; \
	Q5_KGRP(48, 4, 0, 32, VPSLLW, 4, VPSLLW, 3, MADD); \
	Q5_KGRP(80, 68, 64, 96, VPSLLW, 2, VPSLLW, 1, MADD); \
	Q5_KGRP(112, 132, 128, 160, VPSRLW, 0, VPSRLW, 1, MADD); \
	Q5_KGRP(144, 196, 192, 224, VPSRLW, 2, VPSRLW, 3, MADD)

// func gemvQ5_KAVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ5_KAVX2(SB), NOSPLIT, $0-40
	ARGS
	BROADCAST32($0x0f0f0f0f, X14, Y14)
	BROADCAST32($0x10101010, X13, Y13)
	KLOOP(176, Q5_KGROUPS(MADDAVX2))

// func gemvQ5_KVNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ5_KVNNI(SB), NOSPLIT, $0-40
	ARGS
	BROADCAST32($0x0f0f0f0f, X14, Y14)
	BROADCAST32($0x10101010, X13, Y13)
	KLOOP(176, Q5_KGROUPS(MADDVNNI))

// Q6_KCHUNK adds to acc the lanes of one 32-element chunk of a Q6_K
// super-block whose levels are in q (0..63): the levels times the
// activation quants at xo(BX), less 32 times the activation pair sums,
// times the chunk's two scales (word 2c in the low lane, 2c+1 in the high,
// selected from Y3 or Y4 by the control at sel). Y15 holds bytes 32.
#define Q6_KCHUNK(q, xo, scales, sel, acc, MADD) \
	VPMADDUBSW xo(BX), q, q; \
	VPMADDUBSW xo(BX), Y15, Y9; \
	VPSUBW Y9, q, q; \
	VPSHUFB wordsel<>+sel(SB), scales, Y9; \
	MADD(Y9, q, acc)

// Q6_KHALF adds the 128 elements of half h of a Q6_K super-block: low
// nibbles at lo(SI) and lo+32(SI) (chunks 4h, 4h+1), their high nibbles
// (4h+2, 4h+3), and the top two bits of each from the byte at hi(SI), at
// bit offsets 0, 2, 4, 6 for the four chunks. Y14 holds bytes 0x0f, Y13
// bytes 0x03.
#define Q6_KHALF(lo, hi, xo, scales, MADD) \
	VMOVDQU lo(SI), Y6; \
	VMOVDQU lo+32(SI), Y7; \
	VMOVDQU hi(SI), Y8; \
	VPAND Y14, Y6, Y1; \
	VPAND Y13, Y8, Y2; \
	VPSLLW $4, Y2, Y2; \
	VPOR Y2, Y1, Y1; \
	Q6_KCHUNK(Y1, xo, scales, 256, Y10, MADD); \
	VPAND Y14, Y7, Y1; \
	VPSRLW $2, Y8, Y2; \
	VPAND Y13, Y2, Y2; \
	VPSLLW $4, Y2, Y2; \
	VPOR Y2, Y1, Y1; \
	Q6_KCHUNK(Y1, xo+32, scales, 288, Y11, MADD); \
	VPSRLW $4, Y6, Y1; \
	VPAND Y14, Y1, Y1; \
	VPSRLW $4, Y8, Y2; \
	VPAND Y13, Y2, Y2; \
	VPSLLW $4, Y2, Y2; \
	VPOR Y2, Y1, Y1; \
	Q6_KCHUNK(Y1, xo+64, scales, 320, Y10, MADD); \
	VPSRLW $4, Y7, Y1; \
	VPAND Y14, Y1, Y1; \
	VPSRLW $6, Y8, Y2; \
	VPAND Y13, Y2, Y2; \
	VPSLLW $4, Y2, Y2; \
	VPOR Y2, Y1, Y1; \
	Q6_KCHUNK(Y1, xo+96, scales, 352, Y11, MADD)

// GEMVQ6_K is the body of a Q6_K kernel.
#define GEMVQ6_K(MADD) \
	ARGS; \
	BROADCAST32($0x0f0f0f0f, X14, Y14); \
	BROADCAST32($0x03030303, X13, Y13); \
	BROADCAST32($0x20202020, X15, Y15); \
row: \
	MOVQ x+16(FP), BX; \
	MOVQ R13, CX; \
	VXORPS Y0, Y0, Y0; \
block: \
	VPBROADCASTW 208(SI), X5; \
	VCVTPH2PS X5, Y5; \
	VBROADCASTSS (BX), Y6; \
	VMULPS Y6, Y5, Y5; \
	VPMOVSXBW 192(SI), Y3; \
	VPERMQ $0xee, Y3, Y4; \
	VPERMQ $0x44, Y3, Y3; \
	VPXOR Y10, Y10, Y10; \
	VPXOR Y11, Y11, Y11; \
	Q6_KHALF(0, 128, 4, Y3, MADD); \
	Q6_KHALF(64, 160, 132, Y4, MADD); \
	VPADDD Y11, Y10, Y10; \
	ADDLANES(Y10); \
	ADDQ $292, BX; \
	ADDQ $210, SI; \
	DECQ CX; \
	JNZ block; \
	HSUM(Y0, X0, X8); \
	MOVSS X0, 0(DI); \
	ADDQ $4, DI; \
	DECQ R12; \
	JNZ row; \
	VZEROUPPER; \
	RET

// func gemvQ6_KAVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ6_KAVX2(SB), NOSPLIT, $0-40
	GEMVQ6_K(MADDAVX2)

// func gemvQ6_KVNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ6_KVNNI(SB), NOSPLIT, $0-40
	GEMVQ6_K(MADDVNNI)
