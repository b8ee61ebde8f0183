package paging

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
)

// HybridMode says how PlanHybrid splits the layers that do not stay on the
// device between the CPU and the link.
type HybridMode string

// The hybrid modes.
const (
	// HybridAuto chooses the split with the least predicted decode time.
	HybridAuto HybridMode = "auto"
	// HybridAllCPU streams nothing in decode: the fewest layers that let
	// the others stay wholly on the device run on the CPU, the embedding
	// and the first blocks (as llama.cpp offloads the last ones).
	HybridAllCPU HybridMode = "cpu"
	// HybridForced puts HybridOptions.CPULayers layers on the CPU and
	// chooses which.
	HybridForced HybridMode = "forced"
)

// HybridOptions adjust PlanHybrid.
type HybridOptions struct {
	Mode HybridMode // "" is HybridAuto
	// CPULayers is the number of layers on the CPU for HybridForced.
	CPULayers int
	// HostBytes bounds the host memory the CPU's layers hold (the pager's
	// Options.HostCacheBytes, -host-memory-limit): 0 sets no bound, < 0
	// allows none. HybridAuto only considers splits within it; the other
	// modes fail with an error wrapping ErrHostMemory when theirs is not.
	HostBytes int64
}

// HybridPlan is PlanHybrid's answer: the device's plan, which layers the
// CPU computes in decode, and what a token is predicted to cost.
type HybridPlan struct {
	Mode HybridMode `json:"mode"`
	// GPU is the device's plan over every layer: the CPU's layers stream
	// whole (a prefill that runs every layer on the device passes them
	// through the ring), and its ring also serves Sequence.
	GPU *PlanResult `json:"gpu"`
	// CPULayers are the layers the CPU computes in decode (Pager.HostLayer;
	// give them to the pager as Options.HostLayers); Sequence the others,
	// in order: the pager's sequence in decode (Pager.SetSequence).
	CPULayers []int `json:"cpu_layers"`
	Sequence  []int `json:"sequence"`
	// Places are every layer's place in decode, as SimulateDecode takes
	// them.
	Places []LayerPlace `json:"places"`
	// ResidentBytes stay on the device (GPU.ResidentBytes); per token,
	// StreamedBytes cross the link and CPUBytes are read by the CPU (the
	// embedding one row). HostLayerBytes are what the CPU's layers hold in
	// host memory.
	ResidentBytes  int64 `json:"resident_bytes"`
	StreamedBytes  int64 `json:"streamed_bytes"`
	CPUBytes       int64 `json:"cpu_bytes"`
	HostLayerBytes int64 `json:"host_layer_bytes"`
	// Positions is what a decoded token attends over in the prediction
	// (WithAttendPositions, or the context length), and KVBytes the KV
	// cache bytes its attention reads then in all blocks; HostKVBytes
	// are those the CPU reads (its own blocks', and the device's blocks'
	// whose cache is in host memory).
	Positions   int   `json:"positions"`
	KVBytes     int64 `json:"kv_bytes"`
	HostKVBytes int64 `json:"host_kv_bytes"`
	// Predicted is one decoded token's time by SimulateDecode, and
	// PredictedTokS its inverse (0 when no time is predicted); Breakdown
	// the time of each path in it.
	Predicted     time.Duration `json:"predicted_ns"`
	PredictedTokS float64       `json:"predicted_tok_s"`
	Breakdown     Breakdown     `json:"breakdown"`
	Rates         Rates         `json:"rates"`
	// Bounds are the rates' bounds for the weights' bytes a token reads
	// outside device memory (StreamedBytes + CPUBytes, the KV cache's
	// reads left out); 0 when there are none.
	Bounds Bounds `json:"bounds"`
}

