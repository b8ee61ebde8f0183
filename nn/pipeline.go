package nn

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Stage is one device's part of a Pipeline: the decoder blocks
// [FirstBlock, EndBlock) on Backend, with the embedding on the first stage
// and the final norm and LM head on the last. Weights serves the stage's
// layers in the model's numbering (StageWeights adapts a per-stage pager);
// Alloc charges the stage's KV cache and activations to its device budget.
// The first stage may hold no blocks (the embedding alone), and so may the
// last (the final norm and head alone); the others hold at least one.
//
// Several stages may run on one backend (a CPU+GPU placement alternates
// between two): they share one set of activation buffers, since they run
// one after the other, and the hidden state stays where it is between them.
type Stage struct {
	Backend              tensor.Backend
	Alloc                paging.Allocator
	Weights              Weights
	FirstBlock, EndBlock int
	// Twin, when set, computes the stage's blocks on another device for
	// chunks of at least PipelineOptions.TwinMinTokens tokens (a prompt's
	// prefill, which is compute-bound: the CPU's layers then run on the
	// GPU, their weights streamed). The stage's KV cache stays where the
	// stage is: before each block the twin copies in the rows of earlier
	// positions, after it copies back the chunk's rows (on a stream of
	// their own where the device has one, tensor.AsyncDownload, landed
	// before the chunk ends). A first stage's twin gets the embeddings
	// from the stage's backend.
	Twin *Twin
	// HostKV, when set, keeps the KV cache of its blocks that this stage
	// runs in host memory (Model.SetHostKV); its other blocks are
	// ignored, so that one HostKV serves every stage of a device.
	HostKV *HostKV
}

// Twin is the other device a stage's blocks run on for large chunks.
type Twin struct {
	Backend tensor.Backend
	Alloc   paging.Allocator
	Weights Weights
}

// PipelineOptions adjust a Pipeline.
type PipelineOptions struct {
	// TwinMinTokens is the chunk size from which stages with a Twin run
	// on it; 0 never uses the twins.
	TwinMinTokens int
	// OnTwins, when set, is told before a chunk whether it runs on the
	// twins (so that a pager can prefetch the layers that will run on its
	// device) whenever that changes.
	OnTwins func(twins bool)
	// NoPeerCopies hands the hidden state between two devices through
	// host memory even when they can copy to each other directly
	// (tensor.PeerCopy), to compare the two.
	NoPeerCopies bool
}

// Pipeline runs a model whose layers are spread over several devices in
// contiguous ranges: each token's hidden state passes from one stage to the
// next device to device where they can copy to each other, else through
// host memory.
type Pipeline struct {
	cfg    arch.Config
	stages []*Model
	twins  []*Model         // per stage, nil without one
	keys   []tensor.Backend // the stages' backends as given, which identify their devices
	tkeys  []tensor.Backend // the twins' backends as given, nil without one
	opts   PipelineOptions

	mu        sync.Mutex
	onTwins   bool // what OnTwins was last told
	toldTwins bool
}

