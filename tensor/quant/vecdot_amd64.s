//go:build amd64 && !purego

#include "textflag.h"
#include "reduce_amd64.h"

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
// VPMULLW made the AVX2 kernel 15% faster, VNNI's 4%). The Q8_0 kernels
// now reduce eight blocks at a time (below): 45-55 GB/s on one thread of
// a Zen 5 EPYC, AVX-512, and 38-46 with AVX2, where the kernels of one
// block at a time ran at 31-35.
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

// The Q8_0 kernels (the AVX-512 one on 512-bit registers, which needs
// AVX512BW) sum each block's 32 products into one int32 and add it,
// converted and scaled, to accumulator i mod 8 of block i (doc.go). They
// take the blocks eight at a time: eight blocks' lanes reduced together
// give a register of the eight totals in block order, which is converted,
// scaled by the eight blocks' d·dx and added to Y0 in three instructions.
// Where each block was converted, scaled and added on its own (13.5
// instructions a block, ten of them vector operations) the product ran
// at 31-35 GB/s from the L2 cache on one thread of a 2-core Zen 5 VM,
// and at 24 GB/s on two threads streaming from memory against a read
// bandwidth of 36-46: a thread waits for memory, then computes, and the
// fewer cycles it computes, the closer the stream comes to the read rate.
// The eight F16 weight scales, 34 bytes apart, are packed into two
// quadwords by the integer unit and converted by one VCVTPH2PS (copied
// through the frame instead, the loads waited on the eight stores: 27
// GB/s; VPINSRW of each and VPGATHERDD measured slower too).
//
// Frame: 0(SP) and 32(SP) the totals and d·dx of a last group of fewer
// than eight blocks, zeros past them (which add +0 to an accumulator that
// is never -0).

// PACK4 leaves in AX the four F16 words at a, b, c and d (SI), the first
// lowest; DX is scratch.
#define PACK4(a, b, c, d) \
	MOVWQZX a(SI), AX; \
	MOVWQZX b(SI), DX; \
	SHLQ $16, DX; \
	ORQ DX, AX; \
	MOVWQZX c(SI), DX; \
	SHLQ $32, DX; \
	ORQ DX, AX; \
	MOVWQZX d(SI), DX; \
	SHLQ $48, DX; \
	ORQ DX, AX

// Q8SCALES leaves in x the F16 scales of the eight blocks at SI, packed
// four to a quadword by the integer unit (AX, DX scratch).
#define Q8SCALES(x) \
	PACK4(0, 34, 68, 102); \
	VMOVQ AX, x; \
	PACK4(136, 170, 204, 238); \
	VPINSRQ $1, AX, x, x

// Q8ADD converts the eight totals in t, multiplies them by the eight
// blocks' d·dx (Q8SCALES's x times the activation scales at (R8)) and
// adds them to Y0; u is scratch.
#define Q8ADD(t, u, x) \
	VCVTDQ2PS t, t; \
	VCVTPH2PS x, u; \
	VMULPS (R8), u, u; \
	VMULPS u, t, t; \
	VADDPS t, Y0, Y0

// Q8TAIL adds the last nb mod 8 blocks of the row (CX of them, at least
// one): each block's total (BLK leaves it in the low lane of X1) and d·dx
// go to the frame, then the eight are converted, scaled and added as
// Q8ADD does.
#define Q8TAIL(BLK) \
	VPXOR Y1, Y1, Y1; \
	VMOVDQU Y1, 0(SP); \
	VMOVDQU Y1, 32(SP); \
	XORQ DX, DX; \
tailblk: \
	BLK; \
	VMOVD X1, 0(SP)(DX*4); \
	MOVWLZX 0(SI), AX; \
	VMOVD AX, X2; \
	VCVTPH2PS X2, X2; \
	VMULSS (R8)(DX*4), X2, X2; \
	VMOVSS X2, 32(SP)(DX*4); \
	ADDQ $64, BX; \
	ADDQ $34, SI; \
	INCQ DX; \
	CMPQ DX, CX; \
	JLT tailblk; \
	VMOVDQU 0(SP), Y1; \
	VCVTDQ2PS Y1, Y1; \
	VMULPS 32(SP), Y1, Y1; \
	VADDPS Y1, Y0, Y0

