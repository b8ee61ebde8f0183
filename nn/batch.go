package nn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// ErrNoBlocks is returned when a Batch's KV pool has too few free blocks
// for a reservation.
var ErrNoBlocks = errors.New("nn: no free KV blocks")

// DefaultBlockSize is the positions of a KV block when BatchOptions do not
// say.
const DefaultBlockSize = 16

// BatchOptions size a Batch.
type BatchOptions struct {
	// MaxPos is the most positions one sequence may reach (its context).
	MaxPos int
	// MaxRows is the most rows (tokens of all the sequences) one step
	// runs: the buffers are sized for it.
	MaxRows int
	// BlockSize is the positions of a KV block (0: DefaultBlockSize).
	BlockSize int
	// Blocks is the size of the KV pool in blocks (0: enough for one
	// sequence of MaxPos positions).
	Blocks int
	// KVDType is the pool's stored dtype, as SessionOptions.KVDType (zero:
	// F32); the attention (tensor.AttentionBlocks) converts the rows'
	// keys and values into it.
	KVDType tensor.DType
}

// Batch runs several sequences through a model together: each step runs
// every layer once (one Acquire per layer) for the rows of all the
// sequences in it, stacked for the matrix products, each sequence's
// attention over its own positions. The keys and values live in one pool
// of fixed-size blocks per device (per layer a pair of tensors of
// Blocks*BlockSize rows, charged to the KVCache category of the stage's
// allocator), which the sequences share out through their block tables.
//
// On a backend that is tensor.RowExact (the CPU), a sequence's logits do
// not depend on the other sequences of a step, nor on how its prompt was
// cut into steps: every product runs its rows as one-row products, and
// attention over the blocks has the bits of attention over a contiguous
// cache. (They can differ from a Session's, whose products of several
// rows round differently.)
//
// A Batch is not safe for concurrent use. The stages of a pipeline run
// each on its own device (a stage's twin is not used).
type Batch struct {
	cfg     *arch.Config
	stages  []*Session // one per stage, in batch mode
	shared  []*allocator
	step    batchStep
	maxPos  int
	maxRows int
	blocks  int
	free    []int32 // the free blocks, a stack
	xfer    *PipelineSession
	flight  []*stepGroup // per stage, the step that ran it last beat (Tick)
	host    []float32    // the logits of the last step
	times   StepTimes    // the split of the last step's time
	closed  bool
}

// batchStep is what the stages' sessions need to know of the current
// step: its sequences and each row's position.
type batchStep struct {
	bs     int
	seqs   []tensor.SeqBlocks
	rowPos []int
	pos32  []int32 // rowPos, for tensor.RopeRows
}

// Seq is one sequence of a Batch: its positions so far and the KV blocks
// it holds.
type Seq struct {
	b      *Batch
	pos    int
	blocks []int32
	closed bool
}

// NewBatch makes a Batch over the model on its device.
func (m *Model) NewBatch(o BatchOptions) (*Batch, error) {
	return newBatch(&m.cfg, []*Model{m}, []tensor.Backend{m.backend}, false, o)
}

// NewBatch makes a Batch over the pipeline's stages, each on its device.
func (p *Pipeline) NewBatch(o BatchOptions) (*Batch, error) {
	return newBatch(&p.cfg, p.stages, p.keys, p.opts.NoPeerCopies, o)
}

