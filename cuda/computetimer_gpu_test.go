//go:build cuda

package cuda

import (
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// TestStartCompute: the device time between two marks of the compute
// queue (tensor.ComputeTimer) is positive, within the host's wall time
// from the first mark to the stop's return, and about doubles with twice
// the work queued; a stop called twice answers the same; the marks' events
// are reused, not made anew at each step. It logs what it measures.
func TestStartCompute(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const m, k, n = 64, 4096, 4096
	x, _ := put(t, b, tensor.F32, tensor.Shape{m, k}, uniform(r, m*k, -1, 1))
	w, _ := put(t, b, tensor.F16, tensor.Shape{n, k}, uniform(r, n*k, -1, 1))
	out, _ := put(t, b, tensor.F32, tensor.Shape{m, n}, make([]float32, m*n))
	timed := func(products int) (device, wall, queued time.Duration) {
		t.Helper()
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		stop, ok, err := tensor.StartCompute(b)
		if !ok || err != nil {
			t.Fatalf("StartCompute: ok %v, %v", ok, err)
		}
		for range products {
			if err := b.MatMul(out, x, w, nil); err != nil {
				t.Fatal(err)
			}
		}
		queued = time.Since(t0)
		device, err = stop()
		wall = time.Since(t0)
		if err != nil {
			t.Fatal(err)
		}
		if again, err := stop(); again != device || err != nil {
			t.Errorf("a second stop: %v, %v; the first %v", again, err, device)
		}
		return device, wall, queued
	}
	timed(4) // warm
	d1, w1, q1 := timed(20)
	d2, w2, q2 := timed(40)
	t.Logf("20 products of %dx%dx%d F16: device %v, host queued them in %v, wall %v; 40: device %v, queued %v, wall %v; ratio %.2f",
		m, k, n, d1, q1, w1, d2, q2, w2, float64(d2)/float64(d1))
	if d1 <= 0 || d1 > w1 || d2 > w2 {
		t.Errorf("device times %v and %v against walls %v and %v", d1, d2, w1, w2)
	}
	if ratio := float64(d2) / float64(d1); ratio < 1.5 || ratio > 2.6 {
		t.Errorf("twice the work took %.2f times the device time", ratio)
	}
	b.evMu.Lock()
	before := len(b.evAll)
	b.evMu.Unlock()
	for range 50 {
		timed(1)
	}
	b.evMu.Lock()
	after := len(b.evAll)
	b.evMu.Unlock()
	if after > before+2 {
		t.Errorf("50 timed stretches made %d events: the marks' events are not reused", after-before)
	}
}