// PREFETCH3, PREFETCH4 and PREFETCH5 ask for three, four or five lines
// 4 KB ahead of SI, the distance every kernel here prefetches at: a
// Q8_0 group (272 bytes) takes five, so the lines a group's prefetches
// miss are the next group's first; a Q4_K or Q5_K super-block (144, 176)
// three, a Q6_K one (210) four. Two threads of BenchmarkMatMulDecode's
// Q8_0 products on the 2-core Zen 5 VM, alternated: 0.95-1.04 of the read
// bandwidth with it, 0.85-0.94 without; 2 and 8 KB ahead measured as 4 KB
// did. A prefetch past the weights does not fault.
#define PREFETCH3 \
	PREFETCHT0 4096(SI); \
	PREFETCHT0 4160(SI); \
	PREFETCHT0 4224(SI)
#define PREFETCH4 \
	PREFETCH3; \
	PREFETCHT0 4288(SI)
#define PREFETCH5 \
	PREFETCH4; \
	PREFETCHT0 4352(SI)

// GEMVQ8_0 runs the rows: GROUP adds eight blocks from SI and BX, TAILBLK
// leaves one block's total in X1.
#define GEMVQ8_0(GROUP, SCALES, TAILBLK) \
	ARGS(6); \
row: \
	ROW; \
	SHRQ $3, CX; \
	JZ tail; \
group: \
	PREFETCH5; \
	Q8SCALES(SCALES); \
	GROUP; \
	ADDQ $512, BX; \
	ADDQ $32, R8; \
	ADDQ $272, SI; \
	DECQ CX; \
	JNZ group; \
tail: \
	MOVQ R13, CX; \
	ANDQ $7, CX; \
	JZ rowdone; \
	Q8TAIL(TAILBLK); \
rowdone: \
	ENDROW

// Q8LANES8 leaves in y the eight lanes of the block at wo(SI) times the
// activations at xo(BX) (lane k: elements 2k, 2k+1, 16+2k, 17+2k); t is
// scratch.
#define Q8LANES8(wo, xo, y, t) \
	VPMOVSXBW wo+2(SI), y; \
	VPMOVSXBW wo+18(SI), t; \
	VPMADDWD xo(BX), y, y; \
	VPMADDWD xo+32(BX), t, t; \
	VPADDD t, y, y

// Q8GROUPAVX2: the eight blocks' lanes, then two rounds of VPHADDD leave
// in each 128-bit half four blocks' partial totals (Y1: blocks 0-3, Y5:
// 4-7), and the halves added across give the totals in order.
#define Q8GROUPAVX2 \
	Q8LANES8(0, 0, Y1, Y9); \
	Q8LANES8(34, 64, Y2, Y10); \
	Q8LANES8(68, 128, Y3, Y11); \
	Q8LANES8(102, 192, Y4, Y12); \
	Q8LANES8(136, 256, Y5, Y13); \
	Q8LANES8(170, 320, Y6, Y14); \
	Q8LANES8(204, 384, Y7, Y9); \
	Q8LANES8(238, 448, Y8, Y10); \
	VPHADDD Y2, Y1, Y1; \
	VPHADDD Y4, Y3, Y3; \
	VPHADDD Y6, Y5, Y5; \
	VPHADDD Y8, Y7, Y7; \
	VPHADDD Y3, Y1, Y1; \
	VPHADDD Y7, Y5, Y5; \
	VPERM2I128 $0x20, Y5, Y1, Y2; \
	VPERM2I128 $0x31, Y5, Y1, Y1; \
	VPADDD Y2, Y1, Y1; \
	Q8ADD(Y1, Y2, X15)

#define Q8TAILAVX2 \
	Q8LANES8(0, 0, Y1, Y2); \
	REDUCE8(VPADDD, Y1, X1, X2)

// func gemvQ8_0AVX2(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ8_0AVX2(SB), NOSPLIT, $64-40
	GEMVQ8_0(Q8GROUPAVX2, X15, Q8TAILAVX2)

