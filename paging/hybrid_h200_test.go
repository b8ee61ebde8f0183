package paging

import (
	"fmt"
	"math"
	"testing"
	"time"
)

// c1Run is a row of the H200 run of the fourth session
// (examples/bench/results/h200-session4-c1.jsonl, 7B F16): the rates the
// engine measured at Open, the CPU layers its plan chose, the decode rate
// measured, and the wall time a token spent on each path (bench's
// measured_ms_per_token).
type c1Run struct {
	name          string
	budget        int64
	mode          HybridMode
	cpuLayers     int
	rates         Rates
	measured      float64 // tok/s
	cpuMs, gpuMs  float64
	predictedThen float64 // tok/s, the prediction of that run
}

var c1Runs = []c1Run{
	{"4 GiB cpu", 4 << 30, HybridAllCPU, 26, Rates{H2D: 55.08e9, CPU: 94.56e9, H2DShared: 49.24e9, CPUShared: 77.85e9, Device: 3155.5e9, Handoff: 20450, CPULayer: 132365}, 8.30, 119.26, 1.10, 8.96},
	{"4 GiB hybrid", 4 << 30, HybridForced, 15, Rates{H2D: 55.13e9, CPU: 100.41e9, H2DShared: 49.59e9, CPUShared: 76.88e9, Device: 3411.0e9, Handoff: 18563, CPULayer: 780949}, 10.38, 83.53, 12.64, 10.95},
	{"8 GiB hybrid", 8 << 30, HybridForced, 10, Rates{H2D: 54.56e9, CPU: 103.59e9, H2DShared: 52.21e9, CPUShared: 83.66e9, Device: 3328.7e9, Handoff: 18295, CPULayer: 137876}, 17.63, 50.97, 5.64, 21.20},
	{"2 GiB hybrid", 2 << 30, HybridForced, 19, Rates{H2D: 55.14e9, CPU: 98.60e9, H2DShared: 48.15e9, CPUShared: 76.00e9, Device: 3441.9e9, Handoff: 17117, CPULayer: 681403}, 8.25, 115.96, 5.19, 9.09},
}

// The costs beyond the bytes that the c1 run's times per path imply, one
// pair for the machine: each turn of the device between CPU layers took
// about 0.23 ms more than its layers' bytes and two hand-overs (GPU
// stage's wall time less the prediction's device time and hand-overs,
// over its stages: 0.26 ms at 8 GiB over 10 stages, 0.21 at 2 GiB over
// 15, 0.23 at 4 GiB over 14 once the copies' extra wait is taken out),
// and a CPU block about 0.7 ms more than its bytes at the shared rate
// (0.75 at 8 GiB, 0.65 at 4), where the calibration at Open had measured
// 0.13 to 0.78 ms alone.
const (
	c1DeviceStage = 230 * time.Microsecond
	c1CPULayer    = 700 * time.Microsecond
)

// TestPlanHybridC1 pins the decode model to the H200 run of the fourth
// session: with that run's rates and the costs it left out (a device
// stage's, Rates.DeviceStage; a CPU block's beside copies,
// Rates.CPULayerShared), each row's plan, the CPU layers it ran with, is
// predicted within 15% of its measured decode rate, and its CPU path
// within 15% of the CPU stage's measured time; without them, the 8 GiB
// plan is predicted more than 15% too fast (21.2 tok/s then, 17.63
// measured). It logs what the planner would choose with them (auto), for
// the next run to set against.
func TestPlanHybridC1(t *testing.T) {
	info := llama7B(t)
	for _, run := range c1Runs {
		for _, fixed := range []bool{false, true} {
			r := run.rates
			if fixed {
				r.DeviceStage, r.CPULayer, r.CPULayerShared = c1DeviceStage, c1CPULayer, c1CPULayer
			}
			name := fmt.Sprintf("%s (%v a stage, %v a CPU block)", run.name, r.DeviceStage, r.CPULayer)
			hp, err := PlanHybrid(info, run.budget, 581, 1, r, HybridOptions{Mode: run.mode, CPULayers: run.cpuLayers}, WithChunkTokens(512), WithKVPlacement(KVAuto))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			d, b, err := hp.PredictAt(26) // the bench's timed positions
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			auto, err := PlanHybrid(info, run.budget, 581, 1, r, HybridOptions{Mode: map[bool]HybridMode{true: HybridAllCPU}[run.mode == HybridAllCPU]}, WithChunkTokens(512), WithKVPlacement(KVAuto))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			da, _, err := auto.PredictAt(26)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			tokS, off := 1/d.Seconds(), 1/d.Seconds()/run.measured-1
			t.Logf("%s: %d CPU layers: predicted %.2f tok/s (measured %.2f, %+.0f%%; predicted then %.2f); CPU %.1f ms (measured %.1f), device, hand-overs and waits %.1f ms (measured %.1f), copies %.1f ms; the planner's choice: %d CPU layers, %.2f tok/s",
				name, len(hp.CPULayers), tokS, run.measured, off*100, run.predictedThen, float64(b.CPU)/1e6, run.cpuMs,
				float64(b.GPU+b.Handoff+b.CopyWait)/1e6, run.gpuMs, float64(b.Copy)/1e6, len(auto.CPULayers), 1/da.Seconds())
			switch {
			case fixed && math.Abs(off) > 0.15:
				t.Errorf("%s: predicted %.2f tok/s, measured %.2f", name, tokS, run.measured)
			case fixed && math.Abs(float64(b.CPU)/1e6/run.cpuMs-1) > 0.15:
				t.Errorf("%s: the CPU predicted %v a token, measured %.1f ms", name, b.CPU, run.cpuMs)
			case !fixed && run.budget == 8<<30 && off < 0.15:
				t.Errorf("%s: without the costs it left out, predicted %.2f tok/s against %.2f measured: the gap is gone", name, tokS, run.measured)
			}
		}
	}
}
