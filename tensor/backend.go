package tensor

import (
	"errors"
	"fmt"
	"strings"
)

// ErrOutOfMemory is returned (wrapped) when a backend or a budget cannot
// satisfy an allocation. Callers branch on it with errors.Is.
var ErrOutOfMemory = errors.New("out of memory")

// ErrQuantized is wrapped by the error of an operation given a quantized
// tensor where it takes a float one: only MatMul's w and Embed's table may
// be quantized, and training (GradOps) needs float weights.
var ErrQuantized = errors.New("quantized operand")

// Memory is the part of a backend that holds tensors: allocation and
// copies between host and device. It is all that code placing and moving
// weights (package paging) needs.
type Memory interface {
	// Name identifies the device ("cpu", "cuda:0").
	Name() string
	// Alloc returns an uninitialised tensor in the backend's memory.
	Alloc(dt DType, shape Shape) (*Tensor, error)
	// Free releases a tensor from Alloc. Freeing nil is a no-op.
	Free(t *Tensor)
	// Upload copies len(src) bytes of host memory into dst, starting at
	// byte offset off of dst.
	Upload(dst *Tensor, off int64, src []byte) error
	// Download copies src's bytes into dst (len(dst) == src.NumBytes()),
	// waiting for pending work on src.
	Download(dst []byte, src *Tensor) error
	// Close releases everything the backend holds; its tensors become
	// invalid. Closing twice is a no-op.
	Close() error
}

// Kernels are the compute operations the decoder needs. Shapes are given as
// [rows, columns]; every tensor is contiguous and row-major. Activations
// are F32; weight arguments (w, table, bias, norm weights) may be F32, F16
// or BF16 and are read in their stored type with F32 accumulation: no F32
// copy of a weight is ever made.
//
// MatMul's w and Embed's table may also be quantized: one of ggml's block
// formats (DType.IsQuantized) other than Q8_K, which is ggml's format of
// the activations in the K formats' products and no weight's. They are read in
// their stored blocks. Embed's rows are the dequantized values exactly
// (quant's Dequantize). MatMul's product is that over the dequantized
// weights, within the error of rounding each row of x to 16 bits per
// block as the CPU's integer product does (quant.QuantizeRow: blocks of 32
// elements for the 32-element formats, of 256 for the K formats): on
// normal activations a relative RMS error of about 0.004% of the product
// for blocks of 32 and 0.005% for blocks of 256, twice that when a few
// channels are 20 times larger than the rest, as real hidden states' are.
// A backend may compute it more exactly. One that quantizes x refuses
// activations holding a NaN or an infinity with an error
// wrapping quant.ErrNotFinite. No other operand of any operation may be
// quantized (ErrQuantized).
//
// A backend's kernels do not check their arguments beyond what their own
// memory safety needs (that the operands are the backend's memory): the
// rules written here are checked once, in front of every backend, by
// Checked, and a kernel called directly with arguments that break them may
// fail in any way. Operations may run asynchronously on a device; Download
// synchronises.
type Kernels interface {
	// MatMul computes out[M,N] = x[M,K] · w[N,K]ᵀ (+ bias[N] on every row
	// when bias is non-nil). w is in Hugging Face's [out_features,
	// in_features] layout.
	MatMul(out, x, w, bias *Tensor) error
	// RMSNorm computes out[i,:] = x[i,:] / sqrt(mean(x[i,:]²) + eps) * w.
	RMSNorm(out, x, w *Tensor, eps float32) error
	// Rope rotates x[T, r.Heads*r.HeadDim] in place by the rotary
	// embedding r (see Rotary).
	Rope(x *Tensor, r Rotary) error
	// SiLUMul computes out = silu(gate) * up, elementwise.
	SiLUMul(out, gate, up *Tensor) error
	// Add computes out = a + b, elementwise (out may alias a or b).
	Add(out, a, b *Tensor) error
	// Embed gathers rows: out[i,:] = table[ids[i],:] converted to F32.
	// An id outside the table is an error.
	Embed(out, table *Tensor, ids []int32) error
	// CopyRows copies n rows of src starting at row srcRow into dst starting
	// at row dstRow; both have the same row length (the product of all but
	// the first dimension) and dtype. It is also the KV cache's append: src
	// F32 and dst a cache dtype (IsCacheDType) other than F32 converts the
	// rows on the way, F16 and BF16 rounded to nearest even, Q8_0 and Q8_B8
	// quantized block by block as quant.QuantizeQ8_0 and quant.QuantizeQ8B8
	// do (the rows whole blocks);
	// such a dst must not overlap src.
	CopyRows(dst *Tensor, dstRow int, src *Tensor, srcRow, n int) error
	// Attention computes causal grouped-query attention (see Attn) into
	// out [T, a.Heads*a.HeadDim] F32.
	Attention(out *Tensor, a Attn) error
	// AttentionBlocks writes the keys and values of the rows of several
	// sequences into a cache of fixed-size blocks and computes their
	// causal grouped-query attention over it (see AttnBlocks) into out
	// [T, a.Heads*a.HeadDim] F32.
	AttentionBlocks(out *Tensor, a AttnBlocks) error
}

// Backend is a device: its memory and the kernels that compute on it. All
// tensors passed to a backend's kernels must have been allocated by that
// backend (or, for the CPU backend, be host tensors).
type Backend interface {
	Memory
	Kernels
}

