package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/strata-llm/strata/nn"
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
	// ErrBusy: the KV cache (or the queue) has no room for the request
	// now; try again later.
	ErrBusy = errors.New("engine: no room for the request now")
	// ErrPromptTooLong: the prompt (plus at least one new token) does not
	// fit in the context.
	ErrPromptTooLong = errors.New("engine: prompt longer than the context")
	// ErrDraining: the batcher is shutting down.
	ErrDraining = errors.New("engine: shutting down")
)

// BatchOptions adjust a Batcher.
type BatchOptions struct {
	// MaxSequences runs at most this many requests at once (0: 8).
	MaxSequences int
	// MaxQueue holds at most this many requests waiting (0: 64); beyond
	// it Submit returns ErrBusy.
	MaxQueue int
}

// BatchStats are a batcher's counters and gauges.
type BatchStats struct {
	Running, Queued           int
	Requests, Rejected        int64
	PromptTokens, GenTokens   int64
	Steps                     int64
	BatchSizeSum              int64 // over steps: the mean batch size is BatchSizeSum/Steps
	TimeToFirstToken, PerStep time.Duration
}

// Batcher runs many requests over one engine. This first version runs the
// requests that are running one decode step each in turn, each with its
// own session; a batched forward (one pass over the layers for every
// running sequence) takes its place behind the same API.
type Batcher struct {
	e    *Engine
	opts BatchOptions

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
	sess    Session
	sampler *nn.Sampler
	stop    map[int32]bool
	logits  []float32
	gen     int
	start   time.Time
	first   bool
}

// NewBatcher starts a batcher over the engine; Close stops it.
func (e *Engine) NewBatcher(o BatchOptions) (*Batcher, error) {
	if o.MaxSequences <= 0 {
		o.MaxSequences = 8
	}
	if o.MaxQueue <= 0 {
		o.MaxQueue = 64
	}
	b := &Batcher{e: e, opts: o, done: make(chan struct{})}
	b.cond = sync.NewCond(&b.mu)
	go b.loop()
	return b, nil
}

// Submit queues a request and returns its stream of tokens, which ends
// with a Token whose Done is set and is then closed. Cancelling ctx ends
// the request at the next step. A prompt that cannot fit is
// ErrPromptTooLong; a full queue ErrBusy; a closing batcher ErrDraining.
func (b *Batcher) Submit(ctx context.Context, req Request) (<-chan Token, error) {
	if len(req.Prompt) == 0 {
		return nil, errors.New("engine: empty prompt")
	}
	if len(req.Prompt) >= b.e.Context() {
		return nil, fmt.Errorf("%w: %d prompt tokens, the context holds %d positions", ErrPromptTooLong, len(req.Prompt), b.e.Context())
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
	j := &job{ctx: ctx, req: req, out: make(chan Token, 16), sampler: sampler, stop: map[int32]bool{}, start: time.Now()}
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
	}
	b.queue = append(b.queue, j)
	b.st.Requests++
	b.cond.Broadcast()
	return j.out, nil
}

// Stats returns the counters.
func (b *Batcher) Stats() BatchStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.st
	st.Running, st.Queued = len(b.running), len(b.queue)
	return st
}

// Close stops taking requests, lets the running and queued ones finish
// (or end when ctx is done: they end with ctx's error), and stops.
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
		var admit []*job
		for len(b.queue) > 0 && len(b.running)+len(admit) < b.opts.MaxSequences {
			admit = append(admit, b.queue[0])
			b.queue = b.queue[1:]
		}
		b.mu.Unlock()
		for _, j := range admit {
			s, err := b.e.NewSession()
			if err != nil {
				b.finish(j, "", fmt.Errorf("%w: %v", ErrBusy, err))
				continue
			}
			j.sess = s
			b.mu.Lock()
			b.running = append(b.running, j)
			b.mu.Unlock()
		}
		b.step()
	}
}

// step runs one forward for each running request: its prompt first, then
// one token at a time.
func (b *Batcher) step() {
	b.mu.Lock()
	running := append([]*job(nil), b.running...)
	b.mu.Unlock()
	t0 := time.Now()
	var keep []*job
	for _, j := range running {
		if done := b.advance(j); !done {
			keep = append(keep, j)
		}
	}
	b.mu.Lock()
	b.running = keep
	b.st.Steps++
	b.st.BatchSizeSum += int64(len(running))
	b.st.PerStep = time.Since(t0)
	b.mu.Unlock()
}

// advance runs one forward of j and reports whether j has ended.
func (b *Batcher) advance(j *job) bool {
	if err := j.ctx.Err(); err != nil {
		b.finish(j, "", err)
		return true
	}
	var err error
	if j.logits == nil {
		j.logits, err = j.sess.Forward(j.ctx, j.req.Prompt, false, nil)
		b.mu.Lock()
		b.st.PromptTokens += int64(len(j.req.Prompt))
		b.mu.Unlock()
	}
	if err != nil {
		b.finish(j, "", err)
		return true
	}
	id := int32(j.sampler.Sample(j.logits))
	j.gen++
	if !j.first {
		j.first = true
		b.mu.Lock()
		b.st.TimeToFirstToken = time.Since(j.start)
		b.mu.Unlock()
	}
	b.mu.Lock()
	b.st.GenTokens++
	b.mu.Unlock()
	stopped := j.stop[id]
	if !j.send(Token{ID: id, Emitted: true, PromptTokens: len(j.req.Prompt), GeneratedTokens: j.gen}) {
		b.finish(j, "", j.ctx.Err())
		return true
	}
	limit := b.e.Context() - len(j.req.Prompt)
	if j.req.MaxTokens > 0 {
		limit = min(limit, j.req.MaxTokens)
	}
	switch {
	case stopped:
		b.finish(j, FinishStop, nil)
		return true
	case j.gen >= limit:
		b.finish(j, FinishLength, nil)
		return true
	}
	if j.logits, err = j.sess.Forward(j.ctx, []int32{id}, false, nil); err != nil {
		b.finish(j, "", err)
		return true
	}
	return false
}

// finish ends j's stream and frees its session.
func (b *Batcher) finish(j *job, reason string, err error) {
	if j.sess != nil {
		j.sess.Close()
		j.sess = nil
	}
	j.send(Token{Done: true, Finish: reason, Err: err, PromptTokens: len(j.req.Prompt), GeneratedTokens: j.gen})
	close(j.out)
}

// send passes t to the request's reader unless its context ends first (a
// client that went away reads no more), and reports whether it did.
func (j *job) send(t Token) bool {
	select {
	case j.out <- t:
		return true
	case <-j.ctx.Done():
		return false
	}
}
