package nn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"unsafe"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Model runs a Llama-family decoder on a backend, taking each layer's weights
// from a Weights source while the layer runs.
type Model struct {
	cfg     arch.Config
	backend tensor.Backend
	alloc   paging.Allocator
	weights Weights
	names   []arch.Names   // the tensor names of each layer, in Weights' numbering
	experts [][]arch.Names // the routed experts' names of each layer; nil for a layer without
	synth   *synthRouter   // the synthetic routing of a synthetic model, or nil
	// guessed and guessRight count the experts guessed for a sparse block
	// ahead of it, and those it chose (ExpertGuesses).
	guessed, guessRight atomic.Int64
	// guessRecord holds each sparse block's recent guess accuracy, which
	// decides whether its guesses are prefetched (worthPrefetching).
	guessRecord guessRecord
	// sparse counts the host's time in sparse blocks (SparseTimes).
	sparse sparseCounters
	// lo and hi bound the decoder blocks this model runs: all of them,
	// unless it is one stage of a Pipeline. The first stage embeds, the
	// last applies the final norm and LM head.
	lo, hi int
	// noGraphs turns decode graphs off (SetGraphs; graph.go).
	noGraphs atomic.Bool
	// hostKV, when set, keeps some blocks' KV cache in host memory
	// (SetHostKV); kv counts that work.
	hostKV *HostKV
	kv     kvCounters
	// expertCPU, when set, computes the experts the weights hand to the
	// CPU (CPUExpertWeights, SetExpertCPU).
	expertCPU tensor.Backend
}

func (m *Model) embeds() bool { return m.lo == 0 }
func (m *Model) heads() bool  { return m.hi == m.cfg.NumLayers }

// Layer indexes in the numbering Weights uses, which is arch's.
func (m *Model) embedLayer() int      { return m.cfg.EmbedLayer() }
func (m *Model) blockLayer(i int) int { return m.cfg.BlockLayer(i) }
func (m *Model) headLayer() int       { return m.cfg.HeadLayer() }

// name is the tensor of role r in layer.
func (m *Model) name(layer int, r arch.Role) string { return m.names[layer][r] }

// NumLayers is the number of layers as Weights numbers them: the embedding,
// the decoder blocks and the head.
func (m *Model) NumLayers() int { return m.cfg.LayerCount() }