// NewPipeline checks that the stages cover the decoder blocks in order and
// returns the pipeline.
func NewPipeline(cfg *arch.Config, stages []Stage, opts ...PipelineOptions) (*Pipeline, error) {
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
	if len(opts) > 0 {
		p.opts = opts[0]
	}
	next := 0
	for i, st := range stages {
		empty := st.EndBlock == st.FirstBlock && (i == 0 || i == len(stages)-1)
		if st.FirstBlock != next || st.EndBlock < st.FirstBlock || st.EndBlock == st.FirstBlock && !empty || st.EndBlock > cfg.NumLayers {
			return nil, fmt.Errorf("nn: pipeline stage %d holds blocks [%d, %d); want a range starting at %d within %d blocks, empty only for the first or last stage",
				i, st.FirstBlock, st.EndBlock, next, cfg.NumLayers)
		}
		m, err := New(cfg, st.Backend, st.Alloc, st.Weights)
		if err != nil {
			return nil, err
		}
		m.lo, m.hi = st.FirstBlock, st.EndBlock
		if h := st.HostKV; h != nil {
			own := *h
			own.Blocks = slices.DeleteFunc(slices.Clone(h.Blocks), func(b int) bool { return b < m.lo || b >= m.hi })
			if err := m.SetHostKV(own); err != nil {
				return nil, fmt.Errorf("nn: pipeline stage %d: %w", i, err)
			}
		}
		var twin *Model
		var tkey tensor.Backend
		if st.Twin != nil {
			tkey = st.Twin.Backend
			if twin, err = New(cfg, st.Twin.Backend, st.Twin.Alloc, st.Twin.Weights); err != nil {
				return nil, err
			}
			twin.lo, twin.hi = st.FirstBlock, st.EndBlock
		}
		p.stages, p.twins, p.keys, p.tkeys = append(p.stages, m), append(p.twins, twin), append(p.keys, st.Backend), append(p.tkeys, tkey)
		next = st.EndBlock
	}
	if next != cfg.NumLayers {
		return nil, fmt.Errorf("nn: pipeline stages end at block %d of %d", next, cfg.NumLayers)
	}
	return p, nil
}

// SetGraphs turns decode graphs on or off for every stage (Model.SetGraphs).
func (p *Pipeline) SetGraphs(on bool) {
	for _, m := range p.stages {
		m.SetGraphs(on)
	}
	for _, m := range p.twins {
		if m != nil {
			m.SetGraphs(on)
		}
	}
}

// Config returns a copy of the model's configuration.
func (p *Pipeline) Config() *arch.Config { return p.cfg.Clone() }

// PipelineSession is one sequence through a Pipeline: a Session per stage,
// each holding the KV cache of its own blocks, over buffers shared by the
// stages of one device.
type PipelineSession struct {
	p      *Pipeline
	sess   []*Session
	twins  []*Session // per stage, nil without a twin
	shared []*allocator
	run    []*Session // the sessions the current chunk runs
	// copyBacks are the twins' devices' copies back to the host under
	// way, one per device; every chunk waits for them (landCopies).
	copyBacks []*copyBack
	xfer      []byte // one chunk's hidden state on its way between stages
	chunk     int
	closed    bool
	busy      map[string]time.Duration // wall time by device name, see Busy
	noPeer    bool                     // PipelineOptions.NoPeerCopies
}

// NewSession allocates each stage's KV cache, each device's buffers, and
// for the twins one pair of KV rows per device that each twin block's rows
// pass through.
func (p *Pipeline) NewSession(maxPos, chunk int) (*PipelineSession, error) {
	return p.NewSessionWith(maxPos, chunk, SessionOptions{})
}

