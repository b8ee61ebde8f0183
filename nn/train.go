package nn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TrainOptions configure a Trainer.
type TrainOptions struct {
	// Segments splits the decoder blocks into this many recompute
	// checkpoints, as PyTorch's checkpoint_sequential does: the forward
	// keeps only the input of every segment but the last, and the backward
	// re-runs each such segment's forward before its backward. 0 or 1 keeps
	// every block's activations and recomputes nothing. At most the number
	// of blocks.
	Segments int
	// Threads bounds the goroutines of the backward; 0 takes the CPU
	// backend's thread count (GOMAXPROCS for other backends).
	Threads int
	// MaxGradNorm, when > 0, makes Step clip the gradients to this norm
	// before the update.
	MaxGradNorm float64
	// Hook, when non-nil, sees the hidden states of the forward as
	// Session.Forward's hook does (not those of recomputation).
	Hook Hook
}

// Trainer computes the loss of a model and its gradient with respect to
// every weight, on the host, with recompute checkpoints. Its forward runs on
// the model's backend with the same operations as Session.Forward, so its
// activations are the inference forward's bit for bit; the backward runs in
// F32 on the host and needs the backend's tensors on the host (the CPU
// backend). Weights come through the model's Weights, acquired in forward
// order and then, for the backward, in reverse: a Weights that has a
// SetOrder(paging.Order) method (PagedWeights) is told the direction, so
// that a paging.Pager prefetches the layers the backward needs next.
//
// Activations are allocated from the model's Allocator, charged to
// paging.Activations; StepStats.PeakActivationBytes is their peak, and
// Config.TrainActivationBytes predicts it.
//
// A Trainer is not safe for concurrent use.
type Trainer struct {
	m      *Model
	opts   TrainOptions
	bounds []int // segment j covers blocks bounds[j] .. bounds[j+1]-1
	p      par
	grads  Grads // Step's gradients
}

// NewTrainer returns a trainer of m.
func NewTrainer(m *Model, opts TrainOptions) (*Trainer, error) {
	bounds, err := segmentBounds(m.cfg.NumLayers, opts.Segments)
	if err != nil {
		return nil, err
	}
	threads := opts.Threads
	if threads <= 0 {
		if c, ok := m.backend.(interface{ Threads() int }); ok {
			threads = c.Threads()
		}
	}
	return &Trainer{m: m, opts: opts, bounds: bounds, p: newPar(threads)}, nil
}

// CheckpointSequential returns a trainer of m that splits the decoder
// blocks into segments recompute checkpoints (see TrainOptions.Segments).
func CheckpointSequential(m *Model, segments int) (*Trainer, error) {
	return NewTrainer(m, TrainOptions{Segments: segments})
}

// Model returns the model the trainer differentiates.
func (tr *Trainer) Model() *Model { return tr.m }

// Segments returns the number of segments the blocks are split into (1
// when nothing is recomputed).
func (tr *Trainer) Segments() int { return len(tr.bounds) - 1 }

// StepStats describe one forward and backward pass.
type StepStats struct {
	Loss    float64 // mean cross-entropy over the targets, not scaled
	Targets int     // positions counted in the loss
	// PeakActivationBytes is the most activation memory the pass held at
	// once, as its Allocator counted it.
	PeakActivationBytes int64
	// RecomputedBlocks is the number of block forwards run again by the
	// backward.
	RecomputedBlocks int
	Forward          time.Duration // the first forward, through the loss
	Backward         time.Duration // the backward, recomputation included
}

// NextToken returns the inputs and targets of next-token prediction over
// ids: inputs ids[:n-1], targets ids[1:], sharing ids' storage. Fewer than
// two ids give nil.
func NextToken(ids []int32) (inputs, targets []int32) {
	if len(ids) < 2 {
		return nil, nil
	}
	return ids[:len(ids)-1], ids[1:]
}

