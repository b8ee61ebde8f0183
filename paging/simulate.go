package paging

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
)

// Place is where a layer runs in decode.
type Place uint8

// The places of a layer.
const (
	// Resident: computed on the device from its memory, nothing copied.
	Resident Place = iota
	// Streamed: computed on the device once its streamed part (the whole
	// layer, or the tensors a per-tensor plan streams) has crossed the
	// link into the ring.
	Streamed
	// OnCPU: computed on the CPU from host memory (Pager.HostLayer).
	OnCPU
)

var placeNames = [...]string{Resident: "resident", Streamed: "streamed", OnCPU: "cpu"}

func (p Place) String() string {
	if int(p) < len(placeNames) {
		return placeNames[p]
	}
	return fmt.Sprintf("Place(%d)", p)
}

// MarshalText writes the place's name.
func (p Place) MarshalText() ([]byte, error) {
	if int(p) >= len(placeNames) {
		return nil, fmt.Errorf("paging: unknown place %d", p)
	}
	return []byte(placeNames[p]), nil
}

// UnmarshalText reads a place's name.
func (p *Place) UnmarshalText(b []byte) error {
	for i, n := range placeNames {
		if string(b) == n {
			*p = Place(i)
			return nil
		}
	}
	return fmt.Errorf("paging: unknown place %q (want resident, streamed or cpu)", b)
}

// LayerPlace is one layer's place in decode and what a token costs it.
type LayerPlace struct {
	Layer int   `json:"layer"`
	Place Place `json:"place"`
	// CopyBytes cross the link for each token (Streamed only).
	CopyBytes int64 `json:"copy_bytes,omitempty"`
	// ReadBytes are what computing the layer for one token reads: its
	// weights, or one row of an embedding.
	ReadBytes int64 `json:"read_bytes"`
	// Block marks a decoder block: on the CPU it costs Rates.CPULayer
	// besides its bytes.
	Block bool `json:"block,omitempty"`
	// KVBytes are the KV cache bytes the layer's attention reads for one
	// token. An OnCPU layer reads them on the CPU (at Rates.CPUAttention);
	// so does a device layer whose KV cache is in host memory (HostKV),
	// between two more hand-overs (the query to the CPU, the attention's
	// output back); another device layer reads them at the device's rate.
	KVBytes int64 `json:"kv_bytes,omitempty"`
	HostKV  bool  `json:"host_kv,omitempty"`
}