// New returns a model of the architecture cfg describes (a copy is kept).
// alloc provides the KV cache and activation buffers (paging.Unbudgeted(b)
// when no budget applies). The model runs b's operations through
// tensor.Checked, so that a malformed call (a weight of the wrong shape,
// say) is an error rather than a fault in a kernel.
func New(cfg *arch.Config, b tensor.Backend, alloc paging.Allocator, w Weights) (*Model, error) {
	if cfg == nil {
		return nil, errors.New("nn: no config")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if alloc == nil {
		alloc = paging.Unbudgeted(b)
	}
	m := &Model{cfg: *cfg.Clone(), backend: tensor.Checked(b), alloc: alloc, weights: w, hi: cfg.NumLayers}
	for l := range cfg.LayerCount() {
		m.names = append(m.names, cfg.LayerNames(l))
		m.experts = append(m.experts, cfg.LayerExperts(l))
	}
	m.synth = newSynthRouter(cfg)
	return m, nil
}

// Config returns a copy of the model's configuration.
func (m *Model) Config() *arch.Config { return m.cfg.Clone() }

// Backend returns the backend the model computes on, behind the checks of
// tensor.Checked (find its capabilities with tensor's helpers, such as
// tensor.Sync, which look behind them).
func (m *Model) Backend() tensor.Backend { return m.backend }

// ErrContextFull is returned when a session has no room for more positions.
var ErrContextFull = errors.New("nn: context length exceeded")

// ErrContextTooLong is returned when a session or a training window asks
// for more positions than the model's context (arch.Config.ContextLength).
var ErrContextTooLong = errors.New("nn: context longer than the model's")

// Session holds one sequence's KV cache and the buffers of its forward pass.
// A session is not safe for concurrent use; several sessions may share a
// model.
type Session struct {
	m      *Model
	maxPos int
	chunk  int
	pos    int
	k, v   []*tensor.Tensor // per block: [maxPos, KVDim], SessionOptions.KVDType
	*buffers
	ownBufs bool             // the buffers are this session's (not a pipeline's, shared)
	owned   []*tensor.Tensor // the KV cache (and the buffers when ownBufs)
	// twin, when set, is the CPU session whose blocks this session computes
	// on another device for large chunks: the KV cache lives in twin's
	// host tensors, and this session's k and v are one scratch pair that
	// each block's rows are copied into and back from.
	twin *Session
	// copyBack, on a twin session, holds the copies of its device's
	// scratch pair back to the host still under way (copyback.go); the
	// twin sessions of one device share it, as they share the pair.
	copyBack   *copyBack
	guesses    *guesses       // the experts guessed ahead in decode steps, made on first use
	batchGuess *batchGuess    // a batch session's guesses of the next sparse block's experts, made on first use
	graphs     *sessionGraphs // decode steps' captured blocks (graph.go), made on first use
	// pending is set between blocksChunk and headChunk when the last
	// block's output (proj) is not yet added to x: the final norm adds it.
	pending bool
	hkv     *hostKVSession // the blocks whose KV cache is in host memory, or nil
	host    []float32      // logits returned by Forward
	// batch, when set, makes this session one stage of a Batch: its rows
	// belong to several sequences, k and v are the Batch's block pools.
	batch    *batchStep
	download []byte // one chunk's logits from the backend
	// downloadPinned says download is page-locked memory of the backend's
	// (a batch's logits: batchLogits), to give back at the Batch's Close.
	downloadPinned bool
	// stepRaw holds a decode step's sparse blocks' router scores and the
	// rows of their experts on the CPU (stepBuf): page-locked memory of
	// the backend's when stepPinned.
	stepRaw    []byte
	stepPinned bool
	// argmax, set during a Greedy step, makes headChunk find the last
	// row's largest logit on the backend into argmaxID instead of
	// downloading the logits.
	argmax   tensor.Argmaxer
	argmaxID int32
	closed   bool
}

// buffers are the activations and rotary tables of the forward pass on one
// device: a session's own, or shared by the sessions of a pipeline's stages
// on that device, which run one after the other.
type buffers struct {
	cos, sin *tensor.Tensor // [maxPos, HeadDim/2]
	// posAt is the position decode graphs read (graph.go), I32 [1]: one
	// per device, as the stages on it run the same positions.
	posAt   *tensor.Tensor
	x, h    *tensor.Tensor // [chunk, Hidden]
	q, attn *tensor.Tensor // [chunk, QDim]
	kk, vv  *tensor.Tensor // [chunk, KVDim]
	proj    *tensor.Tensor // [chunk, Hidden]
	gate    *tensor.Tensor // [chunk, MLPSize]: the widest MLP's, dense or expert
	up      *tensor.Tensor
	logits  *tensor.Tensor      // [chunk, Vocab], or nil without a head
	views   map[int]*chunkViews // buffer views by row count, made once
	moe     *moeBuffers         // the mixture of experts' buffers, or nil for a dense model
	// kvScratch are the device copies host KV blocks attend over in
	// prefill (HostKV), shared by the stages of a device.
	kvScratch [][2]*tensor.Tensor
	// The widths of the views: the dense MLP's, and the heads of q and k.
	inter, heads, kvHeads, headDim int
}

// allocator collects a session's allocations, remembering the first that
// failed.
type allocator struct {
	a     paging.Allocator
	owned []*tensor.Tensor
	err   error
}

func (al *allocator) alloc(cat paging.Category, shape ...int) *tensor.Tensor {
	return al.allocDT(cat, tensor.F32, shape...)
}

func (al *allocator) allocDT(cat paging.Category, dt tensor.DType, shape ...int) *tensor.Tensor {
	if al.err != nil {
		return nil
	}
	t, err := al.a.Alloc(cat, dt, tensor.Shape(shape))
	if err != nil {
		al.err = err
		return nil
	}
	al.owned = append(al.owned, t)
	return t
}

func (al *allocator) free() {
	for _, t := range al.owned {
		al.a.Free(t)
	}
	al.owned = nil
}

// newBuffers allocates the forward buffers for chunks of chunk tokens and
// maxPos positions, with the logits buffer when withLogits, and fills the
// rotary tables.
func newBuffers(c *arch.Config, b tensor.Backend, al *allocator, maxPos, chunk int, withLogits bool) (*buffers, error) {
	bf := &buffers{heads: c.NumHeads, kvHeads: c.NumKVHeads, headDim: c.HeadDim}
	for i := range c.NumLayers {
		if !c.Sparse(i) {
			bf.inter = c.IntermediateSize // a dense MLP's width; 0 when every block is sparse
		}
	}
	bf.cos = al.alloc(paging.Workspace, maxPos, c.HeadDim/2)
	bf.sin = al.alloc(paging.Workspace, maxPos, c.HeadDim/2)
	if p := al.alloc(paging.Workspace, 1); p != nil {
		bf.posAt = view32(p)
	}
	bf.x = al.alloc(paging.Activations, chunk, c.HiddenSize)
	bf.h = al.alloc(paging.Activations, chunk, c.HiddenSize)
	bf.q = al.alloc(paging.Activations, chunk, c.QDim())
	bf.attn = al.alloc(paging.Activations, chunk, c.QDim())
	bf.kk = al.alloc(paging.Activations, chunk, c.KVDim())
	bf.vv = al.alloc(paging.Activations, chunk, c.KVDim())
	bf.proj = al.alloc(paging.Activations, chunk, c.HiddenSize)
	bf.gate = al.alloc(paging.Activations, chunk, c.MLPSize())
	bf.up = al.alloc(paging.Activations, chunk, c.MLPSize())
	if withLogits {
		bf.logits = al.alloc(paging.Activations, chunk, c.VocabSize)
	}
	if c.MoE != nil {
		bf.moe = newMoEBuffers(c, al, chunk)
	}
	if al.err != nil {
		return nil, al.err
	}
	if bf.moe != nil {
		if err := bf.moe.clearZero(b); err != nil {
			return nil, err
		}
	}
	cos, sin := c.RopeTables(maxPos)
	if err := uploadF32(b, bf.cos, cos); err != nil {
		return nil, err
	}
	if err := uploadF32(b, bf.sin, sin); err != nil {
		return nil, err
	}
	return bf, nil
}

// NewSession allocates a KV cache for maxPos positions and forward buffers
// for prompts processed chunk tokens at a time. maxPos beyond the model's
// context (arch.Config.ContextLength) is an error wrapping ErrContextTooLong,
// returned before anything is allocated.
func (m *Model) NewSession(maxPos, chunk int) (*Session, error) {
	return m.newSession(maxPos, chunk, nil, SessionOptions{})
}

// NewSessionWith is NewSession with the choices of o (the KV cache's
// dtype); a dtype the model cannot store its cache in is an error
// (CheckKVDType).
func (m *Model) NewSessionWith(maxPos, chunk int, o SessionOptions) (*Session, error) {
	return m.newSession(maxPos, chunk, nil, o)
}

// newSession makes a session over bufs, a pipeline's buffers of the
// model's device, or over buffers of its own when bufs is nil.
func (m *Model) newSession(maxPos, chunk int, bufs *buffers, o SessionOptions) (*Session, error) {
	if maxPos <= 0 || chunk <= 0 {
		return nil, fmt.Errorf("nn: session needs positive context (%d) and chunk (%d)", maxPos, chunk)
	}
	if err := checkContext(&m.cfg, "session", maxPos); err != nil {
		return nil, err
	}
	if err := CheckKVDType(&m.cfg, o.KVDType); err != nil {
		return nil, err
	}
	if chunk > maxPos {
		chunk = maxPos
	}
	c := &m.cfg
	s := &Session{m: m, maxPos: maxPos, chunk: chunk, buffers: bufs}
	al := &allocator{a: m.alloc}
	var err error
	var hk, hv []*tensor.Tensor // the host caches, when some blocks' are there
	if m.hostKV != nil {
		s.hkv, hk, hv, err = m.allocHostKV(maxPos, chunk, al, bufs, o.kvDType())
	}
	for i := m.lo; i < m.hi && err == nil; i++ {
		if hk != nil && hk[i-m.lo] != nil {
			s.k, s.v = append(s.k, hk[i-m.lo]), append(s.v, hv[i-m.lo])
			continue
		}
		s.k = append(s.k, al.allocDT(paging.KVCache, o.kvDType(), maxPos, c.KVDim()))
		s.v = append(s.v, al.allocDT(paging.KVCache, o.kvDType(), maxPos, c.KVDim()))
	}
	if err == nil {
		err = al.err
	}
	if err == nil && bufs == nil {
		s.buffers, err = newBuffers(c, m.backend, al, maxPos, chunk, m.heads())
		s.ownBufs = true
	}
	s.owned = al.owned
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("nn: session buffers for %d positions: %w", maxPos, err)
	}
	return s, nil
}

