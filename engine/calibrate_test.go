package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// slowCPU is a CPU with known costs: each RMSNorm sleeps norm, each
// attention perPos for each position it attends over.
type slowCPU struct {
	tensor.Backend
	norm, perPos time.Duration
}

func (s slowCPU) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	time.Sleep(s.norm)
	return s.Backend.RMSNorm(out, x, w, eps)
}

func (s slowCPU) Attention(out *tensor.Tensor, a tensor.Attn) error {
	time.Sleep(time.Duration(a.Pos0+1) * s.perPos)
	return s.Backend.Attention(out, a)
}

// TestCalibrateCPU: a CPU whose blocks cost a known time besides their
// bytes (two norms of 2 ms) and whose attention reads a position's keys
// and values in a known time gives those costs; the CPU's rate becomes
// the calibration's own. The calibration keeps medians, which a machine
// loaded for most of it moves (sleeps overslept by 10 ms and more on the
// shared 2-core VM): a case fails when three calibrations in a row miss.
func TestCalibrateCPU(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaBF16)
	cfg := lm.Config
	block := nn.Source(lm).LayerTensors(cfg.BlockLayer(0))
	for _, tc := range []struct {
		name         string
		norm, perPos time.Duration
		kv           tensor.DType
	}{
		{"norms 2 ms, 50 us a position, F16 KV", 2 * time.Millisecond, 50 * time.Microsecond, tensor.F16},
		{"norms 3 ms, 80 us a position, F32 KV", 3 * time.Millisecond, 80 * time.Microsecond, tensor.F32},
	} {
		var errs []string
		for attempt := 0; attempt < 3; attempt++ {
			cpu := slowCPU{Backend: tensor.NewCPU(2), norm: tc.norm, perPos: tc.perPos}
			r := paging.Rates{CPU: 1e12, H2D: 1e9}
			if err := CalibrateCPU(context.Background(), cpu, cfg, block, tc.kv, 1<<20, &r); err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			kvPerPos := nn.KVCacheBytes(cfg, 1, tc.kv) / int64(cfg.NumLayers)
			wantAttn := float64(kvPerPos) / tc.perPos.Seconds()
			t.Logf("%s: CPU layer %v (%v), attention %.3g bytes/s (want %v, %.3g)", tc.name, r.CPULayer, r.CPULayerSpread, r.CPUAttention, 2*tc.norm, wantAttn)
			errs = errs[:0]
			if r.CPULayer < 2*tc.norm*9/10 || r.CPULayer > 2*tc.norm+4*time.Millisecond {
				errs = append(errs, fmt.Sprintf("CPU layer %v, want about %v", r.CPULayer, 2*tc.norm))
			}
			// Timing on a loaded machine only ever takes longer: a
			// slower rate is more likely than a faster one.
			if q := r.CPUAttention / wantAttn; q < 0.5 || q > 1.25 {
				errs = append(errs, fmt.Sprintf("attention %.3g bytes/s, want about %.3g", r.CPUAttention, wantAttn))
			}
			// The CPU's rate is the calibration's own, of its products
			// beside the blocks; the link's is left alone.
			if r.CPU == 1e12 || r.CPU <= 0 || r.H2D != 1e9 {
				errs = append(errs, fmt.Sprintf("rates %+v", r))
			}
			if sp := r.CPULayerSpread; sp.N < calibrateMinReps || sp.Min > sp.Median || sp.Median > sp.Max || max(sp.Median, 0) != r.CPULayer {
				errs = append(errs, fmt.Sprintf("spread %v of a fixed cost %v", sp, r.CPULayer))
			}
			if len(errs) == 0 {
				break
			}
		}
		for _, e := range errs {
			t.Errorf("%s: %s", tc.name, e)
		}
	}
	// No CPU rate to subtract the bytes' time with.
	r := paging.Rates{}
	if err := CalibrateCPU(context.Background(), tensor.NewCPU(1), cfg, block, tensor.F16, 64, &r); !errors.Is(err, paging.ErrBadRates) {
		t.Errorf("no CPU rate: %v", err)
	}
	// A sparse block is not timed.
	mx := openFixture(t, fixtures.TinyMixtralBF16)
	r = paging.Rates{CPU: 1e9}
	if err := CalibrateCPU(context.Background(), tensor.NewCPU(1), mx.Config, nn.Source(mx).LayerTensors(mx.Config.BlockLayer(0)), tensor.F16, 64, &r); err != nil || r.CPULayer != 0 || r.CPUAttention != 0 {
		t.Errorf("sparse block: %+v, %v", r, err)
	}
}

