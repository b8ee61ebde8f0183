package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Request is one generation: a prompt's token ids and how to continue it.
type Request struct {
	Prompt    []int32
	MaxTokens int // new tokens at most; 0 is as many as the context holds
	Sampler   nn.SamplerConfig
	// StopIDs end the generation when one is produced (the model's EOS ids
	// are added unless IgnoreEOS). Stop strings are the caller's: it
	// decodes text and cancels the request's context when one appears.
	StopIDs   []int32
	IgnoreEOS bool
}

// Token is one step of a request's stream. The last value on the stream
// has Done set, with why the generation ended (FinishStop for a stop id,
// FinishLength for MaxTokens or the context's end) or the error that ended
// it; its ID is valid only when Err is nil and Emitted is set.
type Token struct {
	ID      int32
	Emitted bool // ID is a generated token
	Done    bool
	Finish  string
	Err     error
	// PromptTokens and GeneratedTokens count the request's tokens so far.
	PromptTokens, GeneratedTokens int
}

// Why a generation ended.
const (
	FinishStop   = "stop"
	FinishLength = "length"
)

// The errors Submit returns, for a server to map to its statuses.
var (
	// ErrBusy: the queue has no room for the request now (one waiting
	// for KV blocks waits in the queue); try again later.
	ErrBusy = errors.New("engine: no room for the request now")
	// ErrTooLarge: the request's KV reservation (its prompt and the
	// tokens it may generate) is larger than the whole KV pool: no retry
	// can fit it, only a smaller MaxTokens (or prompt).
	ErrTooLarge = errors.New("engine: request larger than the KV pool")
	// ErrPromptTooLong: the prompt (plus at least one new token) does not
	// fit in the context.
	ErrPromptTooLong = errors.New("engine: prompt longer than the context")
	// ErrDraining: the batcher is shutting down.
	ErrDraining = errors.New("engine: shutting down")
	// ErrKVRoom: NewBatcher's KV pool does not fit in the room the
	// devices' plans left for it.
	ErrKVRoom = errors.New("engine: KV pool larger than the plan's room")
)

// BatchOptions adjust a Batcher.
type BatchOptions struct {
	// MaxSequences runs at most this many requests at once (0: 8).
	MaxSequences int
	// MaxQueue holds at most this many requests waiting (0: 64); beyond
	// it Submit returns ErrBusy.
	MaxQueue int
	// StepTokens is the most tokens one step runs, all the sequences'
	// together: the decode rows first, then prompt chunks up to it (0:
	// the engine's chunk, and at least MaxSequences).
	StepTokens int
	// BlockSize is the positions of a KV block (0: nn.DefaultBlockSize).
	BlockSize int
	// KVBlocks is the size of the KV pool in blocks, allocated when the
	// batcher starts from the devices' budgets. 0 takes the room the
	// plans left free on the devices (Options.KVPositions makes it) less
	// a session's KV cache and buffers, so that a session still runs
	// beside the batcher: at least one sequence of the engine's context
	// and at most MaxSequences of them. A pool that does not fit in the room left
	// free is refused: it would take the place of the weights the plan
	// keeps resident, and every step would load them again. The blocks
	// whose KV cache Memory.KVCache places in host memory keep their part
	// of the pool there: under a host memory limit within the room the
	// plan set aside for the KV cache there (one context), else the
	// default takes MaxSequences contexts' worth of host memory.
	KVBlocks int
	// Pipeline, over several devices of their own (a pipeline that is
	// not a CPU+GPU placement), runs the steps beat by beat
	// (nn.Batch.Tick): while the second device runs one step of some
	// requests, the first runs the next step of the others, every device
	// computing at once. The steps hold the requests that have none in
	// flight. On one device, or stages sharing one, it is ignored.
	Pipeline bool
}

