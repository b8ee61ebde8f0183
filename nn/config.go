package nn

import (
	"fmt"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
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

// KVCacheBytes is the F32 key and value cache for maxPos positions.
func KVCacheBytes(c *arch.Config, maxPos int) int64 {
	return 2 * 4 * int64(c.NumLayers) * int64(maxPos) * int64(c.KVDim())
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
func Reserve(c *arch.Config) paging.Reserve {
	row := func(n int) int64 { return 4 * int64(n) }
	return append(paging.Reserve{
		{Category: paging.KVCache, Bytes: row(c.KVDim()), Per: paging.PerPosition, Count: 2, PerBlock: true},
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
