package engine

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
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
// and values in a known time gives those rates; the CPU rate itself is
// left alone.
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
		cpu := slowCPU{Backend: tensor.NewCPU(2), norm: tc.norm, perPos: tc.perPos}
		r := paging.Rates{CPU: 1e12, H2D: 1e9}
		if err := CalibrateCPU(context.Background(), cpu, cfg, block, tc.kv, 1<<20, &r); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		kvPerPos := nn.KVCacheBytes(cfg, 1, tc.kv) / int64(cfg.NumLayers)
		wantAttn := float64(kvPerPos) / tc.perPos.Seconds()
		t.Logf("%s: CPU layer %v, attention %.3g bytes/s (want %v, %.3g)", tc.name, r.CPULayer, r.CPUAttention, 2*tc.norm, wantAttn)
		if r.CPULayer < 2*tc.norm*9/10 || r.CPULayer > 2*tc.norm+4*time.Millisecond {
			t.Errorf("%s: CPU layer %v, want about %v", tc.name, r.CPULayer, 2*tc.norm)
		}
		// Timing on a loaded machine only ever takes longer: a slower
		// rate is more likely than a faster one.
		if q := r.CPUAttention / wantAttn; q < 0.5 || q > 1.25 {
			t.Errorf("%s: attention %.3g bytes/s, want about %.3g", tc.name, r.CPUAttention, wantAttn)
		}
		if r.CPU != 1e12 || r.H2D != 1e9 {
			t.Errorf("%s: the measured rates changed: %+v", tc.name, r)
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