// Rates are the measured speeds the decode time model takes, in bytes per
// second.
type Rates struct {
	// H2D is pinned host-to-device copying alone; CPU the CPU's
	// matrix-vector product reading weights from host memory, with the
	// threads in use, alone.
	H2D float64 `json:"h2d_bytes_per_s"`
	CPU float64 `json:"cpu_bytes_per_s"`
	// H2DShared and CPUShared are the same while the other runs; 0 takes
	// the rate alone.
	H2DShared float64 `json:"h2d_shared_bytes_per_s,omitempty"`
	CPUShared float64 `json:"cpu_shared_bytes_per_s,omitempty"`
	// Device is the device reading its own memory; 0 leaves the device's
	// compute time out.
	Device float64 `json:"device_bytes_per_s,omitempty"`
	// Handoff is one hand-over of the hidden state between the CPU and the
	// device.
	Handoff time.Duration `json:"handoff_ns"`
	// CPULayer is what a decoder block computed on the CPU takes for one
	// token beyond its weights' bytes at the CPU rate: its norms, rope and
	// attention over a few positions, the worker pool's fork and join
	// around each op (engine.CalibrateCPU measures it on a block of the
	// model's shape); 0 counts nothing.
	CPULayer time.Duration `json:"cpu_layer_ns,omitempty"`
	// CPURows is the rate at which the CPU's product of a chunk of many
	// rows (32) gets through its weights' bytes for each row: a product
	// of t rows, which reads the weights once, takes t·bytes/CPURows
	// when its arithmetic is longer than the read; 0 counts a read of
	// the weights for each row (SplitMisses).
	CPURows float64 `json:"cpu_rows_bytes_per_s,omitempty"`
	// CPUExperts is the CPU's rate over two products at once, each over
	// its own weights and spread over the CPU's threads with the other's
	// (their bytes together over the time): a sparse block computes its
	// experts on the CPU several at once (nn, up to four), and one
	// product alone leaves much of the host's memory rate unused (37.9 of
	// 97.7 GB/s over one expert on the H200's host). SplitMisses counts
	// two experts or more on the CPU at this rate, slowed as CPUShared
	// slows CPU; 0 takes CPU.
	CPUExperts float64 `json:"cpu_experts_bytes_per_s,omitempty"`
	// CPULayerShared is CPULayer while a copy runs (the block timed with
	// the copy engine streaming, its bytes at CPUShared); 0 takes
	// CPULayer.
	CPULayerShared time.Duration `json:"cpu_layer_shared_ns,omitempty"`
	// CPULayerSpread and CPULayerSharedSpread are how the calibration's
	// repetitions of CPULayer and CPULayerShared spread (zero when not
	// calibrated): a wide one says the machine was noisy as it measured.
	CPULayerSpread       Spread `json:"cpu_layer_spread,omitzero"`
	CPULayerSharedSpread Spread `json:"cpu_layer_shared_spread,omitzero"`
	// CPUAttention is the rate at which the CPU's attention reads a KV
	// cache in host memory; 0 reads it at the CPU's rate. While a copy
	// runs it slows as the CPU's rate does (CPUShared / CPU).
	CPUAttention float64 `json:"cpu_attention_bytes_per_s,omitempty"`
	// DeviceStage is what the device takes beyond its layers' bytes each
	// time the computation comes to it from the CPU: a stage's launches,
	// the pager's turns, the wait for its queue at the hand-over back
	// (engine's calibration times a block of the model's shape on the
	// device between two hand-overs); 0 counts nothing. DeviceStageSpread
	// is its calibration's spread.
	DeviceStage       time.Duration `json:"device_stage_ns,omitempty"`
	DeviceStageSpread Spread        `json:"device_stage_spread,omitzero"`
}

// Spread is how N repetitions of a measured time spread.
type Spread struct {
	Min    time.Duration `json:"min_ns"`
	Median time.Duration `json:"median_ns"`
	Max    time.Duration `json:"max_ns"`
	N      int           `json:"n"`
}

// SpreadOf returns the spread of ts (zero for none); the median of an
// even count is the mean of the middle two.
func SpreadOf(ts []time.Duration) Spread {
	if len(ts) == 0 {
		return Spread{}
	}
	s := slices.Clone(ts)
	slices.Sort(s)
	n := len(s)
	return Spread{Min: s[0], Median: (s[(n-1)/2] + s[n/2]) / 2, Max: s[n-1], N: n}
}

// String writes the spread in milliseconds: "min/median/max ms over N".
func (s Spread) String() string {
	return fmt.Sprintf("%.2f/%.2f/%.2f ms over %d", float64(s.Min)/1e6, float64(s.Median)/1e6, float64(s.Max)/1e6, s.N)
}

// ErrBadRates is wrapped by SimulateDecode and PlanHybrid when the rates
// cannot describe a machine.
var ErrBadRates = errors.New("bad rates")

