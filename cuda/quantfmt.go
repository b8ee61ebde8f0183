package cuda

import "github.com/strata-llm/strata/tensor"

// quantFormat describes the kernels of one quantized dtype, as the format
// structs of kernels/quant.cuh define them (keep the two in step; a
// mismatch costs speed, not correctness: the kernels loop over whatever
// grid they are given).
type quantFormat struct {
	dt   tensor.DType
	name string // kernel suffix: gemv_<name>_m1, dequant_<name>_f16, ...
	// pieceBlocks is F::PB, the blocks of a row one warp stages and
	// decodes at a time; MatMul gives a GEMV block one warp per piece of a
	// row, up to quantWarps.
	pieceBlocks int
	// align16 is F::ALIGN16: the GEMV reads the blocks with 16-byte loads
	// and needs the weights 16-byte aligned (their rows are 16-byte
	// multiples); MatMul sends other views another way.
	align16 bool
}

// quantFormats lists the formats with kernels, in the order of
// testdata/quanthost.cu's format numbers. Q8_K, an activation format of
// ggml that files do not store, has none.
var quantFormats = []quantFormat{
	{tensor.Q8_0, "q8_0", 32, false},
	{tensor.Q4_0, "q4_0", 32, false},
	{tensor.Q4_1, "q4_1", 32, false},
	{tensor.Q5_0, "q5_0", 32, false},
	{tensor.Q5_1, "q5_1", 32, false},
	{tensor.Q4_K, "q4_k", 8, true},
	{tensor.Q5_K, "q5_k", 8, true},
	{tensor.Q6_K, "q6_k", 8, false},
}

// Launch geometry of the quantized kernels (QWARPS and QROWS in
// kernels/quant.cuh): at most quantWarps warps a block, and quantRows rows
// of w a GEMV block at a time.
const (
	quantWarps = 4
	quantRows  = 4
)

// quantFormatOf returns the kernels of a quantized dtype, or false.
func quantFormatOf(dt tensor.DType) (quantFormat, bool) {
	for _, f := range quantFormats {
		if f.dt == dt {
			return f, true
		}
	}
	return quantFormat{}, false
}

// gemvWarps is the warps of a GEMV block for rows of k elements: one per
// piece of a row, at most quantWarps.
func (f quantFormat) gemvWarps(k int) int {
	pieces := (k/f.dt.BlockSize() + f.pieceBlocks - 1) / f.pieceBlocks
	return max(1, min(quantWarps, pieces))
}
