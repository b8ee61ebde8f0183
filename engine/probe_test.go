package engine

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestHybridProbe: Open's probe times decode steps through the placement
// it planned, scales the CPU's rates by them, and plans again. Where the
// CPU measures far faster than planned (the hook divides its time) the
// placement is built again with more layers on the CPU, and far slower
// with fewer; either way the engine decodes bit-identically to the model
// run directly, and Close finds nothing left (the first placement's
// budget, pager and pinned memory included).
func TestHybridProbe(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps = 6
	want := reference(t, lm, prompt, steps)
	defer func() { probeHook = nil }()
	for _, tc := range []struct {
		name  string
		scale float64 // the measured CPU time's factor
	}{
		{"as measured", 1},
		{"CPU 8x as fast", 1.0 / 8},
		{"CPU 8x as slow", 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			probeHook = func(m decodeProbe) decodeProbe {
				m.cpu = max(time.Duration(float64(m.cpu)*tc.scale), 1)
				return m
			}
			gpu := newFakeGPU()
			defer gpu.Close()
			o := Options{Backends: []tensor.Backend{gpu}, Context: len(prompt) + steps, Chunk: 4, TwinMinTokens: 4, ProbeSteps: 3,
				Memory: Memory{Budgets: []int64{400 << 10}, Strategy: paging.StrategyHybrid}, Rates: &testRates}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			h := e.Hybrid()
			p := h.Probe
			if p == nil {
				t.Fatalf("no probe: %+v", h)
			}
			t.Logf("%s\n%s", p, h.Plan)
			if p.Steps != 3 || p.Positions != probeWarmSteps+1 || p.CPUMs <= 0 || tc.scale <= 1 && p.TokenMs < p.CPUMs {
				t.Errorf("probe %+v: want 3 steps at %d positions, the CPU's part of a token > 0 and within it", p, probeWarmSteps+1)
			}
			if p.Calibrated != testRates || h.Rates != testRates.ScaleCPU(p.CPUScale) {
				t.Errorf("rates %+v from %+v scaled by %v", h.Rates, p.Calibrated, p.CPUScale)
			}
			if !strings.Contains(e.Summary(), "probe: 3 decode steps") {
				t.Errorf("the summary does not show the probe:\n%s", e.Summary())
			}
			n, first := len(h.Plan.CPULayers), len(p.FirstCPULayers)
			switch {
			case tc.scale < 1 && (!p.Replanned || n <= first):
				t.Errorf("a CPU 8x as fast: replanned %v, %d CPU layers, first %d", p.Replanned, n, first)
			case tc.scale > 1 && (!p.Replanned || n >= first):
				t.Errorf("a CPU 8x as slow: replanned %v, %d CPU layers, first %d", p.Replanned, n, first)
			case p.Replanned && slices.Equal(h.Plan.CPULayers, p.FirstCPULayers):
				t.Errorf("replanned to the same CPU layers %v", p.FirstCPULayers)
			case p.Replanned && p.BestTokS <= p.FirstTokS:
				t.Errorf("replanned for %.1f tok/s, the first plan predicted %.1f", p.BestTokS, p.FirstTokS)
			case p.Replanned && p.ReusedPinnedBytes <= 0:
				// The second placement takes the first's host copies
				// over (pinnedPool); Close below finds none left.
				t.Errorf("replanned keeping no pinned host memory")
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			for i := range want {
				if !slices.Equal(got[i], want[i]) {
					t.Fatalf("step %d: logits differ from the direct run (CPU layers %v)", i, h.Plan.CPULayers)
				}
			}
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			if gpu.pinned.Load() != 0 {
				t.Errorf("%d bytes of pinned memory left after Close", gpu.pinned.Load())
			}
		})
	}
}

// TestProbeSteps: Open probes only a split the planner chose on one GPU
// with something off the device, by default only at rates it measured,
// and within the context.
func TestProbeSteps(t *testing.T) {
	off := &Hybrid{Plan: &paging.HybridPlan{StreamedBytes: 1 << 20}}
	for _, tc := range []struct {
		name     string
		o        Options
		strategy paging.Strategy
		h        *Hybrid
		context  int
		want     int
	}{
		{"measured rates", Options{}, paging.StrategyHybrid, off, 100, DefaultProbeSteps},
		{"given rates", Options{Rates: &testRates}, paging.StrategyHybrid, off, 100, 0},
		{"given rates, asked", Options{Rates: &testRates, ProbeSteps: 7}, paging.StrategyHybrid, off, 100, 7},
		{"turned off", Options{ProbeSteps: -1}, paging.StrategyHybrid, off, 100, 0},
		{"forced split", Options{Memory: Memory{CPULayers: 3}}, paging.StrategyHybrid, off, 100, 0},
		{"cpu strategy", Options{}, paging.StrategyCPU, off, 100, 0},
		{"several GPUs", Options{}, paging.StrategyHybrid, &Hybrid{GPUs: []HybridGPU{{}, {}}}, 100, 0},
		{"all resident", Options{}, paging.StrategyHybrid, &Hybrid{Plan: &paging.HybridPlan{}}, 100, 0},
		{"CPU layers only", Options{}, paging.StrategyHybrid, &Hybrid{Plan: &paging.HybridPlan{CPUBytes: 1}}, 100, DefaultProbeSteps},
		{"short context", Options{}, paging.StrategyHybrid, off, probeWarmSteps + 1, 1},
		{"no room", Options{}, paging.StrategyHybrid, off, probeWarmSteps, 0},
	} {
		e := &Engine{opts: tc.o, strategy: tc.strategy, hybrid: tc.h, context: tc.context}
		if got := e.probeSteps(); got != tc.want {
			t.Errorf("%s: %d steps, want %d", tc.name, got, tc.want)
		}
	}
}

// TestPinnedPool: the pool passes allocations through; while it holds, a
// freed buffer is handed out again for its size (and counted), and
// release gives back what was not.
func TestPinnedPool(t *testing.T) {
	gpu := newFakeGPU()
	defer gpu.Close()
	p := &pinnedPool{pa: gpu}
	a, _ := p.AllocPinned(100)
	b, _ := p.AllocPinned(200)
	if err := p.FreePinned(a); err != nil || gpu.pinned.Load() != 200 {
		t.Fatalf("a free not holding: %v, %d bytes pinned, want 200", err, gpu.pinned.Load())
	}
	p.hold()
	if err := p.FreePinned(b); err != nil || gpu.pinned.Load() != 200 {
		t.Fatalf("a free while holding: %v, %d bytes pinned, want 200 kept", err, gpu.pinned.Load())
	}
	c, _ := p.AllocPinned(100) // no 100-byte buffer kept: a new one
	d, _ := p.AllocPinned(200) // b again
	if &d[0] != &b[0] || gpu.pinned.Load() != 300 {
		t.Fatalf("the kept buffer was not reused: %d bytes pinned, want 300", gpu.pinned.Load())
	}
	if err := p.FreePinned(c); err != nil {
		t.Fatal(err)
	}
	reused, err := p.release()
	if err != nil || reused != 200 || gpu.pinned.Load() != 200 {
		t.Fatalf("release: %v, %d reused (want 200), %d bytes pinned (want d's 200)", err, reused, gpu.pinned.Load())
	}
	if err := p.FreePinned(d); err != nil || gpu.pinned.Load() != 0 {
		t.Fatalf("a free after release: %v, %d bytes pinned", err, gpu.pinned.Load())
	}
}