// check refuses rates that are negative or not numbers, and a path that
// has work but no rate.
func (r Rates) check(copies, cpu bool) error {
	for _, v := range []struct {
		name string
		x    float64
	}{{"H2D", r.H2D}, {"CPU", r.CPU}, {"H2DShared", r.H2DShared}, {"CPUShared", r.CPUShared}, {"Device", r.Device}, {"CPURows", r.CPURows}, {"CPUExperts", r.CPUExperts}, {"CPUAttention", r.CPUAttention}} {
		if v.x < 0 || math.IsNaN(v.x) || math.IsInf(v.x, 0) {
			return fmt.Errorf("paging: %w: %s %v bytes/s", ErrBadRates, v.name, v.x)
		}
	}
	switch {
	case r.Handoff < 0:
		return fmt.Errorf("paging: %w: handoff %v", ErrBadRates, r.Handoff)
	case r.DeviceStage < 0:
		return fmt.Errorf("paging: %w: device stage %v", ErrBadRates, r.DeviceStage)
	case r.CPULayer < 0 || r.CPULayerShared < 0:
		return fmt.Errorf("paging: %w: CPU layer overhead %v (%v while copying)", ErrBadRates, r.CPULayer, r.CPULayerShared)
	case copies && r.H2D == 0:
		return fmt.Errorf("paging: %w: layers stream, but the H2D rate is 0", ErrBadRates)
	case cpu && r.CPU == 0:
		return fmt.Errorf("paging: %w: layers run on the CPU, but the CPU rate is 0", ErrBadRates)
	}
	return nil
}

// h2d is the copy rate while the CPU computes or not.
func (r Rates) h2d(cpuBusy bool) float64 {
	if cpuBusy && r.H2DShared > 0 {
		return r.H2DShared
	}
	return r.H2D
}

// cpu is the CPU's rate while a copy runs or not.
func (r Rates) cpu(copyBusy bool) float64 {
	if copyBusy && r.CPUShared > 0 {
		return r.CPUShared
	}
	return r.CPU
}

// cpuLayer is the rate a block's fixed cost on the CPU runs at, in
// blocks a second: 1/CPULayer alone, 1/CPULayerShared while a copy runs
// (CPULayer when that is 0). A cost of 0 is taken as a nanosecond.
func (r Rates) cpuLayer(copyBusy bool) float64 {
	d := r.CPULayer
	if copyBusy && r.CPULayerShared > 0 {
		d = r.CPULayerShared
	}
	return 1 / max(d, time.Nanosecond).Seconds()
}

// ScaleCPU returns r with the CPU k times as fast at decode's work: its
// rates alone and beside copies, its attention's, times k; a block's
// fixed costs over k. A plan's CPU time (Breakdown.CPU) then takes 1/k of
// what it took (to within the shifts of what overlaps the copies), which
// is how a decode that measured the CPU's part corrects the rates it was
// planned with (engine's probe). The rates of many rows and of experts,
// which decode's dense blocks do not use, stay. k must be > 0.
func (r Rates) ScaleCPU(k float64) Rates {
	r.CPU *= k
	r.CPUShared *= k
	r.CPUAttention *= k
	r.CPULayer = time.Duration(float64(r.CPULayer) / k)
	r.CPULayerShared = time.Duration(float64(r.CPULayerShared) / k)
	return r
}

// cpuLayerCosts reports a block on the CPU costing more than its bytes.
func (r Rates) cpuLayerCosts() bool { return r.CPULayer > 0 || r.CPULayerShared > 0 }

// cpuAttention is the rate the CPU's attention reads host KV at, while a
// copy runs or not.
func (r Rates) cpuAttention(copyBusy bool) float64 {
	if r.CPUAttention <= 0 {
		return r.cpu(copyBusy)
	}
	if copyBusy && r.CPUShared > 0 && r.CPU > 0 {
		return r.CPUAttention * r.CPUShared / r.CPU
	}
	return r.CPUAttention
}

// Bounds are decode rates in tokens per second that the bandwidths allow
// for a number of bytes read per token from outside device memory: all of
// them copied over the link (Stream), all of them read by the CPU (CPU),
// or split so that both paths run at once at their shared rates (Hybrid).
// The device's own compute and the handoffs are left out.
type Bounds struct {
	Stream float64 `json:"stream_tok_s"`
	CPU    float64 `json:"cpu_tok_s"`
	Hybrid float64 `json:"hybrid_tok_s"`
}