func newBatch(c *arch.Config, models []*Model, keys []tensor.Backend, noPeer bool, o BatchOptions) (*Batch, error) {
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	}
	if o.MaxPos <= 0 || o.MaxRows <= 0 || o.BlockSize < 0 || o.Blocks < 0 {
		return nil, fmt.Errorf("nn: batch of %d positions, %d rows a step, blocks of %d, %d blocks: want positive values", o.MaxPos, o.MaxRows, o.BlockSize, o.Blocks)
	}
	if err := checkContext(c, "batch", o.MaxPos); err != nil {
		return nil, err
	}
	if err := CheckKVDType(c, o.KVDType); err != nil {
		return nil, err
	}
	kv := SessionOptions{KVDType: o.KVDType}.kvDType()
	if o.Blocks == 0 {
		o.Blocks = (o.MaxPos + o.BlockSize - 1) / o.BlockSize
	}
	if int64(o.Blocks)*int64(o.BlockSize) > math.MaxInt32 {
		return nil, fmt.Errorf("nn: batch pool of %d blocks of %d positions is too large", o.Blocks, o.BlockSize)
	}
	b := &Batch{cfg: c, maxPos: o.MaxPos, maxRows: o.MaxRows, blocks: o.Blocks, step: batchStep{bs: o.BlockSize}}
	b.xfer = &PipelineSession{xfer: make([]byte, 4*o.MaxRows*c.HiddenSize), noPeer: noPeer}
	bufs := map[tensor.Backend]*buffers{}
	rows := o.Blocks * o.BlockSize
	for k, m := range models {
		bf, ok := bufs[keys[k]]
		al := &allocator{a: m.alloc}
		b.shared = append(b.shared, al)
		if !ok {
			var err error
			// The head's buffers hold one row of logits per sequence:
			// at most MaxRows of them.
			if bf, err = newBuffers(c, m.backend, al, o.MaxPos, o.MaxRows, k == len(models)-1); err != nil {
				b.Close()
				return nil, fmt.Errorf("nn: batch buffers on %s: %w", m.backend.Name(), err)
			}
			bufs[keys[k]] = bf
		} else if k == len(models)-1 && bf.logits == nil {
			bf.logits = al.alloc(paging.Activations, o.MaxRows, c.VocabSize)
		}
		s := &Session{m: m, maxPos: o.MaxPos, chunk: o.MaxRows, buffers: bf, batch: &b.step}
		host := batchHostKV(s, o.MaxRows)
		if host != nil {
			b.shared = append(b.shared, host)
		}
		for j := range m.hi - m.lo {
			pool := al
			if s.hkv != nil && s.hkv.onHost[j] {
				pool = host
			}
			s.k = append(s.k, pool.allocDT(paging.KVCache, kv, rows, c.KVDim()))
			s.v = append(s.v, pool.allocDT(paging.KVCache, kv, rows, c.KVDim()))
		}
		if al.err != nil {
			b.Close()
			return nil, fmt.Errorf("nn: batch KV pool of %d blocks of %d positions on %s: %w", o.Blocks, o.BlockSize, m.backend.Name(), al.err)
		}
		if host != nil && host.err != nil {
			b.Close()
			return nil, fmt.Errorf("nn: batch KV pool of %d blocks of %d positions in host memory: %w", o.Blocks, o.BlockSize, host.err)
		}
		b.stages = append(b.stages, s)
	}
	for i := o.Blocks - 1; i >= 0; i-- {
		b.free = append(b.free, int32(i))
	}
	return b, nil
}

// BlockSize is the positions of a KV block.
func (b *Batch) BlockSize() int { return b.step.bs }

// Blocks is the pool's size in blocks.
func (b *Batch) Blocks() int { return b.blocks }

// FreeBlocks is the pool's blocks no sequence holds.
func (b *Batch) FreeBlocks() int { return len(b.free) }

// MaxRows is the most rows a step runs.
func (b *Batch) MaxRows() int { return b.maxRows }

// MaxPos is the most positions a sequence may reach.
func (b *Batch) MaxPos() int { return b.maxPos }

// BlocksFor is the number of blocks that hold n positions.
func (b *Batch) BlocksFor(n int) int { return (n + b.step.bs - 1) / b.step.bs }

// Close frees the pool and the buffers. It is safe to call more than once.
func (b *Batch) Close() {
	if b == nil || b.closed {
		return
	}
	b.closed = true
	for _, al := range b.shared {
		al.free()
	}
	if s := b.stages; len(s) > 0 {
		s[len(s)-1].freeBatchLogits()
	}
}

// NewSeq starts a sequence that holds no blocks yet.
func (b *Batch) NewSeq() *Seq { return &Seq{b: b} }

// Pos is the number of positions the sequence has processed.
func (s *Seq) Pos() int { return s.pos }

