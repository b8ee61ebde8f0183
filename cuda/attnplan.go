package cuda

import (
	"fmt"
	"strconv"

	"github.com/strata-llm/strata/tensor"
)

// Attention's choice of kernel, in a file of its own (no build tag) so that
// it is tested, and the host harness of the kernels (attnhost_test.go) runs
// them as planned, without cgo.

// The attention kernels' choices (kernels/attention_split.cuh and
// flash_attention.cuh).
const (
	// splitMaxRows is the most queries the decode kernel takes: it
	// reads the cache once per query, the tiled kernel once per 64.
	splitMaxRows = 4
	// splitChunk is the fewest positions a block of the decode kernel
	// walks by default (SplitChunkEnv sets another); a cache of up to
	// this many positions takes one block a head. A block walks its
	// positions 8 (head of 128) or 16 (of 64) a warp step, two steps a
	// round of loads: 256 positions were 8 to 16 dependent rounds, the
	// kernel bound by their latency (25 us for a 7B layer at 1,000
	// positions, 27% of the HBM rate, Nsight Compute on the H200).
	splitChunk = 64
	// splitWarps and splitSteps are the split kernel's SPLIT_WARPS (its
	// blocks' warps) and SPLIT_STEPS (positions a lane group loads at
	// once).
	splitWarps = 4
	splitSteps = 4
	// splitMax is the most splits of a query's positions: longer caches
	// take longer chunks, so the partials stay small.
	splitMax = 128
	// flashMinRows is the fewest queries the tiled prefill kernel takes.
	flashMinRows = 16
	// splitCounts is how many heads × queries the split kernel's blocks
	// can count themselves for (Backend.splitCount); more take a merge
	// launch of their own.
	splitCounts = 16384
	// splitPartBytes bounds the split kernel's partial results (heads ×
	// queries × splits records of headDim+2 floats), which live in the
	// scratch arena: half of it.
	splitPartBytes = 16 << 20
)

// attnPlan is how Attention runs a call: its kernel, and for the decode
// kernel the chunk and number of splits of each query's positions.
type attnPlan struct {
	kernel        string
	chunk, splits int
}

// planAttention chooses Attention's kernel: for head dimensions of 64 and
// 128 (flash) or 64, 128 and 256 (split), the tiled tensor-core kernel for
// prefill of at least flashMinRows queries where the device has it
// (compute capability 8.0), the split decode kernel for up to
// splitMaxRows queries, splitting the positions when the cache is longer
// than chunk (splitChunk unless set otherwise); the one-block-a-query
// kernel otherwise. The vector
// loads of the new kernels need q and the caches 16-byte aligned. A
// precise call (tensor.Attn.Precise) never takes the tensor-core kernel.
// has reports whether a kernel is loaded.
func planAttention(t, heads, headDim, pos0 int, dt tensor.DType, aligned, precise bool, chunk int, has func(string) bool) attnPlan {
	sfx := cacheSuffix(dt)
	old := attnPlan{kernel: "attention_" + sfx}
	if !aligned {
		return old
	}
	d := fmt.Sprintf("_d%d", headDim)
	if !precise && t >= flashMinRows && (headDim == 64 || headDim == 128) && has("flash_attention_"+sfx+d) {
		return attnPlan{kernel: "flash_attention_" + sfx + d}
	}
	if t > splitMaxRows || headDim != 64 && headDim != 128 && headDim != 256 {
		return old
	}
	// Chunks of chunk positions (a 7B layer at 8,192 positions: 128
	// splits of 32 heads, each block with two steps of loads in flight a
	// warp), at most splitMax of them.
	n := pos0 + t // the longest query's positions
	splits := min((n+chunk-1)/chunk, splitMax, max(1, splitPartBytes/(heads*t*(headDim+2)*4)))
	// Whole passes of the kernel a chunk: 8,193 positions in 128 chunks
	// of 65 ran 96 positions' work a block (two passes of 32 and one with
	// a position).
	pass := splitPass(headDim, dt)
	chunk = ((n+splits-1)/splits + pass - 1) / pass * pass
	return attnPlan{kernel: "attention_split_" + sfx + d, chunk: chunk, splits: (n + chunk - 1) / chunk}
}

// splitPass is how many positions a block of the split decode kernel
// takes a pass (attention_split.cuh): SPLIT_WARPS warps of 32/(headDim/8)
// lane groups, split_steps positions each (2 for an F32 cache, else
// SPLIT_STEPS, 4).
func splitPass(headDim int, dt tensor.DType) int {
	steps := splitSteps
	if dt == tensor.F32 {
		steps = 2
	}
	return splitWarps * 32 / (headDim / 8) * steps
}

// SplitChunkEnv names the environment variable that sets the positions a
// block of the decode attention walks (planAttention's chunk): a number
// from 1 to 4096; empty for splitChunk.
const SplitChunkEnv = "STRATA_CUDA_SPLIT_CHUNK"

// splitChunkNamed parses SplitChunkEnv's value.
func splitChunkNamed(v string) (int, error) {
	if v == "" {
		return splitChunk, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 4096 {
		return 0, fmt.Errorf("cuda: %s=%q: want a number of positions from 1 to 4096", SplitChunkEnv, v)
	}
	return n, nil
}

// cacheSuffix names a kernel variant by its cache dtype.
func cacheSuffix(dt tensor.DType) string {
	switch dt {
	case tensor.F16:
		return "f16"
	case tensor.BF16:
		return "bf16"
	case tensor.Q8_0:
		return "q8_0"
	case tensor.Q8_B8:
		return "q8_b8"
	}
	return "f32"
}

// blocksMeta is the table the AttentionBlocks kernels read for the t rows
// of at: each row's pool row, its position, the offset of its sequence's
// block table, then the tables (the entries that cover each sequence's
// positions).
func blocksMeta(at tensor.AttnBlocks, t int) []int32 {
	meta := make([]int32, 3*t, 3*t+t)
	bs, row := at.BlockSize, 0
	for _, s := range at.Seqs {
		if s.Rows == 0 {
			continue
		}
		off := int32(len(meta))
		meta = append(meta, s.Blocks[:(s.Pos0+s.Rows+bs-1)/bs]...)
		for r := range s.Rows {
			p := s.Pos0 + r
			meta[row] = s.Blocks[p/bs]*int32(bs) + int32(p%bs)
			meta[t+row] = int32(p)
			meta[2*t+row] = off
			row++
		}
	}
	return meta
}