// TestCPUCosts checks the arithmetic of the calibration on times worked
// out by hand: 1000 bytes of block at 1000 bytes/s take 1 s, 10 bytes of
// KV a position.
func TestCPUCosts(t *testing.T) {
	s := func(x float64) time.Duration { return time.Duration(x * 1e9) }
	for _, tc := range []struct {
		name      string
		t0, t1    time.Duration
		p0, p1    int
		layer     time.Duration
		attention float64
	}{
		// 100 positions more took 2 s more: 500 bytes/s; at 10 positions
		// the KV took 0.2 s, the bytes 1 s: 0.3 s fixed.
		{"both", s(1.5), s(3.5), 10, 110, s(0.3), 500},
		// The time did not grow: the KV at the CPU's rate (0.1 s).
		{"no growth", s(1.5), s(1.5), 10, 110, s(0.4), 0},
		{"one point", s(1.5), 0, 10, 10, s(0.4), 0},
		// Faster than its bytes: no fixed cost.
		{"faster than the rate", s(0.8), s(2.8), 10, 110, 0, 500},
	} {
		layer, attention := cpuCosts(tc.t0, tc.t1, tc.p0, tc.p1, 10, 1000, 1000)
		if math.Abs(float64(layer-tc.layer)) > 1e3 || math.Abs(attention-tc.attention) > 1e-9 {
			t.Errorf("%s: fixed %v, attention %v; want %v, %v", tc.name, layer, attention, tc.layer, tc.attention)
		}
	}
}

// TestMeasureRatesQuantized: the rates and the calibrations (the CPU's,
// alone and beside copies, and the device's) measure the block of a
// quantized model (Q4_K and Q8_0 matrices) on the CPU: a
// hybrid plan of such a model opened with no rates given failed on the
// GPU with "the block has no matrix".
func TestMeasureRatesQuantized(t *testing.T) {
	rb, cb := rateBytes, cpuRateMinBytes
	rateBytes, cpuRateMinBytes = 8<<20, 8<<20 // what the test checks is that the block is measured
	t.Cleanup(func() { rateBytes, cpuRateMinBytes = rb, cb })
	for _, qt := range []quant.Type{quant.Q4_K, quant.Q8_0} {
		lm := synthGGUF(t, qt)
		cfg := lm.Config
		block := nn.Source(lm).LayerTensors(cfg.BlockLayer(0))
		gpu := newFakeGPU()
		r, err := MeasureCalibratedRates(context.Background(), gpu, tensor.NewCPU(1), block[0].DType, cfg, tensor.F16, 256, block)
		gpu.Close()
		if err != nil {
			t.Fatalf("%v: %v", qt, err)
		}
		if !(r.CPU > 0 && r.H2D > 0 && r.CPUShared > 0) {
			t.Errorf("%v: rates %+v", qt, r)
		}
		// The calibration ran alone, beside copies and on the device
		// (its block uploaded from the CPU's pinned copy).
		if r.CPULayerSpread.N < calibrateMinReps || r.CPULayerSharedSpread.N < calibrateMinReps || r.DeviceStageSpread.N < calibrateMinReps {
			t.Errorf("%v: repetitions: %v alone, %v beside copies, %v on the device", qt, r.CPULayerSpread, r.CPULayerSharedSpread, r.DeviceStageSpread)
		}
	}
}