// NewSessionWith is NewSession with the choices of o (the KV cache's
// dtype, every stage's and the twins' scratch rows alike).
func (p *Pipeline) NewSessionWith(maxPos, chunk int, o SessionOptions) (*PipelineSession, error) {
	if err := CheckKVDType(&p.cfg, o.KVDType); err != nil {
		return nil, err
	}
	if maxPos <= 0 || chunk <= 0 {
		return nil, fmt.Errorf("nn: session needs positive context (%d) and chunk (%d)", maxPos, chunk)
	}
	if err := checkContext(&p.cfg, "session", maxPos); err != nil {
		return nil, err
	}
	chunk = min(chunk, maxPos)
	c := &p.cfg
	ps := &PipelineSession{p: p, chunk: chunk, twins: make([]*Session, len(p.stages)), noPeer: p.opts.NoPeerCopies}
	bufs := map[tensor.Backend]*buffers{}
	// The logits are computed where the last stage runs: on its device,
	// or on its twin's for large chunks.
	heads := map[tensor.Backend]bool{p.keys[len(p.keys)-1]: true}
	if p.twins[len(p.twins)-1] != nil {
		heads[p.stagesTwinKey(len(p.twins)-1)] = true
	}
	// bufsOn returns the buffers of a device, allocating them the first
	// time from alloc.
	bufsOn := func(key tensor.Backend, m *Model) (*buffers, error) {
		if bf, ok := bufs[key]; ok {
			return bf, nil
		}
		al := &allocator{a: m.alloc}
		ps.shared = append(ps.shared, al)
		bf, err := newBuffers(c, m.backend, al, maxPos, chunk, heads[key])
		if err != nil {
			return nil, err
		}
		bufs[key] = bf
		return bf, nil
	}
	fail := func(m *Model, err error) (*PipelineSession, error) {
		ps.Close()
		return nil, fmt.Errorf("nn: pipeline stage on %s: %w", m.backend.Name(), err)
	}
	for k, m := range p.stages {
		bf, err := bufsOn(p.keys[k], m)
		if err != nil {
			return fail(m, err)
		}
		s, err := m.newSession(maxPos, chunk, bf, o)
		if err != nil {
			return fail(m, err)
		}
		ps.sess = append(ps.sess, s)
	}
	scratch := map[tensor.Backend][2]*tensor.Tensor{}
	copyBacks := map[tensor.Backend]*copyBack{}
	for k, tm := range p.twins {
		if tm == nil {
			continue
		}
		key := p.stagesTwinKey(k)
		bf, err := bufsOn(key, tm)
		if err != nil {
			return fail(tm, err)
		}
		kv, ok := scratch[key]
		if !ok {
			al := &allocator{a: tm.alloc}
			ps.shared = append(ps.shared, al)
			kv = [2]*tensor.Tensor{al.allocDT(paging.KVCache, o.kvDType(), maxPos, c.KVDim()), al.allocDT(paging.KVCache, o.kvDType(), maxPos, c.KVDim())}
			if al.err != nil {
				return fail(tm, al.err)
			}
			scratch[key] = kv
			copyBacks[key] = &copyBack{}
			ps.copyBacks = append(ps.copyBacks, copyBacks[key])
		}
		ts := &Session{m: tm, maxPos: maxPos, chunk: chunk, buffers: bf, twin: ps.sess[k], copyBack: copyBacks[key]}
		for range tm.hi - tm.lo {
			ts.k, ts.v = append(ts.k, kv[0]), append(ts.v, kv[1])
		}
		ps.twins[k] = ts
	}
	ps.xfer = make([]byte, 4*chunk*c.HiddenSize)
	return ps, nil
}

// stagesTwinKey is the key of stage k's twin's device, which identifies it
// as a stage's key does, so that a twin shares its device's buffers.
func (p *Pipeline) stagesTwinKey(k int) tensor.Backend { return p.tkeys[k] }

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
	if ps == nil || ps.closed {
		return
	}
	ps.closed = true
	for _, s := range ps.sess {
		s.Close()
	}
	for _, al := range ps.shared {
		al.free()
	}
}

// Forward is Session.Forward across the stages: the same logits as one
// device computing everything, and the same *NonFiniteError when they hold
// a NaN or an infinity.
func (ps *PipelineSession) Forward(ctx context.Context, ids []int32, all bool, hook Hook) ([]float32, error) {
	first, last := ps.sess[0], ps.sess[len(ps.sess)-1]
	if ps.closed {
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
			ps.setPos(pos0)
		}
	}()
	out, err := ps.forward(ctx, ids, all, func(int) Hook { return hook })
	if err != nil {
		return nil, err
	}
	if firstNonFiniteF32(out) >= 0 {
		ps.setPos(pos0)
		d := &diagnosis{cfg: &ps.p.cfg, backendOf: ps.backendOf}
		out, err := ps.forward(ctx, ids, all, d.hookAt)
		return nil, d.result(out, err, pos0, len(ids), all, ps.p.cfg.VocabSize)
	}
	last.host = out
	done = true
	return out, nil
}

