//go:build amd64 && !purego

#include "textflag.h"

// The integer products for x86-64, in the order the package documentation
// defines (doc.go, "The integer product"): AVX2 with F16C, and the same
// with AVX512_VNNI's VPDPWSSD on 256-bit registers. Each gemv function
// computes rows products of nb blocks: out[r] for the weight rows laid one
// after the other from w, with QuantizeRow's activations at x (the int16
// quants of all nb blocks, then each block's scale and sums: act.go). The
// rows are taken one at a time: a single sequential stream of weights is
// what the hardware prefetchers follow best. A Q8_0 kernel that took four
// rows a pass, loading each activation block once for the four and
// keeping four independent accumulators, ran faster from the L2 cache
// (36 GB/s against 33, one thread of the shared Zen 4 EPYC) but streamed
// from memory at 12.4 GB/s against 19-21: four streams a row apart
// defeat the prefetchers, as they did the four-row F16 kernel of the
// tensor package. The Go wrappers in
// vecdot_amd64.go check the lengths.
//
// The weight levels of a 32-element chunk are widened to two registers of
// 16 words (elements 0..15 and 16..31), less their offset and times the
// sub-block scale where the format has one (at most 4096 in magnitude, so
// every word is exact), and multiplied with the chunk's activation quants
// by VPMADDWD, which adds adjacent products into 32-bit lanes: lane k of
// the two registers' sum holds elements 2k, 2k+1, 16+2k and 17+2k, as the
// lanes are defined. No pair wraps: the activation quants are at most
// ActMax in magnitude. The VNNI kernels multiply and accumulate in one
// VPDPWSSD, with the same exact integers, so their results are the AVX2
// kernels'.
//
// Cost, against the kernels of ggml's 8-bit activations that these
// replaced (VPMADDUBSW on bytes), on one thread of a Zen 4 EPYC with the
// weights in the L2 cache (BenchmarkGEMVCached, GB/s of weights per
// second of CPU time, VNNI table): Q8_0 31 (31 before), Q4_0 14 (12.5),
// Q4_K 16 (22), Q5_K 14.5 (22), Q6_K 16 (25). Widening the weights to
// words doubles the multiply-adds of the 4- to 6-bit formats; their
// kernels run out of vector pipes, not of latency (four accumulators and
// scales broadcast from the frame measured no faster; scaling a Q4_K
// sub-block's lanes once with VPMULLD rather than its 32 levels with two
// VPMULLW made the AVX2 kernel 15% faster, VNNI's 4%).
//
// Floats: VCVTDQ2PS (exact, every lane is below 2^24 in magnitude, or
// rounded as Go's conversion rounds), VMULPS by the block's scale
// broadcast, VADDPS into the accumulator; never an FMA, so that each
// product is rounded as the Go code rounds it. HSUM reduces the
// accumulator as hsum8 does.
//
// Registers: DI out, SI weights, BX activation quants, R8 activation
// scales and sums, R9 the row's first scale, R12 rows left, R13 nb, CX
// blocks left; Y0 the float accumulators, Y5 the block's d·dx.

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

// ARGS loads the arguments; R9 is the activations' first scale, past the
// nb blocks of quants of 2<<sh bytes each.
#define ARGS(sh) \
	MOVQ out+0(FP), DI; \
	MOVQ w+8(FP), SI; \
	MOVQ rows+24(FP), R12; \
	MOVQ nb+32(FP), R13; \
	MOVQ R13, R9; \
	SHLQ $sh, R9; \
	ADDQ x+16(FP), R9

// ROW starts a row: the activations from their start, nb blocks, a zero
// accumulator.
#define ROW \
	MOVQ x+16(FP), BX; \
	MOVQ R9, R8; \
	MOVQ R13, CX; \
	VXORPS Y0, Y0, Y0

