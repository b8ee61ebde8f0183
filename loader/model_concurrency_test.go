package loader

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader/fixtures"
)

// TestConcurrentReadsAndClose reads random ranges of random tensors of the
// sharded fixture from many goroutines, checking every byte against a
// single-threaded read, and closes the model while they run: each read
// returns the right bytes or an error wrapping ErrClosed, nothing else.
func TestConcurrentReadsAndClose(t *testing.T) {
	m, err := Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	all := m.Tensors()
	want := map[string][]byte{}
	for _, ti := range all {
		x, err := m.ReadTensor(ctx, ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		want[ti.Name] = x.Bytes()
	}
	const workers = 8
	var reads, closedReads atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 3))
			<-start
			for i := 0; i < 4000; i++ {
				ti := all[r.IntN(len(all))]
				off := r.Int64N(ti.Size)
				n := 1 + r.Int64N(ti.Size-off)
				dst := make([]byte, n)
				err := m.ReadRange(ctx, ti, off, dst)
				switch {
				case errors.Is(err, ErrClosed):
					closedReads.Add(1)
					if closedReads.Load() > 50 {
						return
					}
				case err != nil:
					errs <- err
					return
				case !bytes.Equal(dst, want[ti.Name][off:off+n]):
					errs <- errors.New("concurrent read of " + ti.Name + " returned other bytes")
					return
				default:
					reads.Add(1)
				}
			}
		}()
	}
	close(start)
	// Let the readers get going before closing under them.
	for deadline := time.Now().Add(10 * time.Second); reads.Load() < 2000 && time.Now().Before(deadline); {
		runtime.Gosched()
	}
	closeErrs := make(chan error, 3)
	for range 3 { // Close from several goroutines at once: idempotent
		go func() { closeErrs <- m.Close() }()
	}
	for range 3 {
		if err := <-closeErrs; err != nil {
			t.Errorf("Close: %v", err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d concurrent reads checked, %d refused after Close", reads.Load(), closedReads.Load())
}