// String summarises the plan on one line.
func (h *HybridPlan) String() string {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/1e6) }
	streamed := 0
	for _, lp := range h.Places {
		if lp.Place == Streamed {
			streamed++
		}
	}
	return fmt.Sprintf("%s plan for %s budget: %s resident (%d of %d layers whole), per token %s streamed in %d layers and %s read by the CPU in %d layers (holding %s of host memory), prefetch %d, predicted %.1f tok/s (copy %s, CPU %s, GPU %s, %d handoffs %s, waiting for copies %s; bounds: stream %.1f, CPU %.1f, hybrid %.1f tok/s)",
		h.GPU.Strategy, FormatSize(h.GPU.Budget), FormatSize(h.ResidentBytes), len(h.GPU.ResidentLayers), len(h.GPU.Layers),
		FormatSize(h.StreamedBytes), streamed, FormatSize(h.CPUBytes), len(h.CPULayers), FormatSize(h.HostLayerBytes),
		h.GPU.PrefetchDepth, h.PredictedTokS, ms(h.Breakdown.Copy), ms(h.Breakdown.CPU), ms(h.Breakdown.GPU),
		h.Breakdown.Handoffs, ms(h.Breakdown.Handoff), ms(h.Breakdown.CopyWait), h.Bounds.Stream, h.Bounds.CPU, h.Bounds.Hybrid) +
		fmt.Sprintf("; attention over %d positions reads %s of KV cache, %s of it on the CPU; a CPU block costs %s",
			h.Positions, FormatSize(h.KVBytes), FormatSize(h.HostKVBytes), h.Rates.cpuLayerString())
}

// cpuLayerString writes a CPU block's fixed costs, alone and beside
// copies, and a device stage's, with their calibration's spreads when
// there are some.
func (r Rates) cpuLayerString() string {
	s := fmt.Sprintf("%.2f ms besides its bytes", float64(r.CPULayer)/1e6)
	if r.CPULayerSpread.N > 0 {
		s += fmt.Sprintf(" (min/median/max %s)", r.CPULayerSpread)
	}
	if r.CPULayerShared > 0 || r.CPULayerSharedSpread.N > 0 {
		s += fmt.Sprintf(", %.2f ms beside copies", float64(r.CPULayerShared)/1e6)
		if r.CPULayerSharedSpread.N > 0 {
			s += fmt.Sprintf(" (%s)", r.CPULayerSharedSpread)
		}
	}
	if r.DeviceStage > 0 || r.DeviceStageSpread.N > 0 {
		s += fmt.Sprintf("; a device stage %.2f ms besides its bytes", float64(r.DeviceStage)/1e6)
		if r.DeviceStageSpread.N > 0 {
			s += fmt.Sprintf(" (%s)", r.DeviceStageSpread)
		}
	}
	return s
}