// ENDROW stores the row's sum and goes on to the next row at label row.
#define ENDROW \
	HSUM(Y0, X0, X8); \
	MOVSS X0, 0(DI); \
	ADDQ $4, DI; \
	DECQ R12; \
	JNZ row; \
	VZEROUPPER; \
	RET

// DSCALE leaves in Y5 eight copies of the F16 weight scale at wp times the
// F32 activation scale at (R8).
#define DSCALE(wp) \
	VPBROADCASTW wp, X5; \
	VCVTPH2PS X5, Y5; \
	VBROADCASTSS (R8), Y6; \
	VMULPS Y6, Y5, Y5

// ADDLANES converts the integer lanes in t, multiplies them by Y5 and adds
// them to Y0.
#define ADDLANES(t) \
	VCVTDQ2PS t, t; \
	VMULPS Y5, t, t; \
	VADDPS t, Y0, Y0

// MADDAVX2 and MADDVNNI add to the lanes of acc the products of the words
// of m and q summed in pairs (q is scratch).
#define MADDAVX2(m, q, acc) \
	VPMADDWD m, q, q; \
	VPADDD q, acc, acc

#define MADDVNNI(m, q, acc) \
	VPDPWSSD m, q, acc

// CHUNK adds to acc the products of the words a (elements 0..15 of a
// chunk) and b (16..31) with the activation quants at xo(BX).
#define CHUNK(a, b, xo, acc, MADD) \
	MADD(xo(BX), a, acc); \
	MADD(xo+32(BX), b, acc)

// Q8_0B adds the Q8_0 block at wo(SI) (its 32 signed quants widened)
// times the activation block at xo(BX), its scale at so(R8), to Y0; the
// other registers are scratch. The block's d·dx is one scalar product
// broadcast (VCVTPH2PS converts the F16 scale with the next three words,
// which are ignored), the same float32 product DSCALE makes in every lane.
#define Q8_0B(wo, xo, so, sx, sy, a, b, acc, MADD) \
	VCVTPH2PS wo(SI), sx; \
	VMULSS so(R8), sx, sx; \
	VBROADCASTSS sx, sy; \
	VPMOVSXBW wo+2(SI), a; \
	VPMOVSXBW wo+18(SI), b; \
	VPXOR acc, acc, acc; \
	MADD(xo(BX), a, acc); \
	MADD(xo+32(BX), b, acc); \
	VCVTDQ2PS acc, acc; \
	VMULPS sy, acc, acc; \
	VADDPS acc, Y0, Y0

// GEMVQ8_0 takes two blocks a step (then the last one where nb is odd),
// added to Y0 in their order, so that the sums are a block at a time's:
// 13.5 instructions a block where the loop of one block a step and
// DSCALE's four took 17. From the L2 cache, in GB/s of the thread's CPU
// time (the shared VM's wall time moved too much to compare): VNNI 35
// against 34 (best of 10, four runs). The vector pipes bind it, not the instruction count: ten
// vector operations a block remain (the conversions, the multiply-adds
// and the float scaling), and the weights stream from memory slower than
// two threads compute them.
#define GEMVQ8_0(MADD) \
	ARGS(6); \
row: \
	ROW; \
	SHRQ $1, CX; \
	JZ single; \
pair: \
	Q8_0B(0, 0, 0, X5, Y5, Y6, Y7, Y10, MADD); \
	Q8_0B(34, 64, 4, X9, Y9, Y11, Y12, Y13, MADD); \
	ADDQ $128, BX; \
	ADDQ $8, R8; \
	ADDQ $68, SI; \
	DECQ CX; \
	JNZ pair; \
single: \
	TESTQ $1, R13; \
	JZ rowdone; \
	Q8_0B(0, 0, 0, X5, Y5, Y6, Y7, Y10, MADD); \
	ADDQ $64, BX; \
	ADDQ $4, R8; \
	ADDQ $34, SI; \
rowdone: \
	ENDROW

