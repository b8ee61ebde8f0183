package paging

import (
	"errors"
	"fmt"
	"math"
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
	}{{"H2D", r.H2D}, {"CPU", r.CPU}, {"H2DShared", r.H2DShared}, {"CPUShared", r.CPUShared}, {"Device", r.Device}} {
		if v.x < 0 || math.IsNaN(v.x) || math.IsInf(v.x, 0) {
			return fmt.Errorf("paging: %w: %s %v bytes/s", ErrBadRates, v.name, v.x)
		}
	}
	switch {
	case r.Handoff < 0:
		return fmt.Errorf("paging: %w: handoff %v", ErrBadRates, r.Handoff)
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
//     (taking no time when it is 0), an OnCPU layer on the CPU at
//     rates.CPUShared while a copy runs and rates.CPU otherwise;
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
		if lp.CopyBytes < 0 || lp.ReadBytes < 0 || lp.Place > OnCPU {
			return 0, Breakdown{}, fmt.Errorf("paging: simulate: layer %d: %+v", lp.Layer, lp)
		}
		copies = copies || lp.Place == Streamed
		cpu = cpu || lp.Place == OnCPU
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
	rem   float64 // seconds of handoff, or bytes to compute
	doneG int     // device layers computed, over all tokens
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
			s.phase, s.rem = phaseRun, float64(lp.ReadBytes)
			if lp.Place != OnCPU && s.rates.Device == 0 {
				s.rem = 0
			}
			changed = true
		}
	case phaseRun:
		if s.rem <= 0 {
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
		cpuBusy := s.phase == phaseRun && s.onCPU(s.x)
		// the time until each activity ends, and the rates behind them
		dt := math.Inf(1)
		var copyRate, runRate float64
		if s.copying {
			copyRate = s.rates.h2d(cpuBusy)
			dt = min(dt, s.copyRem/copyRate)
		}
		switch s.phase {
		case phaseHandoff:
			dt = min(dt, s.rem)
		case phaseRun:
			runRate = s.rates.Device
			if s.onCPU(s.x) {
				runRate = s.rates.cpu(s.copying)
			}
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
		switch s.phase {
		case phaseHandoff:
			s.busy[t][3] += dt
			s.rem = advance(s.rem, 1, dt)
		case phaseRun:
			if s.onCPU(s.x) {
				s.busy[t][1] += dt
			} else {
				s.busy[t][2] += dt
			}
			s.rem = advance(s.rem, runRate, dt)
		case phaseWait:
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