// TestCalibrateNoisyClock: on a clock that makes the times up, with
// outliers in a few repetitions (a products pass ten times slower, a
// block five times, a long block faster than the short one), the fixed
// cost, the CPU's rate and the attention's rate are those of the clean
// repetitions, alone and beside copies, while the spread shows the
// outliers; the repetitions stop at calibrateMaxReps when the runs take
// no time, and after calibrateMinReps when the first run outlasts the
// budget.
func TestCalibrateNoisyClock(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaBF16)
	cfg := lm.Config
	block := nn.Source(lm).LayerTensors(cfg.BlockLayer(0))
	const kv = tensor.F16
	var blockBytes, productBytes int64
	for _, ts := range block {
		blockBytes += ts.Bytes
		if len(ts.Shape) == 2 {
			productBytes += ts.Bytes
		}
	}
	kvPerPos := nn.KVCacheBytes(cfg, 1, kv) / int64(cfg.NumLayers)
	p0, p1 := calibrateShortPos, min(calibrateLongPos, cfg.ContextLength()-1)
	ms := func(x float64) time.Duration { return time.Duration(x * 1e6) }
	// The clean machine: a pass of the products takes 10 ms alone and
	// 12.5 beside copies; a block its bytes at that rate, 1 ms (1.5
	// beside copies) and its KV reads at 1 GB/s (0.8 beside copies).
	const pass, passShared = 10.0, 12.5
	const attn = 1e9
	kvMs := func(p int, rate float64) float64 { return float64(int64(p)*kvPerPos) / rate * 1e3 }
	bytesMs := func(passMs float64) float64 { return float64(blockBytes) / float64(productBytes) * passMs }
	clean := map[string]float64{
		"products":        pass,
		"block":           bytesMs(pass) + 1 + kvMs(p0, attn),
		"long block":      bytesMs(pass) + 1 + kvMs(p1, attn),
		"products shared": passShared,
		"block shared":    bytesMs(passShared) + 1.5 + kvMs(p0, attn*pass/passShared),
	}
	noise := map[string]map[int]float64{ // what, repetition: factor
		"products":        {1: 10},
		"block":           {3: 5},
		"long block":      {4: 0.2},
		"products shared": {0: 8},
		"block shared":    {2: 6},
	}
	for _, tc := range []struct {
		name       string
		scale      float64 // of every time
		wantReps   int     // the repetitions alone
		checkRates bool
	}{
		{"outliers", 0.1, 0, true},
		{"runs taking no time", 1e-6, calibrateMaxReps, false},
		{"runs outlasting the budget", 100, calibrateMinReps, false},
	} {
		var now time.Time
		count := map[string]int{}
		sw := stopwatch{
			now: func() time.Time { return now },
			time: func(what string, f func() error) (time.Duration, error) {
				if err := f(); err != nil {
					return 0, err
				}
				d := clean[what]
				if x, ok := noise[what][count[what]]; ok {
					d *= x
				}
				count[what]++
				now = now.Add(ms(d * tc.scale))
				return ms(d * tc.scale), nil
			},
		}
		var copies atomic.Int64
		c := calibrator{cpu: tensor.NewCPU(1), cfg: cfg, block: block, kv: kv, maxPos: 1 << 20,
			copies: make([]nn.LayerWeights, 1), sw: sw,
			copyOnce: func() error { copies.Add(1); time.Sleep(20 * time.Microsecond); return nil }}
		r := paging.Rates{CPU: 1, H2D: 1}
		if err := c.run(context.Background(), &r); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		t.Logf("%s: %d repetitions alone, %d beside %d copies; fixed %v (%v), beside copies %v (%v); CPU %.4g bytes/s, %.4g beside copies; attention %.4g",
			tc.name, count["block"], count["block shared"], copies.Load(), r.CPULayer, r.CPULayerSpread, r.CPULayerShared, r.CPULayerSharedSpread, r.CPU, r.CPUShared, r.CPUAttention)
		if count["products"] != count["block"] || count["block"] != count["long block"] || count["products shared"] != count["block shared"] || count["block shared"] < calibrateMinReps {
			t.Errorf("%s: runs %v", tc.name, count)
		}
		if tc.wantReps > 0 && (count["block"] != tc.wantReps || count["block shared"] != tc.wantReps) {
			t.Errorf("%s: %d repetitions alone, %d beside copies, want %d", tc.name, count["block"], count["block shared"], tc.wantReps)
		}
		if copies.Load() == 0 {
			t.Errorf("%s: no copy ran beside the CPU", tc.name)
		}
		if !tc.checkRates {
			continue
		}
		near := func(got, want time.Duration) bool { return got-want < time.Microsecond && want-got < time.Microsecond }
		if !near(r.CPULayer, ms(tc.scale)) || !near(r.CPULayerShared, ms(1.5*tc.scale)) {
			t.Errorf("%s: fixed cost %v alone, %v beside copies; want %v and %v", tc.name, r.CPULayer, r.CPULayerShared, ms(tc.scale), ms(1.5*tc.scale))
		}
		for _, v := range []struct {
			name      string
			got, want float64
		}{
			{"CPU", r.CPU, float64(productBytes) / pass * 1e3 / tc.scale},
			{"CPU beside copies", r.CPUShared, float64(productBytes) / passShared * 1e3 / tc.scale},
			{"attention", r.CPUAttention, attn / tc.scale},
		} {
			if math.Abs(v.got/v.want-1) > 1e-3 { // the times are whole nanoseconds
				t.Errorf("%s: %s %.6g bytes/s, want %.6g", tc.name, v.name, v.got, v.want)
			}
		}
		// The outliers show in the spread: the slow pass's repetition
		// left a block less than its bytes, the slow block's four times
		// its time more.
		if sp := r.CPULayerSpread; sp.Min >= 0 || sp.Max < ms(10*tc.scale) || sp.N != count["block"] {
			t.Errorf("%s: spread %v alone hides the outliers", tc.name, sp)
		}
		if sp := r.CPULayerSharedSpread; sp.Min >= 0 || sp.Max < ms(10*tc.scale) {
			t.Errorf("%s: spread %v beside copies hides the outliers", tc.name, sp)
		}
	}
}