func uploadF32(b tensor.Backend, dst *tensor.Tensor, v []float32) error {
	src, err := tensor.FromF32(tensor.Shape{len(v)}, v)
	if err != nil {
		return err
	}
	return b.Upload(dst, 0, src.Bytes())
}

// Pos is the number of positions the session has processed.
func (s *Session) Pos() int { return s.pos }

// MaxPos is the session's context length.
func (s *Session) MaxPos() int { return s.maxPos }

// Reset forgets the sequence, keeping the buffers.
func (s *Session) Reset() { s.pos = 0 }

// Close frees the session's buffers. It is safe to call more than once,
// and on a nil session.
func (s *Session) Close() {
	if s == nil || s.closed {
		return
	}
	s.closed = true
	if s.graphs != nil {
		s.graphs.close()
	}
	for _, t := range s.owned {
		s.m.alloc.Free(t)
	}
	s.owned = nil
	s.hkv.free()
	s.freeStepBuf()
}

// Hook, when non-nil, sees the hidden state after the embedding (layer 0),
// after each block (1..L) and after the final norm (L+1), for the rows of
// the current chunk. It must not keep the tensor.
type Hook func(layer int, hidden *tensor.Tensor) error

// Forward runs ids through the model at the session's next positions and
// returns the logits: for every position when all is set ([len(ids), vocab]
// flattened), otherwise only the last position's [vocab]. The returned slice
// is reused by the next call.
//
// Logits holding a NaN or an infinity are an error, a *NonFiniteError
// naming the first layer whose output held one: Forward re-runs the step
// with a hook that checks every layer's output (hook is not called again),
// which costs nothing unless the logits were bad.
func (s *Session) Forward(ctx context.Context, ids []int32, all bool, hook Hook) ([]float32, error) {
	if err := s.checkIDs(ids); err != nil {
		return nil, err
	}
	// A Forward that fails (or panics in the hook) adds no positions, so
	// the session can retry it.
	pos0, done := s.pos, false
	defer func() {
		if !done {
			s.pos = pos0
		}
	}()
	out, err := s.forward(ctx, ids, all, func(int) Hook { return hook })
	if err != nil {
		return nil, err
	}
	if firstNonFiniteF32(out) >= 0 {
		s.pos = pos0
		d := &diagnosis{cfg: &s.m.cfg, backendOf: func(int) tensor.Backend { return s.m.backend }}
		out, err := s.forward(ctx, ids, all, d.hookAt)
		return nil, d.result(out, err, pos0, len(ids), all, s.m.cfg.VocabSize)
	}
	s.host = out
	done = true
	return out, nil
}