// BatchStats are a batcher's counters and gauges.
type BatchStats struct {
	Running, Queued           int
	Requests, Rejected        int64
	PromptTokens, GenTokens   int64
	Steps                     int64 // the steps that ran a forward
	BatchSizeSum              int64 // over steps: the mean batch size is BatchSizeSum/Steps
	TimeToFirstToken, PerStep time.Duration
	// BatchSize is the number of sequences of the last step, StepRows its
	// tokens.
	BatchSize, StepRows int
	// KVBlocks and KVBlocksFree are the KV pool's blocks, and those no
	// request holds; BlockSize their positions.
	KVBlocks, KVBlocksFree, BlockSize int
	// InterTokenLatency is the last generated token's time since its
	// request's previous one. TimeToFirstToken is the last request's time
	// from Submit to its first token.
	InterTokenLatency time.Duration
	// FirstTokens and TimeToFirstTokenSum, InterTokens and
	// InterTokenLatencySum give the means.
	FirstTokens, InterTokens                  int64
	TimeToFirstTokenSum, InterTokenLatencySum time.Duration
	// StepRowsSum and StepTimeSum add up the rows and the wall time of
	// the Steps: rows a step is StepRowsSum/Steps, steps a second
	// Steps/StepTimeSum.
	StepRowsSum int64
	StepTimeSum time.Duration
	// StepSplit adds up where the Steps' time went (divide by Steps for
	// a step's), the parts adding up to StepTimeSum.
	StepSplit StepSplit
}

// StepSplit is a batched step's time by part: on the host, choosing the
// step's rows (Schedule), then nn.StepTimes' Prepare, Launch, Wait and
// Download, then sampling and sending the tokens and dropping the ended
// requests (Sample). Device is the device's own time for the forward
// (nn.StepTimes.Device), which ran during Launch and Wait. Launches are
// the work the host issued to the devices. A pipelined beat (Tick) counts
// its forward in Launch, unsplit.
type StepSplit struct {
	Schedule, Prepare, Launch, Wait, Download, Sample time.Duration
	Device                                            time.Duration
	Launches                                          int64
}

func (s *StepSplit) add(o StepSplit) {
	s.Schedule += o.Schedule
	s.Prepare += o.Prepare
	s.Launch += o.Launch
	s.Wait += o.Wait
	s.Download += o.Download
	s.Sample += o.Sample
	s.Device += o.Device
	s.Launches += o.Launches
}

// Batcher runs many requests over one engine, batched: each step runs the
// model's layers once for one row of every decoding request plus chunks
// of the prompts of requests that are starting, up to StepTokens rows
// (nn.Batch). On the CPU a request's tokens are the same, bit for bit,
// whatever the other requests of its steps.
//
// Admission reserves, for each request, the KV blocks of its prompt plus
// its MaxTokens (the whole context when MaxTokens is 0) before it runs: a
// running request never runs out of KV blocks, so no batch is preempted
// or runs out of memory mid-way. A request whose reservation does not fit
// in the free blocks waits in the queue, first come first served; one
// that could not fit even in an empty pool is refused with ErrTooLarge.
type Batcher struct {
	e     *Engine
	opts  BatchOptions
	batch *nn.Batch

	mu       sync.Mutex
	cond     *sync.Cond
	queue    []*job
	running  []*job
	draining bool
	closed   bool
	st       BatchStats
	done     chan struct{}
}

type job struct {
	ctx     context.Context
	req     Request
	out     chan Token
	seq     *nn.Seq
	sampler *nn.Sampler
	stop    map[int32]bool
	limit   int   // the tokens it may generate
	fed     int   // prompt tokens run so far
	next    int32 // the token to run next, once the prompt has run
	gen     int
	start   time.Time
	last    time.Time // when its previous token was sent
}

