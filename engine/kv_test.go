package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestKVCacheInHostMemory: the F16 fixture at its full context under a
// budget 100 KiB short of what the KV cache on the device needs is
// refused with the cache on the device (as every long prompt under a small
// budget was); placed auto or host it runs, with logits bit-identical to
// the model run directly, for a prompt of several chunks (the larger ones
// attending on the device over the uploaded rows) and decode steps
// attending on the CPU, or, where the rates say uploading the rows is
// faster, on the device; the plan and the report say which blocks' caches
// are in host memory, the budget's peak stays within the plan's and the
// budget, and the pinned host memory is returned at Close.
func TestKVCacheInHostMemory(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps, ctx = 6, 256
	want := reference(t, lm, prompt, steps)
	info, err := nn.ModelInfo(lm, lm.Config)
	if err != nil {
		t.Fatal(err)
	}
	probe := newFakeGPU()
	_, err = paging.Plan(info, 1, paging.StrategyBalanced, ctx, 1, paging.WithChunkTokens(4), paging.WithDevice(probe))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("probe plan: %v", err)
	}
	budget := be.Needed - 100<<10
	// fastCPU attends faster than the link uploads (decode on the CPU);
	// testRates' CPU is no faster (decode over uploaded rows).
	fastCPU := paging.Rates{H2D: 10e9, CPU: 20e9, Device: 1e12}
	for _, tc := range []struct {
		kv     paging.KVPlacement
		rates  *paging.Rates
		upload bool
	}{{paging.KVDevice, &fastCPU, false}, {paging.KVAuto, &fastCPU, false}, {paging.KVHost, &fastCPU, false}, {paging.KVHost, &testRates, true}} {
		kv := tc.kv
		t.Run(fmt.Sprintf("%s upload=%v", kv, tc.upload), func(t *testing.T) {
			gpu := newFakeGPU()
			defer gpu.Close()
			o := Options{Backends: []tensor.Backend{gpu}, Context: ctx, Chunk: 4, TwinMinTokens: 4, Rates: tc.rates,
				Memory: Memory{Budgets: []int64{budget}, KVCache: kv}}
			e, err := Open(context.Background(), lm, o)
			if kv == paging.KVDevice {
				if !errors.Is(err, paging.ErrBudgetTooSmall) || !strings.Contains(err.Error(), "-kv-cache") {
					t.Fatalf("KV cache on the device at %d bytes: %v, want a budget error naming -kv-cache", budget, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			plan := e.Devices()[0].Plan
			t.Logf("%s", plan)
			if len(plan.KVHostBlocks) == 0 || kv == paging.KVHost && len(plan.KVHostBlocks) != lm.Config.NumLayers {
				t.Fatalf("host blocks %v", plan.KVHostBlocks)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			for i := range want {
				for j := range want[i] {
					if got[i][j] != want[i][j] {
						t.Fatalf("step %d logit %d: %v, direct %v", i, j, got[i][j], want[i][j])
					}
				}
			}
			r := e.KV()
			t.Logf("%s", r)
			if r == nil || r.UploadBytes == 0 || r.HostBytes != plan.KVHostBytes || !strings.Contains(e.Summary(), "KV cache") {
				t.Fatalf("report %+v", r)
			}
			if tc.upload && (r.CPUAttentions != 0 || r.DeviceMaxPos != ctx) || !tc.upload && (r.CPUAttentions < int64(steps*len(plan.KVHostBlocks)) || r.DeviceMaxPos != 0) {
				t.Errorf("%d CPU attentions, decode on the device up to %d positions; want upload %v", r.CPUAttentions, r.DeviceMaxPos, tc.upload)
			}
			if peak := e.Devices()[0].PeakDeviceBytes; peak > plan.PredictedPeakBytes || peak > budget {
				t.Errorf("peak %d, planned %d, budget %d", peak, plan.PredictedPeakBytes, budget)
			}
			if e.HostHeldBytes() < plan.KVHostBytes {
				t.Errorf("host memory held %d, the host KV cache is %d", e.HostHeldBytes(), plan.KVHostBytes)
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

// TestKVCacheRefusals: a host KV cache larger than the host memory limit
// (with the hybrid strategy, every block's cache and nothing left for the
// CPU's layers),
// the host KV caches of two devices together over the limit, host KV on a
// device that has no memory of its own, and an unknown placement are
// refused with
// one line naming the problem.
func TestKVCacheRefusals(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	for _, tc := range []struct {
		name     string
		backends func() []tensor.Backend
		mem      Memory
		want     string
	}{
		{"host memory limit", func() []tensor.Backend { return []tensor.Backend{newFakeGPU()} },
			Memory{KVCache: paging.KVHost, HostCache: 100 << 10, Budgets: []int64{8 << 20}}, "over the host memory limit of 100.00 KiB"},
		{"no host memory at all", func() []tensor.Backend { return []tensor.Backend{newFakeGPU()} },
			Memory{KVCache: paging.KVHost, HostCache: -1, Budgets: []int64{8 << 20}}, "over the host memory limit"},
		{"the CPU", func() []tensor.Backend { return cpus(1) }, Memory{KVCache: paging.KVHost}, "no memory of its own"},
		{"hybrid: the whole cache over the limit", func() []tensor.Backend { return []tensor.Backend{newFakeGPU()} },
			Memory{KVCache: paging.KVHost, Strategy: paging.StrategyHybrid, HostCache: 256 << 10, Budgets: []int64{8 << 20}}, "over the host memory limit of 256.00 KiB"},
		{"two devices share the limit", func() []tensor.Backend { return []tensor.Backend{newFakeGPU(), newFakeGPU()} },
			Memory{KVCache: paging.KVHost, HostCache: 96 << 10, Budgets: []int64{8 << 20}}, "needs 128.00 KiB (131072 bytes) of host memory, over the host memory limit of 96.00 KiB"},
		{"a CPU among the devices", func() []tensor.Backend { return []tensor.Backend{newFakeGPU(), tensor.NewCPU(1)} },
			Memory{KVCache: paging.KVHost}, "cpu has no memory of its own"},
		{"unknown", func() []tensor.Backend { return []tensor.Backend{newFakeGPU()} }, Memory{KVCache: "disk"}, "unknown KV cache placement"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := tc.backends()
			defer func() {
				for _, b := range bs {
					b.Close()
				}
			}()
			e, err := Open(context.Background(), lm, Options{Backends: bs, Context: 256, Chunk: 4, Rates: &testRates, Memory: tc.mem})
			if err == nil {
				e.Close()
				t.Fatal("opened")
			}
			if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
				t.Errorf("error %q, want one line containing %q", err, tc.want)
			}
		})
	}
}

// TestAutoChunk: under a budget, the prefill chunk grows with the budget
// while its activations take at most an eighth of it (the 7B shape: 1,024
// tokens at 4 GiB, 2,048 at 8 GiB, 4,096 at most), and never below
// DefaultChunk.
func TestAutoChunk(t *testing.T) {
	cfg, err := arch.Preset("llama2-7b")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		budget int64
		want   int
	}{{1 << 30, 512}, {4 << 30, 1024}, {8 << 30, 2048}, {80 << 30, 4096}} {
		if got := AutoChunk(cfg, tc.budget); got != tc.want {
			t.Errorf("%d GiB: chunk %d, want %d", tc.budget>>30, got, tc.want)
		}
	}
}

// failingPinned is a fake GPU whose pinned allocations fail from the n-th.
type failingPinned struct {
	*fakeGPU
	n int
}

func (f *failingPinned) AllocPinned(n int64) ([]byte, error) {
	if f.n--; f.n <= 0 {
		return nil, tensor.ErrOutOfMemory
	}
	return f.fakeGPU.AllocPinned(n)
}

// TestKVCacheHostFaults: a session whose host KV cache cannot be pinned,
// at any of its allocations, fails with an error wrapping ErrOutOfMemory,
// leaves no pinned host memory and no device bytes behind, and the engine
// still runs a session once memory is there.
func TestKVCacheHostFaults(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	for n := 1; n < 64; n++ {
		gpu := &failingPinned{fakeGPU: newFakeGPU(), n: 1 << 30}
		e, err := Open(context.Background(), lm, Options{Backends: []tensor.Backend{gpu}, Context: 64, Chunk: 4, TwinMinTokens: 4,
			Rates: &testRates, Memory: Memory{Budgets: []int64{4 << 20}, KVCache: paging.KVHost}})
		if err != nil {
			t.Fatal(err)
		}
		pinned0 := gpu.pinned.Load()
		used0 := e.budgets[0].UsedBy(paging.KVCache) + e.budgets[0].UsedBy(paging.Activations)
		gpu.n = n
		s, err := e.NewSession()
		if err == nil {
			s.Close()
			e.Close()
			gpu.Close()
			if n == 1 {
				t.Fatal("no pinned allocation failed")
			}
			return // every allocation of a session was failed in turn
		}
		if !errors.Is(err, tensor.ErrOutOfMemory) {
			t.Fatalf("pinned allocation %d failed: %v", n, err)
		}
		if gpu.pinned.Load() != pinned0 || e.budgets[0].UsedBy(paging.KVCache)+e.budgets[0].UsedBy(paging.Activations) != used0 {
			t.Fatalf("pinned allocation %d failed: pinned %d bytes (before %d), device %d bytes (before %d)", n, gpu.pinned.Load(), pinned0, e.budgets[0].UsedBy(paging.KVCache)+e.budgets[0].UsedBy(paging.Activations), used0)
		}
		gpu.n = 1 << 30
		s, err = e.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Forward(context.Background(), []int32{1, 2, 3, 4, 5}, false, nil); err != nil {
			t.Fatal(err)
		}
		s.Close()
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		gpu.Close()
	}
	t.Fatal("sessions kept failing")
}

// TestKVCacheHybrid: the hybrid strategy (two layers on the CPU) with the
// KV cache in host memory,
// under a budget between the least it needs so and the least it needs
// with the cache on the device (which is refused), gives logits
// bit-identical to the model run directly; the CPU attends for the GPU's
// blocks in decode, the report counts every block's cache in host memory,
// the peak stays within the budget and the pinned memory is returned.
func TestKVCacheHybrid(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps, ctx = 6, 256
	want := reference(t, lm, prompt, steps)
	info, err := nn.ModelInfo(lm, lm.Config)
	if err != nil {
		t.Fatal(err)
	}
	rates := paging.Rates{H2D: 10e9, CPU: 20e9, Device: 1e12}
	need := func(kv paging.KVPlacement) int64 {
		_, err := paging.PlanHybrid(info, 1, ctx, 1, rates, paging.HybridOptions{Mode: paging.HybridForced, CPULayers: 2}, paging.WithChunkTokens(4), paging.WithDevice(newFakeGPU()), paging.WithKVPlacement(kv))
		var be *paging.BudgetError
		if !errors.As(err, &be) {
			t.Fatalf("probe plan: %v", err)
		}
		return be.Needed
	}
	hostNeed, devNeed := need(paging.KVHost), need(paging.KVDevice)
	budget := hostNeed + (devNeed-hostNeed)/2
	t.Logf("least budget: %d with the KV cache in host memory, %d on the device; testing at %d", hostNeed, devNeed, budget)
	for _, kv := range []paging.KVPlacement{paging.KVDevice, paging.KVHost} {
		gpu := newFakeGPU()
		o := Options{Backends: []tensor.Backend{gpu}, Context: ctx, Chunk: 4, TwinMinTokens: 4, Rates: &rates,
			Memory: Memory{Budgets: []int64{budget}, Strategy: paging.StrategyHybrid, CPULayers: 2, KVCache: kv}}
		e, err := Open(context.Background(), lm, o)
		if kv == paging.KVDevice {
			if !errors.Is(err, paging.ErrBudgetTooSmall) {
				t.Fatalf("device KV at %d bytes: %v, want ErrBudgetTooSmall", budget, err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s", e.Hybrid().Plan)
		s, err := e.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		got := decode(t, s, prompt, steps)
		for i := range want {
			for j := range want[i] {
				if got[i][j] != want[i][j] {
					t.Fatalf("step %d logit %d: %v, direct %v", i, j, got[i][j], want[i][j])
				}
			}
		}
		r := e.KV()
		t.Logf("%s", r)
		gpuBlocks := 0
		for b := range lm.Config.NumLayers {
			if !slices.Contains(e.Hybrid().Plan.CPULayers, lm.Config.BlockLayer(b)) {
				gpuBlocks++
			}
		}
		if gpuBlocks == 0 || r.Placement != paging.KVHost || r.CPUAttentions < int64(steps*gpuBlocks) || len(r.HostBlocks) != lm.Config.NumLayers || r.HostBytes != nn.KVCacheBytes(lm.Config, ctx, tensor.F32) {
			t.Errorf("%d GPU blocks; report %+v", gpuBlocks, r)
		}
		if peak := e.Devices()[0].PeakDeviceBytes; peak > budget {
			t.Errorf("peak %d over the budget %d", peak, budget)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		if gpu.pinned.Load() != 0 {
			t.Errorf("%d bytes of pinned memory left after Close", gpu.pinned.Load())
		}
		gpu.Close()
	}
}

// TestKVCacheHostSeveralDevices: over two and three fake GPUs, each under
// a budget that streams layers, the KV cache placed host (every block's)
// or auto (each device's plan chooses its own blocks; on this fixture, of
// four blocks, the device scratch of a host block takes what it saves, so
// they stay) gives logits bit-identical to the model run directly; the
// report's host blocks are the plans' in the model's numbering, its bytes
// their sum, decode attends on the CPU over them; each device's peak stays
// within its budget, and the pinned memory is returned at Close.
func TestKVCacheHostSeveralDevices(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps, ctx = 6, 256
	want := reference(t, lm, prompt, steps)
	fastCPU := paging.Rates{H2D: 10e9, CPU: 20e9, Device: 1e12}
	info, err := nn.ModelInfo(lm, lm.Config)
	if err != nil {
		t.Fatal(err)
	}
	_, err = paging.Plan(info, 1, paging.StrategyBalanced, ctx, 1, paging.WithChunkTokens(4), paging.WithDevice(newFakeGPU()))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("probe plan: %v", err)
	}
	for _, devices := range []int{2, 3} {
		// Each device's budget: a share of what one device needs at
		// least for the whole model, which streams layers.
		budget := be.Needed * 2 / int64(devices)
		for _, kv := range []paging.KVPlacement{paging.KVHost, paging.KVAuto} {
			t.Run(fmt.Sprintf("%d devices, %s", devices, kv), func(t *testing.T) {
				var gpus []*fakeGPU
				var bs []tensor.Backend
				for range devices {
					g := newFakeGPU()
					defer g.Close()
					gpus, bs = append(gpus, g), append(bs, g)
				}
				o := Options{Backends: bs, Context: ctx, Chunk: 4, TwinMinTokens: 4, Rates: &fastCPU,
					Memory: Memory{Budgets: []int64{budget}, Strategy: paging.StrategyBalanced, KVCache: kv}}
				e, err := Open(context.Background(), lm, o)
				if err != nil {
					t.Fatal(err)
				}
				var hostBlocks []int
				var hostBytes int64
				streamed := 0
				for _, d := range e.Devices() {
					for _, b := range d.Plan.KVHostBlocks {
						hostBlocks = append(hostBlocks, d.Placement.FirstBlock+b)
					}
					hostBytes += d.Plan.KVHostBytes
					streamed += len(d.Plan.StreamedLayers)
				}
				if streamed == 0 {
					t.Errorf("nothing streamed under %d", budget)
				}
				if kv == paging.KVHost && len(hostBlocks) != lm.Config.NumLayers {
					t.Fatalf("host blocks %v, want every block", hostBlocks)
				}
				s, err := e.NewSession()
				if err != nil {
					t.Fatal(err)
				}
				got := decode(t, s, prompt, steps)
				s.Close()
				for i := range want {
					if d := maxDiff(got[i], want[i]); d != 0 {
						t.Fatalf("step %d: logits differ from the direct run's by %g", i, d)
					}
				}
				r := e.KV()
				t.Logf("%s", r)
				if len(hostBlocks) == 0 {
					if r.Placement != paging.KVDevice || r.HostBytes != 0 {
						t.Errorf("report %+v, with every block's cache on the devices", r)
					}
				} else if fmt.Sprint(r.HostBlocks) != fmt.Sprint(hostBlocks) || r.HostBytes != hostBytes || r.CPUAttentions < int64(steps*len(hostBlocks)) {
					t.Errorf("report %+v; the plans keep blocks %v (%d bytes) in host memory", r, hostBlocks, hostBytes)
				}
				for _, d := range e.Devices() {
					if d.PeakDeviceBytes > budget {
						t.Errorf("%s: peak %d over the budget %d", d.Name, d.PeakDeviceBytes, budget)
					}
				}
				if err := e.Close(); err != nil {
					t.Fatal(err)
				}
				for _, g := range gpus {
					if g.pinned.Load() != 0 {
						t.Errorf("%d bytes of pinned memory left after Close", g.pinned.Load())
					}
				}
			})
		}
	}
}