// func gemvQ8_0AVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ8_0AVX2(SB), NOSPLIT, $0-40
	GEMVQ8_0(MADDAVX2)

// func gemvQ8_0VNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ8_0VNNI(SB), NOSPLIT, $0-40
	GEMVQ8_0(MADDVNNI)

// Q4_0BLK adds the Q4_0 block at SI: the low nibbles of its 16 bytes
// (elements 0..15) and the high (16..31), less 8. Y14 holds words 0x0f,
// Y12 words 8.
#define Q4_0BLK(MADD) \
	DSCALE((SI)); \
	VPMOVZXBW 2(SI), Y6; \
	VPSRLW $4, Y6, Y7; \
	VPAND Y14, Y6, Y6; \
	VPSUBW Y12, Y6, Y6; \
	VPSUBW Y12, Y7, Y7; \
	VPXOR Y10, Y10, Y10; \
	CHUNK(Y6, Y7, 0, Y10, MADD); \
	ADDLANES(Y10)

#define GEMVQ4_0(MADD) \
	ARGS(6); \
	BROADCAST32($0x000f000f, X14, Y14); \
	BROADCAST32($0x00080008, X12, Y12); \
row: \
	ROW; \
block: \
	Q4_0BLK(MADD); \
	ADDQ $64, BX; \
	ADDQ $4, R8; \
	ADDQ $18, SI; \
	DECQ CX; \
	JNZ block; \
	ENDROW

// func gemvQ4_0AVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_0AVX2(SB), NOSPLIT, $0-40
	GEMVQ4_0(MADDAVX2)

// func gemvQ4_0VNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_0VNNI(SB), NOSPLIT, $0-40
	GEMVQ4_0(MADDVNNI)

// dsel<> holds the VPSHUFB controls that set every 32-bit lane to byte j
// of its 128-bit lane, zero-extended, at 32·j: the eight Q4_K and Q5_K
// sub-block scales, as dwords.
#define DSEL(j) \
	DATA dsel<>+(32*j)+0(SB)/8, $(0x8080800080808000+j*0x0000000100000001); \
	DATA dsel<>+(32*j)+8(SB)/8, $(0x8080800080808000+j*0x0000000100000001); \
	DATA dsel<>+(32*j)+16(SB)/8, $(0x8080800080808000+j*0x0000000100000001); \
	DATA dsel<>+(32*j)+24(SB)/8, $(0x8080800080808000+j*0x0000000100000001)

DSEL(0)
DSEL(1)
DSEL(2)
DSEL(3)
DSEL(4)
DSEL(5)
DSEL(6)
DSEL(7)
GLOBL dsel<>(SB), RODATA|NOPTR, $256

// words<> holds 16 words of 0x0f, then 16 of 0x10.
DATA words<>+0(SB)/8, $0x000f000f000f000f
DATA words<>+8(SB)/8, $0x000f000f000f000f
DATA words<>+16(SB)/8, $0x000f000f000f000f
DATA words<>+24(SB)/8, $0x000f000f000f000f
DATA words<>+32(SB)/8, $0x0010001000100010
DATA words<>+40(SB)/8, $0x0010001000100010
DATA words<>+48(SB)/8, $0x0010001000100010
DATA words<>+56(SB)/8, $0x0010001000100010
GLOBL words<>(SB), RODATA|NOPTR, $64

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
// super-block at SI: Y4 receives the eight scales as bytes 0..7 of both
// 128-bit lanes; Y3 the eight min terms, min_j times the activation's
// stored sum of sub-block j (exact 32-bit integers, wrapping as Go's).
// For j < 4 scale j and min j are the low six bits of bytes j and j+4;
// for j >= 4 the low four bits are the nibbles of byte j+4 and the top two
// the top bits of bytes j-4 (scale) and j (min). The 16 bytes from 4(SI)
// are rearranged as [b0..b3, b8..b11, b4..b7, b8..b11] and masked (low six
// bits, low nibble, low six bits, high nibble), and the top bits of b0..b7
// moved in: X7 = [scales 0..7, mins 0..7].
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
	VINSERTI128 $1, X7, Y7, Y4; \
	VPSRLDQ $8, X7, X3; \
	VPMOVZXBD X3, Y3; \
	VPMULLD 4(R8), Y3, Y3