// checkIDs refuses a step of ids that Forward cannot run: a closed
// session, no ids, too many for the context, an id outside the
// vocabulary.
func (s *Session) checkIDs(ids []int32) error {
	if s.closed {
		return errors.New("nn: session is closed")
	}
	if len(ids) == 0 {
		return errors.New("nn: forward of no tokens")
	}
	if s.pos+len(ids) > s.maxPos {
		return fmt.Errorf("%w: %d positions used, %d more asked, context is %d", ErrContextFull, s.pos, len(ids), s.maxPos)
	}
	vocab := s.m.cfg.VocabSize
	for i, id := range ids {
		if id < 0 || int(id) >= vocab {
			return fmt.Errorf("nn: token id %d at position %d is outside the vocabulary of %d", id, i, vocab)
		}
	}
	return nil
}

// Greedy runs ids as Forward does and returns the most likely next token:
// Argmax of the last position's logits. On a backend that finds it where
// the logits are (tensor.Argmaxer) only the id comes back, not the
// logits: less to copy and scan between the steps of greedy decoding,
// where the device waits for the host. Logits holding a NaN or an
// infinity are Forward's error (Greedy runs Forward to diagnose them).
func (s *Session) Greedy(ctx context.Context, ids []int32) (int32, error) {
	am, ok := tensor.Argmaxers(s.m.backend)
	if !ok || s.twin != nil || s.batch != nil {
		logits, err := s.Forward(ctx, ids, false, nil)
		if err != nil {
			return 0, err
		}
		return int32(Argmax(logits)), nil
	}
	if err := s.checkIDs(ids); err != nil {
		return 0, err
	}
	// As Forward: a step that fails (or panics) adds no positions.
	pos0, done := s.pos, false
	defer func() {
		s.argmax = nil
		if !done {
			s.pos = pos0
		}
	}()
	s.argmax, s.argmaxID = am, -1
	if _, err := s.forward(ctx, ids, false, func(int) Hook { return nil }); err != nil {
		return 0, err
	}
	if s.argmaxID >= 0 {
		done = true
		return s.argmaxID, nil
	}
	// Not finite: run the step again as Forward, which names the layer.
	s.pos, s.argmax = pos0, nil
	if _, err := s.Forward(ctx, ids, false, nil); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("nn: the backend found a NaN or an infinity among the logits at position %d; Forward found none", pos0+len(ids)-1)
}

// forward runs ids through the model chunk by chunk from the session's
// position and returns the logits Forward returns; hookAt gives the hook
// for the chunk whose first row is at position pos.
func (s *Session) forward(ctx context.Context, ids []int32, all bool, hookAt func(pos int) Hook) ([]float32, error) {
	out := s.host[:0]
	for start := 0; start < len(ids); start += s.chunk {
		end := min(start+s.chunk, len(ids))
		last := end == len(ids)
		rows, err := s.forwardChunk(ctx, ids[start:end], all || last, all, hookAt(s.pos))
		if err != nil {
			return nil, err
		}
		out = append(out, rows...) // empty unless all or last
	}
	return out, nil
}

// forwardChunk runs up to s.chunk tokens through every layer. When logits is
// set it returns them, for every row when allRows is set, otherwise for the
// last row.
func (s *Session) forwardChunk(ctx context.Context, ids []int32, logits, allRows bool, hook Hook) ([]float32, error) {
	T := len(ids)
	s.hkv.startChunk()
	if err := s.embedChunk(ctx, ids, hook); err != nil {
		return nil, err
	}
	if err := s.blocksChunk(ctx, T, hook, true); err != nil {
		return nil, err
	}
	s.pos += T
	return s.headChunk(ctx, T, logits, allRows, hook)
}

// embedChunk writes the embeddings of ids into the first rows of x.
func (s *Session) embedChunk(ctx context.Context, ids []int32, hook Hook) error {
	m, b := s.m, s.m.backend
	x := s.viewsFor(len(ids)).x
	lw, err := m.weights.Acquire(ctx, m.embedLayer())
	if err != nil {
		return err
	}
	err = func() error {
		defer m.weights.Release(m.embedLayer()) // released even if the backend panics
		return b.Embed(x, lw[m.name(m.embedLayer(), arch.Embed)], ids)
	}()
	if err != nil {
		return fmt.Errorf("nn: embedding: %w", err)
	}
	if hook != nil {
		return hook(0, x)
	}
	return nil
}