// Greedy runs ids as Forward does and returns Argmax of the last
// position's logits (a pipeline's logits come back to the host).
func (ps *PipelineSession) Greedy(ctx context.Context, ids []int32) (int32, error) {
	logits, err := ps.Forward(ctx, ids, false, nil)
	if err != nil {
		return 0, err
	}
	return int32(Argmax(logits)), nil
}

func (ps *PipelineSession) setPos(pos int) {
	for _, s := range ps.sess {
		s.pos = pos
	}
}

// runners returns the sessions a chunk of T tokens runs: each stage's, or
// its twin's for a chunk large enough, telling OnTwins when that changes.
func (ps *PipelineSession) runners(T int) []*Session {
	p := ps.p
	twins := p.opts.TwinMinTokens > 0 && T >= p.opts.TwinMinTokens && slices.ContainsFunc(ps.twins, func(s *Session) bool { return s != nil })
	if p.opts.OnTwins != nil {
		p.mu.Lock()
		if !p.toldTwins || p.onTwins != twins {
			p.opts.OnTwins(twins)
			p.onTwins, p.toldTwins = twins, true
		}
		p.mu.Unlock()
	}
	ps.run = append(ps.run[:0], ps.sess...)
	if twins {
		for k, ts := range ps.twins {
			if ts != nil {
				ps.run[k] = ts
			}
		}
	}
	return ps.run
}

// forward is Session.forward across the stages. Each chunk ends once the
// twins' keys and values have landed in the stages' KV caches (even when
// it fails: nothing is left copying into them).
func (ps *PipelineSession) forward(ctx context.Context, ids []int32, all bool, hookAt func(pos int) Hook) (_ []float32, err error) {
	first, last := ps.sess[0], ps.sess[len(ps.sess)-1]
	out := last.host[:0]
	defer func() {
		if lerr := ps.landCopies(); err == nil && lerr != nil {
			err = lerr
		}
	}()
	for start := 0; start < len(ids); start += ps.chunk {
		end := min(start+ps.chunk, len(ids))
		T, isLast := end-start, end == len(ids)
		hook := hookAt(first.pos)
		run := ps.runners(T)
		t0 := time.Now()
		for k, s := range run {
			if s.twin != nil {
				s.pos = s.twin.pos
			}
			if k == 0 {
				if err := ps.embed(ctx, s, ids[start:end], hook); err != nil {
					return nil, err
				}
			} else {
				if err := ps.hand(run[k-1], s, T); err != nil {
					return nil, err
				}
				t0 = ps.account(run[k-1], t0) // a hand-over waits for the device it leaves
			}
			if err := s.blocksChunk(ctx, T, hook, k == len(run)-1); err != nil {
				return nil, err
			}
		}
		for _, s := range ps.sess {
			s.pos += T
		}
		rows, err := run[len(run)-1].headChunk(ctx, T, all || isLast, all, hook)
		if err != nil {
			return nil, err
		}
		if err := ps.landCopies(); err != nil {
			return nil, err
		}
		ps.account(run[len(run)-1], t0)
		out = append(out, rows...)
	}
	return out, nil
}

// landCopies waits for the twins' copies of keys and values back to the
// host still under way.
func (ps *PipelineSession) landCopies() error {
	var errs []error
	for _, c := range ps.copyBacks {
		if err := c.land(); err != nil {
			errs = append(errs, fmt.Errorf("nn: keys and values back to the host: %w", err))
		}
	}
	return errors.Join(errs...)
}