// NewBatcher starts a batcher over the engine, allocating its KV pool;
// Close stops it and frees the pool. Close the batcher before the engine.
func (e *Engine) NewBatcher(o BatchOptions) (*Batcher, error) {
	if o.MaxSequences <= 0 {
		o.MaxSequences = 8
	}
	if o.MaxQueue <= 0 {
		o.MaxQueue = 64
	}
	if o.StepTokens <= 0 {
		o.StepTokens = max(e.chunk, o.MaxSequences)
	}
	if o.StepTokens < o.MaxSequences {
		return nil, fmt.Errorf("engine: batcher of %d tokens a step for %d sequences: each needs a row", o.StepTokens, o.MaxSequences)
	}
	if o.BlockSize < 0 || o.KVBlocks < 0 {
		return nil, fmt.Errorf("engine: batcher with blocks of %d positions, %d blocks", o.BlockSize, o.KVBlocks)
	}
	if o.BlockSize == 0 {
		o.BlockSize = nn.DefaultBlockSize
	}
	if o.KVBlocks == 0 {
		o.KVBlocks = e.defaultKVBlocks(o)
	}
	if err := e.hostPoolRoom(o); err != nil {
		return nil, fmt.Errorf("engine: batcher: %w", err)
	}
	// The pool stores the KV dtype of the sessions (Options.Memory.KVDType),
	// which the plans counted.
	bo := nn.BatchOptions{MaxPos: e.context, MaxRows: o.StepTokens, BlockSize: o.BlockSize, Blocks: o.KVBlocks, KVDType: e.kvDType()}
	var nb *nn.Batch
	var err error
	e.mu.Lock()
	weights := e.weightBytes()
	switch {
	case e.hybrid == nil && e.poolRoom(o) != nil:
		err = e.poolRoom(o)
	case e.closed:
		err = errors.New("engine: closed")
	case e.model != nil:
		nb, err = e.model.NewBatch(bo)
	default:
		nb, err = e.pipeline.NewBatch(bo)
	}
	if err == nil {
		for d, w := range e.weightBytes() {
			if w < weights[d] {
				// The pool took the place of weights the plan keeps on
				// the device: they would load again at every step.
				nb.Close()
				err = fmt.Errorf("%w: a KV pool of %d blocks of %d positions (%s) does not fit in the room the plan left on %s: the weights there gave up %s for it; give the engine Options.KVPositions %d (-kv-positions) so that its plan keeps room for the pool, or ask for fewer blocks",
					ErrKVRoom, o.KVBlocks, o.BlockSize, paging.FormatSize(nn.KVCacheBytes(e.cfg, o.KVBlocks*o.BlockSize, e.kvDType())), e.devices[d].Name, paging.FormatSize(weights[d]-w), o.KVBlocks*o.BlockSize)
				break
			}
		}
	}
	e.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("engine: batcher: %w", err)
	}
	b := &Batcher{e: e, opts: o, batch: nb, done: make(chan struct{})}
	b.st.KVBlocks, b.st.KVBlocksFree, b.st.BlockSize = nb.Blocks(), nb.FreeBlocks(), nb.BlockSize()
	b.cond = sync.NewCond(&b.mu)
	go b.loop()
	return b, nil
}

// defaultKVBlocks is the KV pool of BatchOptions.KVBlocks 0: the blocks
// that fit in the smallest room the budgets have free beside the batch's
// buffers and a session's, at least one context's and at most
// MaxSequences contexts'.
func (e *Engine) defaultKVBlocks(o BatchOptions) int {
	perSeq := (e.context + o.BlockSize - 1) / o.BlockSize
	n := perSeq * o.MaxSequences
	for d, b := range e.budgets {
		room := freeRoom(b) - e.stageActivationBytes(d, o.StepTokens) - nn.RopeBytes(e.cfg, e.context)
		room -= nn.KVCacheBytes(e.cfg, e.context, e.kvDType()) + e.stageActivationBytes(d, e.chunk) + nn.RopeBytes(e.cfg, e.context)
		// A block's bytes on this device: its blocks' share of the pool.
		if block := e.devicePoolBytes(d, o.BlockSize); block > 0 && room < int64(n)*block {
			n = int(max(room, 0) / block)
		}
	}
	if hostBlock := e.hostPoolBytes(o.BlockSize); hostBlock > 0 && e.hostPoolLimited() {
		n = min(n, int(e.kv.HostBytes/hostBlock))
	}
	return max(n, perSeq)
}