// PlanHybrid plans decode over the device, the link and the CPU at once:
// the layers that do not stay on the device are either streamed to it
// through the ring or computed on the CPU from host memory, and the copies
// of the streamed ones overlap the CPU's work. It
//
//  1. picks the resident set for the budget as StrategyBalanced does
//     (Plan: per-tensor residency, the ring, the reserve), then
//  2. chooses the CPU's layers among those not wholly resident (and the
//     embedding, which costs the CPU one row a token): HybridAuto tries
//     every count, and, for each, prefetch depths up to the planner's
//     (WithMaxPrefetch), and keeps the least predicted time; and
//  3. plans the device again with the CPU's layers streamed whole
//     (WithStreamedWhole: their room goes to the other layers) and the
//     ring sized for the decode sequence too (WithSequence).
//
// The prediction counts each block's KV cache reads at
// WithAttendPositions' positions (the context length by default): on the
// CPU for its blocks and for the device's blocks whose cache is in host
// memory, and the rates' fixed cost of a block on the CPU
// (Rates.CPULayer).
//
// The CPU's layers are spread evenly among the others (a Bresenham
// spread), so that each streamed layer's copy runs while the CPU computes
// the layers before it. The decode time of each split is
// SimulateDecodeWith's, for a pager that fills its ring
// (Options.PrefetchFill: give it one).
//
// WithKVPlacement places the KV cache: host puts every block's in host
// memory (the device keeps the scratch), auto does when the budget cannot
// hold it on the device.
//
// It fails as Plan does for a budget too small (a *BudgetError), with an
// error wrapping ErrBadRates for rates that cannot describe a machine
// (H2D and CPU must be > 0), and with one wrapping ErrHostMemory when the
// CPU's layers of HybridAllCPU or HybridForced do not fit
// HybridOptions.HostBytes. It refuses WithStreamedWhole and WithSequence,
// which it chooses itself.
func PlanHybrid(model ModelInfo, budget int64, contextLen, batch int, rates Rates, ho HybridOptions, opts ...PlanOption) (*HybridPlan, error) {
	strategy := StrategyHybrid
	switch ho.Mode {
	case "":
		ho.Mode = HybridAuto
	case HybridAllCPU:
		strategy = StrategyCPU
	case HybridAuto, HybridForced:
	default:
		return nil, fmt.Errorf("paging: hybrid plan: unknown mode %q (want auto, cpu or forced)", ho.Mode)
	}
	if err := rates.check(true, true); err != nil {
		return nil, fmt.Errorf("paging: hybrid plan: %w", err)
	}
	n := len(model.Layers)
	if ho.Mode == HybridForced && (ho.CPULayers < 0 || ho.CPULayers > n) {
		return nil, fmt.Errorf("paging: hybrid plan: %d CPU layers asked, the model has %d layers", ho.CPULayers, n)
	}
	o := planOptions{chunk: min(DefaultChunkTokens, contextLen), maxPrefetch: 2, depth: -1}
	for _, f := range opts {
		f(&o)
	}
	if o.whole != nil || o.sequence != nil {
		return nil, fmt.Errorf("paging: hybrid plan: the layers streamed whole and the sequence are PlanHybrid's to choose")
	}
	// The KV cache (WithKVPlacement): host puts every block's in host
	// memory; auto does when the budget cannot hold it on the device.
	switch o.kv {
	case "", KVDevice:
	case KVHost:
		o.hostKV = model.NumLayers
	case KVAuto:
		if _, err := plan(model, budget, strategy, contextLen, batch, o); errors.Is(err, ErrBudgetTooSmall) {
			o.hostKV = model.NumLayers
		}
	default:
		return nil, fmt.Errorf("paging: hybrid plan: unknown KV cache placement %q (want auto, device or host)", o.kv)
	}
	base, err := plan(model, budget, strategy, contextLen, batch, o)
	if err != nil {
		return nil, err
	}
	h := &hybridSearch{model: model, budget: budget, strategy: strategy, contextLen: contextLen, batch: batch,
		rates: rates, o: o, read: make([]int64, n), host: make([]int64, n), hostLimit: ho.HostBytes}
	h.positions = contextLen
	if o.attend > 0 {
		h.positions = o.attend
	}
	h.kvBlock = kvReadBytes(model.Reserve, h.positions)
	switch {
	case ho.HostBytes == 0:
		h.hostLimit = math.MaxInt64
	case ho.HostBytes < 0:
		h.hostLimit = 0
	}
	for l, li := range model.Layers {
		h.read[l], h.host[l] = tokenReadBytes(l, li, model.NoEmbedding), hostCopyBytes(li)
	}
	// The candidates for the CPU: the embedding first, then the layers
	// not wholly resident; HybridForced takes the resident ones after.
	var rest, resident []int
	for l, lp := range base.Layers {
		switch {
		case l == 0 && !model.NoEmbedding && n > 1 && lp.Bytes > 0:
			h.first = []int{0}
		case lp.StreamedBytes > 0:
			rest = append(rest, l)
		default:
			resident = append(resident, l)
		}
	}
	if base.StreamedBytes == 0 {
		rest = nil // everything stays on the device: nothing to gain on the CPU
		if ho.Mode != HybridForced {
			h.first = nil
		}
	}
	var best *hybridCandidate
	switch ho.Mode {
	case HybridAuto:
		best, err = h.auto(rest)
	case HybridAllCPU:
		best, err = h.allCPU(base)
	case HybridForced:
		cpu := h.pick(ho.CPULayers, rest, resident, spreadMiddle)
		if need := h.hostBytes(cpu); need > h.hostLimit {
			return nil, h.hostError(cpu, need)
		}
		best, err = h.bestDepth(cpu)
		if err == nil && best == nil {
			err = fmt.Errorf("paging: hybrid plan: %w: %d layers on the CPU (%v) leave no plan for the device", ErrBudgetTooSmall, len(cpu), cpu)
		}
	}
	if err != nil {
		return nil, err
	}
	return h.result(ho.Mode, best), nil
}