// Bounds returns the bounds for nonResident bytes per token; for 0 bytes,
// which the bandwidths do not bound, they are 0.
func (r Rates) Bounds(nonResident int64) Bounds {
	per := func(rate float64) float64 {
		if nonResident <= 0 {
			return 0
		}
		return rate / float64(nonResident)
	}
	return Bounds{Stream: per(r.H2D), CPU: per(r.CPU), Hybrid: per(r.h2d(true) + r.cpu(true))}
}

// Breakdown is what one decoded token keeps each path busy.
type Breakdown struct {
	Copy time.Duration `json:"copy_ns"` // the copy engine, copying streamed layers
	CPU  time.Duration `json:"cpu_ns"`  // the CPU, computing its layers
	GPU  time.Duration `json:"gpu_ns"`  // the device, computing resident and streamed layers
	// Handoff is the time of the Handoffs hand-overs between the CPU and
	// the device.
	Handoff  time.Duration `json:"handoff_ns"`
	Handoffs int           `json:"handoffs"`
	// CopyWait is the time the computation waited for copies to land.
	CopyWait time.Duration `json:"copy_wait_ns"`
}

// The simulator runs simTokens tokens and reports the mean of the last
// simMeasured, by when the pipeline has settled into its cycle.
const (
	simTokens   = 12
	simMeasured = 6
)

// SimulateDecode predicts the time of one decoded token in steady state
// when the layers run in the order and places of seq, with prefetch depth
// depth, at the given rates. It is a small discrete-event simulation of
// the pager and the two processors, run over several tokens:
//
//   - the layers compute one after the other, in seq's order, token after
//     token: a Resident or Streamed layer on the device at rates.Device
//     (taking no time when it is 0), after rates.DeviceStage when the
//     layer before it ran on the CPU; an OnCPU layer on the CPU at
//     rates.CPUShared while a copy runs and rates.CPU otherwise, then its
//     KV reads at the CPU's attention rate, then rates.CPULayer when it
//     is a decoder block (rates.CPULayerShared while a copy runs); a
//     device layer whose KV cache is in host memory hands over to the CPU
//     and back (two rates.Handoff) around its KV reads on the CPU;
//   - a Streamed layer computes once its copy has landed;
//   - the copy engine copies the Streamed layers in order, at
//     rates.H2DShared while the CPU computes and rates.H2D otherwise, one
//     at a time. The device's layers (Resident and Streamed) are the
//     pager's sequence and its ring holds depth+1 of them: the copy of
//     the layer at a place of that sequence starts once the layer depth+1
//     places before it has computed (Pager prefetches that far ahead once
//     a layer is released); with depth 0, which does not prefetch, once
//     the computation reaches the layer (SimulateDecodeWith models a
//     pager that fills its ring);
//   - each change between the CPU and the device, from one layer to the
//     next (the last layer of a token to the first of the next included),
//     takes rates.Handoff.
//
// It fails on an empty seq, a negative depth or byte count, and rates
// that are negative or leave a path with work and no speed.
func SimulateDecode(seq []LayerPlace, rates Rates, depth int) (time.Duration, Breakdown, error) {
	return SimulateDecodeWith(seq, rates, SimPrefetch{Depth: depth})
}

// SimPrefetch is how far ahead of the computation the simulated pager
// copies.
type SimPrefetch struct {
	// Depth is the pager's prefetch depth; 0 does not prefetch.
	Depth int
	// RingBytes, when > 0 with Depth > 0, is the ring of a pager that
	// fills it (Options.PrefetchFill): the copy of a device layer also
	// starts once the streamed parts from the first device layer not yet
	// computed up to it take at most RingBytes, and it is within one
	// pass of the device's layers (a pager's walk ahead stops before
	// the layer it left).
	RingBytes int64
}

