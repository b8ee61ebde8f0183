package nn

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

// TimeBlock times decoder block `block` of cfg computed alone on b, as a
// CPU stage of a hybrid placement computes it in decode: one token
// attending over pos earlier positions (its KV cache stored in o's dtype),
// the weights taken from w's copies in turn, one copy a step, so that a
// host whose last-level cache holds one block's weights reads them from
// memory as the model's run does. It returns the shortest of n steps
// (BlockTimer.Step, the hidden state's upload included), after one
// untimed step over each copy. The hidden state is a small constant and
// the KV cache zeros: the time, not the values, is the point. A sparse
// block (a mixture of experts) is refused.
func TimeBlock(ctx context.Context, cfg *arch.Config, b tensor.Backend, w []LayerWeights, block, pos, n int, o SessionOptions) (time.Duration, error) {
	if n <= 0 {
		return 0, fmt.Errorf("nn: timing block %d at position %d: %d steps", block, pos, n)
	}
	bt, err := NewBlockTimer(ctx, cfg, b, w, block, pos, o)
	if err != nil {
		return 0, err
	}
	defer bt.Close()
	ts := make([]time.Duration, 0, n)
	for range n {
		t0 := time.Now()
		if err := bt.Step(ctx); err != nil {
			return 0, err
		}
		ts = append(ts, time.Since(t0))
	}
	return slices.Min(ts), nil
}

// BlockTimer runs the steps TimeBlock times one at a time, for a caller
// that times them itself (interleaved with other timings, or with a clock
// of its own).
type BlockTimer struct {
	m     *Model
	s     *Session
	x     []float32
	pos   int
	block int
}

// NewBlockTimer prepares decoder block `block` of cfg on b for Step, as
// TimeBlock describes, and runs the untimed step over each copy of w. Its
// caller closes it.
func NewBlockTimer(ctx context.Context, cfg *arch.Config, b tensor.Backend, w []LayerWeights, block, pos int, o SessionOptions) (*BlockTimer, error) {
	if cfg == nil {
		return nil, fmt.Errorf("nn: timing a block: no config")
	}
	if len(w) == 0 || pos < 0 || block < 0 || block >= cfg.NumLayers {
		return nil, fmt.Errorf("nn: timing block %d of %d at position %d: %d copies of its weights", block, cfg.NumLayers, pos, len(w))
	}
	if cfg.Sparse(block) {
		return nil, fmt.Errorf("nn: timing block %d: a sparse block's experts are not timed", block)
	}
	cw := &cyclingWeights{w: w}
	m, err := New(cfg, b, nil, cw)
	if err != nil {
		return nil, err
	}
	m.lo, m.hi = block, block+1
	s, err := m.NewSessionWith(pos+1, 1, o)
	if err != nil {
		return nil, err
	}
	// The KV cache's pages are written, so that the attention reads
	// memory, not the zero page of rows never written (and, on a
	// device, zeros, not what the memory held before).
	for _, t := range []*tensor.Tensor{s.k[0], s.v[0]} {
		if t.OnHost() {
			clear(t.Bytes())
		} else if err := b.Upload(t, 0, make([]byte, t.NumBytes())); err != nil {
			s.Close()
			return nil, fmt.Errorf("nn: timing block %d: %w", block, err)
		}
	}
	bt := &BlockTimer{m: m, s: s, x: make([]float32, cfg.HiddenSize), pos: pos, block: block}
	for i := range bt.x {
		bt.x[i] = 0.01 * float32(i%7+1)
	}
	for range w {
		if err := bt.Step(ctx); err != nil {
			s.Close()
			return nil, err
		}
	}
	return bt, nil
}

// Step computes the block for one token over the next copy of its
// weights: the hidden state's upload, the block, and a wait for the
// backend to finish.
func (bt *BlockTimer) Step(ctx context.Context) error {
	if err := uploadF32(bt.m.backend, bt.s.viewsFor(1).x, bt.x); err != nil {
		return fmt.Errorf("nn: timing block %d: %w", bt.block, err)
	}
	bt.s.pos = bt.pos
	if err := bt.s.blocksChunk(ctx, 1, nil, false); err != nil {
		return fmt.Errorf("nn: timing block %d: %w", bt.block, err)
	}
	if err := tensor.Sync(bt.m.backend); err != nil {
		return fmt.Errorf("nn: timing block %d: %w", bt.block, err)
	}
	return nil
}

// Close frees the block's session (its KV cache and activations).
func (bt *BlockTimer) Close() { bt.s.Close() }

// cyclingWeights serves one of its copies of a layer's weights at each
// Acquire, in turn.
type cyclingWeights struct {
	w    []LayerWeights
	next int
}

func (c *cyclingWeights) Acquire(context.Context, int) (LayerWeights, error) {
	lw := c.w[c.next%len(c.w)]
	c.next++
	return lw, nil
}

func (c *cyclingWeights) Release(int) {}
