package nn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/strata-llm/strata/arch"
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
	// MaxGradNorm, when > 0, makes Step clip the gradients to this norm
	// before the update. It must be finite and not negative.
	MaxGradNorm float64
	// Hook, when non-nil, sees the hidden states of the forward as
	// Session.Forward's hook does (not those of recomputation).
	Hook Hook
}

// Trainer computes the loss of a model and its gradient with respect to
// every weight, with recompute checkpoints, on the model's backend, which
// must implement tensor.GradOps (the CPU and CUDA backends do). Its forward
// runs the same operations as Session.Forward, so its activations are the
// inference forward's bit for bit; the backward runs in F32. Weights come
// through the model's Weights, acquired in forward order and then, for the
// backward, in reverse: a Weights that has a SetOrder(paging.Order) method
// (a paging.Pager) is told the direction, so that a paging.Pager prefetches
// the layers the backward needs next.
//
// Activations are allocated from the model's Allocator, charged to
// paging.Activations; StepStats.PeakActivationBytes is their peak, and
// TrainActivationBytes predicts it. The gradients end in host F32
// tensors (Grads). On a device backend each layer's gradients are computed
// into device buffers charged to paging.Gradients, then copied out and added
// into the Grads, so the device holds one layer's gradients at a time
// (TrainGradientBytes); on the CPU they accumulate in the Grads
// directly.
//
// A Trainer is not safe for concurrent use.
type Trainer struct {
	m      *Model
	opts   TrainOptions
	bounds []int // segment j covers blocks bounds[j] .. bounds[j+1]-1
	grads  Grads // Step's gradients
	stages [2]gradStage
	next   int // the stage the next flush uses
	// stageGrads sends host backends' gradients through the device path
	// (buffers from the allocator, staged copies, additions in flight), so
	// that the CPU tests cover it.
	stageGrads bool
}

// gradStage is a host buffer that one layer's device gradients are copied
// into, pinned when the backend can, and the goroutine adding them from
// there into the Grads. Two stages alternate, so that the host adds one
// layer's gradients while the device computes the next layer's.
type gradStage struct {
	buf    []byte
	pinned bool
	adding sync.WaitGroup
}

// Close waits for the trainer's work in flight and releases its host
// staging buffers. A closed trainer can be used again: it allocates them
// anew.
func (tr *Trainer) Close() error {
	tr.wait()
	var err error
	for i := range tr.stages {
		st := &tr.stages[i]
		if st.pinned {
			if e := tr.pinned().FreePinned(st.buf); e != nil && err == nil {
				err = e
			}
		}
		st.buf, st.pinned = nil, false
	}
	return err
}

// wait waits for every gradient addition in flight.
func (tr *Trainer) wait() {
	for i := range tr.stages {
		tr.stages[i].adding.Wait()
	}
}

// stage returns the next staging buffer and its first n bytes, once its
// previous additions are done.
func (tr *Trainer) stage(n int64) (*gradStage, []byte) {
	st := &tr.stages[tr.next]
	tr.next = 1 - tr.next
	st.adding.Wait()
	if int64(len(st.buf)) >= n {
		return st, st.buf[:n]
	}
	if st.pinned {
		tr.pinned().FreePinned(st.buf)
		st.buf, st.pinned = nil, false
	}
	if pa, ok := tensor.Pinned(tr.m.backend); ok {
		if buf, err := pa.AllocPinned(n); err == nil {
			st.buf, st.pinned = buf, true
			return st, buf
		}
	}
	st.buf = make([]byte, n) // pageable: slower copies, same result
	return st, st.buf
}

// pinned returns the backend's pinned allocator, which a stage marked
// pinned came from.
func (tr *Trainer) pinned() tensor.PinnedAllocator {
	pa, _ := tensor.Pinned(tr.m.backend)
	return pa
}

// floats views host bytes (a multiple of 4) as float32s.
func floats(b []byte) []float32 {
	t, err := tensor.FromBytes(tensor.F32, tensor.Shape{len(b) / 4}, b)
	if err != nil {
		panic(err) // unreachable: the length matches by construction
	}
	return t.F32()
}