// Capacity is the positions the sequence's blocks hold.
func (s *Seq) Capacity() int { return len(s.blocks) * s.b.step.bs }

// Reserve makes the sequence's blocks hold n positions (at most the
// batch's MaxPos): all the blocks it needs, or none and an error wrapping
// ErrNoBlocks.
func (s *Seq) Reserve(n int) error {
	b := s.b
	if s.closed {
		return errors.New("nn: sequence is closed")
	}
	if n > b.maxPos {
		return fmt.Errorf("%w: %d positions asked, a sequence holds %d", ErrContextFull, n, b.maxPos)
	}
	need := b.BlocksFor(n) - len(s.blocks)
	if need <= 0 {
		return nil
	}
	if need > len(b.free) {
		return fmt.Errorf("%w: %d blocks of %d positions needed, %d of %d free", ErrNoBlocks, need, b.step.bs, len(b.free), b.blocks)
	}
	top := len(b.free) - need
	for i := len(b.free) - 1; i >= top; i-- {
		s.blocks = append(s.blocks, b.free[i])
	}
	b.free = b.free[:top]
	return nil
}

// Close returns the sequence's blocks to the pool. It is safe to call more
// than once.
func (s *Seq) Close() {
	if s == nil || s.closed {
		return
	}
	s.closed = true
	s.b.free = append(s.b.free, s.blocks...)
	s.blocks = nil
}

// Work is one sequence's part of a step: its next tokens, and whether the
// step returns the logits of the last of them.
type Work struct {
	Seq    *Seq
	IDs    []int32
	Logits bool
}

// Step runs the works' tokens through the model, all of them through each
// layer at once, and returns the logits of the last token of each work
// that asks for them ([vocab] each, in the works' order; nil for the
// others), reused by the next step. Each sequence's positions advance by
// its tokens; a step that fails advances none. The works' sequences must
// be distinct, their tokens at most MaxRows in all, and each sequence's
// reserved blocks must hold its new positions. Times says where the step's
// time went.
func (b *Batch) Step(ctx context.Context, works []Work) ([][]float32, error) {
	if b.closed {
		return nil, errors.New("nn: batch is closed")
	}
	if b.Flying() > 0 {
		return nil, errors.New("nn: batch step: steps are in flight (Tick until none is)")
	}
	t0 := time.Now()
	b.times = StepTimes{}
	g, err := b.prepare(&b.step, works, nil)
	if err != nil {
		return nil, err
	}
	if g.T == 0 {
		return make([][]float32, len(works)), nil
	}
	t1 := time.Now()
	tm := StepTimes{Prepare: t1.Sub(t0)}
	// One pair of events on the compute queue when one device runs the
	// whole step: its device time, with no wait in between. A step with
	// no logits to download is not waited for (the next one queues
	// behind it): its device time is not known.
	var stop func() (time.Duration, error)
	if dev := b.stages[0].m.backend; b.oneDevice() && len(g.last) > 0 {
		if st, ok, err := tensor.StartCompute(dev); ok && err == nil {
			stop = st
		}
	}
	l0, counted := b.launches()
	var t2, t3 time.Time
	queued := func() {
		if !t2.IsZero() {
			return
		}
		t2 = time.Now()
		tm.Launch = t2.Sub(t1)
		tm.Device = tm.Launch // computed as called, or over several devices
		if l1, _ := b.launches(); counted {
			tm.Launches = l1.Sub(l0).Total()
		}
		t3 = t2
		if stop != nil {
			if d, err := stop(); err == nil {
				tm.Device = d
			}
			t3 = time.Now()
			tm.Wait = t3.Sub(t2)
		}
	}
	defer queued() // a failed step's events go back too
	for k, s := range b.stages {
		if k == 0 {
			if err := s.embedChunk(ctx, g.ids, nil); err != nil {
				return nil, err
			}
		} else if err := b.xfer.hand(b.stages[k-1], s, g.T); err != nil {
			return nil, err
		}
		if err := s.blocksChunk(ctx, g.T, nil, false); err != nil {
			return nil, err
		}
	}
	logits, err := b.stages[len(b.stages)-1].batchHead(ctx, g.T, g.last, queued)
	if err != nil {
		return nil, err
	}
	queued()
	if len(g.last) > 0 {
		tm.Download = time.Since(t3)
	}
	b.times = tm
	b.host = logits
	return g.finish(logits, b.cfg.VocabSize), nil
}

