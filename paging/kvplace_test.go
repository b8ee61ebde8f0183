package paging

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestParseKVPlacement(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want KVPlacement
		bad  bool
	}{
		{"", KVDevice, false}, {"auto", KVAuto, false}, {" Host ", KVHost, false}, {"device", KVDevice, false},
		{"gpu", "", true}, {"cpu", "", true},
	} {
		got, err := ParseKVPlacement(tc.in)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("ParseKVPlacement(%q) = %q, %v; want %q, error %v", tc.in, got, err, tc.want, tc.bad)
		}
	}
}

// TestPlanKVPlacement: the 7B shape with an 8,064-position context at
// 4 GiB (its KV cache alone is 7.88 GiB) is refused with the KV cache on
// the device; auto moves the fewest blocks' caches to host memory that
// fit (one fewer does not), host moves them all, and every plan's peak,
// scratch included, stays within the budget. A budget that holds the
// whole cache keeps it on the device under auto.
func TestPlanKVPlacement(t *testing.T) {
	info := llama7B(t)
	const ctx, budget = 8064, 4 << 30
	perBlock := int64(2 * 4 * 4096 * ctx)
	_, err := Plan(info, budget, StrategyBalanced, ctx, 1, WithKVPlacement(KVDevice))
	if !errors.Is(err, ErrBudgetTooSmall) || !strings.Contains(err.Error(), "-kv-cache") {
		t.Fatalf("device KV at 4 GiB: %v, want a budget error naming -kv-cache", err)
	}
	for _, tc := range []struct {
		kv        KVPlacement
		wantHosts int // -1: the fewest that fit
	}{{KVAuto, -1}, {KVHost, 32}} {
		p, err := Plan(info, budget, StrategyBalanced, ctx, 1, WithKVPlacement(tc.kv), WithChunkTokens(512))
		if err != nil {
			t.Fatalf("%s: %v", tc.kv, err)
		}
		t.Logf("%s: %s", tc.kv, p)
		n := len(p.KVHostBlocks)
		if n == 0 || tc.wantHosts >= 0 && n != tc.wantHosts {
			t.Fatalf("%s: %d blocks' KV in host memory, want %d", tc.kv, n, tc.wantHosts)
		}
		if p.KVHostBlocks[n-1] != 31 || p.KVHostBytes != int64(n)*perBlock {
			t.Errorf("%s: host blocks %v, %d bytes; want the last %d, %d bytes", tc.kv, p.KVHostBlocks, p.KVHostBytes, n, int64(n)*perBlock)
		}
		if p.KVScratchBytes != 2*perBlock || p.KVCacheBytes != int64(32-n+2)*perBlock {
			t.Errorf("%s: device KV %d bytes (scratch %d), want %d (scratch %d)", tc.kv, p.KVCacheBytes, p.KVScratchBytes, int64(32-n+2)*perBlock, 2*perBlock)
		}
		if p.PredictedPeakBytes > budget {
			t.Errorf("%s: peak %d over the budget", tc.kv, p.PredictedPeakBytes)
		}
		if tc.wantHosts < 0 {
			o := planOptions{chunk: 512, maxPrefetch: 2, depth: -1, hostKV: n - 1}
			if _, err := plan(info, budget, StrategyBalanced, ctx, 1, o); !errors.Is(err, ErrBudgetTooSmall) {
				t.Errorf("auto chose %d host blocks, yet %d fit: %v", n, n-1, err)
			}
		}
	}
	p, err := Plan(info, 24<<30, StrategyBalanced, ctx, 1, WithKVPlacement(KVAuto))
	if err != nil || len(p.KVHostBlocks) != 0 || p.KVPlacement != KVDevice {
		t.Errorf("auto at 24 GiB: %v, %v; want the KV cache on the device", p, err)
	}
	// A budget too small even for host KV names what it needs.
	if _, err := Plan(info, 1<<30, StrategyBalanced, ctx, 1, WithKVPlacement(KVAuto)); !errors.Is(err, ErrBudgetTooSmall) {
		t.Errorf("auto at 1 GiB: %v, want ErrBudgetTooSmall", err)
	}
}

