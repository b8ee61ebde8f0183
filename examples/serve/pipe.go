package main

import (
	"errors"
	"strings"
	"sync"
)

// errSlowClient ends a streamed request whose client has left more than
// the pipe's limit of text unread.
var errSlowClient = errors.New("serve: the client does not read its stream")

// pipe hands a streamed request's text to a goroutine of its own that
// writes it to the client, so that a client slow to read holds up only
// its own request: the batcher waits for each request's reader to take
// its tokens, and a reader stuck in a write would hold up every request.
// Text the client has not taken yet piles up to limit bytes; beyond it
// the request ends with errSlowClient and full is called (to cut the
// write short).
type pipe struct {
	write func(string) error
	limit int
	full  func()

	mu      sync.Mutex
	pending strings.Builder
	closed  bool
	err     error
	wake    chan struct{}
	done    chan struct{}
}

func newPipe(write func(string) error, limit int, full func()) *pipe {
	p := &pipe{write: write, limit: limit, full: full, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go p.loop()
	return p
}

// loop writes what is pending each time emit or close wakes it.
func (p *pipe) loop() {
	defer close(p.done)
	for range p.wake {
		p.mu.Lock()
		text, closed := p.pending.String(), p.closed
		p.pending.Reset()
		p.mu.Unlock()
		if text != "" {
			if err := p.write(text); err != nil {
				p.mu.Lock()
				if p.err == nil {
					p.err = err
				}
				p.mu.Unlock()
				return
			}
		}
		if closed {
			return
		}
	}
}

// emit queues text for the writer without waiting for it.
func (p *pipe) emit(text string) error {
	p.mu.Lock()
	if p.err != nil {
		defer p.mu.Unlock()
		return p.err
	}
	if p.pending.Len()+len(text) > p.limit {
		p.err = errSlowClient
		p.mu.Unlock()
		p.full()
		return errSlowClient
	}
	p.pending.WriteString(text)
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default: // the writer is awake already
	}
	return nil
}

// close waits for the writer to write what is pending and returns the
// error that ended it, if any.
func (p *pipe) close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}