// StepTimes is where a Batch's last Step spent its time, on the host's
// clock but for Device.
type StepTimes struct {
	// Prepare is checking the works and building the step's tables (the
	// rows' positions, the sequences' block tables).
	Prepare time.Duration
	// Launch is the host's time running the forward up to the logits'
	// download: the ids' upload, every layer's operations (their
	// per-sequence calls, the attention's tables and their uploads) and
	// the head's. A backend that computes each operation as it is called
	// (the CPU) computes the step in it; a device that queues them
	// computes meanwhile.
	Launch time.Duration
	// Wait is the host's wait, once the forward was queued, for the
	// device to finish it (zero on the CPU).
	Wait time.Duration
	// Device is the device's time for the forward: between two events on
	// its compute queue (tensor.ComputeTimer), else (the CPU, several
	// devices, a step without logits, which nothing waits for) Launch.
	// Device well under Launch is a step bound by the host's launches.
	Device time.Duration
	// Download is the copy of the logits to host memory.
	Download time.Duration
	// Launches is the work the host issued to the devices up to the
	// download (tensor.Launches: kernels, copies, library calls, graph
	// replays), 0 on a backend that does not count them (the CPU).
	Launches int64
}

// Times is the split of the last Step's time (zero after a Tick, and for a
// step that failed or ran no rows).
func (b *Batch) Times() StepTimes { return b.times }

// launches adds up the launches of the stages' backends so far
// (tensor.CountLaunches), each backend once; ok is false when none counts
// them.
func (b *Batch) launches() (l tensor.Launches, ok bool) {
	for k, s := range b.stages {
		if slices.ContainsFunc(b.stages[:k], func(o *Session) bool { return o.m.backend == s.m.backend }) {
			continue
		}
		if n, counted := tensor.CountLaunches(s.m.backend); counted {
			l, ok = tensor.Launches{Kernels: l.Kernels + n.Kernels, Copies: l.Copies + n.Copies, Library: l.Library + n.Library, Graphs: l.Graphs + n.Graphs}, true
		}
	}
	return l, ok
}

// oneDevice reports whether every stage runs on one backend.
func (b *Batch) oneDevice() bool {
	for _, s := range b.stages[1:] {
		if s.m.backend != b.stages[0].m.backend {
			return false
		}
	}
	return true
}

// stepGroup is one group of works of a step, checked: its rows' ids, the
// step state its stages attend with, the rows whose logits it asks for.
type stepGroup struct {
	works []Work
	ids   []int32
	st    *batchStep
	last  []int32
	T     int
}

// prepare checks works (distinct open sequences of b, none in seen, each
// with room for its tokens, at most MaxRows rows) and fills st with their
// sequences and rows' positions.
func (b *Batch) prepare(st *batchStep, works []Work, seen map[*Seq]bool) (*stepGroup, error) {
	st.seqs, st.rowPos, st.pos32 = st.seqs[:0], st.rowPos[:0], st.pos32[:0]
	g := &stepGroup{works: works, st: st}
	for i, w := range works {
		s := w.Seq
		switch {
		case s == nil || s.b != b || s.closed:
			return nil, fmt.Errorf("nn: batch step: work %d: not an open sequence of this batch", i)
		case len(w.IDs) == 0:
			return nil, fmt.Errorf("nn: batch step: work %d: no tokens", i)
		case s.pos+len(w.IDs) > s.Capacity():
			return nil, fmt.Errorf("%w: batch step: work %d: %d positions used, %d more asked, its blocks hold %d", ErrContextFull, i, s.pos, len(w.IDs), s.Capacity())
		case seen[s]:
			return nil, fmt.Errorf("nn: batch step: work %d: its sequence is in another group of the step", i)
		}
		for j := range i {
			if works[j].Seq == s {
				return nil, fmt.Errorf("nn: batch step: works %d and %d are one sequence", j, i)
			}
		}
		for j, id := range w.IDs {
			if id < 0 || int(id) >= b.cfg.VocabSize {
				return nil, fmt.Errorf("nn: batch step: work %d: token id %d at position %d is outside the vocabulary of %d", i, id, s.pos+j, b.cfg.VocabSize)
			}
			st.rowPos = append(st.rowPos, s.pos+j)
			st.pos32 = append(st.pos32, int32(s.pos+j))
		}
		g.ids = append(g.ids, w.IDs...)
		st.seqs = append(st.seqs, tensor.SeqBlocks{Rows: len(w.IDs), Pos0: s.pos, Blocks: s.blocks})
		if w.Logits {
			g.last = append(g.last, int32(len(g.ids)-1))
		}
	}
	g.T = len(g.ids)
	if g.T > b.maxRows {
		return nil, fmt.Errorf("nn: batch step of %d rows, the batch runs %d at most", g.T, b.maxRows)
	}
	return g, nil
}

