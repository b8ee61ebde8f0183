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
	f.bytes += 50e9
	f.busy += 2 * time.Second
	f.stall += time.Second / 2
	gbps, overlap := w.End(f)
	if math.Abs(gbps-25) > 1e-9 || math.Abs(overlap-0.75) > 1e-9 {
		t.Errorf("50 GB in 2 s with 0.5 s stalled: %v GB/s, overlap %v; want 25, 0.75", gbps, overlap)
	}
	var none tensor.Backend = newFake()
	if w := StartCopyWindow(none); w != nil {
		t.Error("a backend without copy timing gave a window")
	} else if g, o := w.End(none); g != 0 || o != 0 {
		t.Errorf("nil window: %v %v", g, o)
	}
}