// hostPoolBytes is what positions of the batch's KV pool take in host
// memory: the pool's share of the blocks whose cache Memory.KVCache
// places there.
func (e *Engine) hostPoolBytes(positions int) int64 {
	if e.kv == nil || e.cfg.NumLayers == 0 {
		return 0
	}
	return nn.KVCacheBytes(e.cfg, positions, e.kvDType()) / int64(e.cfg.NumLayers) * int64(len(e.kv.HostBlocks))
}

// hostPoolLimited reports whether the pool's host part is bounded by the
// host memory limit: the room the plan set aside for the KV cache there
// (the hybrid strategies' limit is their layers' and caches' together).
func (e *Engine) hostPoolLimited() bool {
	return e.kv != nil && len(e.kv.HostBlocks) > 0 && e.hybrid == nil && e.opts.Memory.HostCache > 0
}

// devicePoolBytes is what positions of the batch's KV pool take on device
// d: the pool's share of its blocks whose cache is on the device (those in
// host memory, Memory.KVCache, keep theirs there).
func (e *Engine) devicePoolBytes(d, positions int) int64 {
	p := e.devices[d].Placement
	blocks := p.EndBlock - p.FirstBlock
	if e.kv != nil {
		for _, b := range e.kv.HostBlocks {
			if b >= p.FirstBlock && b < p.EndBlock {
				blocks--
			}
		}
	}
	return nn.KVCacheBytes(e.cfg, positions, e.kvDType()) / int64(e.cfg.NumLayers) * int64(blocks)
}

// hostPoolRoom checks the part of the batch's KV pool in host memory (the
// blocks Memory.KVCache places there) against the host memory limit
// (Memory.HostCache): it must fit in the room the plan set aside there for
// the KV cache, the rest of the limit being the streamed layers'.
func (e *Engine) hostPoolRoom(o BatchOptions) error {
	if !e.hostPoolLimited() {
		return nil
	}
	if need := e.hostPoolBytes(o.KVBlocks * o.BlockSize); need > e.kv.HostBytes {
		return fmt.Errorf("%w: a KV pool of %d blocks of %d positions keeps %s in host memory, over the %s the plan set aside for the KV cache there under the host memory limit of %s (-host-memory-limit): ask for fewer blocks or raise the limit",
			ErrKVRoom, o.KVBlocks, o.BlockSize, paging.FormatSize(need), paging.FormatSize(e.kv.HostBytes), paging.FormatSize(e.opts.Memory.HostCache))
	}
	return nil
}

// poolRoom checks, before anything is allocated, that the batch's KV pool
// and buffers fit in the room each device's budget has free, so that the
// pool takes no weight's place (ErrKVRoom).
func (e *Engine) poolRoom(o BatchOptions) error {
	positions := o.KVBlocks * o.BlockSize
	for d, b := range e.budgets {
		kv := e.devicePoolBytes(d, positions)
		need := kv + e.stageActivationBytes(d, o.StepTokens) + nn.RopeBytes(e.cfg, e.context)
		room := freeRoom(b)
		if need <= room {
			continue
		}
		advice := fmt.Sprintf("give the engine Options.KVPositions %d (-kv-positions) so that its plan keeps room for the pool, or ask for fewer blocks", positions)
		if e.kvPositions() >= positions && o.StepTokens > e.chunk {
			// The plan kept room for the pool and for the buffers of a
			// step of the engine's chunk: the batch's steps are larger.
			advice = fmt.Sprintf("the plan kept room for the pool and for steps of %d rows (the engine's chunk): ask for at most that many rows a step (BatchOptions.StepTokens), not %d, or fewer blocks", e.chunk, o.StepTokens)
		}
		return fmt.Errorf("%w: a KV pool of %d blocks of %d positions (%s) and the batch's buffers need %s on %s, the plan left %s free; %s",
			ErrKVRoom, o.KVBlocks, o.BlockSize, paging.FormatSize(kv), paging.FormatSize(need), e.devices[d].Name, paging.FormatSize(max(room, 0)), advice)
	}
	return nil
}