// KDSCALE leaves in Y5 eight copies of the F16 d at SI times the
// activation's F32 scale, and in Y2 eight of the F16 dmin at 2(SI) times
// it.
#define KDSCALE \
	VMOVD (SI), X5; \
	VCVTPH2PS X5, X5; \
	VBROADCASTSS (R8), X6; \
	VMULPS X6, X5, X5; \
	VMOVSHDUP X5, X2; \
	VBROADCASTSS X2, Y2; \
	VBROADCASTSS X5, Y5

// KMIN takes the min terms (Y3) times dmin·dx (Y2) away from Y0.
#define KMIN \
	VCVTDQ2PS Y3, Y3; \
	VMULPS Y2, Y3, Y3; \
	VSUBPS Y3, Y0, Y0

// Q4_KGRP adds to Y10 and Y11 group g of a Q4_K super-block: the 32 bytes
// at qo(SI), whose low nibbles are sub-block 2g and high nibbles 2g+1,
// times the activation quants at xo(BX) (elements 64g on), times their
// scales (selected from Y4 by the controls at s0 and s1). Y14 holds words
// 0x0f; Y12 is scratch.
#define Q4_KGRP(qo, xo, s0, s1, SDOT) \
	VPMOVZXBW qo(SI), Y6; \
	VPMOVZXBW qo+16(SI), Y7; \
	VPSRLW $4, Y6, Y8; \
	VPSRLW $4, Y7, Y9; \
	VPAND Y14, Y6, Y6; \
	VPAND Y14, Y7, Y7; \
	KSUB(xo, s0, s1, SDOT, Y12)

// KSUB adds to Y10 the products of the levels of sub-block 2g (Y6, Y7)
// with the activation quants at xo(BX) times its scale, and to Y11 those
// of sub-block 2g+1 (Y8, Y9); t is scratch. The scale multiplies the
// sub-block's 32-bit lanes (VPMULLD), one multiply per sub-block rather
// than one per 16 levels.
#define KSUB(xo, s0, s1, SDOT, t) \
	SDOT(xo, Y6, Y7, t); \
	VPSHUFB dsel<>+s0(SB), Y4, Y1; \
	VPMULLD Y1, t, t; \
	VPADDD t, Y10, Y10; \
	SDOT(xo+64, Y8, Y9, t); \
	VPSHUFB dsel<>+s1(SB), Y4, Y1; \
	VPMULLD Y1, t, t; \
	VPADDD t, Y11, Y11

// SDOTAVX2 and SDOTVNNI set the lanes of t to the products of the words a
// (elements 0..15 of a chunk) and b (16..31) with the activation quants
// at xo(BX), summed as the lanes are defined (b is scratch).
#define SDOTAVX2(xo, a, b, t) \
	VPMADDWD xo(BX), a, t; \
	VPMADDWD xo+32(BX), b, b; \
	VPADDD b, t, t

#define SDOTVNNI(xo, a, b, t) \
	VPXOR t, t, t; \
	VPDPWSSD xo(BX), a, t; \
	VPDPWSSD xo+32(BX), b, t

// KLOOP is the row and super-block loops of the Q4_K and Q5_K kernels,
// around the four groups GROUPS of a super-block of bb bytes.
#define KLOOP(bb, GROUPS) \
row: \
	ROW; \
block: \
	KDSCALE; \
	KSCALES; \
	VPXOR Y10, Y10, Y10; \
	VPXOR Y11, Y11, Y11; \
	GROUPS; \
	VPADDD Y11, Y10, Y10; \
	ADDLANES(Y10); \
	KMIN; \
	ADDQ $512, BX; \
	ADDQ $36, R8; \
	ADDQ $bb, SI; \
	DECQ CX; \
	JNZ block; \
	ENDROW

