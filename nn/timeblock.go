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
// memory as the model's run does. It returns the shortest of n steps,
// after one untimed step over each copy. The hidden state is a small
// constant and the KV cache zeros: the time, not the values, is the
// point. A sparse block (a mixture of experts) is refused.
func TimeBlock(ctx context.Context, cfg *arch.Config, b tensor.Backend, w []LayerWeights, block, pos, n int, o SessionOptions) (time.Duration, error) {
	if cfg == nil {
		return 0, fmt.Errorf("nn: timing a block: no config")
	}
	if len(w) == 0 || n <= 0 || pos < 0 || block < 0 || block >= cfg.NumLayers {
		return 0, fmt.Errorf("nn: timing block %d of %d at position %d: %d copies of its weights, %d steps", block, cfg.NumLayers, pos, len(w), n)
	}
	if cfg.Sparse(block) {
		return 0, fmt.Errorf("nn: timing block %d: a sparse block's experts are not timed", block)
	}
	cw := &cyclingWeights{w: w}
	m, err := New(cfg, b, nil, cw)
	if err != nil {
		return 0, err
	}
	m.lo, m.hi = block, block+1
	s, err := m.NewSessionWith(pos+1, 1, o)
	if err != nil {
		return 0, err
	}
	defer s.Close()
	// The KV cache's pages are written, so that the attention reads
	// memory, not the zero page of rows never written.
	for _, t := range []*tensor.Tensor{s.k[0], s.v[0]} {
		if t.OnHost() {
			clear(t.Bytes())
		}
	}
	x := make([]float32, cfg.HiddenSize)
	for i := range x {
		x[i] = 0.01 * float32(i%7+1)
	}
	step := func() (time.Duration, error) {
		if err := uploadF32(m.backend, s.viewsFor(1).x, x); err != nil {
			return 0, err
		}
		s.pos = pos
		t0 := time.Now()
		if err := s.blocksChunk(ctx, 1, nil, false); err != nil {
			return 0, err
		}
		if err := tensor.Sync(m.backend); err != nil {
			return 0, err
		}
		return time.Since(t0), nil
	}
	for range w {
		if _, err := step(); err != nil {
			return 0, fmt.Errorf("nn: timing block %d: %w", block, err)
		}
	}
	ts := make([]time.Duration, 0, n)
	for range n {
		d, err := step()
		if err != nil {
			return 0, fmt.Errorf("nn: timing block %d: %w", block, err)
		}
		ts = append(ts, d)
	}
	return slices.Min(ts), nil
}

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