// blocksChunk runs the model's decoder blocks on the first T rows of x, at
// positions s.pos onwards. headNext says this session's headChunk comes
// next, which adds the last block's output to x with the final norm;
// otherwise x has it added when blocksChunk returns.
func (s *Session) blocksChunk(ctx context.Context, T int, hook Hook, headNext bool) error {
	m, c := s.m, &s.m.cfg
	x, pos0 := s.viewsFor(T).x, s.pos
	scale := float32(1 / math.Sqrt(float64(c.HeadDim)))
	gs := s.graphsFor(T, hook)
	if gs != nil {
		if err := gs.setPosition(m.backend, pos0); err != nil {
			return fmt.Errorf("nn: decode graphs' position: %w", err)
		}
	}
	// A block leaves its output in proj (pending); the next block's norm
	// (or the final norm) adds it to x in the same pass
	// (tensor.AddRMSNorm). A block that folds (Session.folds) adds its
	// own. A hook, and the hand-over to another stage, see x with it
	// added.
	s.pending = false
	pending := false
	flush := func() error {
		if !pending {
			return nil
		}
		pending = false
		return m.backend.Add(x, x, s.viewsFor(T).proj)
	}
	for i := m.lo; i < m.hi; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		if gs != nil { // no hook, no twin: see graphsFor
			if end := s.runEnd(gs, i); end-i >= 2 {
				p, err := s.runGraphed(ctx, gs, i, end, pos0, scale, pending)
				if err != nil {
					return fmt.Errorf("nn: %w", err)
				}
				pending = p
				i = end - 1
				continue
			}
		}
		layer := m.blockLayer(i)
		lw, err := m.weights.Acquire(ctx, layer)
		if err != nil {
			return err
		}
		err = func() error {
			defer m.weights.Release(layer)
			if s.twin != nil {
				// The block overwrites the scratch pair that the blocks
				// before it are still copying back.
				if err := s.copyBack.order(); err != nil {
					return err
				}
				if err := s.twinKVIn(i, pos0); err != nil {
					return err
				}
			}
			var err error
			if gs != nil {
				pending, err = s.blockGraphed(ctx, gs, i, pos0, lw, scale, pending)
			} else {
				pending, err = s.block(ctx, i, T, pos0, lw, scale, nil, pending)
			}
			if err != nil {
				return err
			}
			if s.twin != nil {
				return s.twinKVOut(i, pos0, T)
			}
			return nil
		}()
		if err != nil {
			return fmt.Errorf("nn: block %d: %w", i, err)
		}
		if hook != nil {
			if err := flush(); err != nil {
				return fmt.Errorf("nn: block %d: %w", i, err)
			}
			if err := hook(layer, x); err != nil {
				return err
			}
		}
	}
	if !headNext { // another stage takes x
		if err := flush(); err != nil {
			return fmt.Errorf("nn: block %d: %w", m.hi-1, err)
		}
	}
	s.pending = pending
	return nil
}

// twinKVIn copies block i's keys and values of the positions before pos0
// from the stage's KV cache (the twin session's) into the scratch pair
// this twin session computes with.
func (s *Session) twinKVIn(i, pos0 int) error {
	if pos0 == 0 {
		return nil
	}
	j := i - s.m.lo
	for _, kv := range [][2]*tensor.Tensor{{s.k[j], s.twin.k[j]}, {s.v[j], s.twin.v[j]}} {
		src, err := kv[1].Rows(0, pos0)
		if err != nil {
			return err
		}
		if err := copyTensor(s.m.backend, s.twin.m.backend, kv[0], src); err != nil {
			return fmt.Errorf("keys and values of %d positions to %s: %w", pos0, s.m.backend.Name(), err)
		}
	}
	return nil
}

// twinKVOut copies the keys and values block i computed for the chunk at
// pos0 back into the stage's KV cache: on a device with asynchronous
// downloads the copies are queued (copyBack) and the host goes on queuing
// the next blocks, else they wait for the block's compute.
func (s *Session) twinKVOut(i, pos0, T int) error {
	j := i - s.m.lo
	for _, kv := range [][2]*tensor.Tensor{{s.k[j], s.twin.k[j]}, {s.v[j], s.twin.v[j]}} {
		src, err := kv[0].Rows(pos0, T)
		if err != nil {
			return err
		}
		dst, err := kv[1].Rows(pos0, T)
		if err != nil {
			return err
		}
		if ad, ok := tensor.AsyncDownload(s.m.backend); ok && s.copyBack != nil && dst.OnHost() {
			err = s.copyBack.queue(ad, dst.Bytes()[:src.NumBytes()], src)
		} else {
			err = copyTensor(s.twin.m.backend, s.m.backend, dst, src)
		}
		if err != nil {
			return fmt.Errorf("keys and values of %d positions from %s: %w", T, s.m.backend.Name(), err)
		}
	}
	return nil
}

// copyTensor copies src (on from's device) into the first bytes of dst (on
// to's), one of which is in host memory. From a device it waits for the
// compute that wrote src, not for the copies of later layers
// (tensor.DownloadComputed).
func copyTensor(to, from tensor.Backend, dst, src *tensor.Tensor) error {
	switch {
	case dst.OnHost():
		return tensor.DownloadComputed(from, dst.Bytes()[:src.NumBytes()], src)
	case src.OnHost():
		return to.Upload(dst, 0, src.Bytes())
	}
	return fmt.Errorf("nn: copy between two devices (%s and %s) is not through host memory", from.Name(), to.Name())
}