// SimulateDecodeWith is SimulateDecode with the pager's prefetch as pf
// says: a depth, and the ring of a pager that fills it.
func SimulateDecodeWith(seq []LayerPlace, rates Rates, pf SimPrefetch) (time.Duration, Breakdown, error) {
	depth := pf.Depth
	if len(seq) == 0 {
		return 0, Breakdown{}, fmt.Errorf("paging: simulate: no layers")
	}
	if depth < 0 || pf.RingBytes < 0 {
		return 0, Breakdown{}, fmt.Errorf("paging: simulate: prefetch depth %d, ring %d bytes", depth, pf.RingBytes)
	}
	var copies, cpu bool
	for _, lp := range seq {
		if lp.CopyBytes < 0 || lp.ReadBytes < 0 || lp.KVBytes < 0 || lp.Place > OnCPU {
			return 0, Breakdown{}, fmt.Errorf("paging: simulate: layer %d: %+v", lp.Layer, lp)
		}
		copies = copies || lp.Place == Streamed
		cpu = cpu || lp.Place == OnCPU || lp.HostKV && lp.KVBytes > 0
	}
	if err := rates.check(copies, cpu); err != nil {
		return 0, Breakdown{}, err
	}
	s := newSim(seq, rates, depth)
	if depth > 0 {
		s.ring = pf.RingBytes
	}
	if err := s.run(); err != nil {
		return 0, Breakdown{}, err
	}
	return s.result()
}

// sim is the state of one simulation. Times are in seconds.
type sim struct {
	seq   []LayerPlace
	rates Rates
	depth int
	ring  int64   // the ring a filling pager fills, or 0
	gcopy []int64 // the copy bytes of each of the device's layers
	gpos  []int   // each layer's place among the device's layers, or -1
	cidx  []int   // each layer's index among the token's copies, or -1
	m     int     // the device's layers per token
	copyG []int   // the device place of each copy of a token
	copyL []int   // the index in seq of each copy of a token

	now float64
	// the computation: layer x (over all tokens) in a phase
	x     int
	phase simPhase
	rem   float64  // seconds of handoff, or what is left of the segment
	segs  []simSeg // the layer's segments, in phaseRun
	seg   int      // the segment running
	doneG int      // device layers computed, over all tokens
	// the copy engine
	nextCopy, copiesDone int
	copying              bool
	copyRem              float64

	// by token: when its last layer computed, its handoffs, and the
	// seconds of copy, CPU, device, handoff and waiting for copies
	tokenEnd []float64
	handoffs []int
	busy     [][5]float64
}

type simPhase int

// simSeg is one part of a layer's computation: bytes the CPU reads (its
// weights, or its KV cache at the attention's rate), bytes the device
// reads, a block's fixed cost on the CPU (one, at Rates.cpuLayer), or
// seconds of a device stage's fixed cost or of hand-overs.
type simSeg struct {
	kind simSegKind
	n    float64
}

type simSegKind int

const (
	segCPU simSegKind = iota
	segCPUKV
	segCPUTime
	segDevice
	segDeviceTime
	segHandoff
)

// onCPU reports a segment that keeps the CPU busy.
func (k simSegKind) onCPU() bool { return k == segCPU || k == segCPUKV || k == segCPUTime }

// segments are the parts of computation of layer x (over all tokens),
// those that take time.
func (s *sim) segments(x int) []simSeg {
	lp := s.layer(x)
	segs := s.segs[:0]
	add := func(k simSegKind, n float64) {
		if n > 0 {
			segs = append(segs, simSeg{k, n})
		}
	}
	if lp.Place == OnCPU {
		add(segCPU, float64(lp.ReadBytes))
		add(segCPUKV, float64(lp.KVBytes))
		if lp.Block && s.rates.cpuLayerCosts() {
			add(segCPUTime, 1) // one block's fixed cost
		}
		return segs
	}
	// The first of a run of device layers after the CPU's (the token's
	// last layer before the first).
	if prev := s.layer(x + len(s.seq) - 1); prev.Place == OnCPU {
		add(segDeviceTime, s.rates.DeviceStage.Seconds())
	}
	if s.rates.Device > 0 {
		dev := lp.ReadBytes
		if !lp.HostKV {
			dev += lp.KVBytes
		}
		add(segDevice, float64(dev))
	}
	if lp.HostKV && lp.KVBytes > 0 {
		add(segHandoff, 2*s.rates.Handoff.Seconds())
		add(segCPUKV, float64(lp.KVBytes))
	}
	return segs
}