// hybridSearch is what PlanHybrid's search needs.
type hybridSearch struct {
	model             ModelInfo
	budget            int64
	strategy          Strategy
	contextLen, batch int
	rates             Rates
	o                 planOptions
	read, host        []int64 // per layer: what a token reads, and its host copy
	hostLimit         int64
	first             []int // the embedding, when it is a candidate
	// positions are what a decoded token attends over, kvBlock the KV
	// bytes one block's attention reads then.
	positions int
	kvBlock   int64
}

// hybridCandidate is one split evaluated.
type hybridCandidate struct {
	cpu    []int
	gpu    *PlanResult
	places []LayerPlace
	t      time.Duration
	b      Breakdown
}

// better reports c a better split than o: faster in decode by more than a
// hundredth, or about as fast with more bytes resident on the device
// (which a prefill, streaming every layer that is not, runs faster with:
// a deeper ring of whole layers takes room from the resident set), or as
// fast and as resident with fewer CPU layers.
func (c *hybridCandidate) better(o *hybridCandidate) bool {
	if o == nil {
		return true
	}
	if d := float64(c.t - o.t); math.Abs(d) > 1e-2*float64(o.t) {
		return d < 0
	}
	if c.gpu.ResidentBytes != o.gpu.ResidentBytes {
		return c.gpu.ResidentBytes > o.gpu.ResidentBytes
	}
	if len(c.cpu) != len(o.cpu) {
		return len(c.cpu) < len(o.cpu)
	}
	return c.gpu.PrefetchDepth > o.gpu.PrefetchDepth
}

// auto tries every count of CPU layers within the host limit, each spread
// evenly and at every depth, then the counts near the best with the
// spread shifted to either end, and returns the fastest.
func (h *hybridSearch) auto(rest []int) (*hybridCandidate, error) {
	var best *hybridCandidate
	bestK := 0
	try := func(k int, at spreadAt) error {
		cpu := h.pick(k, rest, nil, at)
		if h.hostBytes(cpu) > h.hostLimit {
			return nil
		}
		c, err := h.bestDepth(cpu)
		if err != nil {
			return err
		}
		if c != nil && c.better(best) {
			best, bestK = c, k
		}
		return nil
	}
	K := len(h.first) + len(rest)
	for k := 0; k <= K; k++ {
		if err := try(k, spreadMiddle); err != nil {
			return nil, err
		}
	}
	for k := max(bestK-2, 1); k <= min(bestK+2, K); k++ {
		for _, at := range []spreadAt{spreadStart, spreadEnd} {
			if err := try(k, at); err != nil {
				return nil, err
			}
		}
	}
	if best == nil { // k = 0 is Plan's balanced plan at one of the depths: it plans
		return nil, fmt.Errorf("paging: hybrid plan: internal error: no split plans")
	}
	return best, nil
}

// allCPU puts the embedding and the first layers on the CPU, as few as
// let every other layer stay wholly on the device.
func (h *hybridSearch) allCPU(base *PlanResult) (*hybridCandidate, error) {
	n := len(h.model.Layers)
	if base.StreamedBytes == 0 {
		return h.bestDepth(nil)
	}
	for k := 1; k <= n; k++ {
		cpu := forwardLayers(k) // the embedding and the first blocks
		var best *hybridCandidate
		for d := 0; d <= min(h.o.maxPrefetch, n-1); d++ {
			c, err := h.eval(cpu, d)
			if err != nil {
				return nil, err
			}
			if c != nil && c.streamsNothing() && c.better(best) {
				best = c
			}
		}
		if best == nil {
			continue
		}
		if need := h.hostBytes(cpu); need > h.hostLimit {
			return nil, h.hostError(cpu, need)
		}
		return best, nil
	}
	return nil, fmt.Errorf("paging: hybrid plan cpu: internal error: no plan streams nothing in decode")
}

// streamsNothing reports a split whose decode copies nothing.
func (c *hybridCandidate) streamsNothing() bool {
	for _, lp := range c.places {
		if lp.Place == Streamed {
			return false
		}
	}
	return true
}

// pick returns k CPU layers: the embedding first, then an even spread over
// rest, then, when rest runs out, an even spread over more.
func (h *hybridSearch) pick(k int, rest, more []int, at spreadAt) []int {
	var cpu []int
	if k > 0 && h.first != nil {
		cpu, k = append(cpu, h.first...), k-1
	}
	a := min(k, len(rest))
	cpu = append(cpu, spread(rest, a, at)...)
	cpu = append(cpu, spread(more, min(k-a, len(more)), at)...)
	slices.Sort(cpu)
	return cpu
}

