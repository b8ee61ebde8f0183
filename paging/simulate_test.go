package paging

import (
	"encoding/json"
	"errors"
	"math"
	"slices"
	"testing"
	"time"
)

// Layer places for the simulator's tests: bytes at rates of 100 bytes a
// second, so that 100 bytes take a second.
func rl(read int64) LayerPlace { return LayerPlace{Place: Resident, ReadBytes: read} }
func sl(copy, read int64) LayerPlace {
	return LayerPlace{Place: Streamed, CopyBytes: copy, ReadBytes: read}
}
func cl(read int64) LayerPlace     { return LayerPlace{Place: OnCPU, ReadBytes: read} }
func secs(x float64) time.Duration { return time.Duration(x * 1e9) }
func near(a, b time.Duration) bool {
	return math.Abs(float64(a-b)) <= 1e-6*math.Max(1, math.Abs(float64(b)))
}
func places(ls ...LayerPlace) []LayerPlace { return ls }

// TestSimulateDecode checks the simulator against timelines worked out by
// hand (in the comments: [start, end) of each activity in seconds, once
// the cycle has settled).
func TestSimulateDecode(t *testing.T) {
	plain := Rates{H2D: 100, CPU: 100, Device: 100}
	noGPU := Rates{H2D: 100, CPU: 100}
	for _, tc := range []struct {
		name  string
		seq   []LayerPlace
		rates Rates
		depth int
		want  float64 // seconds a token
		check func(b Breakdown) bool
	}{
		// Three layers on the device, one after the other.
		{"resident", places(rl(100), rl(100), rl(100)), plain, 1, 3, func(b Breakdown) bool { return near(b.GPU, secs(3)) && b.Copy == 0 }},
		{"resident, device time left out", places(rl(100), rl(100)), noGPU, 1, 0, nil},
		// Depth 0 does not prefetch: a copy starts when the computation
		// reaches its layer, so copy and compute alternate: 1+1 a layer.
		{"streamed, depth 0", places(sl(100, 100), sl(100, 100)), plain, 0, 4, func(b Breakdown) bool { return near(b.CopyWait, secs(2)) }},
		// Depth 1: copy k runs while layer k-1 computes: a second a layer.
		{"streamed, depth 1", places(sl(100, 100), sl(100, 100)), plain, 1, 2, func(b Breakdown) bool { return near(b.Copy, secs(2)) && near(b.GPU, secs(2)) }},
		// The device slower than the link: copies wait for the ring,
		// compute takes 2 a layer.
		{"streamed, device bound", places(sl(100, 200), sl(100, 200)), plain, 1, 4, nil},
		// CPU and streamed layers alternate, the copy of each streamed
		// layer during the CPU layer before it: the CPU bounds (1 a
		// layer, copies of 0.5 hidden) ...
		{"C/S, copy faster", places(cl(100), sl(50, 0), cl(100), sl(50, 0)), noGPU, 1, 2, func(b Breakdown) bool { return near(b.CPU, secs(2)) && near(b.Copy, secs(1)) }},
		// ... or the link does (copies of 3, the CPU's second hidden).
		{"C/S, copy slower", places(cl(100), sl(300, 0), cl(100), sl(300, 0)), noGPU, 1, 6, nil},
		// Without prefetch nothing overlaps: 1 + 3 a pair.
		{"C/S, copy slower, depth 0", places(cl(100), sl(300, 0), cl(100), sl(300, 0)), noGPU, 0, 8, nil},
		// C S S, CPU 2, copies 1. Depth 1: the device's sequence is
		// S1 S2 and a copy may start once the device's layer two places
		// before it has computed, the same layer a token earlier: both
		// copies run beside C ([0,1) and [1,2) beside [0,2)): 2 a token.
		// Depth 0: C, then each copy: 4.
		{"C S S, depth 1", places(cl(200), sl(100, 0), sl(100, 0)), noGPU, 1, 2, nil},
		{"C S S, depth 0", places(cl(200), sl(100, 0), sl(100, 0)), noGPU, 0, 4, nil},
		// Four changes between the CPU and the device a token (the last
		// layer to the first included), 0.1 each.
		{"handoffs", places(cl(100), rl(0), cl(100), rl(0)), Rates{CPU: 100, Handoff: 100 * time.Millisecond}, 1, 2.4,
			func(b Breakdown) bool { return b.Handoffs == 4 && near(b.Handoff, secs(0.4)) }},
		{"no change, no handoff", places(cl(100), cl(100)), Rates{CPU: 100, Handoff: time.Second}, 1, 2, func(b Breakdown) bool { return b.Handoffs == 0 }},
		// Both paths at half speed while both run: the CPU layer and the
		// copy of the next streamed one take 2 together.
		{"shared, even", places(cl(100), sl(100, 0)), Rates{H2D: 100, H2DShared: 50, CPU: 100, CPUShared: 50}, 1, 2, nil},
		// C of 100 and one streamed layer a token, whose copy is 50;
		// with depth 1 the copy for token t+1 may start once token
		// t-1's streamed layer has computed. In the cycle C runs beside
		// a copy, both at 50, for 1 (50 of C done, the copy done); the
		// next copy waits for this token's streamed layer, so C ends
		// alone at 100 in 0.5: 1.5 a token.
		{"shared, uneven", places(cl(100), sl(50, 0)), Rates{H2D: 100, H2DShared: 50, CPU: 100, CPUShared: 50}, 1, 1.5,
			func(b Breakdown) bool { return near(b.CPU, secs(1.5)) && near(b.Copy, secs(1)) }},
	} {
		got, b, err := SimulateDecode(tc.seq, tc.rates, tc.depth)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !near(got, secs(tc.want)) || tc.check != nil && !tc.check(b) {
			t.Errorf("%s: %v a token (%+v), want %vs", tc.name, got, b, tc.want)
		}
	}
}