// LossAndGrads runs inputs through the model and computes the mean
// cross-entropy of the logits at position t against targets[t] (a negative
// target leaves the position out), then adds the gradient of lossScale times
// that loss with respect to every weight into grads, allocating the entries
// it lacks. With tied embeddings both uses of the table add into one entry.
// lossScale 0 means 1.
func (tr *Trainer) LossAndGrads(ctx context.Context, inputs, targets []int32, grads Grads, lossScale float32) (StepStats, error) {
	c := &tr.m.cfg
	switch {
	case grads == nil:
		return StepStats{}, errors.New("nn: train: nil gradients")
	case len(inputs) == 0:
		return StepStats{}, errors.New("nn: train: no input tokens")
	case len(targets) != len(inputs):
		return StepStats{}, fmt.Errorf("nn: train: %d targets for %d inputs", len(targets), len(inputs))
	case c.SlidingWindow > 0 && len(inputs) > c.SlidingWindow:
		return StepStats{}, fmt.Errorf("nn: train: %d positions exceed the model's sliding attention window of %d, which strata does not implement", len(inputs), c.SlidingWindow)
	}
	if lossScale == 0 {
		lossScale = 1
	}
	if !(lossScale > 0) || math.IsInf(float64(lossScale), 0) {
		return StepStats{}, fmt.Errorf("nn: train: loss scale %v must be positive and finite", lossScale)
	}
	count := 0
	for i, id := range inputs {
		if id < 0 || int(id) >= c.VocabSize {
			return StepStats{}, fmt.Errorf("nn: train: input id %d at position %d is outside the vocabulary of %d", id, i, c.VocabSize)
		}
		if y := targets[i]; int(y) >= c.VocabSize {
			return StepStats{}, fmt.Errorf("nn: train: target id %d at position %d is outside the vocabulary of %d", y, i, c.VocabSize)
		} else if y >= 0 {
			count++
		}
	}
	if count == 0 {
		return StepStats{}, errors.New("nn: train: every target is ignored")
	}
	ps := &pass{
		tr: tr, m: tr.m, c: c, b: tr.m.backend, ctx: ctx, p: tr.p,
		T: len(inputs), ids: inputs, targets: targets, count: count,
		grads: grads, scale: float64(lossScale), hook: tr.opts.Hook,
		acts: actAlloc{a: tr.m.alloc, live: map[*tensor.Tensor]bool{}},
	}
	defer ps.close()
	err := ps.run()
	st := StepStats{
		Targets: count, PeakActivationBytes: ps.acts.peak, RecomputedBlocks: ps.recomputed,
		Forward: ps.fwdTime, Backward: ps.bwdTime,
	}
	if err != nil {
		return st, err
	}
	st.Loss = ps.lossSum / float64(count)
	return st, nil
}

// StepResult describes one training step.
type StepResult struct {
	StepStats
	Scale    float32 // the loss scale the step ran with
	Skipped  bool    // the gradients were not finite: no update
	GradNorm float64 // norm of the unscaled gradients before clipping; 0 when skipped
}

// Step runs one training step on p, the trainer's model's parameters: the
// gradients of the loss over inputs and targets, scaled by scaler (nil for
// no scaling), unscaled, clipped to MaxGradNorm, and opt's update of p. With
// a scaler, gradients holding an infinity or a NaN skip the update and
// reduce the scale; without one they are an error.
//
// When the model reads p through a paging.Pager, the pager's copies of the
// weights are stale after the step; build a new pager before the next.
func (tr *Trainer) Step(ctx context.Context, inputs, targets []int32, p *Params, opt Optimizer, scaler *LossScaler) (StepResult, error) {
	if tr.grads == nil {
		tr.grads = Grads{}
	}
	tr.grads.Zero()
	scale := float32(1)
	if scaler != nil {
		scale = scaler.Scale
	}
	st, err := tr.LossAndGrads(ctx, inputs, targets, tr.grads, scale)
	res := StepResult{StepStats: st, Scale: scale}
	if err != nil {
		return res, err
	}
	if scaler != nil {
		if !scaler.Unscale(tr.grads) {
			res.Skipped = true
			return res, nil
		}
	} else if !tr.grads.AllFinite() {
		return res, fmt.Errorf("nn: train: gradients are not finite (loss %g); a LossScaler skips such steps", st.Loss)
	}
	res.GradNorm = tr.grads.ClipNorm(tr.opts.MaxGradNorm)
	if err := opt.Step(p, tr.grads); err != nil {
		return res, err
	}
	return res, nil
}

