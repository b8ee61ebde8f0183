package cuda

import (
	"fmt"
	"strings"

	"github.com/strata-llm/strata/tensor"
)

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
	// xrows1 is I::ROWS1 of kernels/quantx.cuh: the rows of w an integer
	// GEMV block takes at a time for one row of x.
	xrows1 int
	// direct: the format has the direct GEMV kernels of
	// kernels/quantd.cuh (gemvd_<name>, gemvd8_<name>) for one row of x.
	direct bool
	// xrowsWide is the rows of w a block of gemvx_<name>_m1w takes at a
	// time (QUANT_GEMVX_WIDE in kernels/gemvx_<name>.cu), or 0 where the
	// format has no such kernel.
	xrowsWide int
}

// quantFormats lists the formats with kernels, in the order of
// testdata/quanthost.cu's format numbers. Q8_K, an activation format of
// ggml that files do not store, has none.
var quantFormats = []quantFormat{
	{tensor.Q8_0, "q8_0", 32, false, 4, false, 2},
	{tensor.Q4_0, "q4_0", 32, false, 4, false, 2},
	{tensor.Q4_1, "q4_1", 32, false, 4, false, 2},
	{tensor.Q5_0, "q5_0", 32, false, 4, false, 2},
	{tensor.Q5_1, "q5_1", 32, false, 4, false, 2},
	{tensor.Q4_K, "q4_k", 8, true, 4, true, 0},
	{tensor.Q5_K, "q5_k", 8, true, 4, true, 0},
	{tensor.Q6_K, "q6_k", 8, false, 2, false, 1},
}

// Launch geometry of the quantized kernels (QWARPS and QROWS in
// kernels/quant.cuh): at most quantWarps warps a block, and quantRows rows
// of w a GEMV block at a time.
const (
	quantWarps = 4
	quantRows  = 4
)

// The integer GEMV (kernels/quantx.cuh): kernels for up to 1, 2, 4 and
// quantMaxRows rows of x, a block taking f.xRows(mm) rows of w at a time
// (QXROWS). The kernels are bounded to 128 registers, quantSMWarps warps
// an SM; MatMul launches about as many blocks as fit at once, and each
// loops over row groups, loading its next piece while it computes.
const (
	quantMaxRows = 8
	quantSMWarps = 16
	// quantSMWarpsWide is the warps an SM holds of gemvx_<f>_m1w (8 blocks
	// of 64 registers a thread).
	quantSMWarpsWide = 32
)

// qgemvKind is an integer GEMV of one row of x for a format with direct
// kernels (Backend.qgemv).
type qgemvKind int

const (
	// qgemvStaged: quantx16, then gemvx_<f>_m1, the kernel of quantx.cuh
	// that stages pieces of 4 rows in shared memory (the default until
	// session 5: 19.3 us for Q4_K N11008 x K4096 on the H200).
	qgemvStaged qgemvKind = iota
	// qgemvDirect: quantx16i, then gemvd_<f>_r<R>u<U>: R rows of w a warp
	// read straight from global memory, x rounded to 16 bits
	// (quantd.cuh). The default.
	qgemvDirect
	// qgemvDirect8: quantx8i, then gemvd8_<f>_r2u2: the same with x
	// rounded to 8 bits a 32 elements and dp4a (the product's error is
	// about 256 times qgemvDirect's; no faster on the H200).
	qgemvDirect8
)

func (k qgemvKind) String() string {
	switch k {
	case qgemvDirect:
		return "direct"
	case qgemvDirect8:
		return "direct8"
	case qgemvStaged:
		return "staged"
	}
	return fmt.Sprintf("qgemvKind(%d)", int(k))
}

// gemvdWarps is QDWARPS of kernels/quantd.cuh: the warps of a direct GEMV
// block, each taking a group of rows of w.
const gemvdWarps = 4

// gemvdVariant is an instantiation of the direct GEMV (QUANT_GEMVD in
// kernels/quantd.cuh): r rows of w a warp, u steps of loads in flight.
type gemvdVariant struct{ r, u int }

// gemvdVariants are the X16 instantiations of QUANT_GEMVD; keep the two
// lists together. gemvd8Variant is its one X8 instantiation.
var (
	gemvdVariants = []gemvdVariant{{1, 2}, {2, 1}, {2, 2}, {4, 1}, {1, 4}}
	gemvd8Variant = gemvdVariant{2, 2}
)

func (v gemvdVariant) String() string { return fmt.Sprintf("r%du%d", v.r, v.u) }

