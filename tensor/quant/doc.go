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
// The package depends on no other part of strata, so that tensor, loader
// and the backends can all use it.
//
//	q := make([]byte, 144) // one Q4_K super-block
//	if err := quant.Q4_K.Quantize(q, x[:256]); err != nil {
//		return err
//	}
//	y := make([]float32, 256)
//	err := quant.Q4_K.Dequantize(y, q)
package quant