// Grads returns the gradients of the last Step (unscaled and clipped), nil
// before the first.
func (tr *Trainer) Grads() Grads { return tr.grads }

// actAlloc hands out F32 activation buffers from the model's allocator,
// charged to paging.Activations, and counts their bytes.
type actAlloc struct {
	a         paging.Allocator
	live      map[*tensor.Tensor]bool
	cur, peak int64
}

var errDeviceTraining = errors.New("nn: train: the backward runs on the host and needs the backend's tensors there (the CUDA backward is not implemented)")

func (a *actAlloc) get(rows, cols int) (*tensor.Tensor, error) {
	t, err := a.a.Alloc(paging.Activations, tensor.F32, tensor.Shape{rows, cols})
	if err != nil {
		return nil, fmt.Errorf("nn: train: activations [%d %d]: %w", rows, cols, err)
	}
	if !t.OnHost() {
		a.a.Free(t)
		return nil, errDeviceTraining
	}
	a.live[t] = true
	a.cur += t.NumBytes()
	a.peak = max(a.peak, a.cur)
	return t, nil
}

func (a *actAlloc) put(ts ...*tensor.Tensor) {
	for _, t := range ts {
		if t != nil && a.live[t] {
			delete(a.live, t)
			a.cur -= t.NumBytes()
			a.a.Free(t)
		}
	}
}

func (a *actAlloc) freeAll() {
	for t := range a.live {
		a.put(t)
	}
}

// pass is one LossAndGrads call.
type pass struct {
	tr      *Trainer
	m       *Model
	c       *Config
	b       tensor.Backend
	ctx     context.Context
	p       par
	T       int
	ids     []int32
	targets []int32
	count   int
	grads   Grads
	scale   float64
	hook    Hook
	acts    actAlloc

	cos, sin       *tensor.Tensor // rotary tables [T, HeadDim/2], workspace
	embedShape     tensor.Shape
	lossSum        float64
	recomputed     int
	fwdTime        time.Duration
	bwdTime        time.Duration
	recomputing    bool
	attentionScale float32
}

// blockBufs are the tensors one block's forward reads and writes. In the
// forward that keeps nothing, xIn, xMid and xOut are one buffer, as are h1
// and h2, and act is gate.
type blockBufs struct {
	xIn, h1, q, k, v, attn, xMid, h2, gate, up *tensor.Tensor // kept for the backward
	proj, act, xOut                            *tensor.Tensor
}

// kept returns the tensors a block's backward reads.
func (bb *blockBufs) kept() []*tensor.Tensor {
	return []*tensor.Tensor{bb.xIn, bb.h1, bb.q, bb.k, bb.v, bb.attn, bb.xMid, bb.h2, bb.gate, bb.up}
}

// bwdWork is the workspace of the backward, also lent to the forwards that
// keep activations (dh as proj, act as act).
type bwdWork struct {
	dx, dh, dact, act, dattn, dq, dk, dv *tensor.Tensor
}

func (ps *pass) close() {
	ps.acts.freeAll()
	ps.m.alloc.Free(ps.cos)
	ps.m.alloc.Free(ps.sin)
	ps.order(paging.Forward)
}

// order tells a Weights that pages which way the next layers go.
func (ps *pass) order(o paging.Order) {
	if s, ok := ps.m.weights.(interface{ SetOrder(paging.Order) }); ok {
		s.SetOrder(o)
	}
}

