package tensor

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestPoolReuse: jobs of changing sizes, recycled one after another, run
// each task exactly once and return only when all have run. A worker late
// from a job's previous use must neither claim a task of the next use nor
// count one as done (which ended a call early, or left a stale signal that
// deadlocked the next).
func TestPoolReuse(t *testing.T) {
	p := newPool(4)
	defer p.close()
	var ran [16]atomic.Int32
	done := make(chan int)
	go func() {
		calls := 0
		for start := time.Now(); time.Since(start) < 2*time.Second; calls++ {
			n := []int{2, 7, 3, 16, 5}[calls%5]
			for i := range n {
				ran[i].Store(0)
			}
			p.run(n, func(i int) { ran[i].Add(1) })
			for i := range n {
				if c := ran[i].Load(); c != 1 {
					t.Errorf("call %d of %d tasks: task %d ran %d times when run returned", calls, n, i, c)
					done <- calls
					return
				}
			}
		}
		done <- calls
	}()
	select {
	case calls := <-done:
		t.Logf("%d calls", calls)
	case <-time.After(30 * time.Second):
		t.Fatal("a call of run never returned: a stale completion signal deadlocked the pool")
	}
}
