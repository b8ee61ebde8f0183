// Package quant reads and writes the ggml block formats that GGUF files
// store weights in: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32-element blocks),
// the K formats Q4_K, Q5_K and Q6_K (256-element super-blocks, what
// Q4_K_M, Q5_K_M and Q6_K files hold) and Q8_K, plus F32, F16 and BF16.
// Type numbers every ggml type as GGUF files do, with its block size and
// bytes per block, so that any tensor of a file can be sized even where
// this package cannot decode it (Supported).
//
// Dequantize is bit-exact with the reference definitions (ggml's
// dequantize_row_* functions with every product rounded to float32).
// Quantize produces the bytes of the reference quantizers, including the
// iterative scale search of the K formats (make_qkx2_quants and
// make_qx_quants), which is what llama.cpp's quantize tool writes when it
// is given no importance matrix. The reference is defined with separately
// rounded multiplies and adds; a C build that fuses them (-march=native
// with GCC's default -ffp-contract=fast) writes slightly different K-format
// bytes, and so would Go if it fused: every product that feeds an add here
// is converted explicitly to float32, which Go's specification says
// prevents fusing, so the output is the same on every architecture.
//
// DotF32 multiplies a quantized row with an F32 vector straight from the
// quantized bytes: the product over the row's dequantized values, within
// float32 rounding of the sum. The kernels are plain Go; the tensor
// backends build their matrix products on them.
//
// # The integer product
//
// A CPU decodes a token as ggml does, in integers, but with finer
// activations: QuantizeRow quantizes the activation vector once, to 16-bit
// quants with an F32 scale per block of the weights (32 elements, or 256
// for the K formats; act.go has the layout), and VecDot or GEMV multiply
// each weight row with it block by block in integer arithmetic before any
// float is touched. A row costs one pass over its quantized bytes and a
// few float operations per block, so a product runs at the speed memory
// delivers the weights. Rounding the activations to steps of
// max|x|/16383 adds a relative RMS error of about 0.004% (blocks of 32)
// or 0.005% (blocks of 256) to each product, 1/128 of what ggml's 8-bit
// Q8_0 and Q8_K activations cost; DotF32 is the exact alternative.
//
// The kernels are Go everywhere, and x86-64 assembly for Q8_0, Q4_0, Q4_K,
// Q5_K and Q6_K with AVX2 or AVX512_VNNI, chosen at run time (KernelsEnv overrides
// the choice; the purego build tag leaves the assembly out); QuantizeRow's
// loops (the largest magnitude, the rounding, the K formats' sums) are
// AVX2 assembly where the processor has it (act_amd64.s), with the Go
// loops' bits. Every kernel computes the same float32 result, bit for bit,
// from the same bytes:
//
//   - The integers are exact. A block's elements are taken in chunks of 32
//     consecutive elements; within a chunk, lane k (k = 0..7) holds the sum
//     of the products of elements 2k, 2k+1, 16+2k and 17+2k, each weight
//     level (less its offset) times its activation quant, the first 16
//     times the chunk's integer sub-block scale where the format has one
//     (Q4_K, Q5_K: the 6-bit scale of the 32 elements; Q6_K: the signed
//     scale of each 16). A K-format super-block adds its eight chunks'
//     lanes together. The sums are int32's, and ActMax keeps them from
//     wrapping.
//   - The floats follow one order. Eight float32 accumulators acc[k] start
//     at +0. For each block, in order: dd = d·dx (the weight's scale times
//     the activation's, rounded), then acc[k] += float32(lane[k])·dd, the
//     product rounded before the add (no fused multiply-add). The row's
//     result is ((acc0+acc4)+(acc2+acc6)) + ((acc1+acc5)+(acc3+acc7)).
//   - Offsets: Q4_0, Q5_0 and Q6_K fold theirs (8, 16, 32) into the integer
//     lanes. Q4_1 and Q5_1 add their min per block after the scaled lanes:
//     acc[k] = (acc[k] + float32(lane[k])·dd) + float32(xsum[k])·(m·dx),
//     with xsum[k] the sum of the activation quants of lane k. Q4_K and
//     Q5_K take their mins away per super-block the same way: acc[k] =
//     (acc[k] + float32(lane[k])·dd) − float32(mlane[k])·(dmin·dx), where
//     mlane[j] = min_j times the stored sum of the activation quants of
//     sub-block j.
//   - Q8_0 sums each block's 32 products into one int32 t (at most
//     32·128·32768 in magnitude, so exact) and adds float32(t)·dd to
//     acc[i mod 8] for block i; the row's result is the same sum of the
//     accumulators. Its kernels reduce eight blocks together and convert,
//     scale and add the eight totals in one step each: a Q8_0 block has a
//     byte per weight, and converting and scaling its eight lanes one
//     block at a time cost more than reading it.
//
// That order is the one an 8-lane vector unit runs naturally: VPMADDWD
// of 16 weights and 16 activation quants fills the eight lanes.
//
// The package depends on no other part of strata, so that tensor, loader
// and the backends can all use it.
//
//	q := make([]byte, 144) // one Q4_K super-block
//	if err := quant.Q4_K.Quantize(q, x[:256]); err != nil {
//		return err
//	}
//	y := make([]float32, 256)
//	err := quant.Q4_K.Dequantize(y, q)
//
// A matrix-vector product with the integer kernels:
//
//	nb, err := quant.ActivationBytes(quant.Q4_K, cols)
//	if err != nil {
//		return err
//	}
//	xq := make([]byte, nb)
//	if err := quant.QuantizeRow(quant.Q4_K, xq, x); err != nil {
//		return err
//	}
//	err := quant.GEMV(quant.Q4_K, out, w, rows, cols, xq)
package quant
