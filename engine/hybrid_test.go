package engine

import (
	"context"
	"fmt"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// fakeGPU is a CPU backend that passes for a GPU in the hybrid strategy's
// eyes: it pins host memory (ordinary memory here) and uploads
// "asynchronously" (at once), so the whole CPU+GPU assembly runs, bit for
// bit, on any machine.
type fakeGPU struct {
	*tensor.CPU
	pinned int64
}

func newFakeGPU() *fakeGPU { return &fakeGPU{CPU: tensor.NewCPU(1)} }

func (f *fakeGPU) Name() string { return "fakegpu" }

func (f *fakeGPU) AllocPinned(n int64) ([]byte, error) {
	f.pinned += n
	return make([]byte, n), nil
}

func (f *fakeGPU) FreePinned(b []byte) error {
	f.pinned -= int64(len(b))
	return nil
}

func (f *fakeGPU) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	if err := f.Upload(dst, off, src); err != nil {
		return nil, err
	}
	return func() error { return nil }, nil
}

// testRates make the CPU and the link equally fast, so that the planner
// splits the non-resident layers between them.
var testRates = paging.Rates{H2D: 10e9, CPU: 10e9, H2DShared: 9e9, CPUShared: 9e9, Device: 1e12}

// TestHybridMatchesDirect: the hybrid strategy (the planner's split, a
// forced count, and every non-resident layer on the CPU) under a budget
// that leaves most layers off the "GPU" gives logits bit-identical to the
// model run directly, for a prompt of several chunks that runs on the
// twins (the CPU's layers on the GPU, their keys copied back) and decode
// steps that run on the CPU; the plan puts layers on the CPU, the pinned
// host memory is returned at Close.
func TestHybridMatchesDirect(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps = 6
	want := reference(t, lm, prompt, steps)
	for _, tc := range []struct {
		name      string
		strategy  paging.Strategy
		cpuLayers int
	}{
		{"planner's split", paging.StrategyHybrid, 0},
		{"two CPU layers", paging.StrategyHybrid, 2},
		{"every non-resident layer on the CPU", paging.StrategyCPU, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu := newFakeGPU()
			defer gpu.Close()
			o := Options{Backends: []tensor.Backend{gpu}, Context: len(prompt) + steps, Chunk: 4, TwinMinTokens: 4,
				Memory: Memory{Budgets: []int64{400 << 10}, Strategy: tc.strategy, CPULayers: tc.cpuLayers}, Rates: &testRates}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			h := e.Hybrid()
			if h == nil || len(h.Plan.CPULayers) == 0 {
				t.Fatalf("hybrid plan %+v: no layer on the CPU", h)
			}
			if tc.cpuLayers > 0 && len(h.Plan.CPULayers) != tc.cpuLayers {
				t.Errorf("%d CPU layers, forced %d", len(h.Plan.CPULayers), tc.cpuLayers)
			}
			t.Logf("%s", h.Plan)
			if tc.strategy == paging.StrategyCPU && h.Plan.StreamedBytes != 0 {
				t.Errorf("-offload cpu streams %d bytes per token", h.Plan.StreamedBytes)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			for i := range want {
				for j := range want[i] {
					if got[i][j] != want[i][j] {
						t.Fatalf("step %d logit %d: %v, direct %v (CPU layers %v)", i, j, got[i][j], want[i][j], h.Plan.CPULayers)
					}
				}
			}
			if e.Devices()[0].PeakDeviceBytes > 400<<10 {
				t.Errorf("peak %d over the budget", e.Devices()[0].PeakDeviceBytes)
			}
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			if gpu.pinned != 0 {
				t.Errorf("%d bytes of pinned memory left after Close", gpu.pinned)
			}
		})
	}
}

// TestHybridNeedsAGPU: the hybrid strategies refuse a device without a
// copy engine, and several devices, with one line.
func TestHybridNeedsAGPU(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaBF16)
	for _, o := range []Options{
		{Backends: cpus(1), Memory: Memory{Strategy: paging.StrategyHybrid}, Rates: &testRates},
		{Backends: []tensor.Backend{newFakeGPU(), newFakeGPU()}, Memory: Memory{Strategy: paging.StrategyCPU}, Rates: &testRates},
	} {
		if e, err := Open(context.Background(), lm, o); err == nil {
			e.Close()
			t.Errorf("%d devices, %s: opened", len(o.Backends), o.Memory.Strategy)
		} else if s := fmt.Sprint(err); len(s) == 0 {
			t.Error("empty error")
		}
	}
}