#define Q4_KGROUPS(SDOT) \
	Q4_KGRP(16, 0, 0, 32, SDOT); \
	Q4_KGRP(48, 128, 64, 96, SDOT); \
	Q4_KGRP(80, 256, 128, 160, SDOT); \
	Q4_KGRP(112, 384, 192, 224, SDOT)

// func gemvQ4_KAVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_KAVX2(SB), NOSPLIT, $0-40
	ARGS(9)
	BROADCAST32($0x000f000f, X14, Y14)
	KLOOP(144, Q4_KGROUPS(SDOTAVX2))

// func gemvQ4_KVNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ4_KVNNI(SB), NOSPLIT, $0-40
	ARGS(9)
	BROADCAST32($0x000f000f, X14, Y14)
	KLOOP(144, Q4_KGROUPS(SDOTVNNI))

// Q5_KGRP is Q4_KGRP for Q5_K: the levels' fifth bits, bit j of the words
// of Y12 (elements 0..15) and Y13 (16..31) for sub-block j, are moved to
// bit 4 (a word shift by sh0 or sh1, left or right as SH0 and SH1 say,
// then the mask 0x10) and added. Its masks are read from memory, Y14 is
// KSUB's scratch.
#define Q5_KGRP(qo, xo, s0, s1, SH0, sh0, SH1, sh1, SDOT) \
	VPMOVZXBW qo(SI), Y6; \
	VPMOVZXBW qo+16(SI), Y7; \
	VPSRLW $4, Y6, Y8; \
	VPSRLW $4, Y7, Y9; \
	VPAND words<>+0(SB), Y6, Y6; \
	VPAND words<>+0(SB), Y7, Y7; \
	SH0 $sh0, Y12, Y1; \
	VPAND words<>+32(SB), Y1, Y1; \
	VPOR Y1, Y6, Y6; \
	SH0 $sh0, Y13, Y1; \
	VPAND words<>+32(SB), Y1, Y1; \
	VPOR Y1, Y7, Y7; \
	SH1 $sh1, Y12, Y1; \
	VPAND words<>+32(SB), Y1, Y1; \
	VPOR Y1, Y8, Y8; \
	SH1 $sh1, Y13, Y1; \
	VPAND words<>+32(SB), Y1, Y1; \
	VPOR Y1, Y9, Y9; \
	KSUB(xo, s0, s1, SDOT, Y14)

#define Q5_KGROUPS(SDOT) \
	VPMOVZXBW 16(SI), Y12; \
	VPMOVZXBW 32(SI), Y13; \
	Q5_KGRP(48, 0, 0, 32, VPSLLW, 4, VPSLLW, 3, SDOT); \
	Q5_KGRP(80, 128, 64, 96, VPSLLW, 2, VPSLLW, 1, SDOT); \
	Q5_KGRP(112, 256, 128, 160, VPSRLW, 0, VPSRLW, 1, SDOT); \
	Q5_KGRP(144, 384, 192, 224, VPSRLW, 2, VPSRLW, 3, SDOT)

// func gemvQ5_KAVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ5_KAVX2(SB), NOSPLIT, $0-40
	ARGS(9)
	KLOOP(176, Q5_KGROUPS(SDOTAVX2))

// func gemvQ5_KVNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ5_KVNNI(SB), NOSPLIT, $0-40
	ARGS(9)
	KLOOP(176, Q5_KGROUPS(SDOTVNNI))

// Q6_KSCALE sets the words of y to the signed scale at so(SI): its byte
// broadcast, each word then shifted right arithmetically by 8.
#define Q6_KSCALE(so, y) \
	VPBROADCASTB so(SI), y; \
	VPSRAW $8, y, y