func (ps *pass) run() error {
	c, b, T := ps.c, ps.b, ps.T
	ps.attentionScale = float32(1 / math.Sqrt(float64(c.HeadDim)))
	var err error
	if ps.cos, err = ps.m.alloc.Alloc(paging.Workspace, tensor.F32, tensor.Shape{T, c.HeadDim / 2}); err != nil {
		return fmt.Errorf("nn: train: rotary tables: %w", err)
	}
	if ps.sin, err = ps.m.alloc.Alloc(paging.Workspace, tensor.F32, tensor.Shape{T, c.HeadDim / 2}); err != nil {
		return fmt.Errorf("nn: train: rotary tables: %w", err)
	}
	if !ps.cos.OnHost() || !ps.sin.OnHost() {
		return errDeviceTraining
	}
	cos, sin := c.RopeTables(T)
	copy(ps.cos.F32(), cos)
	copy(ps.sin.F32(), sin)

	start := time.Now()
	ps.order(paging.Forward)
	x0, err := ps.acts.get(T, c.HiddenSize)
	if err != nil {
		return err
	}
	lw, err := ps.m.weights.Acquire(ps.ctx, ps.m.embedLayer())
	if err != nil {
		return err
	}
	err = func() error {
		defer ps.m.weights.Release(ps.m.embedLayer()) // released even if the backend panics
		table := lw[EmbedName]
		if table == nil {
			return errors.New("no tensor " + EmbedName)
		}
		ps.embedShape = table.Shape().Clone()
		return b.Embed(x0, table, ps.ids)
	}()
	if err != nil {
		return fmt.Errorf("nn: train: embedding: %w", err)
	}
	if err := ps.callHook(0, x0); err != nil {
		return err
	}

	// Forward through the segments whose activations are not kept,
	// keeping each one's input.
	K := len(ps.tr.bounds) - 1
	inputs := make([]*tensor.Tensor, K)
	x := x0
	if K > 1 {
		var sc blockBufs
		for _, f := range []struct {
			p *(*tensor.Tensor)
			w int
		}{
			{&sc.xIn, c.HiddenSize}, {&sc.h1, c.HiddenSize}, {&sc.q, c.QDim()}, {&sc.attn, c.QDim()},
			{&sc.k, c.KVDim()}, {&sc.v, c.KVDim()}, {&sc.proj, c.HiddenSize},
			{&sc.gate, c.IntermediateSize}, {&sc.up, c.IntermediateSize},
		} {
			if *f.p, err = ps.acts.get(T, f.w); err != nil {
				return err
			}
		}
		sc.xMid, sc.xOut, sc.h2, sc.act = sc.xIn, sc.xIn, sc.h1, sc.gate
		for j := 0; j < K-1; j++ {
			if j == 0 {
				inputs[0] = x0
			} else if inputs[j], err = ps.acts.get(T, c.HiddenSize); err != nil {
				return err
			}
			// The running residual is sc.xIn; segment j's input is a copy.
			src, dst := inputs[j], sc.xIn
			if j > 0 {
				src, dst = sc.xIn, inputs[j]
			}
			copy(dst.F32(), src.F32())
			for i := ps.tr.bounds[j]; i < ps.tr.bounds[j+1]; i++ {
				if err := ps.ctx.Err(); err != nil {
					return err
				}
				if err := ps.forwardBlock(i, &sc, true); err != nil {
					return err
				}
				if err := ps.callHook(ps.m.blockLayer(i), sc.xIn); err != nil {
					return err
				}
			}
		}
		// The running residual becomes the last segment's input.
		x = sc.xIn
		ps.acts.put(sc.h1, sc.q, sc.attn, sc.k, sc.v, sc.proj, sc.gate, sc.up)
	}

	bw, err := ps.newBwdWork()
	if err != nil {
		return err
	}
	last := ps.tr.bounds[K-1]
	recs, xL, err := ps.forwardKept(last, c.NumLayers, x, bw, true, true)
	if err != nil {
		return err
	}

	// The head runs forward and backward at once: the logits are never
	// kept.
	ps.order(paging.Reverse)
	if err := ps.head(xL, bw); err != nil {
		return err
	}
	ps.acts.put(xL)
	mid := time.Now()
	ps.fwdTime = mid.Sub(start)

	if err := ps.backwardBlocks(last, recs, bw); err != nil {
		return err
	}
	for j := K - 2; j >= 0; j-- {
		ps.order(paging.Forward)
		ps.recomputing = true
		recs, _, err := ps.forwardKept(ps.tr.bounds[j], ps.tr.bounds[j+1], inputs[j], bw, false, false)
		if err != nil {
			return err
		}
		ps.recomputed += len(recs)
		if err := ps.backwardBlocks(ps.tr.bounds[j], recs, bw); err != nil {
			return err
		}
	}

	// The embedding's gradient needs no weights: each row of dx goes to
	// its token's row.
	dE, err := ps.grads.buffer(EmbedName, ps.embedShape)
	if err != nil {
		return err
	}
	embedBack(dE, bw.dx.F32(), ps.ids, c.HiddenSize)
	ps.bwdTime = time.Since(mid)
	return nil
}