// spreadAt says which element of its stretch spread takes.
type spreadAt int

const (
	spreadMiddle spreadAt = iota
	spreadStart
	spreadEnd
)

// spread returns k of xs evenly spread (Bresenham): one of each of k equal
// stretches, at its middle, start or end.
func spread(xs []int, k int, at spreadAt) []int {
	out := make([]int, 0, k)
	M := len(xs)
	for j := range k {
		i := (2*j + 1) * M / (2 * k)
		switch at {
		case spreadStart:
			i = j * M / k
		case spreadEnd:
			i = ((j+1)*M - 1) / k
		}
		out = append(out, xs[i])
	}
	return out
}

// bestDepth evaluates cpu at every prefetch depth and returns the best, or
// nil when none plans.
func (h *hybridSearch) bestDepth(cpu []int) (*hybridCandidate, error) {
	var best *hybridCandidate
	for d := 0; d <= min(h.o.maxPrefetch, len(h.model.Layers)-1); d++ {
		c, err := h.eval(cpu, d)
		if err != nil {
			return nil, err
		}
		if c != nil && c.better(best) {
			best = c
		}
	}
	return best, nil
}

// eval plans the device with cpu streamed whole at prefetch depth d and
// simulates its decode; nil when no plan at that depth fits.
func (h *hybridSearch) eval(cpu []int, d int) (*hybridCandidate, error) {
	o := h.o
	o.depth = d
	model := h.model
	if len(cpu) > 0 {
		o.whole, o.sequence = cpu, complement(len(h.model.Layers), cpu)
		// The CPU's blocks keep their KV cache in host memory; the device
		// holds one block's keys and values for when a large chunk runs
		// them there (nn's twins), in place of one per block.
		if nb := h.blocksAmong(cpu); nb > 0 {
			model.NumLayers += 1 - nb
			if o.hostKV > 0 {
				// The device's blocks keep theirs in host memory too
				// (WithKVPlacement): the twins' block stays.
				o.hostKV = model.NumLayers - 1
			}
		}
	}
	gpu, err := plan(model, h.budget, h.strategy, h.contextLen, h.batch, o)
	if errors.Is(err, errNoPlanAtDepth) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	c := &hybridCandidate{cpu: cpu, gpu: gpu}
	for l, lp := range gpu.Layers {
		pl := LayerPlace{Layer: l, Place: Resident, ReadBytes: h.read[l]}
		if h.isBlock(l) {
			pl.Block, pl.KVBytes, pl.HostKV = true, h.kvBlock, h.o.hostKV > 0
		}
		switch {
		case slices.Contains(cpu, l):
			pl.Place = OnCPU
		case lp.StreamedBytes > 0:
			pl.Place, pl.CopyBytes = Streamed, lp.StreamedBytes
		}
		c.places = append(c.places, pl)
	}
	if c.t, c.b, err = SimulateDecodeWith(c.places, h.rates, SimPrefetch{Depth: gpu.PrefetchDepth, RingBytes: gpu.RingBytes}); err != nil {
		return nil, err
	}
	return c, nil
}

// isBlock reports whether layer l is a decoder block (blocksAmong).
func (h *hybridSearch) isBlock(l int) bool { return h.blocksAmong([]int{l}) == 1 }

// blocksAmong counts the decoder blocks among layers: not the embedding
// (layer 0, unless the share has none) nor the head (the last layer, when
// the share has one more layer than blocks besides the embedding).
func (h *hybridSearch) blocksAmong(layers []int) int {
	n, first := len(h.model.Layers), 0
	if !h.model.NoEmbedding {
		first = 1
	}
	last := n
	if n-first > h.model.NumLayers {
		last = n - 1
	}
	k := 0
	for _, l := range layers {
		if l >= first && l < last {
			k++
		}
	}
	return k
}

func (h *hybridSearch) hostBytes(cpu []int) int64 {
	var sum int64
	for _, l := range cpu {
		sum += h.host[l]
	}
	return sum
}

