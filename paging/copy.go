package paging

import (
	"time"

	"github.com/strata-llm/strata/tensor"
)

// CopyWindow measures a backend's uploads between its start and End.
type CopyWindow struct {
	b             tensor.Memory
	bytes0        int64
	busy0, stall0 time.Duration
	start         time.Time
}

// StartCopyWindow starts measuring; it returns nil for a backend that does
// not time its copies (tensor.CopyTimer), and a nil window's End returns
// zeros.
func StartCopyWindow(b tensor.Memory) *CopyWindow {
	w := &CopyWindow{b: b, start: time.Now()}
	var ok bool
	if w.bytes0, w.busy0, w.stall0, ok = tensor.CopyStats(b); !ok {
		return nil
	}
	return w
}

// End waits for the backend's queued work and returns the copy rate
// achieved in the window (GB/s) and the overlap: the copy time that did not
// hold compute up (busy - stall) over the most that could have been hidden,
// the smaller of the copy time and the compute time (wall - stall). 1 means
// copies and compute ran fully in parallel, 0 one after the other. Zeros
// when nothing was copied.
func (w *CopyWindow) End(b tensor.Memory) (gbps, overlap float64) {
	if w == nil {
		return 0, 0
	}
	_ = tensor.Sync(b)
	bytes, busy, stall, _ := tensor.CopyStats(w.b)
	bytes, busy, stall = bytes-w.bytes0, busy-w.busy0, stall-w.stall0
	if bytes <= 0 || busy <= 0 {
		return 0, 0
	}
	gbps = float64(bytes) / busy.Seconds() / 1e9
	compute := time.Since(w.start) - stall
	if hideable := min(busy, compute); hideable > 0 {
		overlap = min(max(float64(busy-stall)/float64(hideable), 0), 1)
	}
	return gbps, overlap
}