// Q6_KCHUNK adds to Y10 chunk c of half h of a Q6_K super-block: the low
// four bits of its levels in the words lo0 (elements 0..15) and lo1
// (16..31), the top two at bits 4 and 5 of the words of Y12 and Y13 after
// TOP (a shift, then the mask 0x30 in Y15), less 32 (Y14), times the
// scales at so(SI) and so+1(SI), times the activation quants at xo(BX).
#define Q6_KCHUNK(lo0, lo1, TOP, sh, so, xo, MADD) \
	TOP $sh, Y12, Y1; \
	VPAND Y15, Y1, Y1; \
	VPOR Y1, lo0, lo0; \
	TOP $sh, Y13, Y1; \
	VPAND Y15, Y1, Y1; \
	VPOR Y1, lo1, lo1; \
	VPSUBW Y14, lo0, lo0; \
	VPSUBW Y14, lo1, lo1; \
	Q6_KSCALE(so, Y1); \
	VPMULLW Y1, lo0, lo0; \
	Q6_KSCALE(so+1, Y1); \
	VPMULLW Y1, lo1, lo1; \
	CHUNK(lo0, lo1, xo, Y10, MADD)

// Q6_KHALF adds the 128 elements of half h of a Q6_K super-block: the low
// bits in the 64 bytes at lo(SI) (chunks 4h and 4h+1 in their low
// nibbles, 4h+2 and 4h+3 in their high), the top bits in the 32 bytes at
// hi(SI) (bit offsets 0, 2, 4, 6 for the four chunks), the scales from
// so(SI) and the activation quants from xo(BX). Y11 holds words 0x0f.
#define Q6_KHALF(lo, hi, so, xo, MADD) \
	VPMOVZXBW hi(SI), Y12; \
	VPMOVZXBW hi+16(SI), Y13; \
	VPMOVZXBW lo(SI), Y6; \
	VPMOVZXBW lo+16(SI), Y7; \
	VPMOVZXBW lo+32(SI), Y8; \
	VPMOVZXBW lo+48(SI), Y9; \
	VPSRLW $4, Y6, Y2; \
	VPSRLW $4, Y7, Y3; \
	VPAND Y11, Y6, Y6; \
	VPAND Y11, Y7, Y7; \
	Q6_KCHUNK(Y6, Y7, VPSLLW, 4, so, xo, MADD); \
	VPSRLW $4, Y8, Y6; \
	VPSRLW $4, Y9, Y7; \
	VPAND Y11, Y8, Y8; \
	VPAND Y11, Y9, Y9; \
	Q6_KCHUNK(Y8, Y9, VPSLLW, 2, so+2, xo+64, MADD); \
	Q6_KCHUNK(Y2, Y3, VPSRLW, 0, so+4, xo+128, MADD); \
	Q6_KCHUNK(Y6, Y7, VPSRLW, 2, so+6, xo+192, MADD)

#define GEMVQ6_K(MADD) \
	ARGS(9); \
	BROADCAST32($0x000f000f, X11, Y11); \
	BROADCAST32($0x00200020, X14, Y14); \
	BROADCAST32($0x00300030, X15, Y15); \
row: \
	ROW; \
block: \
	DSCALE(208(SI)); \
	VPXOR Y10, Y10, Y10; \
	Q6_KHALF(0, 128, 192, 0, MADD); \
	Q6_KHALF(64, 160, 200, 256, MADD); \
	ADDLANES(Y10); \
	ADDQ $512, BX; \
	ADDQ $36, R8; \
	ADDQ $210, SI; \
	DECQ CX; \
	JNZ block; \
	ENDROW

// func gemvQ6_KAVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ6_KAVX2(SB), NOSPLIT, $0-40
	GEMVQ6_K(MADDAVX2)

// func gemvQ6_KVNNI(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ6_KVNNI(SB), NOSPLIT, $0-40
	GEMVQ6_K(MADDVNNI)
