package nn

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// Decode steps as captured graphs.
//
// On a backend with a tensor.Grapher, a decode step (one token, no hook,
// not a hybrid twin) runs each dense decoder block as a graph captured
// once and replayed: one launch where the block takes a dozen. What
// changes between steps is read from device memory: the position, which
// the session uploads to posAt before the first block, and which RopeKV
// and Attention read through PosAt. Everything else a graph bakes in is
// fixed while its key holds: the session's buffers and caches (a graph
// belongs to one session), the layer's weight tensors (their addresses
// are the key's fingerprint), and the bound of the position (the key's
// bucket, a power of two, up to which the graph's launches are sized).
//
// A block is captured the second step its key is seen unchanged: a layer
// the pager streams into the same ring slot each step is replayed like a
// resident one (its upload is ordered before the replay by Acquire), one
// that lands in different slots runs eagerly, and one whose weights move
// maxMoves times gives up graphs for the session.
// A capture that fails leaves the block eager for the session, so graphs
// never decide whether a step succeeds. Sparse (mixture-of-experts)
// blocks, whose routing reads the device, always run eagerly.
//
// Consecutive dense blocks whose layers are resident (ResidentWeights:
// every layer of HostWeights, a pager's wholly resident layers) run as
// one graph instead, a run: the step acquires all of the run's layers,
// then replays the run's graph once, so a model that is wholly resident
// launches one graph per step where it launched one per block. A run is
// keyed, captured and given up as a block is (its key holds the bound,
// the addresses of all its layers' tensors and the first block's
// residual); a run whose capture fails leaves its blocks to graphs of
// their own. Streamed layers, which take ring slots one at a time, keep
// a graph per block.

const (
	// minBucket is the smallest bound of positions a graph is captured
	// for; larger bounds are powers of two, up to the session's context:
	// a 4096-position session captures each block at most 7 times.
	minBucket = 64
	// maxMoves is how often a block's weights may move to new addresses
	// before the block stays eager for the session.
	maxMoves = 3
	// graphsPerLayer caps the graphs kept for one block (buckets, after a
	// Reset, or weights in a few places).
	graphsPerLayer = 4
)

// GraphPositionBytes is the device memory of the position a session's
// decode graphs read: one I32.
const GraphPositionBytes = 4

// graphKey is what a block's graph bakes in besides the session: the
// bound of the position and the addresses of the layer's tensors.
type graphKey struct {
	bound    int
	fp       string
	residual bool // the block adds the previous block's output first
}

// layerGraphs are one block's graphs in one session.
type layerGraphs struct {
	graphs map[graphKey]tensor.Graph
	// pending is, by key, whether the blocks leave their output in proj
	// (see Session.block): known from the capture, for a replay.
	pending map[graphKey]bool
	last    graphKey // the previous step's key
	seen    bool     // last is set
	moves   int      // times the fingerprint changed
	eager   bool     // graphs given up for this block
}

// sessionGraphs are a session's graphs and the position they read.
type sessionGraphs struct {
	g      tensor.Grapher
	posAt  *tensor.Tensor // the buffers' posAt
	layers map[int]*layerGraphs
	// runs are the graphs of runs of resident blocks, by first and end
	// block; noRun marks the blocks of a run whose capture failed.
	runs     map[[2]int]*layerGraphs
	noRun    map[int]bool
	resident ResidentWeights // the model's weights, or nil without it
	fp       []byte          // runGraphed's buffer for a run's fingerprint
	// Counters since the session opened, for tests and benchmarks.
	captures, replays, eager, runReplays, runBlocks int64
}

// GraphStats counts a session's decode blocks run as graphs: graphs
// captured, graphs replayed, and blocks run eagerly in decode steps that
// could use graphs; of the replays, those of runs of several blocks, and
// the blocks they ran.
type GraphStats struct {
	Captures, Replays, Eager int64
	RunReplays, RunBlocks    int64
}

// GraphStats returns the session's counts of captured, replayed and eager
// blocks in decode steps (zero without graphs).
func (s *Session) GraphStats() GraphStats {
	if s.graphs == nil {
		return GraphStats{}
	}
	gs := s.graphs
	return GraphStats{Captures: gs.captures, Replays: gs.replays, Eager: gs.eager, RunReplays: gs.runReplays, RunBlocks: gs.runBlocks}
}

// SetGraphs turns decode graphs on (the default, on a backend that can
// capture them) or off for the sessions' next steps.
func (m *Model) SetGraphs(on bool) { m.noGraphs.Store(!on) }