// embed writes the embeddings of ids into the first stage's x: s's own,
// or, when s is the twin of a CPU stage, the CPU's from its host copy of
// the table, handed to the twin. The twin would otherwise copy the whole
// table over the link for a chunk's rows (on the 7B shape 262 MB, 4.9 ms
// on the H200, against 16 KiB a row handed over).
func (ps *PipelineSession) embed(ctx context.Context, s *Session, ids []int32, hook Hook) error {
	if s.twin == nil {
		return s.embedChunk(ctx, ids, hook)
	}
	if err := s.twin.embedChunk(ctx, ids, hook); err != nil {
		return err
	}
	return ps.hand(s.twin, s, len(ids))
}

// account adds the time since t0 to s's device and returns now.
func (ps *PipelineSession) account(s *Session, t0 time.Time) time.Time {
	now := time.Now()
	if ps.busy == nil {
		ps.busy = map[string]time.Duration{}
	}
	ps.busy[s.m.backend.Name()] += now.Sub(t0)
	return now
}

// Busy returns, by device name, the wall time the session's forward passes
// spent on each device's stages so far: from the start of a stage to the
// end of the hand-over that leaves it (which waits for the device's
// queued work), so that the times add up to the forward's. Hybrid reports
// divide them by the tokens decoded.
func (ps *PipelineSession) Busy() map[string]time.Duration {
	return maps.Clone(ps.busy)
}

// backendOf returns the backend holding a layer's output, in Weights'
// numbering, for the chunk being run.
func (ps *PipelineSession) backendOf(layer int) tensor.Backend {
	run := ps.run
	if len(run) == 0 {
		run = ps.sess
	}
	if layer == 0 {
		if run[0].twin != nil { // embedded on the CPU (embed)
			return run[0].twin.m.backend
		}
		return run[0].m.backend
	}
	for _, s := range run {
		if layer-1 >= s.m.lo && layer-1 < s.m.hi { // block layer-1
			return s.m.backend
		}
	}
	return run[len(run)-1].m.backend
}

// hand passes the first T rows of the hidden state from one stage to the
// next: nothing to do on one device (they share the buffers), a peer copy
// between two devices that can copy to each other directly
// (tensor.PeerCopy, unless NoPeerCopies), a copy into or out of host
// memory when either is the host, else through host memory.
// A device's hidden state leaves it once its compute is done
// (tensor.DownloadComputed): copies of later layers that its pager queued
// go on while the next stage computes.
func (ps *PipelineSession) hand(from, to *Session, T int) error {
	if from.buffers == to.buffers {
		return nil
	}
	src, dst := rows(from.x, T), rows(to.x, T)
	if !ps.noPeer {
		if pc, ok := tensor.PeerCopy(from.m.backend, to.m.backend); ok {
			if err := pc.CopyToPeer(to.m.backend, dst, src); err != nil {
				return fmt.Errorf("nn: hidden state from %s to %s: %w", from.m.backend.Name(), to.m.backend.Name(), err)
			}
			return nil
		}
	}
	switch {
	case dst.OnHost():
		if err := tensor.DownloadComputed(from.m.backend, dst.Bytes(), src); err != nil {
			return fmt.Errorf("nn: hidden state from %s: %w", from.m.backend.Name(), err)
		}
	case src.OnHost():
		if err := to.m.backend.Upload(dst, 0, src.Bytes()); err != nil {
			return fmt.Errorf("nn: hidden state to %s: %w", to.m.backend.Name(), err)
		}
	default:
		buf := ps.xfer[:src.NumBytes()]
		if err := tensor.DownloadComputed(from.m.backend, buf, src); err != nil {
			return fmt.Errorf("nn: hidden state from %s: %w", from.m.backend.Name(), err)
		}
		if err := to.m.backend.Upload(dst, 0, buf); err != nil {
			return fmt.Errorf("nn: hidden state to %s: %w", to.m.backend.Name(), err)
		}
	}
	return nil
}