// stageActivationBytes is the forward buffers of tokens rows on device d:
// nn.ActivationBytes less the logits on a stage of a pipeline that does
// not hold the LM head.
func (e *Engine) stageActivationBytes(d, tokens int) int64 {
	n := nn.ActivationBytes(e.cfg, tokens)
	if d < len(e.devices) && len(e.devices) > 1 && !slices.Contains(e.devices[d].Placement.Layers, e.cfg.LayerCount()-1) {
		n -= 4 * int64(tokens) * int64(e.cfg.VocabSize)
	}
	return n
}

// freeRoom is what b can still give without evicting a weight: its free
// bytes and the allocator's cached free blocks, which it trims first.
func freeRoom(b *paging.Budget) int64 {
	return b.Limit() - b.Used() + b.UsedBy(paging.Cached)
}

// weightBytes is, per device budget, the bytes of weights on the device.
// The allocator's cached free blocks are not weights: a pool that reuses
// them (a closed session's buffers, say) takes no weight's place.
func (e *Engine) weightBytes() []int64 {
	var w []int64
	for _, b := range e.budgets {
		w = append(w, b.UsedBy(paging.ResidentWeights)+b.UsedBy(paging.StreamedWeights))
	}
	return w
}

// Submit queues a request and returns its stream of tokens, which ends
// with a Token whose Done is set and is then closed. Cancelling ctx ends
// the request at the next step. A prompt that cannot fit is
// ErrPromptTooLong; a full queue ErrBusy; a request whose KV reservation
// is larger than the whole pool, which no retry can fit, ErrTooLarge; a
// closing batcher ErrDraining.
func (b *Batcher) Submit(ctx context.Context, req Request) (<-chan Token, error) {
	if len(req.Prompt) == 0 {
		return nil, errors.New("engine: empty prompt")
	}
	if len(req.Prompt) >= b.e.Context() {
		return nil, fmt.Errorf("%w: %d prompt tokens, the context holds %d positions", ErrPromptTooLong, len(req.Prompt), b.e.Context())
	}
	if req.MaxTokens < 0 {
		return nil, fmt.Errorf("engine: max tokens %d", req.MaxTokens)
	}
	vocab := b.e.Config().VocabSize
	for i, id := range req.Prompt {
		if id < 0 || int(id) >= vocab {
			return nil, fmt.Errorf("engine: token id %d at prompt position %d is outside the vocabulary of %d", id, i, vocab)
		}
	}
	sampler, err := nn.NewSampler(req.Sampler)
	if err != nil {
		return nil, err
	}
	limit := b.e.Context() - len(req.Prompt)
	if req.MaxTokens > 0 {
		limit = min(limit, req.MaxTokens)
	}
	j := &job{ctx: ctx, req: req, out: make(chan Token, streamBuffer), sampler: sampler, stop: map[int32]bool{}, limit: limit, start: time.Now()}
	for _, id := range req.StopIDs {
		j.stop[id] = true
	}
	if !req.IgnoreEOS {
		for _, id := range b.e.Config().EOS {
			j.stop[int32(id)] = true
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.draining || b.closed:
		b.st.Rejected++
		return nil, ErrDraining
	case len(b.queue) >= b.opts.MaxQueue:
		b.st.Rejected++
		return nil, fmt.Errorf("%w: %d requests queued", ErrBusy, len(b.queue))
	case b.batch.BlocksFor(j.positions()) > b.batch.Blocks():
		b.st.Rejected++
		return nil, fmt.Errorf("%w: %d prompt tokens and %d new tokens need %d KV positions (%d blocks of %d), the whole pool holds %d blocks (%d positions): ask for fewer tokens",
			ErrTooLarge, len(req.Prompt), j.limit, j.positions(), b.batch.BlocksFor(j.positions()), b.batch.BlockSize(), b.batch.Blocks(), b.batch.Blocks()*b.batch.BlockSize())
	}
	b.queue = append(b.queue, j)
	b.st.Requests++
	b.cond.Broadcast()
	return j.out, nil
}

// positions is what j reserves: its prompt and the tokens it may generate
// but the last (which is sampled, never run).
func (j *job) positions() int { return len(j.req.Prompt) + j.limit - 1 }

// Stats returns the counters.
func (b *Batcher) Stats() BatchStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.st
	st.Running, st.Queued = len(b.running), len(b.queue)
	return st
}