// finish advances the group's sequences and returns each work's logits
// (nil for those that ask none) from logits, a row of vocab per work that
// asks.
func (g *stepGroup) finish(logits []float32, vocab int) [][]float32 {
	out := make([][]float32, len(g.works))
	n := 0
	for i, w := range g.works {
		w.Seq.pos += len(w.IDs)
		if w.Logits {
			out[i] = logits[n*vocab : (n+1)*vocab : (n+1)*vocab]
			n++
		}
	}
	return out
}

// Pipelined reports whether Tick overlaps steps on the stages: a batch
// over several stages, each on a device of its own (stages that share a
// device, as a CPU+GPU placement's do, share buffers).
func (b *Batch) Pipelined() bool {
	if len(b.stages) < 2 {
		return false
	}
	for k, s := range b.stages {
		for _, o := range b.stages[:k] {
			if o.buffers == s.buffers {
				return false
			}
		}
	}
	return true
}

// Tick is one beat of a pipelined batch (Pipelined): each step in flight
// moves on to the next stage while the first stage starts the works given
// (a step, as Step takes them; none starts nothing), all the stages
// computing at once, each on its device. So while stage 1 runs the second
// half of one step, stage 0 runs the first half of the next: a step
// finishes every beat once the pipeline is full, its works' sequences
// their own (a sequence's next step starts once its step has finished).
//
// It returns the works of the step that left the last stage this beat and
// their logits, as Step returns them for those works (owned by the
// caller); nil, nil when none left. InFlight says which sequences have a
// step under way; the works given must be none of them. A beat that fails
// abandons every step in flight and advances none of their sequences; it
// returns the error and the steps abandoned (their works), so that the
// caller ends them.
func (b *Batch) Tick(ctx context.Context, works []Work) (done []Work, logits [][]float32, err error) {
	if b.closed {
		return nil, nil, errors.New("nn: batch is closed")
	}
	if !b.Pipelined() {
		return nil, nil, errors.New("nn: batch tick: the stages do not run on devices of their own (use Step)")
	}
	S := len(b.stages)
	if b.flight == nil {
		b.flight = make([]*stepGroup, S)
	}
	var g *stepGroup
	if len(works) > 0 {
		for i, w := range works {
			if w.Seq != nil && b.InFlight(w.Seq) {
				return nil, nil, fmt.Errorf("nn: batch tick: work %d: its sequence has a step in flight", i)
			}
		}
		if g, err = b.prepare(&batchStep{bs: b.step.bs}, works, nil); err != nil {
			return nil, nil, err
		}
		if g.T == 0 {
			g = nil
		}
	}
	// flight[k] has run stage k; this beat stage k+1 runs it, stage 0 g.
	run := make([]*stepGroup, S)
	run[0] = g
	for k := 1; k < S; k++ {
		run[k] = b.flight[k-1]
	}
	abandon := func(err error) ([]Work, [][]float32, error) {
		var lost []Work
		for _, r := range run {
			if r != nil {
				lost = append(lost, r.works...)
			}
		}
		clear(b.flight)
		return lost, nil, err
	}
	// The hand-overs first, from the last stage back: stage k's input
	// arrives once its previous output has left it.
	for k := S - 1; k >= 1; k-- {
		if r := run[k]; r != nil {
			if err := b.xfer.hand(b.stages[k-1], b.stages[k], r.T); err != nil {
				return abandon(err)
			}
		}
	}
	errs := make([]error, S)
	var out []float32
	var wg sync.WaitGroup
	for k, r := range run {
		if r == nil {
			continue
		}
		s := b.stages[k]
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.batch = r.st
			defer func() { s.batch = &b.step }()
			if k == 0 {
				if errs[k] = s.embedChunk(ctx, r.ids, nil); errs[k] != nil {
					return
				}
			}
			if errs[k] = s.blocksChunk(ctx, r.T, nil, false); errs[k] != nil || k < S-1 {
				return
			}
			l, err := s.batchHead(ctx, r.T, r.last, nil)
			out, errs[k] = slices.Clone(l), err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return abandon(err)
	}
	copy(b.flight, run[:S-1])
	last := run[S-1]
	b.flight[S-1] = nil
	if last == nil {
		return nil, nil, nil
	}
	return last.works, last.finish(out, b.cfg.VocabSize), nil
}