// TestSimulateDecodeFill checks the simulated pager that fills its ring
// (SimPrefetch.RingBytes) against timelines worked out by hand.
func TestSimulateDecodeFill(t *testing.T) {
	noGPU := Rates{H2D: 100, CPU: 100}
	for _, tc := range []struct {
		name  string
		seq   []LayerPlace
		rates Rates
		depth int
		want  float64 // seconds a token
		check func(b Breakdown) bool
		ring  int64
	}{
		// C of 3, then S1 S2 S3 (copies of 1) and R. Depth 1: S1 and S2
		// copy beside C ([0,1), [1,2)), S3 only once S1 has computed, at
		// 3: 4 a token. A pager filling a ring of 300 copies all three
		// beside C: 3 a token; a ring of 250 holds two of them: 4.
		{"C S S S R, depth 1", places(cl(300), sl(100, 0), sl(100, 0), sl(100, 0), rl(0)), noGPU, 1, 4,
			func(b Breakdown) bool { return near(b.CopyWait, secs(1)) }, 0},
		{"C S S S R, ring of 3 parts", places(cl(300), sl(100, 0), sl(100, 0), sl(100, 0), rl(0)), noGPU, 1, 3,
			func(b Breakdown) bool { return b.CopyWait == 0 }, 300},
		{"C S S S R, ring of 2.5 parts", places(cl(300), sl(100, 0), sl(100, 0), sl(100, 0), rl(0)), noGPU, 1, 4, nil, 250},
		// A filling pager walks one pass ahead at most: with the
		// device's layers S1 S2 S3 alone the copy of S3 waits for S1,
		// whatever the ring.
		{"C S S S, ring of 3 parts", places(cl(300), sl(100, 0), sl(100, 0), sl(100, 0)), noGPU, 1, 4, nil, 300},
		// Depth 0 does not prefetch, whatever the ring.
		{"C S S S R, depth 0, ring", places(cl(300), sl(100, 0), sl(100, 0), sl(100, 0), rl(0)), noGPU, 0, 6, nil, 300},
	} {
		got, b, err := SimulateDecodeWith(tc.seq, tc.rates, SimPrefetch{Depth: tc.depth, RingBytes: tc.ring})
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !near(got, secs(tc.want)) || tc.check != nil && !tc.check(b) {
			t.Errorf("%s: %v a token (%+v), want %vs", tc.name, got, b, tc.want)
		}
	}
}