// segRate is the rate the segment runs at: bytes a second, or 1 for
// seconds.
func (s *sim) segRate(k simSegKind) float64 {
	switch k {
	case segCPU:
		return s.rates.cpu(s.copying)
	case segCPUKV:
		return s.rates.cpuAttention(s.copying)
	case segDevice:
		return s.rates.Device
	case segCPUTime:
		return s.rates.cpuLayer(s.copying)
	}
	return 1
}

const (
	phaseStart simPhase = iota
	phaseHandoff
	phaseWait
	phaseRun
)

func newSim(seq []LayerPlace, rates Rates, depth int) *sim {
	s := &sim{seq: seq, rates: rates, depth: depth, tokenEnd: make([]float64, simTokens),
		handoffs: make([]int, simTokens), busy: make([][5]float64, simTokens)}
	for _, lp := range seq {
		g, c := -1, -1
		if lp.Place != OnCPU {
			g = s.m
			s.m++
			s.gcopy = append(s.gcopy, lp.CopyBytes)
		}
		if lp.Place == Streamed {
			c = len(s.copyG)
			s.copyG, s.copyL = append(s.copyG, g), append(s.copyL, len(s.gpos))
		}
		s.gpos, s.cidx = append(s.gpos, g), append(s.cidx, c)
	}
	return s
}

func (s *sim) layer(x int) LayerPlace { return s.seq[x%len(s.seq)] }

// fits reports whether a filling pager has started the copy of the
// device's layer at place G (over all tokens): the parts from the first
// layer not yet computed up to G fit in the ring, and G is within the
// walk ahead of the layer computed last.
func (s *sim) fits(G int) bool {
	if G-s.doneG > max(s.m-2, s.depth) {
		return false
	}
	var sum int64
	for g := s.doneG; g <= G; g++ {
		sum += s.gcopy[g%s.m]
	}
	return sum <= s.ring
}

// onCPU reports the layer running on the CPU.
func (s *sim) onCPU(x int) bool { return s.layer(x).Place == OnCPU }

// step makes the changes that take no time; it reports whether it made one.
func (s *sim) step() bool {
	L, nc := len(s.seq), len(s.copyG)
	changed := false
	// Copies go on past the last token, as they would for the next: the
	// last token is not spared the sharing of the link with the CPU.
	if !s.copying && nc > 0 {
		t, j := s.nextCopy/nc, s.nextCopy%nc
		G := t*s.m + s.copyG[j]
		ready := s.doneG >= G-s.depth // the place depth+1 before it has computed
		if s.depth == 0 {             // no prefetch: the computation has reached it
			ready = s.x >= t*len(s.seq)+s.copyL[j]
		}
		if !ready && s.ring > 0 {
			ready = s.fits(G)
		}
		if ready {
			s.copying, s.copyRem = true, float64(s.seq[s.copyL[j]].CopyBytes)
			s.nextCopy++
			changed = true
		}
	}
	if s.copying && s.copyRem <= 0 {
		s.copying = false
		s.copiesDone++
		changed = true
	}
	t, lp := s.x/L, s.layer(s.x)
	switch s.phase {
	case phaseStart:
		s.phase = phaseWait
		if s.x > 0 && s.onCPU(s.x) != s.onCPU(s.x-1) {
			s.phase, s.rem = phaseHandoff, s.rates.Handoff.Seconds()
			s.handoffs[t]++
		}
		changed = true
	case phaseHandoff:
		if s.rem <= 0 {
			s.phase = phaseWait
			changed = true
		}
	case phaseWait:
		if lp.Place != Streamed || s.copiesDone > t*nc+s.cidx[s.x%L] {
			s.phase, s.segs, s.seg = phaseRun, s.segments(s.x), 0
			if len(s.segs) > 0 {
				s.rem = s.segs[0].n
				if lp.Place != OnCPU && lp.HostKV && lp.KVBytes > 0 {
					s.handoffs[t] += 2
				}
			}
			changed = true
		}
	case phaseRun:
		for s.seg < len(s.segs) && s.rem <= 0 {
			s.seg++
			if s.seg < len(s.segs) {
				s.rem = s.segs[s.seg].n
			}
			changed = true
		}
		if s.seg >= len(s.segs) {
			if lp.Place != OnCPU {
				s.doneG++
			}
			if s.x%L == L-1 {
				s.tokenEnd[t] = s.now
			}
			s.x++
			s.phase = phaseStart
			changed = true
		}
	}
	return changed
}