// Close stops taking requests, lets the running and queued ones finish
// (or end when ctx is done: they end with ErrDraining), frees the KV pool
// and stops.
func (b *Batcher) Close(ctx context.Context) error {
	b.mu.Lock()
	b.draining = true
	b.cond.Broadcast()
	b.mu.Unlock()
	stop := context.AfterFunc(ctx, func() {
		b.mu.Lock()
		b.closed = true
		b.cond.Broadcast()
		b.mu.Unlock()
	})
	defer stop()
	<-b.done
	return ctx.Err()
}

// loop admits queued requests and steps the running ones.
func (b *Batcher) loop() {
	defer close(b.done)
	defer b.batch.Close()
	for {
		b.mu.Lock()
		for len(b.queue) == 0 && len(b.running) == 0 && !b.draining && !b.closed {
			b.cond.Wait()
		}
		if b.closed || b.draining && len(b.queue) == 0 && len(b.running) == 0 {
			queued, running := b.queue, b.running
			b.queue, b.running = nil, nil
			b.mu.Unlock()
			for _, j := range append(queued, running...) {
				b.finish(j, "", ErrDraining)
			}
			return
		}
		b.admit()
		b.mu.Unlock()
		b.step()
	}
}

// admit moves requests from the queue to the running set while there is
// room, in order: the head of the queue waits for KV blocks rather than
// let later, smaller requests pass it for ever. Requests cancelled while
// queued end there. b.mu is held.
func (b *Batcher) admit() {
	keep := b.queue[:0]
	for _, j := range b.queue {
		if err := j.ctx.Err(); err != nil {
			b.finish(j, "", err)
			continue
		}
		keep = append(keep, j)
	}
	clear(b.queue[len(keep):])
	b.queue = keep
	for len(b.queue) > 0 && len(b.running) < b.opts.MaxSequences {
		j := b.queue[0]
		seq := b.batch.NewSeq()
		if err := seq.Reserve(j.positions()); err != nil {
			break // waits for blocks
		}
		j.seq = seq
		b.queue = b.queue[1:]
		b.running = append(b.running, j)
	}
	b.st.KVBlocksFree = b.batch.FreeBlocks()
}