// headChunk applies the final norm and, when logits is set, the LM head to
// the first T rows of x.
func (s *Session) headChunk(ctx context.Context, T int, logits, allRows bool, hook Hook) ([]float32, error) {
	m, c, b := s.m, &s.m.cfg, s.m.backend
	v := s.viewsFor(T)
	x, h := v.x, v.h
	layer := m.headLayer()
	lw, err := m.weights.Acquire(ctx, layer)
	if err != nil {
		return nil, err
	}
	defer m.weights.Release(layer)
	var err2 error
	if s.pending {
		s.pending = false
		err2 = tensor.AddRMSNorm(b, h, x, v.proj, lw[m.name(layer, arch.FinalNorm)], c.NormEps())
	} else {
		err2 = b.RMSNorm(h, x, lw[m.name(layer, arch.FinalNorm)], c.NormEps())
	}
	if err2 != nil {
		return nil, fmt.Errorf("nn: final norm: %w", err2)
	}
	if hook != nil {
		if err := hook(layer, h); err != nil {
			return nil, err
		}
	}
	if !logits {
		return nil, nil
	}
	head := lw[m.name(layer, arch.LMHead)] // the embedding table when tied
	in, out := h, v.logits
	if !allRows {
		in, out = v.lastH, v.logits1
	}
	if err := b.MatMul(out, in, head, nil); err != nil {
		return nil, fmt.Errorf("nn: lm head: %w", err)
	}
	if s.argmax != nil && !allRows {
		ids, err := s.argmax.Argmax(out)
		if err != nil {
			return nil, fmt.Errorf("nn: argmax of the logits: %w", err)
		}
		s.argmaxID = ids[0]
		return nil, nil
	}
	n := out.Len()
	if len(s.download) < 4*n {
		s.download = make([]byte, 4*n)
	}
	// The logits wait for the compute only: the copies of the next
	// token's layers go on.
	if err := tensor.DownloadComputed(b, s.download[:4*n], out); err != nil {
		return nil, err
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&s.download[0])), n), nil
}

// folds reports whether block i, on a chunk of T rows, folds its two
// norms into the products after them and adds its o and down products to
// x itself (tensor.NormFuser, where the backend folds every one of them):
// one row, no batch, a dense block without biases. Such a block leaves
// nothing in proj for the next norm to add.
func (s *Session) folds(i, T int, lw LayerWeights) bool {
	c, b, n := &s.m.cfg, s.m.backend, &s.m.names[s.m.blockLayer(i)]
	if T != 1 || s.batch != nil || c.Sparse(i) {
		return false
	}
	for _, r := range []arch.Role{arch.QBias, arch.KBias, arch.VBias, arch.OBias} {
		if lw[n[r]] != nil {
			return false
		}
	}
	v := s.viewsFor(T)
	return tensor.FoldsNorms(b, v.x, lw[n[arch.AttnNorm]], lw[n[arch.Q]], lw[n[arch.K]], lw[n[arch.V]]) &&
		tensor.FoldsNorms(b, v.attn, nil, lw[n[arch.O]]) &&
		tensor.FoldsNorms(b, v.x, lw[n[arch.MLPNorm]], lw[n[arch.Gate]], lw[n[arch.Up]]) &&
		tensor.FoldsNorms(b, v.gate, nil, lw[n[arch.Down]])
}

// errFoldDeclined is a fold the backend reported it makes (folds) and then
// declined.
var errFoldDeclined = errors.New("the backend declined a fold it reported")

// block runs decoder block i on the first T rows of the session's buffers,
// at positions pos0 onwards; or, when posAt is set (a decode graph's
// capture), at the position posAt holds when the block runs, pos0 being
// its bound. When residual is set, the previous block's output in proj is
// added to x first (with the norm, in one pass). The block leaves its own
// output in proj, not added to x, and reports pending; or, where it folds
// (folds), adds it to x and reports none pending.
func (s *Session) block(ctx context.Context, i, T, pos0 int, lw LayerWeights, scale float32, posAt *tensor.Tensor, residual bool) (pending bool, err error) {
	if s.folds(i, T, lw) {
		return false, s.foldedBlock(ctx, i, pos0, lw, scale, posAt, residual)
	}
	return true, s.unfoldedBlock(ctx, i, T, pos0, lw, scale, posAt, residual)
}

// foldedBlock is block for one row where it folds: the attention norm in
// the q, k and v products, the o product added to x, the MLP's norm in the
// gate and up products, the down product added to x. The same bits as
// unfoldedBlock on the same backend (the norm fold sums as the norm kernel
// does, and x + product is the add that norm kernel makes).
func (s *Session) foldedBlock(ctx context.Context, i, pos0 int, lw LayerWeights, scale float32, posAt *tensor.Tensor, residual bool) error {
	c, b, n := &s.m.cfg, s.m.backend, &s.m.names[s.m.blockLayer(i)]
	v := s.viewsFor(1)
	x, q, attn, kk, vv, proj, gate := v.x, v.q, v.attn, v.kk, v.vv, v.proj, v.gate
	if residual { // the block before did not fold
		if err := b.Add(x, x, proj); err != nil {
			return fmt.Errorf("residual: %w", err)
		}
	}
	folded := func(ok bool, err error, what string) error {
		if err == nil && !ok {
			err = errFoldDeclined
		}
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		return nil
	}
	ok, err := tensor.NormMatMulMany(b, []*tensor.Tensor{q, kk, vv}, x, lw[n[arch.AttnNorm]], c.NormEps(), []*tensor.Tensor{lw[n[arch.Q]], lw[n[arch.K]], lw[n[arch.V]]})
	if err := folded(ok, err, "attention norm and q, k and v projections"); err != nil {
		return err
	}
	if err := s.attention(ctx, i, 1, pos0, scale, posAt, lw); err != nil {
		return err
	}
	ok, err = tensor.MatMulAdd(b, x, attn, lw[n[arch.O]])
	if err := folded(ok, err, "o projection"); err != nil {
		return err
	}
	ok, err = tensor.NormGateUpSiLU(b, gate, x, lw[n[arch.MLPNorm]], c.NormEps(), lw[n[arch.Gate]], lw[n[arch.Up]])
	if err := folded(ok, err, "mlp norm and gate and up projections"); err != nil {
		return err
	}
	ok, err = tensor.MatMulAdd(b, x, gate, lw[n[arch.Down]])
	return folded(ok, err, "down projection")
}