// StageSource restricts a paging.Source to the given layers (in the model's
// numbering), renumbered 0..len(layers)-1, so that a stage's pager plans
// and loads only its own layers. It reads ranges (paging.RangeSource) when
// src does.
func StageSource(src paging.Source, layers []int) paging.Source {
	_, ranged := src.(paging.RangeSource)
	_, mapped := src.(paging.MappedSource)
	switch {
	case ranged && mapped:
		return mappedStageSource{rangedStageSource{stageSource{src, layers}}}
	case ranged:
		return rangedStageSource{stageSource{src, layers}}
	}
	return stageSource{src, layers}
}

// mappedStageSource is a rangedStageSource over a paging.MappedSource too.
type mappedStageSource struct{ rangedStageSource }

func (s mappedStageSource) MappedRegions() [][]byte {
	return s.src.(paging.MappedSource).MappedRegions()
}

func (s mappedStageSource) MappedTensor(l int, name string) ([]byte, bool, error) {
	if l < 0 || l >= len(s.layers) {
		return nil, false, fmt.Errorf("nn: stage has no layer %d", l)
	}
	return s.src.(paging.MappedSource).MappedTensor(s.layers[l], name)
}

// rangedStageSource is a stageSource over a paging.RangeSource.
type rangedStageSource struct{ stageSource }

