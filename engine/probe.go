package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// The probe of a hybrid placement (Options.ProbeSteps). The calibration
// at Open times the CPU on a synthetic block beside synthetic copies, and
// decode on the H200's hosts ran its CPU part 14-18% faster than that
// predicted (session 6: 57.5 against 49.6 GB/s; session 7: 64 against
// 56.4), so the planner put a block too few on the CPU. Decode itself is
// the measure that cannot be wrong in that way: Open decodes a few tokens
// through the plan it made, scales the CPU's rates by what the CPU's part
// took against its prediction (and takes the link's rate beside it from
// the copies timed), plans again, and, when that plan predicts a token
// faster by replanGain, tears the placement down and builds the new one.
const (
	// DefaultProbeSteps is the decode steps the probe times, after
	// probeWarmSteps untimed (the first captures the decode graphs and
	// settles the ring).
	DefaultProbeSteps = 4
	probeWarmSteps    = 2
	// replanGain is the least gain, a fraction of the first plan's token
	// time at the probe's rates, for which Open builds the placement
	// again (which loads the model again).
	replanGain = 0.02
	// probeMaxScale bounds the CPU's correction either way: a probe
	// that measures the CPU 4x off its calibration measured something
	// else (a machine busy with other work for those steps).
	probeMaxScale = 4
)

// HybridProbe is what Open's probe measured of the hybrid placement it
// planned first, and what it did about it.
type HybridProbe struct {
	// Steps are the decode steps timed, at Positions on average.
	Steps     int `json:"steps"`
	Positions int `json:"positions"`
	// TokenMs and CPUMs are a timed step's wall time and the CPU
	// stages' part of it; Predicted* the first plan's prediction of them
	// at the calibrated rates.
	TokenMs          float64 `json:"token_ms"`
	CPUMs            float64 `json:"cpu_ms"`
	PredictedTokenMs float64 `json:"predicted_token_ms"`
	PredictedCPUMs   float64 `json:"predicted_cpu_ms"`
	// CopyGBps is the link's rate over the copies of the timed steps; 0
	// on a device that does not time its copies.
	CopyGBps float64 `json:"copy_GBps,omitempty"`
	// CPUScale is what the CPU's rates were multiplied by
	// (paging.Rates.ScaleCPU); Calibrated the rates before.
	CPUScale   float64      `json:"cpu_scale"`
	Calibrated paging.Rates `json:"calibrated_rates"`
	// FirstTokS is the first plan's prediction at the probe's rates, and
	// BestTokS that of the plan they give; Replanned says the engine was
	// built again with the second (FirstCPULayers were the first's CPU
	// layers), which took ReplanSeconds.
	FirstTokS      float64 `json:"first_tok_s"`
	BestTokS       float64 `json:"best_tok_s"`
	Replanned      bool    `json:"replanned"`
	FirstCPULayers []int   `json:"first_cpu_layers,omitempty"`
	ReplanSeconds  float64 `json:"replan_s,omitempty"`
	// ReusedPinnedBytes are the page-locked host bytes of the first
	// placement that the second took over (pinnedPool).
	ReusedPinnedBytes int64 `json:"reused_pinned_bytes,omitempty"`
}

// String summarises the probe on one line.
func (p *HybridProbe) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "probe: %d decode steps at %d positions: %.1f ms a token (predicted %.1f), the CPU %.1f ms of it (predicted %.1f): CPU rates x%.3f",
		p.Steps, p.Positions, p.TokenMs, p.PredictedTokenMs, p.CPUMs, p.PredictedCPUMs, p.CPUScale)
	if p.CopyGBps > 0 {
		fmt.Fprintf(&b, ", copies %.1f GB/s", p.CopyGBps)
	}
	fmt.Fprintf(&b, "; at those rates the first plan predicts %.2f tok/s, the best %.2f", p.FirstTokS, p.BestTokS)
	if p.Replanned {
		fmt.Fprintf(&b, ": planned again (CPU layers were %v; %.1f s, %s of pinned host memory kept)", p.FirstCPULayers, p.ReplanSeconds, paging.FormatSize(p.ReusedPinnedBytes))
	}
	return b.String()
}

// probeSteps is how many decode steps Open's probe times: none unless
// the planner chose the split (the hybrid strategy without a forced
// count of CPU layers, on one GPU) and something is off the device.
// Options.ProbeSteps < 0 turns it off, > 0 sets it; 0 probes with
// DefaultProbeSteps when the rates were measured at Open (given ones are
// the caller's to believe). The steps and their warm-up fit the context.
func (e *Engine) probeSteps() int {
	o, h := e.opts, e.hybrid
	if o.ProbeSteps < 0 || e.strategy != paging.StrategyHybrid || o.Memory.CPULayers != 0 || h == nil || h.Plan == nil {
		return 0
	}
	if hp := h.Plan; hp.StreamedBytes == 0 && hp.CPUBytes == 0 {
		return 0
	}
	steps := 0
	switch {
	case o.ProbeSteps > 0:
		steps = o.ProbeSteps
	case o.Rates == nil:
		steps = DefaultProbeSteps
	}
	return max(min(steps, e.context-probeWarmSteps), 0) // a context too short for the warm-up: none
}