// step runs one batched forward: a row for each request that is decoding,
// then chunks of the prompts of those that are starting, up to
// StepTokens; then samples, sends and ends requests.
func (b *Batcher) step() {
	b.mu.Lock()
	running := append([]*job(nil), b.running...)
	b.mu.Unlock()
	t0 := time.Now()
	var works []nn.Work
	var owners, ended []*job
	budget := b.opts.StepTokens
	pipe := b.opts.Pipeline && b.batch.Pipelined()
	if pipe {
		// A request with a step in flight waits for it (and ends, if
		// cancelled, once it has left the pipeline).
		running = slices.DeleteFunc(running, func(j *job) bool { return b.batch.InFlight(j.seq) })
	}
	for _, j := range running {
		if err := j.ctx.Err(); err != nil {
			b.finish(j, "", err)
			ended = append(ended, j)
			continue
		}
		if j.fed == len(j.req.Prompt) && j.room() {
			works, owners = append(works, nn.Work{Seq: j.seq, IDs: []int32{j.next}, Logits: true}), append(owners, j)
			budget--
		}
	}
	prompt := 0
	for _, j := range running {
		if budget == 0 {
			break
		}
		if j.fed < len(j.req.Prompt) && j.ctx.Err() == nil && j.room() {
			n := min(budget, len(j.req.Prompt)-j.fed)
			works = append(works, nn.Work{Seq: j.seq, IDs: j.req.Prompt[j.fed : j.fed+n], Logits: j.fed+n == len(j.req.Prompt)})
			owners = append(owners, j)
			budget -= n
			prompt += n
		}
	}
	rows := b.opts.StepTokens - budget
	if pipe {
		b.beat(works, ended, rows, prompt, t0)
		return
	}
	if len(works) == 0 && len(ended) == 0 {
		// Every running request waits for its reader: poll.
		time.Sleep(time.Millisecond)
	}
	var split StepSplit
	if len(works) > 0 {
		split.Schedule = time.Since(t0)
		logits, err := b.batch.Step(context.Background(), works)
		tm := b.batch.Times()
		split.Prepare, split.Launch, split.Wait, split.Download, split.Device, split.Launches = tm.Prepare, tm.Launch, tm.Wait, tm.Download, tm.Device, tm.Launches
		// A step is one pass over the layers, as a decoded token is for
		// a session: the bytes moved per step in the engine's stats.
		b.e.MarkStep()
		if err != nil {
			// A step that fails (a layer that could not be read, say) ends
			// the requests in it.
			for _, j := range owners {
				b.finish(j, "", err)
				ended = append(ended, j)
			}
		} else {
			for i, j := range owners {
				if !works[i].Logits {
					j.fed += len(works[i].IDs)
					continue
				}
				j.fed = len(j.req.Prompt)
				if done := b.emit(j, logits[i]); done {
					ended = append(ended, j)
				}
			}
		}
	}
	b.settle(ended, works, rows, prompt, t0, split)
}

// settle drops the requests that ended from the running ones and counts
// a step of works (rows rows, prompt of them prompt tokens) begun at t0,
// its time split as split says up to the forward's end (the rest is
// Sample's).
func (b *Batcher) settle(ended []*job, works []nn.Work, rows, prompt int, t0 time.Time, split StepSplit) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.running = slices.DeleteFunc(b.running, func(j *job) bool { return slices.Contains(ended, j) })
	b.st.KVBlocksFree = b.batch.FreeBlocks()
	if len(works) == 0 {
		return
	}
	b.st.Steps++
	b.st.BatchSize, b.st.StepRows = len(works), rows
	b.st.BatchSizeSum += int64(len(works))
	b.st.PromptTokens += int64(prompt)
	b.st.PerStep = time.Since(t0)
	b.st.StepRowsSum += int64(rows)
	b.st.StepTimeSum += b.st.PerStep
	split.Sample = b.st.PerStep - split.Schedule - split.Prepare - split.Launch - split.Wait - split.Download
	b.st.StepSplit.add(split)
}

// beat runs one beat of a pipelined batch (BatchOptions.Pipeline): it
// starts a step of works, and takes the step that left the pipeline,
// whose requests it feeds or samples; ended are the requests that step
// ended before the beat.
func (b *Batcher) beat(works []nn.Work, ended []*job, rows, prompt int, t0 time.Time) {
	if len(works) == 0 && b.batch.Flying() == 0 {
		if len(ended) == 0 {
			// Every running request waits for its reader: poll.
			time.Sleep(time.Millisecond)
		}
		b.settle(ended, nil, 0, 0, t0, StepSplit{})
		return
	}
	split := StepSplit{Schedule: time.Since(t0)}
	b.mu.Lock()
	owner := map[*nn.Seq]*job{}
	for _, j := range b.running {
		owner[j.seq] = j
	}
	b.mu.Unlock()
	t1 := time.Now()
	done, logits, err := b.batch.Tick(context.Background(), works)
	split.Launch = time.Since(t1)
	split.Device = split.Launch
	// A beat is one pass over the layers, as a step is.
	b.e.MarkStep()
	if err != nil {
		// The steps in flight are abandoned: their requests end, and
		// those of the works given, which the beat did not start.
		for _, w := range append(done, works...) {
			if j := owner[w.Seq]; j != nil && !slices.Contains(ended, j) {
				b.finish(j, "", err)
				ended = append(ended, j)
			}
		}
		done = nil
	}
	for i, w := range done {
		j := owner[w.Seq]
		if !w.Logits {
			j.fed += len(w.IDs)
			continue
		}
		j.fed = len(j.req.Prompt)
		if j.ctx.Err() != nil {
			b.finish(j, "", j.ctx.Err())
			ended = append(ended, j)
		} else if done := b.emit(j, logits[i]); done {
			ended = append(ended, j)
		}
	}
	b.settle(ended, works, rows, prompt, t0, split)
}