// slowGPU is a fake GPU whose RMSNorm sleeps (one a block: the other is
// fused with the residual's add, which a CPU offers) and whose
// allocations can fail as out of memory.
type slowGPU struct {
	*fakeGPU
	norm time.Duration
	oom  bool
}

func (s slowGPU) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	time.Sleep(s.norm)
	return s.fakeGPU.RMSNorm(out, x, w, eps)
}

func (s slowGPU) Alloc(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	if s.oom {
		return nil, fmt.Errorf("fake: %w", tensor.ErrOutOfMemory)
	}
	return s.fakeGPU.Alloc(dt, shape)
}

// TestCalibrateDevice: a device block between two hand-overs costs what
// its bytes at the device's rate and one hand-over leave of its step: the
// norm's sleep here (fast device, no hand-over); on a clock with an
// outlier the median holds; a device with no room leaves the rates as
// they are; no device rate is refused.
func TestCalibrateDevice(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaBF16)
	cfg := lm.Config
	block := nn.Source(lm).LayerTensors(cfg.BlockLayer(0))
	gpu := slowGPU{fakeGPU: newFakeGPU(), norm: 3 * time.Millisecond}
	defer gpu.Close()
	var r paging.Rates
	for attempt := 0; attempt < 3; attempt++ { // as TestCalibrateCPU: three misses in a row fail
		r = paging.Rates{Device: 1e15}
		if err := calibrateDevice(context.Background(), gpu, cfg, block, tensor.F16, &r, stopwatch{}, nil); err != nil {
			t.Fatal(err)
		}
		t.Logf("device stage %v (%v)", r.DeviceStage, r.DeviceStageSpread)
		if r.DeviceStage >= 3*time.Millisecond && r.DeviceStage <= 10*time.Millisecond && r.DeviceStageSpread.N >= calibrateMinReps {
			break
		}
	}
	if r.DeviceStage < 3*time.Millisecond || r.DeviceStage > 10*time.Millisecond || r.DeviceStageSpread.N < calibrateMinReps {
		t.Errorf("device stage %v (%v), want about the 3 ms of its norm", r.DeviceStage, r.DeviceStageSpread)
	}

	// Made-up steps of 1 ms, one of 50; the bytes take 0.2 ms at the
	// device's rate and a hand-over 0.1.
	var blockBytes int64
	for _, ts := range block {
		blockBytes += ts.Bytes
	}
	n := 0
	sw := stopwatch{now: time.Now, time: func(what string, f func() error) (time.Duration, error) {
		if err := f(); err != nil {
			return 0, err
		}
		n++
		if n == 2 {
			return 50 * time.Millisecond, nil
		}
		return time.Millisecond, nil
	}}
	gpu.norm = 0
	r = paging.Rates{Device: float64(blockBytes) / 200e-6, Handoff: 100 * time.Microsecond}
	if err := calibrateDevice(context.Background(), gpu, cfg, block, tensor.F16, &r, sw, nil); err != nil {
		t.Fatal(err)
	}
	if d := r.DeviceStage - 700*time.Microsecond; d < -time.Microsecond || d > time.Microsecond || r.DeviceStageSpread.Max < 40*time.Millisecond {
		t.Errorf("made-up steps: device stage %v (%v), want 0.7 ms and the outlier in the spread", r.DeviceStage, r.DeviceStageSpread)
	}

	gpu.oom = true
	r = paging.Rates{Device: 1e12}
	if err := calibrateDevice(context.Background(), gpu, cfg, block, tensor.F16, &r, stopwatch{}, nil); err != nil || r != (paging.Rates{Device: 1e12}) {
		t.Errorf("no room on the device: %+v, %v", r, err)
	}
	if err := calibrateDevice(context.Background(), gpu, cfg, block, tensor.F16, &paging.Rates{}, stopwatch{}, nil); !errors.Is(err, paging.ErrBadRates) {
		t.Errorf("no device rate: %v", err)
	}
}
