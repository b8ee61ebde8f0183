package tensor

import (
	"errors"
	"fmt"
)

// Positions read when an operation runs.
//
// A captured graph (Grapher) replays the operations it recorded with the
// arguments they had then, so what changes from one decode step to the
// next must live in device memory. Rotary.PosAt and Attn.PosAt are such a
// place: an I32 tensor of at least one element on the backend, whose
// element 0 the operation reads when it runs (in stream order, after the
// Upload that wrote it) as the position of row 0. Pos0 is then an upper
// bound of that value: the checks hold Pos0 (and so every position the
// tensor may hold) inside the tables and caches, and a backend may size a
// launch by it. A backend that has a Grapher reads PosAt on the device;
// the CPU backend reads it from host memory. A value above Pos0 or below 0
// is an error where the backend can see it (the CPU) and reads no memory
// outside the operands where it cannot (a device clamps it).

// ErrPosition is wrapped by the error of an operation whose PosAt holds a
// position outside [0, Pos0].
var ErrPosition = errors.New("position outside its bound")

// checkPosAt checks a PosAt operand: nil, or an I32 tensor with at least
// one element.
func checkPosAt(op string, at *Tensor) error {
	if at == nil {
		return nil
	}
	if at.dtype != I32 || at.shape.NumElements() < 1 {
		return fmt.Errorf("tensor: %s: PosAt is %v %v, want I32 with at least one element", op, at.dtype, at.shape)
	}
	return nil
}

// hostPosition is the position an operation runs at on the host: pos0, or
// element 0 of at (host memory) when at is set, which must lie in [0,
// pos0].
func hostPosition(op string, pos0 int, at *Tensor) (int, error) {
	if at == nil {
		return pos0, nil
	}
	if !at.OnHost() || at.NumBytes() < 4 {
		return 0, fmt.Errorf("tensor: cpu: %s: PosAt %v is not in host memory", op, at)
	}
	p := int(at.I32()[0])
	if p < 0 || p > pos0 {
		return 0, fmt.Errorf("tensor: %s: PosAt holds %d, outside [0, %d]: %w", op, p, pos0, ErrPosition)
	}
	return p, nil
}

// Graph is a captured sequence of a backend's operations (Grapher).
type Graph interface {
	// Replay queues the captured operations again, with the arguments
	// they were captured with, after the work queued before it; like any
	// operation it may return before they have run.
	Replay() error
	// Close frees the graph, after the replays queued so far. Closing
	// twice is a no-op.
	Close() error
}

// Grapher is a backend that can capture the operations of a function into
// a graph and replay it, so that a decode step's dozens of launches cost
// one. Capture runs f, whose calls of the backend's Kernels (and of the
// fused operations of this package) are recorded rather than run; f must
// not wait for the device (Download, Sync), allocate or free, or copy from
// host memory (Upload, Embed). What changes between replays is read from
// device memory: positions through PosAt, anything else through buffers
// the caller rewrites before Replay. Other goroutines' operations on the
// backend wait while f runs. An error from f, or an operation that cannot
// be captured, ends the capture with an error and no graph.
type Grapher interface {
	Capture(f func() error) (Graph, error)
}

// Graphs returns m's graph capture, if it has one.
func Graphs(m Memory) (Grapher, bool) { return capability[Grapher](m) }

// PositionSetter is a backend that writes a position into element 0 of
// a PosAt tensor in stream order without a copy from host memory: a decode
// step's graphs read it, and a small copy from pageable memory costs a
// staging copy on the host and a copy on the device's queue each step.
type PositionSetter interface {
	// SetPosition writes pos (0 <= pos <= MaxInt32) into element 0 of at,
	// an I32 tensor on the backend, after the work queued before it.
	SetPosition(at *Tensor, pos int) error
}

// PositionSetters returns m's PositionSetter, if it has one.
func PositionSetters(m Memory) (PositionSetter, bool) { return capability[PositionSetter](m) }