func (ps *pass) callHook(layer int, h *tensor.Tensor) error {
	if ps.hook == nil || ps.recomputing {
		return nil
	}
	return ps.hook(layer, h)
}

func (ps *pass) newBwdWork() (*bwdWork, error) {
	c, T := ps.c, ps.T
	bw := &bwdWork{}
	var err error
	for _, f := range []struct {
		p *(*tensor.Tensor)
		w int
	}{
		{&bw.dx, c.HiddenSize}, {&bw.dh, c.HiddenSize},
		{&bw.dact, c.IntermediateSize}, {&bw.act, c.IntermediateSize},
		{&bw.dattn, c.QDim()}, {&bw.dq, c.QDim()},
		{&bw.dk, c.KVDim()}, {&bw.dv, c.KVDim()},
	} {
		if *f.p, err = ps.acts.get(T, f.w); err != nil {
			return nil, err
		}
	}
	return bw, nil
}

// forwardKept runs blocks from..to-1 from x (which the first block's record
// takes over), keeping what their backward needs. It returns the records
// and, when wantOut is set, the output of the last block; without it the
// last block's MLP output, which no backward reads, is not computed.
func (ps *pass) forwardKept(from, to int, x *tensor.Tensor, bw *bwdWork, wantOut, first bool) ([]*blockBufs, *tensor.Tensor, error) {
	c, T := ps.c, ps.T
	var recs []*blockBufs
	for i := from; i < to; i++ {
		if err := ps.ctx.Err(); err != nil {
			return nil, nil, err
		}
		bb := &blockBufs{xIn: x, proj: bw.dh, act: bw.act}
		recs = append(recs, bb)
		for _, f := range []struct {
			p *(*tensor.Tensor)
			w int
		}{
			{&bb.h1, c.HiddenSize}, {&bb.q, c.QDim()}, {&bb.k, c.KVDim()}, {&bb.v, c.KVDim()},
			{&bb.attn, c.QDim()}, {&bb.xMid, c.HiddenSize}, {&bb.h2, c.HiddenSize},
			{&bb.gate, c.IntermediateSize}, {&bb.up, c.IntermediateSize},
		} {
			var err error
			if *f.p, err = ps.acts.get(T, f.w); err != nil {
				return nil, nil, err
			}
		}
		needOut := i < to-1 || wantOut
		if needOut {
			var err error
			if bb.xOut, err = ps.acts.get(T, c.HiddenSize); err != nil {
				return nil, nil, err
			}
		}
		if !first && i == to-1 {
			ps.order(paging.Reverse) // the backward starts here
		}
		if err := ps.forwardBlock(i, bb, needOut); err != nil {
			return nil, nil, err
		}
		if needOut {
			if err := ps.callHook(ps.m.blockLayer(i), bb.xOut); err != nil {
				return nil, nil, err
			}
		}
		x = bb.xOut
	}
	return recs, x, nil
}