// emit samples j's next token from logits, sends it and reports whether j
// has ended (and is finished).
func (b *Batcher) emit(j *job, logits []float32) bool {
	id, err := pick(j.sampler, logits, j.gen+1)
	if err != nil {
		b.finish(j, "", err)
		return true
	}
	j.gen++
	now := time.Now()
	b.mu.Lock()
	b.st.GenTokens++
	if j.gen == 1 {
		b.st.TimeToFirstToken = now.Sub(j.start)
		b.st.TimeToFirstTokenSum += b.st.TimeToFirstToken
		b.st.FirstTokens++
	} else {
		b.st.InterTokenLatency = now.Sub(j.last)
		b.st.InterTokenLatencySum += b.st.InterTokenLatency
		b.st.InterTokens++
	}
	b.mu.Unlock()
	j.last = now
	j.next = id
	if !j.send(Token{ID: id, Emitted: true, PromptTokens: len(j.req.Prompt), GeneratedTokens: j.gen}) {
		b.finish(j, "", j.ctx.Err())
		return true
	}
	switch {
	case j.stop[id]:
		b.finish(j, FinishStop, nil)
		return true
	case j.gen >= j.limit:
		b.finish(j, FinishLength, nil)
		return true
	}
	return false
}

// pick samples token n of a request from its logits, which must be
// finite. The check reads the logits at memory speed
// (tensor.FirstNonFinite): it runs for every row of every step.
func pick(s *nn.Sampler, logits []float32, n int) (int32, error) {
	if len(logits) > 0 && tensor.FirstNonFinite(tensor.F32, unsafe.Slice((*byte)(unsafe.Pointer(&logits[0])), 4*len(logits))) >= 0 {
		return 0, fmt.Errorf("engine: the logits of token %d hold a NaN or an infinity", n)
	}
	return int32(s.Sample(logits)), nil
}

// finish ends j's stream and returns its KV blocks; it takes b.mu when j
// holds blocks (a queued request holds none), and drops j from the
// running requests before its stream ends, so that a reader who sees the
// end sees it in Stats too. The stream has room for the last token: a
// request runs only while its stream has room for two.
func (b *Batcher) finish(j *job, reason string, err error) {
	if j.seq != nil {
		b.mu.Lock()
		j.seq.Close()
		j.seq = nil
		b.running = slices.DeleteFunc(b.running, func(r *job) bool { return r == j })
		b.st.KVBlocksFree = b.batch.FreeBlocks()
		b.mu.Unlock()
	}
	j.send(Token{Done: true, Finish: reason, Err: err, PromptTokens: len(j.req.Prompt), GeneratedTokens: j.gen})
	close(j.out)
}

// streamBuffer is the tokens a request's stream holds for its reader. A
// request whose reader lags so far behind sits out the steps until it
// reads: it never holds up the others.
const streamBuffer = 16

// room reports whether j's stream has room for a token and the last one,
// so that the step may run j: the batcher never waits on a reader.
func (j *job) room() bool { return len(j.out) <= cap(j.out)-2 }

// send passes t to the request's stream, which has room for it (room), and
// reports whether the request's context is still live.
func (j *job) send(t Token) bool {
	j.out <- t
	return j.ctx.Err() == nil
}