// InFlight reports whether seq has a step under way in the pipeline
// (Tick).
func (b *Batch) InFlight(seq *Seq) bool {
	for _, g := range b.flight {
		if g == nil {
			continue
		}
		for _, w := range g.works {
			if w.Seq == seq {
				return true
			}
		}
	}
	return false
}

// Flying is the number of steps in flight (Tick).
func (b *Batch) Flying() int {
	n := 0
	for _, g := range b.flight {
		if g != nil {
			n++
		}
	}
	return n
}

// batchHostKV prepares a batch session of a model whose blocks' KV cache
// is partly in host memory (SetHostKV): the blocks there (s.hkv.onHost)
// keep their part of the pool in host memory too, and their attention
// runs on HostKV.CPU over it, every step, whatever its rows (the device
// scratch of a session's prefill is not used). It returns the allocator
// of the host side, which has allocated the CPU's buffers for maxRows
// rows (its error is the caller's to check), or nil without host blocks.
func batchHostKV(s *Session, maxRows int) *allocator {
	m, c := s.m, &s.m.cfg
	h := m.hostKV
	if h == nil {
		return nil
	}
	host := &allocator{a: h.Alloc}
	hs := &hostKVSession{cfg: h, onHost: make([]bool, m.hi-m.lo)}
	for _, blk := range h.Blocks {
		hs.onHost[blk-m.lo] = true
	}
	hs.q = host.alloc(paging.Activations, maxRows, c.QDim())
	hs.attn = host.alloc(paging.Activations, maxRows, c.QDim())
	hs.k = host.alloc(paging.Activations, maxRows, c.KVDim())
	hs.v = host.alloc(paging.Activations, maxRows, c.KVDim())
	s.hkv = hs
	return host
}