// forwardBlock runs decoder block i with the operations and order of
// Session.block. Without needOut it stops before the MLP's output.
func (ps *pass) forwardBlock(i int, bb *blockBufs, needOut bool) error {
	layer := ps.m.blockLayer(i)
	lw, err := ps.m.weights.Acquire(ps.ctx, layer)
	if err != nil {
		return err
	}
	defer ps.m.weights.Release(layer)
	c, b, n := ps.c, ps.b, &ps.m.names[i]
	wrap := func(what string, err error) error {
		if err != nil {
			return fmt.Errorf("nn: train: block %d: %s: %w", i, what, err)
		}
		return nil
	}
	if err := b.RMSNorm(bb.h1, bb.xIn, lw[n.attnNorm], c.RMSNormEps); err != nil {
		return wrap("attention norm", err)
	}
	if err := b.MatMul(bb.q, bb.h1, lw[n.q], lw[n.qBias]); err != nil {
		return wrap("q projection", err)
	}
	if err := b.MatMul(bb.k, bb.h1, lw[n.k], lw[n.kBias]); err != nil {
		return wrap("k projection", err)
	}
	if err := b.MatMul(bb.v, bb.h1, lw[n.v], lw[n.vBias]); err != nil {
		return wrap("v projection", err)
	}
	if err := b.Rope(bb.q, ps.cos, ps.sin, c.NumHeads, c.HeadDim, 0); err != nil {
		return wrap("rope", err)
	}
	if err := b.Rope(bb.k, ps.cos, ps.sin, c.NumKVHeads, c.HeadDim, 0); err != nil {
		return wrap("rope", err)
	}
	if err := b.Attention(bb.attn, bb.q, bb.k, bb.v, c.NumHeads, c.NumKVHeads, c.HeadDim, 0, ps.attentionScale); err != nil {
		return wrap("attention", err)
	}
	if err := b.MatMul(bb.proj, bb.attn, lw[n.o], lw[n.oBias]); err != nil {
		return wrap("o projection", err)
	}
	if err := b.Add(bb.xMid, bb.xIn, bb.proj); err != nil {
		return wrap("residual", err)
	}
	if err := b.RMSNorm(bb.h2, bb.xMid, lw[n.mlpNorm], c.RMSNormEps); err != nil {
		return wrap("mlp norm", err)
	}
	if err := b.MatMul(bb.gate, bb.h2, lw[n.gate], nil); err != nil {
		return wrap("gate projection", err)
	}
	if err := b.MatMul(bb.up, bb.h2, lw[n.up], nil); err != nil {
		return wrap("up projection", err)
	}
	if !needOut {
		return nil
	}
	if err := b.SiLUMul(bb.act, bb.gate, bb.up); err != nil {
		return wrap("silu", err)
	}
	if err := b.MatMul(bb.proj, bb.act, lw[n.down], nil); err != nil {
		return wrap("down projection", err)
	}
	return wrap("residual", b.Add(bb.xOut, bb.xMid, bb.proj))
}