func (s *sim) run() error {
	L := len(s.seq)
	for s.x < simTokens*L {
		for s.step() {
			if s.x >= simTokens*L {
				return nil
			}
		}
		var seg simSeg
		running := s.phase == phaseRun && s.seg < len(s.segs)
		if running {
			seg = s.segs[s.seg]
		}
		cpuBusy := running && seg.kind.onCPU()
		// the time until each activity ends, and the rates behind them
		dt := math.Inf(1)
		var copyRate, runRate float64
		if s.copying {
			copyRate = s.rates.h2d(cpuBusy)
			dt = min(dt, s.copyRem/copyRate)
		}
		switch {
		case s.phase == phaseHandoff:
			dt = min(dt, s.rem)
		case running:
			runRate = s.segRate(seg.kind)
			dt = min(dt, s.rem/runRate)
		}
		if math.IsInf(dt, 1) { // nothing runs and nothing can start: a bug
			return fmt.Errorf("paging: simulate: internal error: stalled at layer %d of token %d", s.x%L, s.x/L)
		}
		t := s.x / L
		if s.copying {
			if ct := (s.nextCopy - 1) / len(s.copyG); ct < simTokens {
				s.busy[ct][0] += dt
			}
			s.copyRem = advance(s.copyRem, copyRate, dt)
		}
		switch {
		case s.phase == phaseHandoff:
			s.busy[t][3] += dt
			s.rem = advance(s.rem, 1, dt)
		case running:
			switch {
			case seg.kind == segHandoff:
				s.busy[t][3] += dt
			case seg.kind.onCPU():
				s.busy[t][1] += dt
			default:
				s.busy[t][2] += dt
			}
			s.rem = advance(s.rem, runRate, dt)
		case s.phase == phaseWait:
			s.busy[t][4] += dt
		}
		s.now += dt
	}
	return nil
}

// advance returns what is left of rem at rate after dt, exactly 0 when
// it was about to end (the step that took dt from it).
func advance(rem, rate, dt float64) float64 {
	left := rem - rate*dt
	if left <= rem*1e-12 {
		return 0
	}
	return left
}

// result is the mean token of the last simMeasured.
func (s *sim) result() (time.Duration, Breakdown, error) {
	first := simTokens - simMeasured
	mean := func(x float64) time.Duration { return time.Duration(math.Round(x / simMeasured * 1e9)) }
	var sum [5]float64
	handoffs := 0
	for t := first; t < simTokens; t++ {
		for k := range sum {
			sum[k] += s.busy[t][k]
		}
		handoffs += s.handoffs[t]
	}
	b := Breakdown{Copy: mean(sum[0]), CPU: mean(sum[1]), GPU: mean(sum[2]), Handoff: mean(sum[3]),
		Handoffs: handoffs / simMeasured, CopyWait: mean(sum[4])}
	return mean(s.tokenEnd[simTokens-1] - s.tokenEnd[first-1]), b, nil
}