func (h *hybridSearch) hostError(cpu []int, need int64) error {
	return fmt.Errorf("paging: hybrid plan %s: %w: %d layers on the CPU hold %s (%d bytes) of host memory, the limit is %s (%d bytes)",
		h.strategy, ErrHostMemory, len(cpu), FormatSize(need), need, FormatSize(h.hostLimit), h.hostLimit)
}

func (h *hybridSearch) result(mode HybridMode, c *hybridCandidate) *HybridPlan {
	hp := &HybridPlan{Mode: mode, GPU: c.gpu, CPULayers: c.cpu, Places: c.places, Predicted: c.t, Breakdown: c.b,
		Rates: h.rates, ResidentBytes: c.gpu.ResidentBytes, HostLayerBytes: h.hostBytes(c.cpu)}
	if hp.CPULayers == nil {
		hp.CPULayers = []int{}
	}
	hp.Sequence = complement(len(h.model.Layers), c.cpu)
	hp.Positions = h.positions
	for _, lp := range c.places {
		switch lp.Place {
		case Streamed:
			hp.StreamedBytes += lp.CopyBytes
		case OnCPU:
			hp.CPUBytes += lp.ReadBytes
		}
		hp.KVBytes += lp.KVBytes
		if lp.Place == OnCPU || lp.HostKV {
			hp.HostKVBytes += lp.KVBytes
		}
	}
	if c.t > 0 {
		hp.PredictedTokS = 1e9 / float64(c.t)
	}
	hp.Bounds = h.rates.Bounds(hp.StreamedBytes + hp.CPUBytes)
	return hp
}

// forwardLayers returns 0..k-1.
func forwardLayers(k int) []int {
	out := make([]int, k)
	for i := range out {
		out[i] = i
	}
	return out
}

// complement returns the layers of 0..n-1 not in xs (sorted), in order.
func complement(n int, xs []int) []int {
	out := make([]int, 0, n-len(xs))
	for l := range n {
		if _, found := slices.BinarySearch(xs, l); !found {
			out = append(out, l)
		}
	}
	return out
}

// tokenReadBytes is what computing layer l for one token reads: one row of
// each matrix of the embedding (layer 0, unless noEmbedding), all the
// bytes of any other layer.
func tokenReadBytes(l int, li LayerInfo, noEmbedding bool) int64 {
	if l != 0 || noEmbedding || len(li.Tensors) == 0 {
		return li.Bytes
	}
	var n int64
	for _, t := range li.Tensors {
		if len(t.Shape) >= 2 && t.Shape[0] > 0 {
			n += t.Bytes / int64(t.Shape[0])
		} else {
			n += t.Bytes
		}
	}
	return n
}

// kvReadBytes is what one block's attention reads of its KV cache for a
// token at positions: the reserve's per-block, per-position KV buffers
// (keys and values) over that many.
func kvReadBytes(r Reserve, positions int) int64 {
	var n int64
	for _, b := range r {
		if b.Category == KVCache && b.Per == PerPosition && b.PerBlock {
			n += b.Bytes * int64(b.Count) * int64(positions)
		}
	}
	return n
}

// PredictAt predicts a decoded token's time again with its attention over
// positions instead of the plan's Positions (the KV cache reads scale
// with them), for a run whose context differs from the one planned for.
func (h *HybridPlan) PredictAt(positions int) (time.Duration, Breakdown, error) {
	if positions < 0 || h.Positions <= 0 || len(h.Places) == 0 {
		return 0, Breakdown{}, fmt.Errorf("paging: hybrid prediction at %d positions: the plan has %d positions, %d layers", positions, h.Positions, len(h.Places))
	}
	places := slices.Clone(h.Places)
	for i := range places {
		places[i].KVBytes = int64(math.Round(float64(places[i].KVBytes) * float64(positions) / float64(h.Positions)))
	}
	return SimulateDecodeWith(places, h.Rates, SimPrefetch{Depth: h.GPU.PrefetchDepth, RingBytes: h.GPU.RingBytes})
}

// hostCopyBytes is what the pager's host copy of the layer, streamed
// whole, takes: each tensor padded to hostAlign.
func hostCopyBytes(li LayerInfo) int64 {
	if len(li.Tensors) == 0 {
		return alignHost(li.Bytes)
	}
	var n int64
	for _, t := range li.Tensors {
		n += alignHost(t.Bytes)
	}
	return n
}