// TestPlanKVPredicted: with rates, auto weighs a block's KV in host memory
// (the CPU reads it each token) against the weights its room would keep
// resident (the link streams them each token): a CPU faster than the link
// moves KV to the host even where it fits on the device; a slow CPU keeps
// it on the device while it fits; the choice is the least prediction.
func TestPlanKVPredicted(t *testing.T) {
	info := llama7B(t)
	const ctx, budget = 4096, 8 << 30
	for _, tc := range []struct {
		name  string
		rates Rates
		host  bool
	}{
		{"fast CPU", Rates{H2D: 55e9, CPU: 92e9, Handoff: 20 * time.Microsecond}, true},
		{"slow CPU", Rates{H2D: 55e9, CPU: 5e9, Handoff: 20 * time.Microsecond}, false},
		{"fast CPU, slow attention", Rates{H2D: 55e9, CPU: 92e9, CPUAttention: 5e9, Handoff: 20 * time.Microsecond}, false},
	} {
		p, err := Plan(info, budget, StrategyBalanced, ctx, 1, WithKVPlacement(KVAuto), WithKVRates(tc.rates))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		dev, err := Plan(info, budget, StrategyBalanced, ctx, 1, WithKVPlacement(KVDevice))
		if err != nil {
			t.Fatal(err)
		}
		devTime := predictKV(dev, tc.rates)
		t.Logf("%s: %d host blocks, predicted %v; all on the device %v", tc.name, len(p.KVHostBlocks), p.KVPredicted, devTime)
		if (len(p.KVHostBlocks) > 0) != tc.host || p.KVPredicted > devTime || p.KVPredicted <= 0 {
			t.Errorf("%s: %s", tc.name, p)
		}
	}
	if _, err := Plan(info, budget, StrategyBalanced, ctx, 1, WithKVPlacement(KVAuto), WithKVRates(Rates{H2D: -1})); !errors.Is(err, ErrBadRates) {
		t.Errorf("bad rates: %v", err)
	}
}

// TestKVUploadMaxPos: uploading a host block's rows beats the CPU's round
// trip only at short contexts on the H200's rates (55 GB/s link, 92 GB/s
// CPU, 20 us hand-over, 7B rows of 32 KiB: about 170 positions), always
// with a CPU slower than the link, never without a hand-over cost.
func TestKVUploadMaxPos(t *testing.T) {
	h200 := Rates{H2D: 55e9, CPU: 92e9, Handoff: 20 * time.Microsecond}
	for _, tc := range []struct {
		name   string
		r      Rates
		row    int64
		lo, hi int
	}{
		{"H200, 7B rows", h200, 32 << 10, 150, 190},
		{"CPU slower than the link", Rates{H2D: 55e9, CPU: 20e9, Handoff: time.Microsecond}, 32 << 10, math.MaxInt, math.MaxInt},
		{"no hand-over cost", Rates{H2D: 55e9, CPU: 92e9}, 32 << 10, 0, 0},
		{"no link", Rates{CPU: 92e9}, 32 << 10, 0, 0},
	} {
		if got := KVUploadMaxPos(tc.r, tc.row); got < tc.lo || got > tc.hi {
			t.Errorf("%s: %d positions, want %d..%d", tc.name, got, tc.lo, tc.hi)
		}
	}
}

// TestPlanHybridKV: the hybrid planner at 4 GiB with an 8,064-position
// context refuses the KV cache on the device, and with it in host memory
// (host, or auto) plans every block's cache there and the scratch on the
// device, within the budget.
func TestPlanHybridKV(t *testing.T) {
	info := llama7B(t)
	const ctx, budget = 8064, 4 << 30
	rates := Rates{H2D: 55e9, CPU: 92e9, H2DShared: 52e9, CPUShared: 83e9, Device: 4e12, Handoff: 20 * time.Microsecond}
	if _, err := PlanHybrid(info, budget, ctx, 1, rates, HybridOptions{}, WithChunkTokens(512)); !errors.Is(err, ErrBudgetTooSmall) {
		t.Fatalf("device KV: %v, want ErrBudgetTooSmall", err)
	}
	for _, kv := range []KVPlacement{KVHost, KVAuto} {
		hp, err := PlanHybrid(info, budget, ctx, 1, rates, HybridOptions{}, WithChunkTokens(512), WithKVPlacement(kv))
		if err != nil {
			t.Fatalf("%s: %v", kv, err)
		}
		t.Logf("%s: %s; %s", kv, hp, hp.GPU)
		g := hp.GPU
		cpuBlocks := 0
		for _, l := range hp.CPULayers {
			if l >= 1 && l <= 32 {
				cpuBlocks++
			}
		}
		// The device keeps the scratch and, when the CPU has blocks, the
		// one block its twins compute large chunks in; every other
		// block's cache is in host memory (the CPU's where it computes).
		perBlock := int64(2 * 4 * 4096 * ctx)
		twin := int64(0)
		if cpuBlocks > 0 {
			twin = perBlock
		}
		if len(g.KVHostBlocks) != 32-cpuBlocks || g.KVHostBytes != int64(32-cpuBlocks)*perBlock ||
			g.KVCacheBytes != g.KVScratchBytes+twin || g.KVScratchBytes != 2*perBlock || g.PredictedPeakBytes > budget {
			t.Errorf("%s: %d CPU blocks; host blocks %d (%d bytes), device KV %d (scratch %d), peak %d",
				kv, cpuBlocks, len(g.KVHostBlocks), g.KVHostBytes, g.KVCacheBytes, g.KVScratchBytes, g.PredictedPeakBytes)
		}
	}
	if _, err := PlanHybrid(info, budget, ctx, 1, rates, HybridOptions{}, WithKVPlacement("disk")); err == nil {
		t.Error("unknown placement accepted")
	}
}