// unfoldedBlock is block with its norms and adds as operations of their
// own.
func (s *Session) unfoldedBlock(ctx context.Context, i, T, pos0 int, lw LayerWeights, scale float32, posAt *tensor.Tensor, residual bool) error {
	c, b, n := &s.m.cfg, s.m.backend, &s.m.names[s.m.blockLayer(i)]
	v := s.viewsFor(T)
	x, h, q, attn, kk, vv, proj, gate, up := v.x, v.h, v.q, v.attn, v.kk, v.vv, v.proj, v.gate, v.up
	var err error
	if residual {
		err = tensor.AddRMSNorm(b, h, x, proj, lw[n[arch.AttnNorm]], c.NormEps())
	} else {
		err = b.RMSNorm(h, x, lw[n[arch.AttnNorm]], c.NormEps())
	}
	if err != nil {
		return fmt.Errorf("attention norm: %w", err)
	}
	if s.batch == nil && lw[n[arch.QBias]] == nil && lw[n[arch.KBias]] == nil && lw[n[arch.VBias]] == nil {
		// One pass over the three weights where the backend fuses it
		// (tensor.MatMulMany).
		err := tensor.MatMulMany(b, []*tensor.Tensor{q, kk, vv}, h, []*tensor.Tensor{lw[n[arch.Q]], lw[n[arch.K]], lw[n[arch.V]]})
		if err != nil {
			return fmt.Errorf("q, k and v projections: %w", err)
		}
	} else {
		if err := s.matMul(q, h, lw[n[arch.Q]], lw[n[arch.QBias]]); err != nil {
			return fmt.Errorf("q projection: %w", err)
		}
		if err := s.matMul(kk, h, lw[n[arch.K]], lw[n[arch.KBias]]); err != nil {
			return fmt.Errorf("k projection: %w", err)
		}
		if err := s.matMul(vv, h, lw[n[arch.V]], lw[n[arch.VBias]]); err != nil {
			return fmt.Errorf("v projection: %w", err)
		}
	}
	if err := s.attention(ctx, i, T, pos0, scale, posAt, lw); err != nil {
		return err
	}
	if err := s.matMul(proj, attn, lw[n[arch.O]], lw[n[arch.OBias]]); err != nil {
		return fmt.Errorf("o projection: %w", err)
	}
	// The residual and the MLP's norm in one pass (tensor.AddRMSNorm).
	if err := tensor.AddRMSNorm(b, h, x, proj, lw[n[arch.MLPNorm]], c.NormEps()); err != nil {
		return fmt.Errorf("mlp norm: %w", err)
	}
	if c.Sparse(i) {
		return s.moe(ctx, i, T, pos0, lw) // its output in proj
	}
	if s.batch == nil {
		// silu(gate) * up, both products in one pass over their weights
		// where the backend fuses them (tensor.GateUpSiLU).
		if err := tensor.GateUpSiLU(b, gate, up, h, lw[n[arch.Gate]], lw[n[arch.Up]]); err != nil {
			return fmt.Errorf("gate and up projections: %w", err)
		}
	} else {
		if err := s.matMul(gate, h, lw[n[arch.Gate]], nil); err != nil {
			return fmt.Errorf("gate projection: %w", err)
		}
		if err := s.matMul(up, h, lw[n[arch.Up]], nil); err != nil {
			return fmt.Errorf("up projection: %w", err)
		}
		if err := b.SiLUMul(gate, gate, up); err != nil {
			return err
		}
	}
	if err := s.matMul(proj, gate, lw[n[arch.Down]], nil); err != nil {
		return fmt.Errorf("down projection: %w", err)
	}
	return nil // the output in proj, added to x by the next norm
}