// Rotary is the rotary position embedding of Rope. Row t of x is at
// position Pos0+t, and each of its Heads heads of HeadDim (even)
// dimensions is rotated by the angles of that position, read from the F32
// tables Cos and Sin [maxPos, HeadDim/2]. The pairs are (j, j+HeadDim/2),
// Hugging Face's rotate_half convention.
//
// PosAt, when set, holds the position of row 0 instead (see PosAt).
type Rotary struct {
	Cos, Sin             *Tensor
	Heads, HeadDim, Pos0 int
	PosAt                *Tensor
}

// Attn is causal grouped-query attention, for T queries at positions
// Pos0..Pos0+T-1. Q is [T, Heads*HeadDim] F32; K and V are the caches
// [maxPos, KVHeads*HeadDim] holding positions 0..Pos0+T-1, both of one
// cache dtype (IsCacheDType: F32, F16, BF16, or Q8_0 or Q8_B8 with rows of
// whole blocks; a backend may read fewer, and says so with an error).
// Query row t sees positions 0..Pos0+t; query head h reads KV head
// h/(Heads/KVHeads), so KVHeads divides Heads. Scores are scaled by Scale
// (not NaN) and softmaxed in F32.
//
// PosAt, when set, holds the position of query row 0 instead (see PosAt).
//
// A backend may compute the products of scores and values with inputs
// rounded to F16 or BF16 (tensor cores) and F32 accumulation, an error of
// about 1e-3 relative; Precise asks for F32 throughout, as training's
// forward does (its gradients are held to an F32 reference).
type Attn struct {
	Q, K, V                       *Tensor
	Heads, KVHeads, HeadDim, Pos0 int
	Scale                         float32
	PosAt                         *Tensor
	Precise                       bool
}

// IsCacheDType reports whether a KV cache may be stored in dt: F32, F16,
// BF16, Q8_0 (ggml's blocks of 32 values with one F16 scale each, 34
// bytes: 8.5 bits a value) or Q8_B8 (blocks of 8 values with one F16
// scale each, 10 bytes: 10 bits a value, quant.Q8B8), the blocks laid
// along a cache row, so that a head of a multiple of the block size has
// scales of its own and smaller heads share blocks. Attention reads such
// caches; CopyRows appends F32 rows to them.
//
// Of the 8-bit caches, Q8_B8 is the one to use: on the synthesised
// TinyLlama-1.1B shape over 271 positions its logits are within 0.89%
// relative RMS of those over an F16 cache, Q8_0's within 1.23%
// (nn's TestKVDTypeLong). Most of that error is the values' (V alone in
// Q8_0: 1.16%, K alone 0.39%); a scale per 8 values rather than 32 narrows
// the step of the values it covers.
func IsCacheDType(dt DType) bool {
	return dt == F32 || dt == F16 || dt == BF16 || dt == Q8_0 || dt == Q8_B8
}

// ParseCacheDType reads a KV cache dtype by name: f32, f16, bf16, q8_0 or
// q8_b8 (any case); "" is F32.
func ParseCacheDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "f32":
		return F32, nil
	case "f16":
		return F16, nil
	case "bf16":
		return BF16, nil
	case "q8_0":
		return Q8_0, nil
	case "q8_b8":
		return Q8_B8, nil
	}
	return Invalid, fmt.Errorf("tensor: unknown KV cache dtype %q (want f32, f16, bf16, q8_0 or q8_b8)", s)
}

// AttnBlocks is causal grouped-query attention for the rows of several
// sequences whose keys and values live in a paged cache: two pools, KPool
// and VPool [blocks*BlockSize, KVHeads*HeadDim] of one cache dtype
// (IsCacheDType; a Q8_0 or Q8_B8 row whole blocks; a backend may read
// fewer, and says so with an error), cut into
// blocks of BlockSize positions that the sequences share out, each
// sequence finding its positions through its block table: position j of a
// sequence is row Blocks[j/BlockSize]*BlockSize + j%BlockSize of the pools.
//
// Q [T, Heads*HeadDim] F32 holds the sequences' rows one sequence after
// another in the order of Seqs, and K and V [T, KVHeads*HeadDim] F32 those
// rows' keys and values. The operation first writes each row's key and
// value into the pools at the row's position (converted as CopyRows
// converts a cache append), then row r of a sequence,
// at position Pos0+r, attends to the sequence's positions 0..Pos0+r. So a
// row's result is what Attention gives it over a contiguous cache of the
// same positions. Heads, KVHeads, HeadDim and Scale are as in Attn.
//
// A block a sequence's rows are written into is that sequence's alone in
// the call: no other sequence's table lists it among the blocks it reads.
// Sequences may share the blocks they only read (a common prefix).
type AttnBlocks struct {
	Q, K, V      *Tensor
	KPool, VPool *Tensor
	Seqs         []SeqBlocks
	Heads        int
	KVHeads      int
	HeadDim      int
	BlockSize    int
	Scale        float32
}

// SeqBlocks is one sequence of AttnBlocks: its next Rows rows of Q, K and
// V, at positions Pos0..Pos0+Rows-1, and its block table, whose first
// entries cover positions 0..Pos0+Rows-1 (further entries are not read).
type SeqBlocks struct {
	Rows, Pos0 int
	Blocks     []int32
}
