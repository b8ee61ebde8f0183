package nn

import (
	"context"
	"errors"
	"fmt"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Stage is one device's part of a Pipeline: the decoder blocks
// [FirstBlock, EndBlock) on Backend, with the embedding on the first stage
// and the final norm and LM head on the last. Weights serves the stage's
// layers in the model's numbering (StageWeights adapts a per-stage pager);
// Alloc charges the stage's KV cache and activations to its device budget.
type Stage struct {
	Backend              tensor.Backend
	Alloc                paging.Allocator
	Weights              Weights
	FirstBlock, EndBlock int
}

// Pipeline runs a model whose layers are spread over several devices in
// contiguous ranges: each token's hidden state passes from one stage to the
// next through host memory.
type Pipeline struct {
	cfg    arch.Config
	stages []*Model
}

// NewPipeline checks that the stages cover the decoder blocks in order,
// each at least one block, and returns the pipeline.
func NewPipeline(cfg *arch.Config, stages []Stage) (*Pipeline, error) {
	if cfg == nil {
		return nil, errors.New("nn: no config")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(stages) == 0 {
		return nil, errors.New("nn: pipeline with no stages")
	}
	p := &Pipeline{cfg: *cfg.Clone()}
	next := 0
	for i, st := range stages {
		if st.FirstBlock != next || st.EndBlock <= st.FirstBlock || st.EndBlock > cfg.NumLayers {
			return nil, fmt.Errorf("nn: pipeline stage %d holds blocks [%d, %d); want a non-empty range starting at %d within %d blocks",
				i, st.FirstBlock, st.EndBlock, next, cfg.NumLayers)
		}
		m, err := New(cfg, st.Backend, st.Alloc, st.Weights)
		if err != nil {
			return nil, err
		}
		m.lo, m.hi = st.FirstBlock, st.EndBlock
		p.stages = append(p.stages, m)
		next = st.EndBlock
	}
	if next != cfg.NumLayers {
		return nil, fmt.Errorf("nn: pipeline stages end at block %d of %d", next, cfg.NumLayers)
	}
	return p, nil
}

// Config returns a copy of the model's configuration.
func (p *Pipeline) Config() *arch.Config { return p.cfg.Clone() }

// PipelineSession is one sequence through a Pipeline: a Session per stage,
// each holding the KV cache of its own blocks.
type PipelineSession struct {
	p     *Pipeline
	sess  []*Session
	xfer  []byte // one chunk's hidden state on its way between stages
	chunk int
}

// NewSession allocates each stage's KV cache and buffers.
func (p *Pipeline) NewSession(maxPos, chunk int) (*PipelineSession, error) {
	if maxPos > 0 {
		if err := checkContext(&p.cfg, "session", maxPos); err != nil {
			return nil, err
		}
	}
	ps := &PipelineSession{p: p}
	for _, m := range p.stages {
		s, err := m.NewSession(maxPos, chunk)
		if err != nil {
			ps.Close()
			return nil, fmt.Errorf("nn: pipeline stage on %s: %w", m.backend.Name(), err)
		}
		ps.sess = append(ps.sess, s)
	}
	ps.chunk = ps.sess[0].chunk
	ps.xfer = make([]byte, 4*ps.chunk*p.cfg.HiddenSize)
	return ps, nil
}

// Pos is the number of positions processed.
func (ps *PipelineSession) Pos() int { return ps.sess[0].pos }

// Reset forgets the sequence.
func (ps *PipelineSession) Reset() {
	for _, s := range ps.sess {
		s.Reset()
	}
}

// Close frees every stage's buffers; it is safe to call more than once,
// and on a nil session.
func (ps *PipelineSession) Close() {
	if ps == nil {
		return
	}
	for _, s := range ps.sess {
		s.Close()
	}
}

// Forward is Session.Forward across the stages: the same logits as one
// device computing everything, and the same *NonFiniteError when they hold
// a NaN or an infinity.
func (ps *PipelineSession) Forward(ctx context.Context, ids []int32, all bool, hook Hook) ([]float32, error) {
	first, last := ps.sess[0], ps.sess[len(ps.sess)-1]
	if first.closed {
		return nil, errors.New("nn: session is closed")
	}
	if len(ids) == 0 {
		return nil, errors.New("nn: forward of no tokens")
	}
	if first.pos+len(ids) > first.maxPos {
		return nil, fmt.Errorf("%w: %d positions used, %d more asked, context is %d", ErrContextFull, first.pos, len(ids), first.maxPos)
	}
	for i, id := range ids {
		if id < 0 || int(id) >= ps.p.cfg.VocabSize {
			return nil, fmt.Errorf("nn: token id %d at position %d is outside the vocabulary of %d", id, i, ps.p.cfg.VocabSize)
		}
	}
	pos0, done := first.pos, false
	defer func() {
		if !done {
			for _, s := range ps.sess {
				s.pos = pos0
			}
		}
	}()
	out, err := ps.forward(ctx, ids, all, func(int) Hook { return hook })
	if err != nil {
		return nil, err
	}
	if firstNonFiniteF32(out) >= 0 {
		for _, s := range ps.sess {
			s.pos = pos0
		}
		d := &diagnosis{cfg: &ps.p.cfg, backendOf: ps.backendOf}
		out, err := ps.forward(ctx, ids, all, d.hookAt)
		return nil, d.result(out, err, pos0, len(ids), all, ps.p.cfg.VocabSize)
	}
	last.host = out
	done = true
	return out, nil
}

// forward is Session.forward across the stages.
func (ps *PipelineSession) forward(ctx context.Context, ids []int32, all bool, hookAt func(pos int) Hook) ([]float32, error) {
	first, last := ps.sess[0], ps.sess[len(ps.sess)-1]
	out := last.host[:0]
	for start := 0; start < len(ids); start += ps.chunk {
		end := min(start+ps.chunk, len(ids))
		T, isLast := end-start, end == len(ids)
		hook := hookAt(first.pos)
		if err := first.embedChunk(ctx, ids[start:end], hook); err != nil {
			return nil, err
		}
		for k, s := range ps.sess {
			if k > 0 {
				if err := ps.hand(ps.sess[k-1], s, T); err != nil {
					return nil, err
				}
			}
			if err := s.blocksChunk(ctx, T, hook); err != nil {
				return nil, err
			}
			s.pos += T
		}
		rows, err := last.headChunk(ctx, T, all || isLast, all, hook)
		if err != nil {
			return nil, err
		}
		out = append(out, rows...)
	}
	return out, nil
}

// backendOf returns the backend holding a layer's output, in Weights'
// numbering.
func (ps *PipelineSession) backendOf(layer int) tensor.Backend {
	for _, s := range ps.sess {
		if layer <= s.m.hi { // the embedding is the first stage's, the head the last's
			return s.m.backend
		}
	}
	return ps.sess[len(ps.sess)-1].m.backend
}

// hand copies the first T rows of the hidden state from one stage's device
// to the next's, through host memory.
func (ps *PipelineSession) hand(from, to *Session, T int) error {
	src, dst := rows(from.x, T), rows(to.x, T)
	buf := ps.xfer[:src.NumBytes()]
	if err := from.m.backend.Download(buf, src); err != nil {
		return fmt.Errorf("nn: hidden state from %s: %w", from.m.backend.Name(), err)
	}
	if err := to.m.backend.Upload(dst, 0, buf); err != nil {
		return fmt.Errorf("nn: hidden state to %s: %w", to.m.backend.Name(), err)
	}
	return nil
}

// StageSource restricts a paging.Source to the given layers (in the model's
// numbering), renumbered 0..len(layers)-1, so that a stage's pager plans
// and loads only its own layers.
func StageSource(src paging.Source, layers []int) paging.Source {
	return stageSource{src, layers}
}

type stageSource struct {
	src    paging.Source
	layers []int
}

func (s stageSource) NumLayers() int { return len(s.layers) }
func (s stageSource) LayerTensors(l int) []paging.TensorSpec {
	if l < 0 || l >= len(s.layers) {
		return nil
	}
	return s.src.LayerTensors(s.layers[l])
}
func (s stageSource) ReadTensor(ctx context.Context, l int, name string, dst []byte) error {
	if l < 0 || l >= len(s.layers) {
		return fmt.Errorf("nn: stage has no layer %d", l)
	}
	return s.src.ReadTensor(ctx, s.layers[l], name, dst)
}

// StageWeights serves a stage's layers, numbered as the model numbers
// them, from a server that numbers them 0..len(layers)-1 (a pager over
// StageSource).
func StageWeights(srv paging.Server, layers []int) Weights {
	local := map[int]int{}
	for i, l := range layers {
		local[l] = i
	}
	return stageWeights{srv, local}
}

type stageWeights struct {
	srv   paging.Server
	local map[int]int
}

func (w stageWeights) Acquire(ctx context.Context, layer int) (LayerWeights, error) {
	l, ok := w.local[layer]
	if !ok {
		return nil, fmt.Errorf("nn: layer %d is not on this stage", layer)
	}
	return w.srv.Acquire(ctx, l)
}

func (w stageWeights) Release(layer int) {
	if l, ok := w.local[layer]; ok {
		w.srv.Release(l)
	}
}