// graphsFor returns the session's graph state for a chunk of T tokens, or
// nil when the chunk runs eagerly (not a decode step, a hook, a hybrid
// twin, a KV cache in host memory, a batch's stage, graphs off, or a
// backend without them).
func (s *Session) graphsFor(T int, hook Hook) *sessionGraphs {
	if T != 1 || hook != nil || s.twin != nil || s.hkv != nil || s.batch != nil || s.m.noGraphs.Load() {
		return nil
	}
	if s.graphs == nil {
		g, ok := tensor.Graphs(s.m.backend)
		if !ok {
			return nil
		}
		s.graphs = &sessionGraphs{g: g, posAt: s.posAt, layers: map[int]*layerGraphs{}, runs: map[[2]int]*layerGraphs{}, noRun: map[int]bool{}}
		s.graphs.resident, _ = s.m.weights.(ResidentWeights)
	}
	return s.graphs
}

// bucket is the bound of positions a graph captured at pos serves.
func (s *Session) bucket(pos int) int {
	b := minBucket
	for b <= pos {
		b *= 2
	}
	return min(b, s.maxPos) - 1
}

// fingerprint is the addresses of lw's tensors, in the order of the
// layer's names.
func (s *Session) fingerprint(layer int, lw LayerWeights) string {
	return string(s.appendFingerprint(nil, layer, lw))
}

// appendFingerprint appends fingerprint's bytes to buf.
func (s *Session) appendFingerprint(buf []byte, layer int, lw LayerWeights) []byte {
	for _, name := range s.m.names[layer] {
		if t := lw[name]; name != "" && t != nil {
			buf = binary.LittleEndian.AppendUint64(buf, uint64(t.Addr()))
		}
	}
	return buf
}

// setPosition writes the step's position for the graphs to read: on the
// device where the backend can (tensor.PositionSetter), else an upload.
func (gs *sessionGraphs) setPosition(b tensor.Backend, pos int) error {
	if ps, ok := tensor.PositionSetters(b); ok {
		return ps.SetPosition(gs.posAt, pos)
	}
	var buf [4]byte
	binary.LittleEndian.PutUint32(buf[:], uint32(int32(pos)))
	return b.Upload(gs.posAt, 0, buf[:])
}

// blockGraphed runs decoder block i of a decode step at pos0 (uploaded to
// posAt already) as a graph when it can, else eagerly (see block for
// residual and pending).
func (s *Session) blockGraphed(ctx context.Context, gs *sessionGraphs, i, pos0 int, lw LayerWeights, scale float32, residual bool) (pending bool, err error) {
	if s.m.cfg.Sparse(i) {
		gs.eager++
		return s.block(ctx, i, 1, pos0, lw, scale, nil, residual)
	}
	lg := gs.layers[i]
	if lg == nil {
		lg = &layerGraphs{graphs: map[graphKey]tensor.Graph{}}
		gs.layers[i] = lg
	}
	if lg.eager {
		gs.eager++
		return s.block(ctx, i, 1, pos0, lw, scale, nil, residual)
	}
	key := graphKey{bound: s.bucket(pos0), fp: s.fingerprint(s.m.blockLayer(i), lw), residual: residual}
	g := lg.graph(gs, key, func() error {
		_, err := s.block(ctx, i, 1, key.bound, lw, scale, gs.posAt, residual)
		return err
	}, lg.giveUp)
	if g == nil {
		// Not yet seen twice at these addresses, moved too often, or not
		// capturable here (the eager run reports the block's own error,
		// if any).
		gs.eager++
		return s.block(ctx, i, 1, pos0, lw, scale, nil, residual)
	}
	gs.replays++
	return !s.folds(i, 1, lw), g.Replay()
}

// runEnd returns the end of the run of blocks that starts at block i: the
// first block from i on that is sparse, not resident, given up, or left
// to itself by a failed run, or m.hi.
func (s *Session) runEnd(gs *sessionGraphs, i int) int {
	m := s.m
	if gs.resident == nil {
		return i
	}
	j := i
	for j < m.hi && !m.cfg.Sparse(j) && !gs.noRun[j] && (gs.layers[j] == nil || !gs.layers[j].eager) && gs.resident.Resident(m.blockLayer(j)) {
		j++
	}
	return j
}