// decodeProbe is what timing decode steps measured.
type decodeProbe struct {
	steps, pos int
	token, cpu time.Duration // a step's, and the CPU stages' part
	copyRate   float64       // bytes/s over the steps' copies; 0 when not timed
}

// timeDecode decodes probeWarmSteps and then steps tokens greedily in a
// session of its own, from token 0, and times the last steps.
func (e *Engine) timeDecode(ctx context.Context, steps int) (m decodeProbe, err error) {
	ps, err := e.pipeline.NewSessionWith(e.context, e.chunk, nn.SessionOptions{KVDType: e.kvDType()})
	if err != nil {
		return m, err
	}
	defer ps.Close()
	id := int32(0)
	for range probeWarmSteps {
		if id, err = ps.Greedy(ctx, []int32{id}); err != nil {
			return m, err
		}
	}
	gpu := e.backends[0]
	drain := func() error { return tensor.Sync(gpu) }
	if err := drain(); err != nil {
		return m, err
	}
	cpu := e.cpu.Name()
	b0, p0 := ps.Busy()[cpu], ps.Pos()
	bytes0, busy0, _, timed := tensor.CopyStats(gpu)
	t0 := time.Now()
	for range steps {
		if id, err = ps.Greedy(ctx, []int32{id}); err != nil {
			return m, err
		}
	}
	if err := drain(); err != nil {
		return m, err
	}
	wall := time.Since(t0)
	bytes1, busy1, _, _ := tensor.CopyStats(gpu)
	m = decodeProbe{steps: steps, pos: p0 + steps/2, token: wall / time.Duration(steps), cpu: (ps.Busy()[cpu] - b0) / time.Duration(steps)}
	if timed && busy1 > busy0 && bytes1 > bytes0 {
		m.copyRate = float64(bytes1-bytes0) / (busy1 - busy0).Seconds()
	}
	if probeHook != nil {
		m = probeHook(m)
	}
	return m, nil
}

// probeHook, when set (by tests), changes what timeDecode measured: a
// machine whose CPU is faster or slower than the calibration's.
var probeHook func(decodeProbe) decodeProbe

// probeRatesHook, when set (by tests), changes the rates the probe
// corrected before it plans with them: a machine whose link is slower
// than measured, for a plan that had nothing on the CPU to scale.
var probeRatesHook func(paging.Rates) paging.Rates