// attention runs block i's attention from its q, kk and vv (the
// projections of the chunk's T rows) into attn: the q/k norms where the
// family has them, then rope, the KV cache's rows and the attention on
// the device, in a batch's pool, or over a KV cache in host memory.
func (s *Session) attention(ctx context.Context, i, T, pos0 int, scale float32, posAt *tensor.Tensor, lw LayerWeights) error {
	c, b, n := &s.m.cfg, s.m.backend, &s.m.names[s.m.blockLayer(i)]
	v := s.viewsFor(T)
	q, attn, kk, vv := v.q, v.attn, v.kk, v.vv
	if c.QKNorm {
		// Each head's queries and keys are normalised on their own: rows
		// of HeadDim in the [T*heads, HeadDim] views.
		if err := b.RMSNorm(v.qHeads, v.qHeads, lw[n[arch.QNorm]], c.NormEps()); err != nil {
			return fmt.Errorf("q norm: %w", err)
		}
		if err := b.RMSNorm(v.kHeads, v.kHeads, lw[n[arch.KNorm]], c.NormEps()); err != nil {
			return fmt.Errorf("k norm: %w", err)
		}
	}
	switch {
	case s.batch != nil:
		kc, vc := s.k[i-s.m.lo], s.v[i-s.m.lo]
		onHost := s.hkv != nil && s.hkv.onHost[i-s.m.lo]
		if err := s.batch.attention(b, s, attn, q, kk, vv, kc, vc, scale, onHost); err != nil {
			return err
		}
	case s.hkv == nil || !s.hkv.onHost[i-s.m.lo]:
		// q and k rotated, k's and v's rows appended to the caches on the
		// device: one pass where the backend fuses it (tensor.RopeKV).
		rot := tensor.Rotary{Cos: s.cos, Sin: s.sin, Heads: c.NumHeads, HeadDim: c.HeadDim, Pos0: pos0, PosAt: posAt}
		kc, vc := s.k[i-s.m.lo], s.v[i-s.m.lo]
		if err := tensor.RopeKV(b, q, kk, vv, kc, vc, rot); err != nil {
			return err
		}
		at := tensor.Attn{Q: q, K: kc, V: vc, Heads: c.NumHeads, KVHeads: c.NumKVHeads, HeadDim: c.HeadDim, Pos0: pos0, Scale: scale, PosAt: posAt}
		if err := b.Attention(attn, at); err != nil {
			return err
		}
	default:
		rot := tensor.Rotary{Cos: s.cos, Sin: s.sin, Heads: c.NumHeads, HeadDim: c.HeadDim, Pos0: pos0}
		if err := b.Rope(q, rot); err != nil {
			return err
		}
		rot.Heads = c.NumKVHeads
		if err := b.Rope(kk, rot); err != nil {
			return err
		}
		at := tensor.Attn{Heads: c.NumHeads, KVHeads: c.NumKVHeads, HeadDim: c.HeadDim, Pos0: pos0, Scale: scale}
		if err := s.attend(ctx, i, T, pos0, q, kk, vv, attn, at); err != nil {
			return err
		}
	}
	return nil
}

// matMul is the backend's MatMul, or in a batch tensor.MatMulRows, whose
// rows have the bits of one-row products: a sequence's results then do not
// depend on the other rows of the step.
func (s *Session) matMul(out, x, w, bias *tensor.Tensor) error {
	if s.batch != nil {
		return tensor.MatMulRows(s.m.backend, out, x, w, bias)
	}
	return s.m.backend.MatMul(out, x, w, bias)
}

// chunkViews are the session's buffers cut to T rows, so that a decode step
// (T = 1, again and again) allocates nothing.
type chunkViews struct {
	x, h, q, attn, kk, vv, proj *tensor.Tensor
	gate, up                    *tensor.Tensor // [T, IntermediateSize], for a dense MLP
	qHeads, kHeads              *tensor.Tensor // q and kk as [T*heads, HeadDim], for the q/k norms
	logits                      *tensor.Tensor // T rows, or nil without a head
	lastH, logits1              *tensor.Tensor // the last row of h, and one row of logits
}

func (bf *buffers) viewsFor(T int) *chunkViews {
	if v, ok := bf.views[T]; ok {
		return v
	}
	v := &chunkViews{
		x: rows(bf.x, T), h: rows(bf.h, T), q: rows(bf.q, T), attn: rows(bf.attn, T),
		kk: rows(bf.kk, T), vv: rows(bf.vv, T), proj: rows(bf.proj, T),
		gate: view(bf.gate, T, bf.inter), up: view(bf.up, T, bf.inter),
		qHeads: view(bf.q, T*bf.heads, bf.headDim), kHeads: view(bf.kk, T*bf.kvHeads, bf.headDim),
	}
	if bf.logits != nil {
		v.logits, v.logits1 = rows(bf.logits, T), rows(bf.logits, 1)
		last, err := bf.h.Rows(T-1, 1)
		if err != nil {
			panic(err) // T <= chunk, the rows of h
		}
		v.lastH = last
	}
	if bf.views == nil {
		bf.views = map[int]*chunkViews{}
	}
	bf.views[T] = v
	return v
}

// view is the first n rows of width w of t's storage, which the session
// sizes to hold them.
func view(t *tensor.Tensor, n, w int) *tensor.Tensor {
	v, err := t.View(0, tensor.F32, tensor.Shape{n, w})
	if err != nil {
		panic(err) // the buffers are sized for the widest view of a chunk
	}
	return v
}

// view32 is a one-element F32 tensor seen as I32.
func view32(t *tensor.Tensor) *tensor.Tensor {
	v, err := t.View(0, tensor.I32, tensor.Shape{1})
	if err != nil {
		panic(err) // four bytes as four bytes
	}
	return v
}

// rows is t.Rows(0, n) for n within t's first dimension, which the session
// guarantees.
func rows(t *tensor.Tensor, n int) *tensor.Tensor {
	v, err := t.Rows(0, n)
	if err != nil {
		panic(err) // chunking keeps n <= the buffer's rows
	}
	return v
}