// Q8LANES16 leaves in z the 16 lanes of the block at wo(SI) times the
// activations at xo(BX): its 32 quants widened into one register, one
// VPMADDWD (lane k: elements 2k and 2k+1).
#define Q8LANES16(wo, xo, z) \
	VPMOVSXBW wo+2(SI), z; \
	VPMADDWD xo(BX), z, z

// Q8PAIR adds the 128-bit chunks of a and b in pairs: a's chunks 0+1 and
// 2+3 to chunks 0 and 1 of a, b's to 2 and 3; t is scratch.
#define Q8PAIR(a, b, t) \
	VSHUFI32X4 $0x88, b, a, t; \
	VSHUFI32X4 $0xdd, b, a, a; \
	VPADDD t, a, a

// Q8GROUPAVX512: two rounds of Q8PAIR leave four blocks' lanes in a
// chunk each (Z1: blocks 0-3, Z5: 4-7); the two registers' chunks
// interleaved by quadwords and added leave blocks j and 4+j two lanes
// each in chunk j, adjacent lanes added leave each total twice, and
// VPERMD by q8perm gathers them in block order.
#define Q8GROUPAVX512 \
	Q8LANES16(0, 0, Z1); \
	Q8LANES16(34, 64, Z2); \
	Q8LANES16(68, 128, Z3); \
	Q8LANES16(102, 192, Z4); \
	Q8LANES16(136, 256, Z5); \
	Q8LANES16(170, 320, Z6); \
	Q8LANES16(204, 384, Z7); \
	Q8LANES16(238, 448, Z8); \
	Q8PAIR(Z1, Z2, Z9); \
	Q8PAIR(Z3, Z4, Z10); \
	Q8PAIR(Z5, Z6, Z11); \
	Q8PAIR(Z7, Z8, Z12); \
	Q8PAIR(Z1, Z3, Z9); \
	Q8PAIR(Z5, Z7, Z10); \
	VPUNPCKLQDQ Z5, Z1, Z9; \
	VPUNPCKHQDQ Z5, Z1, Z1; \
	VPADDD Z9, Z1, Z1; \
	VPSHUFD $0xb1, Z1, Z9; \
	VPADDD Z9, Z1, Z1; \
	VPERMD Z1, Z15, Z1; \
	Q8ADD(Y1, Y2, X13)

#define Q8TAILAVX512 \
	Q8LANES16(0, 0, Z1); \
	VEXTRACTI64X4 $1, Z1, Y2; \
	VPADDD Y2, Y1, Y1; \
	REDUCE8(VPADDD, Y1, X1, X2)

// q8perm: the lanes of Q8GROUPAVX512's totals of blocks 0 to 7.
DATA q8perm<>+0(SB)/4, $0
DATA q8perm<>+4(SB)/4, $4
DATA q8perm<>+8(SB)/4, $8
DATA q8perm<>+12(SB)/4, $12
DATA q8perm<>+16(SB)/4, $2
DATA q8perm<>+20(SB)/4, $6
DATA q8perm<>+24(SB)/4, $10
DATA q8perm<>+28(SB)/4, $14
GLOBL q8perm<>(SB), RODATA|NOPTR, $32

// func gemvQ8_0AVX512(out *float32, w, x *byte, rows, nb int)
TEXT ·gemvQ8_0AVX512(SB), NOSPLIT, $64-40
	VMOVDQU q8perm<>(SB), Y15
	GEMVQ8_0(Q8GROUPAVX512, X13, Q8TAILAVX512)

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
// around the four groups GROUPS of a super-block of bb bytes. Each
// super-block prefetches three lines 4 KB ahead (PREFETCH3), GEMVQ6_K's
// four, which covers its bytes. Two
// threads of BenchmarkMatMulDecode's Q4_K and Q6_K products on the 2-core
// Zen 5 VM, three alternated pairs of runs: 0.57-0.79 of the read
// bandwidth with it, 0.45-0.72 without; 14 of the 18 pairs of figures
// higher with it. The K kernels compute longer a byte than Q8_0's, so the
// gain is smaller.
#define KLOOP(bb, GROUPS) \
row: \
	ROW; \
block: \
	PREFETCH3; \
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
	PREFETCH4; \
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
