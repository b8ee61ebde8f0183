package tensor

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// pool is a fixed set of worker goroutines that run the tasks of parallel
// jobs. The goroutine that submits a job works on it too, so a pool of n
// threads has n-1 workers, and a job always finishes even when every worker
// is busy with another caller's job.
//
// Submitting a job allocates nothing: jobs are recycled, and a worker that
// picks up a recycled job late (after it finished and was reused) sees a
// newer generation number and leaves it alone. After finishing a job a
// worker polls for the next one for a short while before it parks, because
// a decode step submits hundreds of short jobs back to back and waking a
// parked goroutine costs several microseconds each time.
type pool struct {
	threads int
	work    chan jobRef
	jobs    sync.Pool // of *job

	mu     sync.RWMutex // guards closed against sends on a closed channel
	closed bool

	// parallel counts the jobs handed to the threads (runTask with more
	// than one task and thread), for the tests of the fused products.
	parallel atomic.Int64
}

// task is the work of a parallel job: run(i) for i in [0, n).
type task interface{ run(i int) }

// funcTask adapts a function to task.
type funcTask func(i int)

func (f funcTask) run(i int) { f(i) }

// jobRef is a job as handed to a worker: the job and its generation.
type jobRef struct {
	j   *job
	gen uint32
}

// job is one call of pool.run. Tasks are claimed by incrementing the low
// half of state, whose high half is the generation; a claim from an older
// generation fails.
type job struct {
	t     task
	n     atomic.Uint32 // tasks in this generation
	state atomic.Uint64 // generation<<32 | next task
	done  atomic.Uint32 // tasks finished
	fin   chan struct{} // receives one value when the last task finishes
	gen   uint32        // the submitter's copy of the generation
}

// spinFor is how long an idle worker polls for the next job before parking.
const spinFor = 50 * time.Microsecond

func newPool(threads int) *pool {
	p := &pool{threads: threads, work: make(chan jobRef, 4*threads)}
	p.jobs.New = func() any { return &job{fin: make(chan struct{}, 1)} }
	for range threads - 1 {
		go p.worker()
	}
	return p
}

func (p *pool) worker() {
	for {
		var r jobRef
		var ok bool
		select {
		case r, ok = <-p.work:
		default:
			r, ok = p.poll()
		}
		if !ok {
			return
		}
		r.j.do(r.gen)
	}
}

// poll waits for the next job, spinning for spinFor before blocking.
func (p *pool) poll() (jobRef, bool) {
	start := time.Now()
	for i := 0; ; i++ {
		select {
		case r, ok := <-p.work:
			return r, ok
		default:
		}
		if i&63 == 63 {
			if time.Since(start) > spinFor {
				break
			}
			runtime.Gosched()
		}
	}
	r, ok := <-p.work
	return r, ok
}

// do runs tasks of generation gen of j until none are left.
func (j *job) do(gen uint32) {
	for {
		s := j.state.Load()
		if uint32(s>>32) != gen {
			return // a later use of the recycled job
		}
		n := j.n.Load()
		if uint32(s) >= n {
			return
		}
		if !j.state.CompareAndSwap(s, s+1) {
			continue
		}
		j.t.run(int(uint32(s)))
		if j.done.Add(1) == n {
			j.fin <- struct{}{}
		}
	}
}

// run calls fn(i) for i in [0, n) on the pool's threads and returns when all
// calls have returned. fn must not panic. After close, run does all the work
// on the calling goroutine.
func (p *pool) run(n int, fn func(task int)) { p.runTask(n, funcTask(fn)) }

// runTask is run for a task value: with t a pointer to a recycled struct,
// a job allocates nothing.
func (p *pool) runTask(n int, t task) {
	if n <= 0 {
		return
	}
	if n == 1 || p.threads == 1 {
		for i := range n {
			t.run(i)
		}
		return
	}
	p.parallel.Add(1)
	j := p.jobs.Get().(*job)
	// Close the previous use first: a worker late from it may still hold
	// its state, and must not pair that with the new n (which let it claim
	// a task past the old end and count it done). The new generation with
	// no task left fails its claim and sends it away.
	j.gen++
	j.state.Store(uint64(j.gen)<<32 | math.MaxUint32)
	j.t = t
	j.n.Store(uint32(n))
	j.done.Store(0)
	j.state.Store(uint64(j.gen) << 32) // publishes t and n to the workers
	p.mu.RLock()
	if !p.closed {
		for range min(p.threads-1, n-1) {
			select {
			case p.work <- jobRef{j, j.gen}:
			default: // every worker has work queued; the caller helps instead
			}
		}
	}
	p.mu.RUnlock()
	j.do(j.gen)
	<-j.fin
	j.t = nil
	p.jobs.Put(j)
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