// QGEMVEnv names the environment variable that picks the integer GEMV of
// one row of x for Q4_K and Q5_K weights when a backend opens, so that a
// whole decode can be timed with each: "" for the default, "staged",
// "direct" (the variant by rows, gemvdAuto), "direct:r<R>u<U>" (one of
// gemvdVariants for every launch) or "direct8".
const QGEMVEnv = "STRATA_CUDA_QGEMV"

// Defaults of Backend.qgemv and Backend.qgemvD: the direct kernels, the
// variant by the launch's rows (gemvdAuto). Measured on the H200 (Nsight
// Compute, Q4_K, one row of x): 11008x4096 r2u1 11.5 us, r1u2 12.7, r2u2
// 13.0, staged gemvx_q4_k_m1 19.3; 4096x11008 r2u1 12.7, r1u2 13.0,
// staged 19.7; TinyLlama-1.1B Q4_K decode r1u2 963 tok/s, r2u1 919,
// staged 658 (bench, resident).
var (
	defaultQGEMV        = qgemvDirect
	defaultGEMVDVariant = gemvdVariant{}
)

// gemvdAuto is the direct kernel's variant for a launch of rows rows of
// w when none is set: two rows a warp where that still gives every SM
// its fill of warps (the 7B's 11008- and 12288-row launches), else one
// (TinyLlama's 2048-row products, the 7B's 4096).
func gemvdAuto(rows int) gemvdVariant {
	if rows >= 8192 {
		return gemvdVariant{2, 1}
	}
	return gemvdVariant{1, 2}
}

// qgemvNamed parses QGEMVEnv's value.
func qgemvNamed(s string) (qgemvKind, gemvdVariant, error) {
	kind, variant := defaultQGEMV, defaultGEMVDVariant
	name, v, hasV := strings.Cut(s, ":")
	switch name {
	case "":
		return kind, variant, nil
	case "staged":
		kind = qgemvStaged
	case "direct":
		kind = qgemvDirect
	case "direct8":
		kind, variant = qgemvDirect8, gemvd8Variant
	default:
		return 0, variant, fmt.Errorf("cuda: %s=%q names no integer GEMV (have staged, direct, direct:r<R>u<U>, direct8)", QGEMVEnv, s)
	}
	if hasV {
		if kind != qgemvDirect {
			return 0, variant, fmt.Errorf("cuda: %s=%q: only direct has variants", QGEMVEnv, s)
		}
		var names []string
		found := false
		for _, c := range gemvdVariants {
			names = append(names, c.String())
			if c.String() == v {
				variant, found = c, true
			}
		}
		if !found {
			return 0, variant, fmt.Errorf("cuda: %s=%q names no direct GEMV variant (have %s)", QGEMVEnv, s, strings.Join(names, ", "))
		}
	}
	return kind, variant, nil
}

// quantGEMVMaxRows is the largest M that MatMul sends to the integer GEMV
// rather than to cuBLAS for quantized weights (gemvMaxRows for the F32-x
// kernels of MatMulPrecise): one launch reads w once for up to 8 rows of
// x, where the prefill path writes and reads w again as F16, 3.6 (Q4_K)
// to 1.9 (Q8_0) times the stored bytes. BenchmarkQuantMatMulPaths
// measures the crossing.
const quantGEMVMaxRows = quantMaxRows

// gemvxRows returns the rows of x of the integer kernel that runs m (1..8)
// rows: the fewest of 1, 2, 4, 8 that hold them.
func gemvxRows(m int) int {
	mm := 1
	for mm < m {
		mm *= 2
	}
	return mm
}

// xRows is QXROWS: the rows of w an integer GEMV block takes at a time
// for the kernel of mm rows of x.
func (f quantFormat) xRows(mm int) int {
	switch mm {
	case 1:
		return f.xrows1
	case 2:
		return 2
	}
	return 1
}

// x16Geom places the X16 of rows rows of k elements in one allocation:
// the int16 levels from 0, the F32 scales (one a 32) from d, the int32
// sums (one a 16) from s, each 256-byte aligned; bytes in all.
type x16Geom struct{ d, s, bytes int64 }

func x16Layout(rows, k int) x16Geom {
	up := func(v int64) int64 { return (v + 255) &^ 255 }
	n := int64(rows) * int64(k)
	var g x16Geom
	g.d = up(2 * n)
	g.s = g.d + up(n/32*4)
	g.bytes = g.s + up(n/16*4)
	return g
}

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