// TestSimulateDecodeCPUCosts checks what a token costs beyond the weights'
// bytes: a CPU block's fixed time (Rates.CPULayer), the KV cache's reads
// on the CPU (at Rates.CPUAttention) or the device, and the hand-overs of
// a device layer whose KV cache is in host memory.
func TestSimulateDecodeCPUCosts(t *testing.T) {
	block := func(read, kv int64) LayerPlace {
		return LayerPlace{Place: OnCPU, ReadBytes: read, KVBytes: kv, Block: true}
	}
	dev := func(read, kv int64, host bool) LayerPlace {
		return LayerPlace{Place: Resident, ReadBytes: read, KVBytes: kv, HostKV: host}
	}
	for _, tc := range []struct {
		name  string
		seq   []LayerPlace
		rates Rates
		want  float64 // seconds a token
		check func(b Breakdown) bool
	}{
		{"block overhead", places(block(100, 0)), Rates{CPU: 100, CPULayer: secs(0.5)}, 1.5,
			func(b Breakdown) bool { return near(b.CPU, secs(1.5)) }},
		// The embedding is no block: its row costs its bytes only.
		{"no overhead off blocks", places(cl(100), block(100, 0)), Rates{CPU: 100, CPULayer: secs(0.5)}, 2.5, nil},
		// Beside a copy (of 10 s: it runs all through the CPU's block)
		// the block's fixed cost is CPULayerShared; alone, CPULayer, even
		// when that is 0.
		{"block overhead beside a copy", places(block(100, 0), sl(1000, 0)), Rates{CPU: 100, H2D: 100, CPULayer: secs(0.5), CPULayerShared: secs(1)}, 10,
			func(b Breakdown) bool { return near(b.CPU, secs(2)) }},
		{"block overhead beside a copy, none shared", places(block(100, 0), sl(1000, 0)), Rates{CPU: 100, H2D: 100, CPULayer: secs(0.5)}, 10,
			func(b Breakdown) bool { return near(b.CPU, secs(1.5)) }},
		{"block overhead alone, none alone", places(block(100, 0)), Rates{CPU: 100, CPULayerShared: secs(1)}, 1, nil},
		// A device stage's fixed cost, each time the computation comes
		// to the device from the CPU: C R R C R is two stages (the last
		// R and the first C are one turn of the CPU), 1 + 2 + 1 + 1 of
		// bytes, 2 x 0.25 of stages, four hand-overs of 0.1.
		{"device stages", places(cl(100), rl(100), rl(100), cl(100), rl(100)), Rates{CPU: 100, Device: 100, Handoff: secs(0.1), DeviceStage: secs(0.25)}, 5.9,
			func(b Breakdown) bool { return near(b.GPU, secs(3.5)) && b.Handoffs == 4 }},
		{"no device stage without the CPU", places(rl(100), rl(100)), Rates{Device: 100, DeviceStage: secs(0.25)}, 2, nil},
		{"CPU KV at the CPU rate", places(block(100, 100)), Rates{CPU: 100}, 2, nil},
		{"CPU KV at the attention rate", places(block(100, 100)), Rates{CPU: 100, CPUAttention: 50}, 3, nil},
		// A device layer with host KV: 1 on the device, two hand-overs
		// of 0.1, 1 on the CPU.
		{"device layer, host KV", places(dev(100, 100, true)), Rates{CPU: 100, Device: 100, Handoff: secs(0.1)}, 2.2,
			func(b Breakdown) bool {
				return b.Handoffs == 2 && near(b.Handoff, secs(0.2)) && near(b.CPU, secs(1)) && near(b.GPU, secs(1))
			}},
		{"device layer, device KV", places(dev(100, 100, false)), Rates{Device: 100, Handoff: secs(0.1)}, 2,
			func(b Breakdown) bool { return b.Handoffs == 0 && b.CPU == 0 }},
		// The device's time left out, its host KV still costs the CPU.
		{"host KV, device time left out", places(dev(100, 100, true)), Rates{CPU: 100, CPUAttention: 200}, 0.5, nil},
	} {
		got, b, err := SimulateDecode(tc.seq, tc.rates, 1)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !near(got, secs(tc.want)) || tc.check != nil && !tc.check(b) {
			t.Errorf("%s: %v a token (%+v), want %vs", tc.name, got, b, tc.want)
		}
	}
	// The attention slows beside a copy as the CPU does.
	r := Rates{CPU: 100, CPUShared: 50, CPUAttention: 40}
	if a, s := r.cpuAttention(false), r.cpuAttention(true); a != 40 || s != 20 {
		t.Errorf("attention alone %v, beside a copy %v: want 40 and 20", a, s)
	}
}