// attention ropes the step's rows of q and kk, each sequence's at its
// positions, writes their keys and values into the pools kc and vc and
// computes attention over them into attn. A block whose pool is in host
// memory (onHost) sends the rows down and attends on the host's CPU.
func (st *batchStep) attention(b tensor.Backend, s *Session, attn, q, kk, vv, kc, vc *tensor.Tensor, scale float32, onHost bool) error {
	c := &s.m.cfg
	// Every row at its own position in one call each for q and k (not a
	// call per sequence: a GPU's launch each, every layer of every step).
	rot := tensor.Rotary{Cos: s.cos, Sin: s.sin, Heads: c.NumHeads, HeadDim: c.HeadDim}
	if err := tensor.RopeRows(b, q, rot, st.pos32); err != nil {
		return err
	}
	rot.Heads = c.NumKVHeads
	if err := tensor.RopeRows(b, kk, rot, st.pos32); err != nil {
		return err
	}
	ab := tensor.AttnBlocks{Q: q, K: kk, V: vv, KPool: kc, VPool: vc, Seqs: st.seqs,
		Heads: c.NumHeads, KVHeads: c.NumKVHeads, HeadDim: c.HeadDim, BlockSize: st.bs, Scale: scale}
	if !onHost {
		return b.AttentionBlocks(attn, ab)
	}
	hs, T := s.hkv, len(st.pos32)
	ab.Q, ab.K, ab.V = rows(hs.q, T), rows(hs.k, T), rows(hs.v, T)
	for _, p := range [][2]*tensor.Tensor{{ab.Q, q}, {ab.K, kk}, {ab.V, vv}} {
		if err := s.fetch(p[0].Bytes(), p[1]); err != nil {
			return fmt.Errorf("nn: batch rows to host memory: %w", err)
		}
		s.m.kv.down.Add(p[0].NumBytes())
	}
	out := rows(hs.attn, T)
	t0 := time.Now()
	err := hs.cfg.CPU.AttentionBlocks(out, ab)
	s.m.kv.cpuNanos.Add(int64(time.Since(t0)))
	s.m.kv.cpuCalls.Add(1)
	if err != nil {
		return fmt.Errorf("nn: batch attention on %s: %w", hs.cfg.CPU.Name(), err)
	}
	if err := b.Upload(attn, 0, out.Bytes()); err != nil {
		return fmt.Errorf("nn: batch attention output to %s: %w", b.Name(), err)
	}
	return nil
}

// batchHead applies the final norm to the first T rows of x and the LM
// head to the rows last of the result, and returns their logits; queued,
// when set, is called once the head is queued, before the download.
func (s *Session) batchHead(ctx context.Context, T int, last []int32, queued func()) ([]float32, error) {
	m, c, b := s.m, &s.m.cfg, s.m.backend
	v := s.viewsFor(T)
	layer := m.headLayer()
	lw, err := m.weights.Acquire(ctx, layer)
	if err != nil {
		return nil, err
	}
	defer m.weights.Release(layer)
	if len(last) == 0 {
		return nil, nil
	}
	if err := b.RMSNorm(v.h, v.x, lw[m.name(layer, arch.FinalNorm)], c.NormEps()); err != nil {
		return nil, fmt.Errorf("nn: final norm: %w", err)
	}
	n := len(last)
	in, out := rows(s.proj, n), rows(s.logits, n)
	if err := b.Embed(in, v.h, last); err != nil {
		return nil, fmt.Errorf("nn: the sequences' last rows: %w", err)
	}
	if err := s.matMul(out, in, lw[m.name(layer, arch.LMHead)], nil); err != nil {
		return nil, fmt.Errorf("nn: lm head: %w", err)
	}
	if queued != nil {
		queued()
	}
	size := out.Len()
	buf := s.batchLogits(4 * size)
	if err := tensor.DownloadComputed(b, buf, out); err != nil {
		return nil, err
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&buf[0])), size), nil
}

// batchLogits returns n bytes of host memory for a step's logits, kept for
// the next steps: page-locked memory of the backend where it has some
// (tensor.Pinned), which the copy from the device fills at the link's
// speed, where a pageable buffer is staged through the driver's (a step of
// 64 rows of a 32,000-token vocabulary downloads 8 MiB); else pageable.
func (s *Session) batchLogits(n int) []byte {
	if len(s.download) >= n {
		return s.download[:n]
	}
	s.freeBatchLogits()
	if pa, ok := tensor.Pinned(s.m.backend); ok {
		if buf, err := pa.AllocPinned(int64(n)); err == nil {
			s.download, s.downloadPinned = buf, true
			return buf
		}
	}
	s.download = make([]byte, n) // pageable: a slower copy, the same logits
	return s.download
}

// freeBatchLogits gives back batchLogits' page-locked memory.
func (s *Session) freeBatchLogits() {
	if s.downloadPinned {
		if pa, ok := tensor.Pinned(s.m.backend); ok {
			_ = pa.FreePinned(s.download) // the backend's own memory: its error is a bug of its accounting, nothing the batch can undo
		}
	}
	s.download, s.downloadPinned = nil, false
}