// head runs the final norm, the LM head and the loss forward and backward,
// leaving the gradient of the last block's output in bw.dx.
func (ps *pass) head(xL *tensor.Tensor, bw *bwdWork) error {
	c, b, T, H, V := ps.c, ps.b, ps.T, ps.c.HiddenSize, ps.c.VocabSize
	layer := ps.m.headLayer()
	lw, err := ps.m.weights.Acquire(ps.ctx, layer)
	if err != nil {
		return err
	}
	defer ps.m.weights.Release(layer)
	headName := HeadName
	if c.TieEmbeddings {
		headName = EmbedName
	}
	norm, err := hostWeight(lw, NormName)
	if err != nil {
		return err
	}
	head, err := hostWeight(lw, headName)
	if err != nil {
		return err
	}
	hn, err := ps.acts.get(T, H)
	if err != nil {
		return err
	}
	if err := b.RMSNorm(hn, xL, norm, c.RMSNormEps); err != nil {
		return fmt.Errorf("nn: train: final norm: %w", err)
	}
	if err := ps.callHook(layer, hn); err != nil {
		return err
	}
	rowsPer := headRows(T, V)
	logits, err := ps.acts.get(rowsPer, V)
	if err != nil {
		return err
	}
	dHead, err := ps.grads.buffer(headName, head.Shape())
	if err != nil {
		return err
	}
	dh := bw.dh.F32()
	clear(dh)
	for r0 := 0; r0 < T; r0 += rowsPer {
		r1 := min(T, r0+rowsPer)
		lg := rows(logits, r1-r0)
		hr, _ := hn.Rows(r0, r1-r0)
		if err := b.MatMul(lg, hr, head, nil); err != nil {
			return fmt.Errorf("nn: train: lm head: %w", err)
		}
		ps.lossSum += crossEntropy(lg.F32(), ps.targets[r0:r1], V, ps.scale, ps.count)
		linearBackW(ps.p, dHead, lg.F32(), hr.F32(), r1-r0, V, H)
		linearBackX(ps.p, dh[r0*H:r1*H], lg.F32(), head, r1-r0)
	}
	ps.acts.put(logits, hn)
	dNorm, err := ps.grads.buffer(NormName, norm.Shape())
	if err != nil {
		return err
	}
	clear(bw.dx.F32())
	rmsNormBack(ps.p, bw.dx.F32(), dh, xL.F32(), norm.ToF32(), dNorm, H, c.RMSNormEps)
	return nil
}

// headLogitElems bounds the logits the head holds at once: its rows are
// processed in chunks of at most this many elements (at least one row).
const headLogitElems = 1 << 22

func headRows(T, V int) int { return max(1, min(T, headLogitElems/V)) }

// backwardBlocks runs the backward of blocks from..from+len(recs)-1 in
// reverse, freeing each block's activations when done with them.
func (ps *pass) backwardBlocks(from int, recs []*blockBufs, bw *bwdWork) error {
	for j := len(recs) - 1; j >= 0; j-- {
		if err := ps.ctx.Err(); err != nil {
			return err
		}
		if err := ps.backwardBlock(from+j, recs[j], bw); err != nil {
			return err
		}
		ps.acts.put(recs[j].kept()...)
	}
	return nil
}

// hostWeight returns a weight that the host can read.
func hostWeight(lw LayerWeights, name string) (*tensor.Tensor, error) {
	w := lw[name]
	switch {
	case w == nil:
		return nil, fmt.Errorf("nn: train: no tensor %s", name)
	case !w.OnHost():
		return nil, errDeviceTraining
	case w.DType() != tensor.F32 && w.DType() != tensor.F16 && w.DType() != tensor.BF16:
		return nil, fmt.Errorf("nn: train: %s has dtype %v", name, w.DType())
	}
	return w, nil
}