// NewTrainer returns a trainer of m.
func NewTrainer(m *Model, opts TrainOptions) (*Trainer, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	bounds, err := segmentBounds(m.cfg.NumLayers, opts.Segments)
	if err != nil {
		return nil, err
	}
	if _, ok := tensor.CheckedGrad(m.backend); !ok {
		return nil, fmt.Errorf("nn: train: backend %s has no backward operations (tensor.GradOps)", m.backend.Name())
	}
	if c := &m.cfg; c.QKNorm || c.MoE != nil {
		return nil, fmt.Errorf("nn: train: %v models cannot be trained: the backward pass has no q/k norms or experts", c.Family)
	}
	return &Trainer{m: m, opts: opts, bounds: bounds}, nil
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
	// GradCopy is the part of Forward and Backward spent copying device
	// gradients to the host (not waiting for the device to compute them)
	// and waiting for the host to add them up; 0 on the CPU.
	GradCopy time.Duration
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
// lossScale 0 means 1. A loss that is not finite is an error as in Step
// (grads then hold the pass's non-finite gradients).
func (tr *Trainer) LossAndGrads(ctx context.Context, inputs, targets []int32, grads Grads, lossScale float32) (StepStats, error) {
	st, err := tr.lossAndGrads(ctx, inputs, targets, grads, lossScale, false)
	if err == nil && (math.IsNaN(st.Loss) || math.IsInf(st.Loss, 0)) {
		err = tr.nonFiniteLoss(ctx, inputs, st.Loss)
	}
	return st, err
}

// lossAndGrads is LossAndGrads; with overwrite, grads are set rather than
// added to (what Step wants), which spares zeroing them and, on a device,
// reading them back for the addition.
func (tr *Trainer) lossAndGrads(ctx context.Context, inputs, targets []int32, grads Grads, lossScale float32, overwrite bool) (StepStats, error) {
	c := &tr.m.cfg
	switch {
	case grads == nil:
		return StepStats{}, errors.New("nn: train: nil gradients")
	case len(inputs) == 0:
		return StepStats{}, errors.New("nn: train: no input tokens")
	case len(targets) != len(inputs):
		return StepStats{}, fmt.Errorf("nn: train: %d targets for %d inputs", len(targets), len(inputs))
	}
	if err := checkContext(c, "training window", len(inputs)); err != nil {
		return StepStats{}, err
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
	g, _ := tensor.CheckedGrad(tr.m.backend) // present: NewTrainer checked
	ps := &pass{
		tr: tr, m: tr.m, c: c, b: tr.m.backend, g: g, ctx: ctx,
		T: len(inputs), ids: inputs, targets: targets, count: count,
		grads: grads, scale: float64(lossScale), hook: tr.opts.Hook,
		acts:      actAlloc{a: tr.m.alloc, live: map[*tensor.Tensor]bool{}},
		overwrite: overwrite, written: map[*tensor.Tensor]bool{},
	}
	defer ps.close()
	err := ps.run()
	st := StepStats{
		Targets: count, PeakActivationBytes: ps.acts.peak, RecomputedBlocks: ps.recomputed,
		Forward: ps.fwdTime, Backward: ps.bwdTime, GradCopy: ps.gradCopy,
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
// reduce the scale; without one they are an error. A loss that is not
// finite (the forward overflowed, which no scale changes) is an error
// wrapping ErrNonFinite, a *NonFiniteError naming the first layer that
// produced a NaN or an infinity when one can be found. An update that leaves
// a NaN or an infinity in a weight (finite gradients can push an F16 weight
// past its range) is an error wrapping ErrNonFinite naming the weight: p
// holds that update, and training cannot go on from it.
//
// When the model reads p through a paging.Pager, the pager's copies of the
// weights are stale after the step; build a new pager before the next.
func (tr *Trainer) Step(ctx context.Context, inputs, targets []int32, p *Params, opt Optimizer, scaler *LossScaler) (StepResult, error) {
	if tr.grads == nil {
		tr.grads = Grads{}
	}
	scale := float32(1)
	if scaler != nil {
		if err := scaler.Validate(); err != nil {
			return StepResult{}, err
		}
		scale = scaler.Scale
	}
	st, err := tr.lossAndGrads(ctx, inputs, targets, tr.grads, scale, true)
	res := StepResult{StepStats: st, Scale: scale}
	if err != nil {
		return res, err
	}
	if math.IsNaN(st.Loss) || math.IsInf(st.Loss, 0) {
		// The loss is computed before any scaling: the forward itself
		// overflowed, and no loss scale will change that.
		return res, tr.nonFiniteLoss(ctx, inputs, st.Loss)
	}
	// One pass for the norm, which is finite exactly when every gradient
	// is (a float64 sum of float32 squares cannot overflow), and one to
	// unscale and clip together.
	norm := tr.grads.Norm()
	finite := !math.IsInf(norm, 0) && !math.IsNaN(norm)
	if scaler != nil {
		if !scaler.observe(finite) {
			res.Skipped = true
			return res, nil
		}
	} else if !finite {
		return res, fmt.Errorf("nn: train: gradients are not finite (loss %g); a LossScaler skips such steps", st.Loss)
	}
	factor := 1 / float64(scale)
	res.GradNorm = norm * factor
	if m := tr.opts.MaxGradNorm; m > 0 && res.GradNorm > m {
		factor *= m / res.GradNorm
	}
	if factor != 1 {
		tr.grads.Scale(float32(factor))
	}
	if err := opt.Step(p, tr.grads); err != nil {
		return res, err
	}
	return res, nil
}

// nonFiniteLoss is the error of a step whose loss is not finite: it runs
// the inference forward, whose activations are the trainer's bit for bit,
// over inputs to name the first layer that produced a NaN or an infinity
// (falling back to the loss alone when that forward cannot run).
func (tr *Trainer) nonFiniteLoss(ctx context.Context, inputs []int32, loss float64) error {
	err := fmt.Errorf("nn: train: the loss is %v: the forward pass produced %w", loss, ErrNonFinite)
	s, serr := tr.m.NewSession(len(inputs), len(inputs))
	if serr != nil {
		return err
	}
	defer s.Close()
	_, ferr := s.Forward(ctx, inputs, true, nil)
	var ne *NonFiniteError
	if !errors.As(ferr, &ne) {
		return err
	}
	return &lossError{loss, ne}
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

func (a *actAlloc) get(rows, cols int) (*tensor.Tensor, error) {
	t, err := a.a.Alloc(paging.Activations, tensor.F32, tensor.Shape{rows, cols})
	if err != nil {
		return nil, fmt.Errorf("nn: train: activations [%d %d]: %w", rows, cols, err)
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
	c       *arch.Config
	b       tensor.Backend
	g       tensor.GradOps
	ctx     context.Context
	T       int
	ids     []int32
	targets []int32
	count   int
	grads   Grads
	scale   float64
	hook    Hook
	acts    actAlloc

	cos, sin  *tensor.Tensor // rotary tables [T, HeadDim/2], workspace
	negSin    *tensor.Tensor // -sin: Rope with it is the rotary's backward
	hostGrads bool           // the backend's tensors are host memory: add into grads directly
	pending   []pendingGrad  // the current layer's device gradients
	gradCopy  time.Duration
	// overwrite: the gradients' old values do not count; written: the
	// Grads tensors this pass has set or added into.
	overwrite      bool
	written        map[*tensor.Tensor]bool
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

// pendingGrad is a gradient computed on the device, to be added into host.
type pendingGrad struct {
	dev, host *tensor.Tensor
}

func (ps *pass) close() {
	ps.tr.wait() // the Grads are the caller's once LossAndGrads returns
	ps.acts.freeAll()
	ps.freeGrads()
	for _, t := range []*tensor.Tensor{ps.cos, ps.sin, ps.negSin} {
		ps.m.alloc.Free(t)
	}
	ps.order(paging.Forward)
}

// gradBuffer returns the buffer that the current layer's gradient of
// parameter name adds into: the Grads tensor itself when the backend works
// on host memory, else a zeroed device buffer that flushGrads adds into it.
func (ps *pass) gradBuffer(name string, shape tensor.Shape) (*tensor.Tensor, error) {
	host, err := ps.grads.buffer(name, shape)
	if err != nil || ps.hostGrads {
		return host, err
	}
	dev, err := ps.m.alloc.Alloc(paging.Gradients, tensor.F32, shape)
	if err != nil {
		return nil, fmt.Errorf("nn: train: gradient of %s: %w", name, err)
	}
	ps.pending = append(ps.pending, pendingGrad{dev: dev, host: host})
	if err := ps.g.Zero(dev); err != nil {
		return nil, fmt.Errorf("nn: train: gradient of %s: %w", name, err)
	}
	return dev, nil
}

// flushGrads copies the current layer's device gradients to a staging
// buffer on the host and frees them; a goroutine then adds them into the
// Grads while the device goes on with the next layer.
func (ps *pass) flushGrads() error {
	defer ps.freeGrads()
	if len(ps.pending) == 0 {
		return nil
	}
	if err := tensor.Sync(ps.b); err != nil { // the layer's backward, not the copy
		return err
	}
	start := time.Now()
	defer func() { ps.gradCopy += time.Since(start) }()
	var n int64
	for _, p := range ps.pending {
		n += p.dev.NumBytes()
	}
	st, buf := ps.tr.stage(n)
	type job struct {
		dst, src []float32
		set      bool // copy: the first gradient of an overwriting pass
	}
	jobs := make([]job, 0, len(ps.pending))
	for _, p := range ps.pending {
		k := p.dev.NumBytes()
		if err := ps.b.Download(buf[:k], p.dev); err != nil {
			return fmt.Errorf("nn: train: copying gradients to the host: %w", err)
		}
		jobs = append(jobs, job{p.host.F32(), floats(buf[:k]), ps.overwrite && !ps.written[p.host]})
		ps.written[p.host] = true
		buf = buf[k:]
	}
	st.adding.Go(func() {
		for _, j := range jobs {
			if j.set {
				chunks(len(j.dst), func(lo, hi int) { copy(j.dst[lo:hi], j.src[lo:hi]) })
			} else {
				addInto(j.dst, j.src)
			}
		}
	})
	return nil
}

// addInto adds src into dst, spread over the cores when large.
func addInto(dst, src []float32) {
	chunks(len(dst), func(lo, hi int) {
		d, s := dst[lo:hi], src[lo:hi]
		for j := range d {
			d[j] += s[j]
		}
	})
}

// chunkSize is the length of the ranges chunks hands out.
const chunkSize = 1 << 18

// chunks calls fn on the consecutive ranges [i*chunkSize, (i+1)*chunkSize)
// of [0, n) (the last one shorter), on up to GOMAXPROCS goroutines when
// there are several.
func chunks(n int, fn func(lo, hi int)) {
	const size = chunkSize
	k := (n + size - 1) / size
	if k <= 1 {
		fn(0, n)
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(k, runtime.GOMAXPROCS(0)) {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < k; i = int(next.Add(1) - 1) {
				fn(i*size, min(n, (i+1)*size))
			}
		})
	}
	wg.Wait()
}

func (ps *pass) freeGrads() {
	for _, p := range ps.pending {
		ps.m.alloc.Free(p.dev)
	}
	ps.pending = ps.pending[:0]
}

// toHost returns t's F32 values on the host: t's own storage when it is
// there, else a copy in the next staging buffer, valid until the next
// flush.
func (ps *pass) toHost(t *tensor.Tensor) ([]float32, error) {
	if t.OnHost() {
		return t.F32(), nil
	}
	_, buf := ps.tr.stage(t.NumBytes())
	if err := ps.b.Download(buf, t); err != nil {
		return nil, err
	}
	return floats(buf), nil
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
	if ps.negSin, err = ps.m.alloc.Alloc(paging.Workspace, tensor.F32, tensor.Shape{T, c.HeadDim / 2}); err != nil {
		return fmt.Errorf("nn: train: rotary tables: %w", err)
	}
	ps.hostGrads = ps.cos.OnHost() && !ps.tr.stageGrads
	if ps.overwrite && ps.hostGrads {
		// The operations add into the Grads themselves: start from zero.
		ps.grads.Zero()
		ps.overwrite = false
	}
	cos, sin := c.RopeTables(T)
	neg := make([]float32, len(sin))
	for i, v := range sin {
		neg[i] = -v
	}
	for _, tb := range []struct {
		t *tensor.Tensor
		v []float32
	}{{ps.cos, cos}, {ps.sin, sin}, {ps.negSin, neg}} {
		if err := uploadF32(ps.b, tb.t, tb.v); err != nil {
			return fmt.Errorf("nn: train: rotary tables: %w", err)
		}
	}

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
		name := ps.m.name(ps.m.embedLayer(), arch.Embed)
		table := lw[name]
		if table == nil {
			return errors.New("no tensor " + name)
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
			if err := b.CopyRows(dst, 0, src, 0, T); err != nil {
				return fmt.Errorf("nn: train: segment %d input: %w", j, err)
			}
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
	// its token's row, on the host.
	dE, err := ps.grads.buffer(ps.m.name(ps.m.embedLayer(), arch.Embed), ps.embedShape)
	if err != nil {
		return err
	}
	t0 := time.Now()
	ps.tr.wait() // a tied head's gradient may still be adding into dE
	ps.gradCopy += time.Since(t0)
	dx, err := ps.toHost(bw.dx)
	if err != nil {
		return fmt.Errorf("nn: train: embedding gradient: %w", err)
	}
	if ps.overwrite && !ps.written[dE] {
		clear(dE.F32())
	}
	ps.written[dE] = true
	embedBack(dE.F32(), dx, ps.ids, c.HiddenSize)
	// An overwriting pass sets every gradient; one it did not reach (none,
	// for a model's own Grads) must not keep an old value.
	if ps.overwrite {
		for _, t := range ps.grads {
			if !ps.written[t] {
				clear(t.F32())
			}
		}
	}
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

// rotary is the rotary embedding of heads heads of the pass's positions,
// from 0: with sin the forward rotation, with negSin its inverse, which is
// its backward.
func (ps *pass) rotary(heads int, sin *tensor.Tensor) tensor.Rotary {
	return tensor.Rotary{Cos: ps.cos, Sin: sin, Heads: heads, HeadDim: ps.c.HeadDim}
}

// attention is the attention of block buffers bb: the forward's, which the
// backward differentiates.
func (ps *pass) attention(bb *blockBufs) tensor.Attn {
	c := ps.c
	return tensor.Attn{Q: bb.q, K: bb.k, V: bb.v, Heads: c.NumHeads, KVHeads: c.NumKVHeads, HeadDim: c.HeadDim, Scale: ps.attentionScale, Precise: true}
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
	c, b, n := ps.c, ps.b, &ps.m.names[ps.m.blockLayer(i)]
	wrap := func(what string, err error) error {
		if err != nil {
			return fmt.Errorf("nn: train: block %d: %s: %w", i, what, err)
		}
		return nil
	}
	if err := b.RMSNorm(bb.h1, bb.xIn, lw[n[arch.AttnNorm]], c.NormEps()); err != nil {
		return wrap("attention norm", err)
	}
	if err := ps.g.MatMulPrecise(bb.q, bb.h1, lw[n[arch.Q]], lw[n[arch.QBias]]); err != nil {
		return wrap("q projection", err)
	}
	if err := ps.g.MatMulPrecise(bb.k, bb.h1, lw[n[arch.K]], lw[n[arch.KBias]]); err != nil {
		return wrap("k projection", err)
	}
	if err := ps.g.MatMulPrecise(bb.v, bb.h1, lw[n[arch.V]], lw[n[arch.VBias]]); err != nil {
		return wrap("v projection", err)
	}
	if err := b.Rope(bb.q, ps.rotary(c.NumHeads, ps.sin)); err != nil {
		return wrap("rope", err)
	}
	if err := b.Rope(bb.k, ps.rotary(c.NumKVHeads, ps.sin)); err != nil {
		return wrap("rope", err)
	}
	if err := b.Attention(bb.attn, ps.attention(bb)); err != nil {
		return wrap("attention", err)
	}
	if err := ps.g.MatMulPrecise(bb.proj, bb.attn, lw[n[arch.O]], lw[n[arch.OBias]]); err != nil {
		return wrap("o projection", err)
	}
	if err := b.Add(bb.xMid, bb.xIn, bb.proj); err != nil {
		return wrap("residual", err)
	}
	if err := b.RMSNorm(bb.h2, bb.xMid, lw[n[arch.MLPNorm]], c.NormEps()); err != nil {
		return wrap("mlp norm", err)
	}
	if err := ps.g.MatMulPrecise(bb.gate, bb.h2, lw[n[arch.Gate]], nil); err != nil {
		return wrap("gate projection", err)
	}
	if err := ps.g.MatMulPrecise(bb.up, bb.h2, lw[n[arch.Up]], nil); err != nil {
		return wrap("up projection", err)
	}
	if !needOut {
		return nil
	}
	if err := b.SiLUMul(bb.act, bb.gate, bb.up); err != nil {
		return wrap("silu", err)
	}
	if err := ps.g.MatMulPrecise(bb.proj, bb.act, lw[n[arch.Down]], nil); err != nil {
		return wrap("down projection", err)
	}
	return wrap("residual", b.Add(bb.xOut, bb.xMid, bb.proj))
}

// head runs the final norm, the LM head and the loss forward and backward,
// leaving the gradient of the last block's output in bw.dx.
func (ps *pass) head(xL *tensor.Tensor, bw *bwdWork) error {
	c, b, g, T, H, V := ps.c, ps.b, ps.g, ps.T, ps.c.HiddenSize, ps.c.VocabSize
	layer := ps.m.headLayer()
	lw, err := ps.m.weights.Acquire(ps.ctx, layer)
	if err != nil {
		return err
	}
	defer ps.m.weights.Release(layer)
	headName := ps.m.name(layer, arch.LMHead) // the embedding table when tied
	normName := ps.m.name(layer, arch.FinalNorm)
	norm, err := layerWeight(lw, normName)
	if err != nil {
		return err
	}
	head, err := layerWeight(lw, headName)
	if err != nil {
		return err
	}
	hn, err := ps.acts.get(T, H)
	if err != nil {
		return err
	}
	if err := b.RMSNorm(hn, xL, norm, c.NormEps()); err != nil {
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
	dHead, err := ps.gradBuffer(headName, head.Shape())
	if err != nil {
		return err
	}
	wrap := func(what string, err error) error {
		if err != nil {
			return fmt.Errorf("nn: train: lm head: %s: %w", what, err)
		}
		return nil
	}
	if err := g.Zero(bw.dh); err != nil {
		return wrap("zero", err)
	}
	scale := float32(ps.scale / float64(ps.count))
	for r0 := 0; r0 < T; r0 += rowsPer {
		n := min(T, r0+rowsPer) - r0
		lg := rows(logits, n)
		hr, _ := hn.Rows(r0, n)
		dr, _ := bw.dh.Rows(r0, n)
		if err := ps.g.MatMulPrecise(lg, hr, head, nil); err != nil {
			return wrap("forward", err)
		}
		loss, err := g.CrossEntropyGrad(lg, ps.targets[r0:r0+n], scale)
		if err != nil {
			return wrap("cross-entropy", err)
		}
		ps.lossSum += loss
		if err := g.MatMulGradW(dHead, lg, hr); err != nil {
			return wrap("weight gradient", err)
		}
		if err := g.MatMulGradX(dr, lg, head); err != nil {
			return wrap("input gradient", err)
		}
	}
	ps.acts.put(logits, hn)
	dNorm, err := ps.gradBuffer(normName, norm.Shape())
	if err != nil {
		return err
	}
	if err := g.Zero(bw.dx); err != nil {
		return wrap("zero", err)
	}
	if err := g.RMSNormGrad(bw.dx, dNorm, bw.dh, xL, norm, c.NormEps()); err != nil {
		return fmt.Errorf("nn: train: final norm backward: %w", err)
	}
	return ps.flushGrads()
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

// layerWeight returns a layer's weight, checking it is there and a float.
func layerWeight(lw LayerWeights, name string) (*tensor.Tensor, error) {
	w := lw[name]
	switch {
	case w == nil:
		return nil, fmt.Errorf("nn: train: no tensor %s", name)
	case !w.DType().IsFloat():
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
	c, b, g, n := ps.c, ps.b, ps.g, &ps.m.names[ps.m.blockLayer(i)]
	// weight returns a weight and its gradient buffer; optional weights
	// (biases) that the model lacks give nil.
	weight := func(name string, optional bool) (*tensor.Tensor, *tensor.Tensor, error) {
		if optional && lw[name] == nil {
			return nil, nil, nil
		}
		w, err := layerWeight(lw, name)
		if err != nil {
			return nil, nil, err
		}
		gb, err := ps.gradBuffer(name, w.Shape())
		return w, gb, err
	}
	var (
		wq, wk, wv, wo, wg, wu, wd, an, mn   *tensor.Tensor
		gq, gk, gv, gO, gg, gu, gd, gan, gmn *tensor.Tensor
		gbq, gbk, gbv, gbo                   *tensor.Tensor
	)
	for _, f := range []struct {
		name string
		w, g **tensor.Tensor
	}{
		{n[arch.Q], &wq, &gq}, {n[arch.K], &wk, &gk}, {n[arch.V], &wv, &gv}, {n[arch.O], &wo, &gO},
		{n[arch.Gate], &wg, &gg}, {n[arch.Up], &wu, &gu}, {n[arch.Down], &wd, &gd},
		{n[arch.AttnNorm], &an, &gan}, {n[arch.MLPNorm], &mn, &gmn},
	} {
		if *f.w, *f.g, err = weight(f.name, false); err != nil {
			return err
		}
	}
	for _, f := range []struct {
		name string
		g    **tensor.Tensor
	}{{n[arch.QBias], &gbq}, {n[arch.KBias], &gbk}, {n[arch.VBias], &gbv}, {n[arch.OBias], &gbo}} {
		if _, *f.g, err = weight(f.name, true); err != nil {
			return err
		}
	}

	// Every step names what failed; the operations are run in order and
	// the first error stops the rest.
	var stepErr error
	do := func(what string, f func() error) {
		if stepErr == nil {
			if err := f(); err != nil {
				stepErr = fmt.Errorf("nn: train: block %d backward: %s: %w", i, what, err)
			}
		}
	}
	dx, dh, dact, act := bw.dx, bw.dh, bw.dact, bw.act
	// MLP: out = down(silu(gate) * up), gate and up from h2 = norm(xMid).
	do("silu", func() error { return b.SiLUMul(act, bb.gate, bb.up) })
	do("down weight", func() error { return g.MatMulGradW(gd, dx, act) })
	do("zero", func() error { return g.Zero(dact) })
	do("down input", func() error { return g.MatMulGradX(dact, dx, wd) })
	// dact becomes the gradient of gate, act that of up.
	do("silu", func() error { return g.SiLUMulGrad(dact, act, dact, bb.gate, bb.up) })
	do("gate weight", func() error { return g.MatMulGradW(gg, dact, bb.h2) })
	do("up weight", func() error { return g.MatMulGradW(gu, act, bb.h2) })
	do("zero", func() error { return g.Zero(dh) })
	do("gate input", func() error { return g.MatMulGradX(dh, dact, wg) })
	do("up input", func() error { return g.MatMulGradX(dh, act, wu) })
	do("mlp norm", func() error { return g.RMSNormGrad(dx, gmn, dh, bb.xMid, mn, c.NormEps()) })

	// Attention: out = o(attention(rope(q(h1)), rope(k(h1)), v(h1))), h1
	// = norm(xIn). dx is now the gradient of xMid, which is also that of
	// the o projection's output.
	do("o weight", func() error { return g.MatMulGradW(gO, dx, bb.attn) })
	if gbo != nil {
		do("o bias", func() error { return g.BiasGrad(gbo, dx) })
	}
	do("zero", func() error { return g.Zero(bw.dattn) })
	do("o input", func() error { return g.MatMulGradX(bw.dattn, dx, wo) })
	dq, dk, dv := bw.dq, bw.dk, bw.dv
	do("attention", func() error {
		return g.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: bw.dattn, Out: bb.attn}, ps.attention(bb))
	})
	do("rope", func() error { return b.Rope(dq, ps.rotary(c.NumHeads, ps.negSin)) })
	do("rope", func() error { return b.Rope(dk, ps.rotary(c.NumKVHeads, ps.negSin)) })
	do("q weight", func() error { return g.MatMulGradW(gq, dq, bb.h1) })
	do("k weight", func() error { return g.MatMulGradW(gk, dk, bb.h1) })
	do("v weight", func() error { return g.MatMulGradW(gv, dv, bb.h1) })
	for _, bg := range []struct {
		g, dy *tensor.Tensor
	}{{gbq, dq}, {gbk, dk}, {gbv, dv}} {
		if bg.g != nil {
			do("bias", func() error { return g.BiasGrad(bg.g, bg.dy) })
		}
	}
	do("zero", func() error { return g.Zero(dh) })
	do("q input", func() error { return g.MatMulGradX(dh, dq, wq) })
	do("k input", func() error { return g.MatMulGradX(dh, dk, wk) })
	do("v input", func() error { return g.MatMulGradX(dh, dv, wv) })
	do("attention norm", func() error { return g.RMSNormGrad(dx, gan, dh, bb.xIn, an, c.NormEps()) })
	if stepErr != nil {
		return stepErr
	}
	return ps.flushGrads()
}
