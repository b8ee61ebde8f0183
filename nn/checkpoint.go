package nn

import (
	"fmt"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
)

// Recompute checkpoints trade compute for activation memory. With K
// segments the L decoder blocks are cut into K runs of consecutive blocks
// (the first L mod K of them one block longer). The forward keeps only the
// input of segments 0..K-2 and runs their blocks without keeping anything
// else; the last segment runs keeping every block's activations, since its
// backward follows at once. The backward then handles the segments last to
// first, re-running each earlier segment's forward from its kept input, this
// time keeping its activations, just before its backward. The gradients are
// those of the plain backward exactly: the re-run forward performs the same
// operations on the same inputs.
//
// What a block keeps for its backward is its input, both norm outputs, q
// and k after the rotary embedding, v, the attention output, the residual
// stream after attention, and the gate and up projections: 4 hidden, 2
// query, 2 key/value and 2 intermediate widths per position, all F32. The
// attention probabilities are recomputed from q and k, so nothing of size
// T² is kept.

// segmentBounds splits blocks into segments: segment j covers blocks
// b[j]..b[j+1]-1. segments <= 1 gives one segment.
func segmentBounds(blocks, segments int) ([]int, error) {
	if segments <= 1 {
		return []int{0, blocks}, nil
	}
	if segments > blocks {
		return nil, fmt.Errorf("nn: %d checkpoint segments for %d decoder blocks: at most one segment per block", segments, blocks)
	}
	per, extra := blocks/segments, blocks%segments
	b := make([]int, segments+1)
	for j := 1; j <= segments; j++ {
		b[j] = b[j-1] + per
		if j <= extra {
			b[j]++
		}
	}
	return b, nil
}

// TrainActivationBytes is the peak activation memory of a Trainer's
// LossAndGrads over tokens positions with the given number of checkpoint
// segments, as its Allocator counts it (paging.Activations). It is the
// largest of
//
//   - the head's step: the kept inputs of segments 0..K-2, the backward
//     workspace, the last segment's kept activations, the last block's
//     output, the final norm's output and one chunk of logits;
//   - the re-run of segment j < K-1: the inputs of segments 0..j-1, the
//     workspace and segment j's kept activations;
//   - the forward of segments 0..K-2: their inputs and one block's buffers.
//
// It returns 0 for an invalid number of segments or tokens.
func TrainActivationBytes(c *arch.Config, tokens, segments int) int64 {
	bounds, err := segmentBounds(c.NumLayers, segments)
	if err != nil || tokens <= 0 {
		return 0
	}
	H, QD, KVD, I := int64(c.HiddenSize), int64(c.QDim()), int64(c.KVDim()), int64(c.IntermediateSize)
	kept := 4*H + 2*QD + 2*KVD + 2*I    // per block
	scratch := 3*H + 2*QD + 2*KVD + 2*I // one block, nothing kept
	work := 2*H + 2*I + 2*QD + 2*KVD    // the backward's buffers
	K := int64(len(bounds) - 1)
	size := func(j int) int64 { return int64(bounds[j+1] - bounds[j]) }

	T := int64(tokens)
	logits := int64(headRows(tokens, c.VocabSize)) * int64(c.VocabSize)
	peak := T*((K-1)*H+work+size(int(K-1))*kept+2*H) + logits
	if K > 1 {
		peak = max(peak, T*((K-1)*H+scratch))
	}
	for j := 0; j < int(K)-1; j++ {
		peak = max(peak, T*(int64(j)*H+work+size(j)*kept))
	}
	return 4 * peak
}

// TrainGradientBytes is the most gradient memory a Trainer holds on a
// device backend at once, charged to paging.Gradients: one layer's
// gradients in F32, the largest layer's (a decoder block's, or the LM head's
// with the final norm). On the CPU backend the gradients accumulate in host
// memory and nothing is charged.
func TrainGradientBytes(c *arch.Config) int64 {
	var most int64
	for _, layer := range []int{c.BlockLayer(0), c.HeadLayer()} {
		var n int64
		for _, s := range c.LayerTensors(layer) {
			n += s.Shape.NumElements()
		}
		most = max(most, n)
	}
	return 4 * most
}

// TrainWorkspaceBytes is the memory beside the weights that a Trainer's
// LossAndGrads over tokens positions with the given number of checkpoint
// segments allocates from its model's Allocator at most on any backend: the
// activations (TrainActivationBytes) and its three rotary tables (cos, sin
// and -sin). A device backend adds one layer's gradients
// (TrainGradientBytes). TrainReserve gives their sum to the planner.
func TrainWorkspaceBytes(c *arch.Config, tokens, segments int) int64 {
	return TrainActivationBytes(c, tokens, segments) + RopeBytes(c, tokens)*3/2 // RopeBytes counts two tables
}

// TrainReserve is what a Trainer's LossAndGrads over tokens positions with
// the given number of checkpoint segments allocates beside the weights, for
// paging's planner: its activations at their peak (TrainActivationBytes,
// many tensors, counted as one), its three rotary tables, and with
// gradientsOnDevice (a device backend) one layer's gradients
// (TrainGradientBytes, counted as one). A Trainer keeps no KV cache.
func TrainReserve(c *arch.Config, tokens, segments int, gradientsOnDevice bool) paging.Reserve {
	r := paging.Reserve{
		{Category: paging.Activations, Bytes: TrainActivationBytes(c, tokens, segments), Per: paging.Once, Count: 1},
		{Category: paging.Workspace, Bytes: 4 * int64(tokens) * int64(c.HeadDim/2), Per: paging.Once, Count: 3},
	}
	if gradientsOnDevice {
		r = append(r, paging.Buffer{Category: paging.Gradients, Bytes: TrainGradientBytes(c), Per: paging.Once, Count: 1})
	}
	return r
}
