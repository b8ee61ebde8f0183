package tensor

import (
	"sync"
	"sync/atomic"
)

// pool is a fixed set of worker goroutines that run the tasks of parallel
// jobs. The goroutine that submits a job works on it too, so a pool of n
// threads has n-1 workers, and a job always finishes even when every worker
// is busy with another caller's job.
type pool struct {
	threads int
	work    chan *job

	mu     sync.RWMutex // guards closed against sends on a closed channel
	closed bool
}

// job is one call of pool.run: tasks 0..n-1 handed out by an atomic counter.
type job struct {
	fn   func(task int)
	n    int64
	next atomic.Int64
	wg   sync.WaitGroup
}

func newPool(threads int) *pool {
	p := &pool{threads: threads, work: make(chan *job, 4*threads)}
	for range threads - 1 {
		go p.worker()
	}
	return p
}

func (p *pool) worker() {
	for j := range p.work {
		j.do()
	}
}

// do runs tasks of j until none are left.
func (j *job) do() {
	for {
		i := j.next.Add(1) - 1
		if i >= j.n {
			return
		}
		j.fn(int(i))
		j.wg.Done()
	}
}

// run calls fn(i) for i in [0, n) on the pool's threads and returns when all
// calls have returned. fn must not panic. After close, run does all the work
// on the calling goroutine.
func (p *pool) run(n int, fn func(task int)) {
	if n <= 0 {
		return
	}
	if n == 1 || p.threads == 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	j := &job{fn: fn, n: int64(n)}
	j.wg.Add(n)
	p.mu.RLock()
	if !p.closed {
		for range min(p.threads-1, n-1) {
			select {
			case p.work <- j:
			default: // every worker has work queued; the caller helps instead
			}
		}
	}
	p.mu.RUnlock()
	j.do()
	j.wg.Wait()
}

// close stops the workers. It is safe to call more than once.
func (p *pool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.closed = true
		close(p.work)
	}
}
