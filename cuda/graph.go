//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"syscall"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
)

var (
	_ tensor.Grapher        = (*Backend)(nil)
	_ tensor.PositionSetter = (*Backend)(nil)
)

// errCapturing is the error of a call that cannot be part of a capture,
// made from the capturing goroutine.
var errCapturing = errors.New("not allowed while capturing a graph")

// capturing reports whether the calling goroutine is inside Capture's f:
// Capture locks its goroutine to its OS thread and records the thread's
// id, so no other goroutine can match it.
func (b *Backend) capturing() bool {
	t := b.captureTid.Load()
	return t != 0 && t == int64(syscall.Gettid())
}

// Capture records the operations f queues on the compute stream into a
// CUDA graph (stream capture, thread-local mode) and instantiates it. While
// f runs, the capturing goroutine holds the compute stream: other
// goroutines' operations, uploads on the copy stream and prefetches wait
// until the capture ends. A call in f that cannot be captured (a Download,
// Sync, an allocation that reaches the driver, a copy from pageable host
// memory) fails, and Capture returns an error with no graph; so does an
// error or a panic from f (the panic is raised again once the capture has
// ended). The launches captured are counted in Launches as they are
// captured; each Replay counts as one graph launch.
func (b *Backend) Capture(f func() error) (tensor.Graph, error) {
	const op = "Capture"
	if b.capturing() {
		return nil, fmt.Errorf("%s: %s: %w (captures do not nest)", b.name, op, errCapturing)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.enter(op); err != nil {
		return nil, err
	}
	b.gate.Lock()
	b.opsMu.Lock()
	if err := beginCapture(b.compute); err != nil {
		b.opsMu.Unlock()
		b.gate.Unlock()
		b.leave()
		return nil, fmt.Errorf("%s: %s: beginning the capture: %w", b.name, op, err)
	}
	b.captureTid.Store(int64(syscall.Gettid()))
	b.leave()

	var g cuGraph
	var endErr error
	end := func() {
		b.captureTid.Store(0)
		if err := b.enter(op); err != nil {
			endErr = err
		} else {
			g, endErr = endCapture(b.compute)
			b.leave()
		}
		b.opsMu.Unlock()
		b.gate.Unlock()
	}
	ferr := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				end()
				panic(p)
			}
		}()
		return f()
	}()
	end()
	if err := b.enter(op); err != nil {
		return nil, err
	}
	defer b.leave()
	if ferr != nil || endErr != nil {
		if g != nil {
			graphDestroy(g)
		}
		if ferr != nil {
			return nil, fmt.Errorf("%s: %s: %w", b.name, op, ferr)
		}
		return nil, fmt.Errorf("%s: %s: ending the capture: %w", b.name, op, endErr)
	}
	nodes, err := graphNodes(g)
	if err == nil {
		var exec cuGraphExec
		if exec, err = graphInstantiate(g); err == nil {
			gr := &graph{b: b, g: g, exec: exec, nodes: nodes}
			b.graphsMu.Lock()
			b.graphs[gr] = struct{}{}
			b.graphsMu.Unlock()
			return gr, nil
		}
	}
	graphDestroy(g)
	return nil, fmt.Errorf("%s: %s: instantiating the graph: %w", b.name, op, err)
}

// graph is a captured, instantiated CUDA graph.
type graph struct {
	b      *Backend
	g      cuGraph
	exec   cuGraphExec
	nodes  int
	closed bool // guarded by b.graphsMu
}

// Nodes is the number of operations (kernels, copies, memsets) the graph
// holds.
func (g *graph) Nodes() int { return g.nodes }

// Replay launches the graph on the compute stream, after the work queued
// before it.
func (g *graph) Replay() error {
	const op = "Replay"
	b := g.b
	if b.capturing() {
		return fmt.Errorf("%s: %s: %w", b.name, op, errCapturing)
	}
	return b.ops(op, func() error {
		b.graphsMu.Lock()
		closed := g.closed
		b.graphsMu.Unlock()
		if closed {
			return fmt.Errorf("%s: %s: the graph is closed", b.name, op)
		}
		b.counts.graphs.Add(1)
		if err := graphLaunch(g.exec, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, err)
		}
		return nil
	})
}

// Close frees the graph; replays already queued finish first (the driver
// frees an executable graph in flight when it completes). After the
// backend's Close it is a no-op.
func (g *graph) Close() error {
	b := g.b
	b.graphsMu.Lock()
	if g.closed {
		b.graphsMu.Unlock()
		return nil
	}
	g.closed = true
	delete(b.graphs, g)
	b.graphsMu.Unlock()
	if err := b.enter("Graph.Close"); err != nil {
		if errors.Is(err, ErrClosed) {
			return nil // release destroyed it
		}
		return err
	}
	defer b.leave()
	return errors.Join(graphExecDestroy(g.exec), graphDestroy(g.g))
}

// releaseGraphs destroys the graphs not closed yet; the context must be
// current.
func (b *Backend) releaseGraphs() error {
	b.graphsMu.Lock()
	defer b.graphsMu.Unlock()
	var errs []error
	for g := range b.graphs {
		g.closed = true
		errs = append(errs, graphExecDestroy(g.exec), graphDestroy(g.g))
	}
	b.graphs = map[*graph]struct{}{}
	return errors.Join(errs...)
}

// SetPosition writes pos into element 0 of at (I32) with a 4-byte memset
// on the compute stream: no staging of host memory, and a node a graph
// could hold.
func (b *Backend) SetPosition(at *tensor.Tensor, pos int) error {
	const op = "SetPosition"
	if err := b.device(op, "at", at); err != nil {
		return err
	}
	if at.DType() != tensor.I32 || at.Len() < 1 {
		return fmt.Errorf("cuda: %s: at is %v %v, want I32 with at least one element", op, at.DType(), at.Shape())
	}
	if pos < 0 || pos > math.MaxInt32 {
		return fmt.Errorf("cuda: %s: position %d outside [0, %d]", op, pos, math.MaxInt32)
	}
	return b.ops(op, func() error {
		b.counts.copies.Add(1)
		if err := cu.MemsetD32Async(cu.DevicePtr(at.Ptr()), uint(pos), 1, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		return nil
	})
}