// backwardBlock adds block i's weight gradients into the pass's gradients
// and turns bw.dx from the gradient of the block's output into that of its
// input.
func (ps *pass) backwardBlock(i int, bb *blockBufs, bw *bwdWork) error {
	layer := ps.m.blockLayer(i)
	lw, err := ps.m.weights.Acquire(ps.ctx, layer)
	if err != nil {
		return err
	}
	defer ps.m.weights.Release(layer)
	c, p, n, T := ps.c, ps.p, &ps.m.names[i], ps.T
	H, I, QD, KVD := c.HiddenSize, c.IntermediateSize, c.QDim(), c.KVDim()
	// weight returns a weight and its gradient buffer; optional weights
	// (biases) that the model lacks give nil.
	weight := func(name string, optional bool) (*tensor.Tensor, []float32, error) {
		if optional && lw[name] == nil {
			return nil, nil, nil
		}
		w, err := hostWeight(lw, name)
		if err != nil {
			return nil, nil, err
		}
		g, err := ps.grads.buffer(name, w.Shape())
		return w, g, err
	}
	var (
		wq, wk, wv, wo, wg, wu, wd, an, mn   *tensor.Tensor
		gq, gk, gv, gO, gg, gu, gd, gan, gmn []float32
		gbq, gbk, gbv, gbo                   []float32
	)
	for _, f := range []struct {
		name string
		w    **tensor.Tensor
		g    *[]float32
	}{
		{n.q, &wq, &gq}, {n.k, &wk, &gk}, {n.v, &wv, &gv}, {n.o, &wo, &gO},
		{n.gate, &wg, &gg}, {n.up, &wu, &gu}, {n.down, &wd, &gd},
		{n.attnNorm, &an, &gan}, {n.mlpNorm, &mn, &gmn},
	} {
		if *f.w, *f.g, err = weight(f.name, false); err != nil {
			return err
		}
	}
	for _, f := range []struct {
		name string
		g    *[]float32
	}{{n.qBias, &gbq}, {n.kBias, &gbk}, {n.vBias, &gbv}, {n.oBias, &gbo}} {
		if _, *f.g, err = weight(f.name, true); err != nil {
			return err
		}
	}

	dx, dh := bw.dx.F32(), bw.dh.F32()
	dact, act := bw.dact.F32(), bw.act.F32()
	// MLP: out = down(silu(gate) * up), gate and up from h2 = norm(xMid).
	if err := ps.b.SiLUMul(bw.act, bb.gate, bb.up); err != nil {
		return fmt.Errorf("nn: train: block %d: silu: %w", i, err)
	}
	linearBackW(p, gd, dx, act, T, H, I)
	clear(dact)
	linearBackX(p, dact, dx, wd, T)
	siluMulBack(dact, act, bb.gate.F32(), bb.up.F32()) // dact: d gate, act: d up
	h2 := bb.h2.F32()
	linearBackW(p, gg, dact, h2, T, I, H)
	linearBackW(p, gu, act, h2, T, I, H)
	clear(dh)
	linearBackX(p, dh, dact, wg, T)
	linearBackX(p, dh, act, wu, T)
	rmsNormBack(p, dx, dh, bb.xMid.F32(), mn.ToF32(), gmn, H, c.RMSNormEps)

	// Attention: out = o(attention(rope(q(h1)), rope(k(h1)), v(h1))), h1
	// = norm(xIn). dx is now the gradient of xMid, which is also that of
	// the o projection's output.
	linearBackW(p, gO, dx, bb.attn.F32(), T, H, QD)
	if gbo != nil {
		biasBack(gbo, dx, T)
	}
	dattn := bw.dattn.F32()
	clear(dattn)
	linearBackX(p, dattn, dx, wo, T)
	dq, dk, dv := bw.dq.F32(), bw.dk.F32(), bw.dv.F32()
	attentionBack(p, dq, dk, dv, dattn, bb.q.F32(), bb.k.F32(), bb.v.F32(), T, c.NumHeads, c.NumKVHeads, c.HeadDim, ps.attentionScale)
	cos, sin := ps.cos.F32(), ps.sin.F32()
	ropeBack(dq, cos, sin, c.NumHeads, c.HeadDim, 0)
	ropeBack(dk, cos, sin, c.NumKVHeads, c.HeadDim, 0)
	h1 := bb.h1.F32()
	linearBackW(p, gq, dq, h1, T, QD, H)
	linearBackW(p, gk, dk, h1, T, KVD, H)
	linearBackW(p, gv, dv, h1, T, KVD, H)
	for _, bg := range []struct {
		g  []float32
		dy []float32
	}{{gbq, dq}, {gbk, dk}, {gbv, dv}} {
		if bg.g != nil {
			biasBack(bg.g, bg.dy, T)
		}
	}
	clear(dh)
	linearBackX(p, dh, dq, wq, T)
	linearBackX(p, dh, dk, wk, T)
	linearBackX(p, dh, dv, wv, T)
	rmsNormBack(p, dx, dh, bb.xIn.F32(), an.ToF32(), gan, H, c.RMSNormEps)
	return nil
}