// runGraphed runs decoder blocks lo..hi-1 of a decode step at pos0
// (uploaded to posAt already), whose layers are resident, as one graph
// when it can, else eagerly; residual is the first block's and pending
// the last's (see block). It holds every layer of the run from before the
// first block until the last has been queued.
func (s *Session) runGraphed(ctx context.Context, gs *sessionGraphs, lo, hi, pos0 int, scale float32, residual bool) (pending bool, err error) {
	m := s.m
	// The run's layers are pinned, and their maps acquired only for a
	// capture or an eager run: a replay needs only to know that the
	// tensors are where they were (fp).
	var lws []LayerWeights
	pins := 0
	defer func() {
		for k := range pins {
			m.weights.Release(m.blockLayer(lo + k))
		}
		for k := range lws {
			m.weights.Release(m.blockLayer(lo + k))
		}
	}()
	acquire := func() error {
		for i := lo + len(lws); i < hi; i++ {
			lw, err := m.weights.Acquire(ctx, m.blockLayer(i))
			if err != nil {
				return fmt.Errorf("block %d: %w", i, err)
			}
			lws = append(lws, lw)
		}
		return nil
	}
	fp := gs.fp[:0]
	if p := layerPinner(m.weights); p != nil {
		for i := lo; i < hi; i++ {
			var err error
			if fp, err = p.PinLayer(ctx, m.blockLayer(i), fp); err != nil {
				return false, fmt.Errorf("block %d: %w", i, err)
			}
			pins++
		}
	} else {
		if err := acquire(); err != nil {
			return false, err
		}
		for k, lw := range lws {
			fp = s.appendFingerprint(fp, m.blockLayer(lo+k), lw)
		}
	}
	gs.fp = fp
	span := [2]int{lo, hi}
	rg := gs.runs[span]
	if rg == nil {
		rg = &layerGraphs{graphs: map[graphKey]tensor.Graph{}, pending: map[graphKey]bool{}}
		gs.runs[span] = rg
	}
	key := graphKey{bound: s.bucket(pos0), fp: string(fp), residual: residual}
	run := func(pos int, posAt *tensor.Tensor) error {
		pend := residual
		for k, lw := range lws {
			var err error
			if pend, err = s.block(ctx, lo+k, 1, pos, lw, scale, posAt, pend); err != nil {
				return fmt.Errorf("block %d: %w", lo+k, err)
			}
		}
		rg.pending[key] = pend
		return nil
	}
	// A run given up leaves its blocks to graphs of their own from the
	// next step on.
	abandon := func() {
		rg.giveUp()
		for i := lo; i < hi; i++ {
			gs.noRun[i] = true
		}
	}
	if rg.graphs[key] == nil {
		// A capture or an eager run follows: both need the maps, taken
		// before a capture starts.
		if err := acquire(); err != nil {
			return false, err
		}
	}
	g := rg.graph(gs, key, func() error { return run(key.bound, gs.posAt) }, abandon)
	if g == nil {
		gs.eager += int64(hi - lo)
		err := run(pos0, nil)
		return rg.pending[key], err
	}
	gs.replays++
	gs.runReplays++
	gs.runBlocks += int64(hi - lo)
	if err := g.Replay(); err != nil {
		return false, fmt.Errorf("blocks %d to %d: %w", lo, hi-1, err)
	}
	return rg.pending[key], nil
}

// graph returns lg's graph for key, or nil when the step is to run
// eagerly: a key is captured (with capture) the second step in a row it is
// seen; giveUp is called when the addresses have moved maxMoves times or
// the capture fails. A new graph takes the place of an old one beyond
// graphsPerLayer.
func (lg *layerGraphs) graph(gs *sessionGraphs, key graphKey, capture func() error, giveUp func()) tensor.Graph {
	if g := lg.graphs[key]; g != nil {
		return g
	}
	again := lg.seen && lg.last == key
	if lg.seen && lg.last.fp != key.fp {
		if lg.moves++; lg.moves >= maxMoves {
			giveUp()
		}
	}
	lg.last, lg.seen = key, true
	if !again || lg.eager {
		return nil
	}
	g, err := gs.g.Capture(capture)
	if err != nil {
		giveUp()
		return nil
	}
	gs.captures++
	if len(lg.graphs) >= graphsPerLayer {
		for k, old := range lg.graphs {
			old.Close()
			delete(lg.graphs, k)
			break
		}
	}
	lg.graphs[key] = g
	return g
}

// giveUp closes the block's graphs and keeps it eager.
func (lg *layerGraphs) giveUp() {
	lg.eager = true
	for k, g := range lg.graphs {
		g.Close()
		delete(lg.graphs, k)
	}
}

// close frees every graph of the session.
func (gs *sessionGraphs) close() error {
	var errs []error
	all := make([]*layerGraphs, 0, len(gs.layers)+len(gs.runs))
	for _, lg := range gs.layers {
		all = append(all, lg)
	}
	for _, rg := range gs.runs {
		all = append(all, rg)
	}
	for _, lg := range all {
		for _, g := range lg.graphs {
			errs = append(errs, g.Close())
		}
		lg.graphs = nil
	}
	return errors.Join(errs...)
}
