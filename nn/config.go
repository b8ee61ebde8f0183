package nn

import (
	"fmt"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// checkContext refuses a context of n positions longer than the model's,
// naming the limit that applies.
func checkContext(c *arch.Config, what string, n int) error {
	limit := c.ContextLength()
	if limit == 0 || n <= limit {
		return nil
	}
	if limit == c.SlidingWindow {
		return &contextError{fmt.Sprintf("nn: %s of %d positions exceeds the sliding attention window of %d (sliding_window), which strata does not implement", what, n, limit)}
	}
	return &contextError{fmt.Sprintf("nn: %s of %d positions exceeds the model's context of %d (max_position_embeddings)", what, n, limit)}
}

// contextError is a context longer than the model's.
type contextError struct{ msg string }

func (e *contextError) Error() string { return e.msg }
func (e *contextError) Unwrap() error { return ErrContextTooLong }

// ActivationBytes is what one session's forward buffers take for chunks of
// up to chunk tokens: the residual stream, norm output, q, k, v, attention
// output, projection output, gate and up (of the widest MLP, dense or
// expert), logits, and for a mixture of experts the buffers of its routing
// and its experts' outputs, all F32.
func ActivationBytes(c *arch.Config, chunk int) int64 {
	perTok := 3*c.HiddenSize + 2*c.QDim() + 2*c.KVDim() + 2*c.MLPSize() + c.VocabSize
	n := 4 * int64(chunk) * int64(perTok)
	for _, b := range moeReserve(c) {
		n += int64(chunk) * b.Bytes * int64(b.Count)
	}
	return n
}

// KVCacheBytes is the key and value cache for maxPos positions stored in
// dt (a tensor.IsCacheDType: F32, F16, BF16, Q8_0 or Q8_B8).
func KVCacheBytes(c *arch.Config, maxPos int, dt tensor.DType) int64 {
	return 2 * int64(c.NumLayers) * int64(maxPos) * kvRowBytes(c, dt)
}

// kvRowBytes is one position's keys (or values) of one block stored in dt;
// a Q8_0 or Q8_B8 row that is not whole blocks (which CheckKVDType refuses) is
// counted as if rounded up to them.
func kvRowBytes(c *arch.Config, dt tensor.DType) int64 {
	bs, bb := int64(dt.BlockSize()), int64(dt.BlockBytes())
	if bs == 0 {
		bs, bb = 1, 4
	}
	return (int64(c.KVDim()) + bs - 1) / bs * bb
}

// SessionOptions are a session's choices beyond its sizes.
type SessionOptions struct {
	// KVDType is the stored dtype of the KV cache: F32 (also the zero
	// value's), F16, BF16 (the K and V rows rounded to nearest even, as
	// transformers caches them in a model's dtype), Q8_B8 (blocks of 8
	// values along a cache row, each with an F16 scale: 10 bits a value,
	// a head of 128 dimensions has 16 scales a position) or Q8_0 (blocks
	// of 32: 8.5 bits a value). Of the two 8-bit caches Q8_B8 keeps the
	// logits within 1% of an F16 cache's on the 1.1B shape (0.89%
	// relative RMS, Q8_0 1.23%: tensor.IsCacheDType). The attention reads
	// it in its stored dtype; the append converts.
	KVDType tensor.DType
}

// kvDType is o's KV dtype, F32 when unset.
func (o SessionOptions) kvDType() tensor.DType {
	if o.KVDType == tensor.Invalid {
		return tensor.F32
	}
	return o.KVDType
}

// CheckKVDType refuses a KV cache dtype the model cannot store its cache
// in: one that is not a cache dtype, or Q8_0 or Q8_B8 when a position's
// keys (KVDim) are not whole blocks of 32 or 8.
func CheckKVDType(c *arch.Config, dt tensor.DType) error {
	if dt == tensor.Invalid {
		return nil
	}
	if !tensor.IsCacheDType(dt) {
		return fmt.Errorf("nn: a KV cache in %v: the cache dtypes are F32, F16, BF16, Q8_0 and Q8_B8", dt)
	}
	if bs := dt.BlockSize(); c.KVDim()%bs != 0 {
		return fmt.Errorf("nn: a KV cache in %v needs rows of whole blocks of %d values; this model's are %d (%d KV heads of %d)", dt, bs, c.KVDim(), c.NumKVHeads, c.HeadDim)
	}
	return nil
}

// RopeBytes is the cos and sin tables for maxPos positions, F32
// [maxPos, HeadDim/2] each.
func RopeBytes(c *arch.Config, maxPos int) int64 { return 2 * 4 * int64(maxPos) * int64(c.HeadDim/2) }

// Reserve is what a Session allocates from its model's Allocator beside the
// weights, buffer by buffer, for paging's planner: for each block keys and
// values [maxPos, KVDim] (KVCacheBytes), the rotary tables cos and sin
// [maxPos, HeadDim/2] (RopeBytes, charged to Workspace), and the forward
// buffers of a chunk (ActivationBytes): x, the norm's output and the
// projection's [chunk, Hidden], q and the attention's output [chunk, QDim],
// k and v [chunk, KVDim], gate and up [chunk, MLPSize], on the stage that
// holds the LM head the logits [chunk, Vocab], and the mixture of experts'
// buffers. All F32; and the position decode graphs read
// (GraphPositionBytes, Workspace), one I32.
func Reserve(c *arch.Config) paging.Reserve { return ReserveKV(c, tensor.F32) }

// ReserveKV is Reserve with the KV cache stored in kv (SessionOptions).
func ReserveKV(c *arch.Config, kv tensor.DType) paging.Reserve {
	row := func(n int) int64 { return 4 * int64(n) }
	return append(paging.Reserve{
		{Category: paging.KVCache, Bytes: kvRowBytes(c, kv), Per: paging.PerPosition, Count: 2, PerBlock: true},
		{Category: paging.Workspace, Bytes: row(c.HeadDim / 2), Per: paging.PerPosition, Count: 2},
		{Category: paging.Activations, Bytes: row(c.HiddenSize), Per: paging.PerToken, Count: 3},
		{Category: paging.Activations, Bytes: row(c.QDim()), Per: paging.PerToken, Count: 2},
		{Category: paging.Activations, Bytes: row(c.KVDim()), Per: paging.PerToken, Count: 2},
		{Category: paging.Activations, Bytes: row(c.MLPSize()), Per: paging.PerToken, Count: 2},
		{Category: paging.Activations, Bytes: row(c.VocabSize), Per: paging.PerToken, Count: 1, LastLayer: true},
		// The position decode graphs read (graph.go).
		{Category: paging.Workspace, Bytes: GraphPositionBytes, Per: paging.PerSequence, Count: 1},
	}, moeReserve(c)...)
}