func (s rangedStageSource) ReadTensorRange(ctx context.Context, l int, name string, off int64, dst []byte) error {
	if l < 0 || l >= len(s.layers) {
		return fmt.Errorf("nn: stage has no layer %d", l)
	}
	return s.src.(paging.RangeSource).ReadTensorRange(ctx, s.layers[l], name, off, dst)
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

// LayerExperts forwards to the source's when it is a paging.ExpertSource.
func (s stageSource) LayerExperts(l int) [][]string {
	if es, ok := s.src.(paging.ExpertSource); ok && l >= 0 && l < len(s.layers) {
		return es.LayerExperts(s.layers[l])
	}
	return nil
}

// LayerRouting forwards to the source's when it is a paging.ExpertSource.
func (s stageSource) LayerRouting(l int) []string {
	if es, ok := s.src.(paging.ExpertSource); ok && l >= 0 && l < len(s.layers) {
		return es.LayerRouting(s.layers[l])
	}
	return nil
}

// StageWeights serves a stage's layers, numbered as the model numbers
// them, from a server that numbers them 0..len(layers)-1 (a pager over
// StageSource). It is an ExpertWeights, whose PagesExperts is false
// unless the server is a paging.ExpertServer paging the layer's experts.
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

// PinLayer pins layer through the server's PinLayer (layerPinner offers
// it only when the server has one).
func (w stageWeights) PinLayer(ctx context.Context, layer int, fp []byte) ([]byte, error) {
	l, ok := w.local[layer]
	if !ok {
		return fp, fmt.Errorf("nn: layer %d is not on this stage", layer)
	}
	p, ok := w.srv.(LayerPinner)
	if !ok {
		return fp, fmt.Errorf("nn: the stage's weights cannot pin layer %d without its tensors", layer)
	}
	return p.PinLayer(ctx, l, fp)
}

var (
	_ ExpertWeights   = stageWeights{}
	_ ResidentWeights = stageWeights{}
)

// Resident reports the server's Resident for the layer, false for a
// server without it.
func (w stageWeights) Resident(layer int) bool {
	rw, ok := w.srv.(ResidentWeights)
	l, on := w.local[layer]
	return ok && on && rw.Resident(l)
}

// experts returns the server's expert paging and the server's number of
// layer, when it pages the layer's experts.
func (w stageWeights) experts(layer int) (paging.ExpertServer, int, bool) {
	es, ok := w.srv.(paging.ExpertServer)
	l, on := w.local[layer]
	if !ok || !on || !es.PagesExperts(l) {
		return nil, 0, false
	}
	return es, l, true
}

func (w stageWeights) PagesExperts(layer int) bool {
	_, _, ok := w.experts(layer)
	return ok
}

func (w stageWeights) ExpertSlots() int {
	if es, ok := w.srv.(paging.ExpertServer); ok {
		return es.ExpertSlots()
	}
	return 0
}

func (w stageWeights) AcquireExperts(ctx context.Context, layer int, experts []int) (map[int]LayerWeights, error) {
	es, l, ok := w.experts(layer)
	if !ok {
		return nil, fmt.Errorf("nn: layer %d: no experts paged on this stage", layer)
	}
	return es.AcquireExperts(ctx, l, experts)
}

func (w stageWeights) AcquireExpertsLazy(ctx context.Context, layer int, experts []int) (map[int]LayerWeights, []int, func(int) error, error) {
	es, l, ok := w.experts(layer)
	if !ok {
		return nil, nil, nil, fmt.Errorf("nn: layer %d: no experts paged on this stage", layer)
	}
	return es.AcquireExpertsLazy(ctx, l, experts)
}

func (w stageWeights) ReleaseExperts(layer int, experts []int) {
	if es, l, ok := w.experts(layer); ok {
		es.ReleaseExperts(l, experts)
	}
}

func (w stageWeights) PrefetchExperts(layer int, experts []int) {
	if es, l, ok := w.experts(layer); ok {
		es.PrefetchExperts(l, experts)
	}
}

func (w stageWeights) PrepareExperts(layer, n int) {
	if es, l, ok := w.experts(layer); ok {
		if pr, ok := es.(expertPreparer); ok {
			pr.PrepareExperts(l, n)
		}
	}
}

func (w stageWeights) AcquireResident(ctx context.Context, layer int) (LayerWeights, error) {
	es, l, ok := w.experts(layer)
	if !ok {
		return nil, fmt.Errorf("nn: layer %d: no experts paged on this stage", layer)
	}
	return es.AcquireResident(ctx, l)
}

var _ CPUExpertWeights = stageWeights{}

func (w stageWeights) ExpertsOnCPU(layer int, experts, tokens []int, onCPU []bool) {
	clear(onCPU[:len(experts)])
	if es, l, ok := w.experts(layer); ok {
		if cs, ok := es.(paging.ExpertCPUServer); ok {
			cs.ExpertsOnCPU(l, experts, tokens, onCPU)
		}
	}
}

func (w stageWeights) HostExpert(ctx context.Context, layer, expert, tokens int) (LayerWeights, func(), error) {
	es, l, ok := w.experts(layer)
	if !ok {
		return nil, nil, fmt.Errorf("nn: layer %d: no experts paged on this stage", layer)
	}
	cs, ok := es.(paging.ExpertCPUServer)
	if !ok {
		return nil, nil, fmt.Errorf("nn: layer %d: the stage's server computes no experts on the CPU", layer)
	}
	return cs.HostExpert(ctx, l, expert, tokens)
}

// SetExpertCPU gives every stage the CPU that computes the experts its
// weights hand over (Model.SetExpertCPU).
func (p *Pipeline) SetExpertCPU(cpu tensor.Backend) {
	for _, m := range p.stages {
		m.SetExpertCPU(cpu)
	}
}

// SparseTimes adds up the stages' Model.SparseTimes, twins included.
func (p *Pipeline) SparseTimes() SparseTimes {
	var t SparseTimes
	for _, m := range slices.Concat(p.stages, p.twins) {
		if m != nil {
			s := m.SparseTimes()
			t.Blocks, t.RouterWait, t.Host = t.Blocks+s.Blocks, t.RouterWait+s.RouterWait, t.Host+s.Host
		}
	}
	return t
}

// ExpertGuesses adds up the stages' Model.ExpertGuesses, twins included.
func (p *Pipeline) ExpertGuesses() (guessed, right int64) {
	for _, m := range slices.Concat(p.stages, p.twins) {
		if m != nil {
			g, r := m.ExpertGuesses()
			guessed, right = guessed+g, right+r
		}
	}
	return guessed, right
}
