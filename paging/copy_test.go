package paging

import (
	"math"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

type timedFake struct {
	*fakeBackend
	bytes       int64
	busy, stall time.Duration
}

func (f *timedFake) CopyStats() (int64, time.Duration, time.Duration) {
	return f.bytes, f.busy, f.stall
}

func TestCopyWindow(t *testing.T) {
	f := &timedFake{fakeBackend: newFake(), bytes: 100, busy: time.Second}
	w := StartCopyWindow(f)
	w.start = w.start.Add(-4 * time.Second) // a 4 s window
	f.bytes += 50e9
	f.busy += 2 * time.Second
	f.stall += time.Second / 2
	gbps, overlap := w.End(f)
	// 2 s of copies, 0.5 s of them holding compute up: 1.5 s hidden of the
	// 2 s that could have been (compute ran 3.5 s).
	if math.Abs(gbps-25) > 1e-9 || math.Abs(overlap-0.75) > 1e-3 {
		t.Errorf("50 GB in 2 s with 0.5 s stalled: %v GB/s, overlap %v; want 25, 0.75", gbps, overlap)
	}
	// Streaming-bound and fully pipelined: copies all the time, compute
	// waits except for its 0.5 s of work.
	f2 := &timedFake{fakeBackend: newFake()}
	w = StartCopyWindow(f2)
	w.start = w.start.Add(-4 * time.Second)
	f2.bytes, f2.busy, f2.stall = 1e9, 4*time.Second, 3500*time.Millisecond
	if _, o := w.End(f2); math.Abs(o-1) > 1e-3 {
		t.Errorf("pipelined streaming: overlap %v, want 1", o)
	}
	var none tensor.Memory = newFake()
	if w := StartCopyWindow(none); w != nil {
		t.Error("a backend without copy timing gave a window")
	} else if g, o := w.End(none); g != 0 || o != 0 {
		t.Errorf("nil window: %v %v", g, o)
	}
}