// probeRates are the plan's rates corrected by what decode measured: the
// CPU's scaled so that the plan's CPU part at m.pos takes what it took
// (within [1/probeMaxScale, probeMaxScale]), and the link's rate beside
// the CPU the one its copies ran at (never above its rate alone, which
// rises to it when lower).
func probeRates(hp *paging.HybridPlan, m decodeProbe) (paging.Rates, *HybridProbe, error) {
	d, br, err := hp.PredictAt(m.pos)
	if err != nil {
		return paging.Rates{}, nil, err
	}
	p := &HybridProbe{Steps: m.steps, Positions: m.pos, TokenMs: ms(m.token), CPUMs: ms(m.cpu), PredictedTokenMs: ms(d),
		PredictedCPUMs: ms(br.CPU), CopyGBps: m.copyRate / 1e9, CPUScale: 1, Calibrated: hp.Rates}
	r := hp.Rates
	if m.cpu > 0 && br.CPU > 0 {
		p.CPUScale = min(max(float64(br.CPU)/float64(m.cpu), 1.0/probeMaxScale), probeMaxScale)
		r = r.ScaleCPU(p.CPUScale)
	}
	if m.copyRate > 0 && hp.StreamedBytes > 0 {
		r.H2DShared = m.copyRate
		r.H2D = max(r.H2D, m.copyRate)
	}
	return r, p, nil
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// probeHybrid times decode through the hybrid placement Open built
// (timeDecode), corrects the rates by it (probeRates), plans again at
// them, and when the new plan's CPU layers differ and it predicts a token
// faster than the first plan does at the same rates by replanGain, closes
// the placement and builds the new one (the resident set and the host
// copies load again). The engine's Hybrid reports the probe, and its
// rates are the corrected ones either way.
func (e *Engine) probeHybrid(ctx context.Context, steps int, info paging.ModelInfo, limits []int64, kv paging.KVPlacement) error {
	hp := e.hybrid.Plan
	m, err := e.timeDecode(ctx, steps)
	if err != nil {
		return fmt.Errorf("engine: probing the hybrid placement: %w", err)
	}
	r, probe, err := probeRates(hp, m)
	if err != nil {
		return fmt.Errorf("engine: probing the hybrid placement: %w", err)
	}
	if probeRatesHook != nil {
		r = probeRatesHook(r)
	}
	first := *hp
	first.Rates = r
	dFirst, _, err := first.PredictAt(hp.Positions)
	if err != nil {
		return fmt.Errorf("engine: probing the hybrid placement: %w", err)
	}
	hostLimit, err := e.hybridHostLimit(kv)
	if err != nil {
		return err
	}
	best, err := e.planHybrid(info, limits[0], kv, r, e.backends[0], hostLimit, 0)
	if err != nil {
		return fmt.Errorf("engine: probing the hybrid placement: %w", err)
	}
	probe.FirstTokS, probe.BestTokS = tokS(dFirst), best.PredictedTokS
	if !slices.Equal(best.CPULayers, hp.CPULayers) && float64(best.Predicted) < float64(dFirst)*(1-replanGain) {
		t0 := time.Now()
		probe.Replanned, probe.FirstCPULayers = true, slices.Clone(hp.CPULayers)
		// The first placement's page-locked host copies serve the new one.
		if e.pinnedPool != nil {
			e.pinnedPool.hold()
		}
		err := e.closeHybrid()
		if err != nil {
			err = fmt.Errorf("engine: probing the hybrid placement: closing the first: %w", err)
		} else {
			err = e.buildHybrid(ctx, info, limits, kv, &r)
		}
		if e.pinnedPool != nil {
			reused, rerr := e.pinnedPool.release()
			probe.ReusedPinnedBytes, err = reused, errors.Join(err, rerr)
		}
		if err != nil {
			return err
		}
		probe.ReplanSeconds = time.Since(t0).Seconds()
	}
	e.hybrid.Rates, e.hybrid.Probe = r, probe
	return nil
}

func tokS(d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(time.Second) / float64(d)
}

// closeHybrid closes what openHybrid built, so that it can build again:
// the pagers and budgets (which report allocations left behind: the
// probe's session is closed by then), the stages and the pipeline. It
// waits for the device's queued work, copies from host memory the pool may
// keep (pinnedPool) included.
func (e *Engine) closeHybrid() error {
	var errs []error
	for _, s := range e.servers {
		errs = append(errs, s.Close())
	}
	errs = append(errs, tensor.Sync(e.backends[0]))
	for _, b := range e.budgets {
		errs = append(errs, b.Close())
	}
	e.servers, e.budgets, e.devices, e.stages, e.pipeline, e.kv, e.hybrid = nil, nil, nil, nil, nil, nil, nil
	e.pipeOpts = nn.PipelineOptions{}
	if ca, ok := tensor.Caching(e.backends[0]); ok {
		ca.Trim()
	}
	return errors.Join(errs...)
}

// pinnedPool is the hybrid pagers' page-locked host memory
// (paging.Options.Pinned): the backend's, except that while it holds
// (hold, through a rebuild of the placement) a freed buffer is kept for
// the next allocation of its size instead of given back. A pager's host
// copy of a layer has the same size whichever plan it serves, so the new
// placement's copies reuse the old one's pages: pinning runs at about
// 2 GB/s on the H200's host (BenchmarkAllocPinned), 5 s for the 7B's
// 10 GB of host copies.
type pinnedPool struct {
	pa tensor.PinnedAllocator

	mu     sync.Mutex
	keep   bool
	kept   map[int][][]byte
	reused int64 // bytes handed out again since hold
}

func (p *pinnedPool) AllocPinned(n int64) ([]byte, error) {
	p.mu.Lock()
	if bs := p.kept[int(n)]; len(bs) > 0 {
		b := bs[len(bs)-1]
		p.kept[int(n)] = bs[:len(bs)-1]
		p.reused += n
		p.mu.Unlock()
		return b, nil
	}
	p.mu.Unlock()
	return p.pa.AllocPinned(n)
}

func (p *pinnedPool) FreePinned(b []byte) error {
	p.mu.Lock()
	if p.keep {
		if p.kept == nil {
			p.kept = map[int][][]byte{}
		}
		p.kept[len(b)] = append(p.kept[len(b)], b)
		p.mu.Unlock()
		return nil
	}
	p.mu.Unlock()
	return p.pa.FreePinned(b)
}

// hold keeps the buffers freed from now on, until release.
func (p *pinnedPool) hold() {
	p.mu.Lock()
	p.keep, p.reused = true, 0
	p.mu.Unlock()
}

// release gives back what was kept and not reused, and stops keeping; it
// returns the bytes reused since hold.
func (p *pinnedPool) release() (int64, error) {
	p.mu.Lock()
	kept, reused := p.kept, p.reused
	p.keep, p.kept = false, nil
	p.mu.Unlock()
	var errs []error
	for _, bs := range kept {
		for _, b := range bs {
			errs = append(errs, p.pa.FreePinned(b))
		}
	}
	return reused, errors.Join(errs...)
}