func TestSimulateDecodeRefuses(t *testing.T) {
	ok := Rates{H2D: 1, CPU: 1}
	for _, tc := range []struct {
		name  string
		seq   []LayerPlace
		rates Rates
		depth int
		bad   bool // ErrBadRates
	}{
		{"no layers", nil, ok, 1, false},
		{"negative depth", places(rl(1)), ok, -1, false},
		{"negative ring", places(rl(1)), ok, 1, false},
		{"negative bytes", places(sl(-1, 1)), ok, 1, false},
		{"unknown place", places(LayerPlace{Place: 7}), ok, 1, false},
		{"no link", places(sl(1, 1)), Rates{CPU: 1}, 1, true},
		{"no CPU", places(cl(1)), Rates{H2D: 1}, 1, true},
		{"negative", places(rl(1)), Rates{H2D: 1, CPU: 1, Device: -1}, 1, true},
		{"NaN", places(rl(1)), Rates{H2D: math.NaN(), CPU: 1}, 1, true},
		{"negative handoff", places(rl(1)), Rates{H2D: 1, CPU: 1, Handoff: -1}, 1, true},
		{"negative KV bytes", places(LayerPlace{Place: OnCPU, ReadBytes: 1, KVBytes: -1}), ok, 1, false},
		{"negative CPU layer", places(rl(1)), Rates{H2D: 1, CPU: 1, CPULayer: -1}, 1, true},
		{"negative device stage", places(rl(1)), Rates{H2D: 1, CPU: 1, DeviceStage: -1}, 1, true},
		{"negative CPU layer beside copies", places(rl(1)), Rates{H2D: 1, CPU: 1, CPULayerShared: -1}, 1, true},
		{"NaN attention", places(rl(1)), Rates{H2D: 1, CPU: 1, CPUAttention: math.NaN()}, 1, true},
		{"host KV, no CPU", places(LayerPlace{Place: Resident, ReadBytes: 1, KVBytes: 1, HostKV: true}), Rates{H2D: 1}, 1, true},
	} {
		ring := int64(0)
		if tc.name == "negative ring" {
			ring = -1
		}
		_, _, err := SimulateDecodeWith(tc.seq, tc.rates, SimPrefetch{Depth: tc.depth, RingBytes: ring})
		if err == nil || errors.Is(err, ErrBadRates) != tc.bad {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

func TestRatesBounds(t *testing.T) {
	r := Rates{H2D: 55e9, CPU: 92e9, H2DShared: 52e9, CPUShared: 83e9}
	b := r.Bounds(10e9)
	if math.Abs(b.Stream-5.5) > 1e-9 || math.Abs(b.CPU-9.2) > 1e-9 || math.Abs(b.Hybrid-13.5) > 1e-9 {
		t.Errorf("bounds %+v", b)
	}
	if b := (Rates{H2D: 50, CPU: 50}).Bounds(100); b.Hybrid != 1 {
		t.Errorf("shared rates of 0 are not the rates alone: %+v", b)
	}
	if b := r.Bounds(0); b != (Bounds{}) {
		t.Errorf("nothing to read: %+v", b)
	}
	for _, p := range []Place{Resident, Streamed, OnCPU} {
		data, err := json.Marshal(LayerPlace{Place: p})
		if err != nil {
			t.Fatal(err)
		}
		var back LayerPlace
		if err := json.Unmarshal(data, &back); err != nil || back.Place != p {
			t.Errorf("%s: %s -> %v, %v", p, data, back.Place, err)
		}
	}
	var back LayerPlace
	if err := json.Unmarshal([]byte(`{"place":"gpu"}`), &back); err == nil {
		t.Error("unknown place read")
	}
}

// TestSpreadOf: the least, the median (the middle two's mean for an even
// count) and the most of a few times, in any order.
func TestSpreadOf(t *testing.T) {
	ms := func(xs ...int) []time.Duration {
		var d []time.Duration
		for _, x := range xs {
			d = append(d, time.Duration(x)*time.Millisecond)
		}
		return d
	}
	for _, tc := range []struct {
		name string
		ts   []time.Duration
		want Spread
	}{
		{"none", nil, Spread{}},
		{"one", ms(3), Spread{3e6, 3e6, 3e6, 1}},
		{"odd, an outlier", ms(5, 1, 90, 2, 4), Spread{1e6, 4e6, 90e6, 5}},
		{"even", ms(4, 1, 2, 8), Spread{1e6, 3e6, 8e6, 4}},
	} {
		in := slices.Clone(tc.ts)
		if got := SpreadOf(tc.ts); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
		if !slices.Equal(in, tc.ts) {
			t.Errorf("%s: the times were reordered", tc.name)
		}
	}
	if s := (Spread{1e6, 2e6, 9e6, 3}).String(); s != "1.00/2.00/9.00 ms over 3" {
		t.Errorf("String: %q", s)
	}
}

// TestCPULayerString: the summary's CPU block cost shows the calibration's
// spread and the cost beside copies when they were measured.
func TestCPULayerString(t *testing.T) {
	ms := func(x float64) time.Duration { return time.Duration(x * 1e6) }
	for _, tc := range []struct {
		name string
		r    Rates
		want string
	}{
		{"given", Rates{CPULayer: ms(0.5)}, "0.50 ms besides its bytes"},
		{"calibrated", Rates{CPULayer: ms(0.5), CPULayerSpread: Spread{ms(0.4), ms(0.5), ms(2), 7}},
			"0.50 ms besides its bytes (min/median/max 0.40/0.50/2.00 ms over 7)"},
		{"beside copies", Rates{CPULayer: ms(0.5), CPULayerSpread: Spread{ms(0.4), ms(0.5), ms(2), 7}, CPULayerShared: ms(0.9), CPULayerSharedSpread: Spread{ms(0.8), ms(0.9), ms(1), 5}},
			"0.50 ms besides its bytes (min/median/max 0.40/0.50/2.00 ms over 7), 0.90 ms beside copies (0.80/0.90/1.00 ms over 5)"},
		{"device stage", Rates{CPULayer: ms(0.5), DeviceStage: ms(0.25), DeviceStageSpread: Spread{ms(0.2), ms(0.25), ms(0.3), 9}},
			"0.50 ms besides its bytes; a device stage 0.25 ms besides its bytes (0.20/0.25/0.30 ms over 9)"},
	} {
		if got := tc.r.cpuLayerString(); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
