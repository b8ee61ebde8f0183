package engine

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// fakeGPU is a CPU backend that passes for a GPU in the hybrid strategy's
// eyes: it pins host memory (ordinary memory here), uploads
// "asynchronously" (at once) and downloads asynchronously (the copy reads
// its source at the first wait for it, as late as a GPU may), so the whole
// CPU+GPU assembly runs, bit for bit, on any machine.
type fakeGPU struct {
	*tensor.CPU
	pinned    atomic.Int64 // bytes of AllocPinned not freed (the pager pins from several goroutines)
	downloads atomic.Int64 // DownloadAsync calls
}

func newFakeGPU() *fakeGPU { return &fakeGPU{CPU: tensor.NewCPU(1)} }

func (f *fakeGPU) Name() string { return "fakegpu" }

func (f *fakeGPU) AllocPinned(n int64) ([]byte, error) {
	f.pinned.Add(n)
	return make([]byte, n), nil
}

func (f *fakeGPU) FreePinned(b []byte) error {
	f.pinned.Add(-int64(len(b)))
	return nil
}

func (f *fakeGPU) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	if err := f.Upload(dst, off, src); err != nil {
		return nil, err
	}
	return func() error { return nil }, nil
}

func (f *fakeGPU) DownloadAsync(dst []byte, src *tensor.Tensor) (ready, landed func() error, err error) {
	f.downloads.Add(1)
	var once sync.Once
	var cerr error
	wait := func() error {
		once.Do(func() { cerr = f.Download(dst, src) })
		return cerr
	}
	return wait, wait, nil
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
		{"planner's split", paging.StrategyHybrid, 0},
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
			if gpu.downloads.Load() == 0 {
				t.Errorf("the twins copied no keys back asynchronously")
			}
			if e.Devices()[0].PeakDeviceBytes > 400<<10 {
				t.Errorf("peak %d over the budget", e.Devices()[0].PeakDeviceBytes)
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

// TestHybridNeedsAGPU: the hybrid strategies refuse a device without a
// copy engine, alone or beside a GPU, and a KV cache in host memory on
// several GPUs, with one line naming the problem.
func TestHybridNeedsAGPU(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaBF16)
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{Backends: cpus(1), Memory: Memory{Strategy: paging.StrategyHybrid}, Rates: &testRates}, "cpu has no copy engine"},
		{Options{Backends: []tensor.Backend{newFakeGPU(), tensor.NewCPU(1)}, Memory: Memory{Strategy: paging.StrategyCPU}, Rates: &testRates}, "cpu has no copy engine"},
		{Options{Backends: []tensor.Backend{newFakeGPU(), newFakeGPU()}, Memory: Memory{Strategy: paging.StrategyHybrid, KVCache: paging.KVHost}, Rates: &testRates},
			"in host memory on one GPU (2 given)"},
	} {
		e, err := Open(context.Background(), lm, tc.o)
		if err == nil {
			e.Close()
			t.Errorf("%d devices, %s: opened", len(tc.o.Backends), tc.o.Memory.Strategy)
		} else if s := err.Error(); !strings.Contains(s, tc.want) || strings.Contains(s, "\n") {
			t.Errorf("error %q, want one line containing %q", s, tc.want)
		}
	}
}

// TestHybridSeveralGPUs: the hybrid strategies over two and three fake
// GPUs and the CPU, with unequal budgets that leave most layers off the
// GPUs: the blocks are placed over the GPUs in proportion to the budgets,
// each GPU's share planned within its own budget (the planner's split, a
// forced count shared among them, every non-resident layer on the CPU);
// logits are bit-identical to the model run directly (a prompt of several
// chunks on the twins, decode steps on the CPU), alone and through the
// batcher; each GPU's peak stays within its budget; the summary shows each
// GPU's plan and the totals add them up; pinned memory is returned.
func TestHybridSeveralGPUs(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps = 6
	want := reference(t, lm, prompt, steps)
	for _, tc := range []struct {
		name      string
		budgets   []int64
		strategy  paging.Strategy
		cpuLayers int
	}{
		{"two GPUs, planner's split", []int64{150 << 10, 200 << 10}, paging.StrategyHybrid, 0},
		{"two GPUs, four CPU layers", []int64{250 << 10, 250 << 10}, paging.StrategyHybrid, 4},
		{"two GPUs, cpu", []int64{150 << 10, 200 << 10}, paging.StrategyCPU, 0},
		{"three GPUs, planner's split", []int64{130 << 10, 130 << 10, 160 << 10}, paging.StrategyHybrid, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var gpus []*fakeGPU
			var bs []tensor.Backend
			for range tc.budgets {
				g := newFakeGPU()
				defer g.Close()
				gpus, bs = append(gpus, g), append(bs, g)
			}
			o := Options{Backends: bs, Context: len(prompt) + steps + 8, Chunk: 4, TwinMinTokens: 4, KVPositions: 32,
				Memory: Memory{Budgets: tc.budgets, Strategy: tc.strategy, CPULayers: tc.cpuLayers}, Rates: &testRates}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			h := e.Hybrid()
			if h == nil || h.Plan != nil || len(h.GPUs) != len(tc.budgets) {
				t.Fatalf("hybrid %+v: want a plan per GPU", h)
			}
			next := 0
			for d, g := range h.GPUs {
				if g.Plan.GPU.Budget != tc.budgets[d] || g.Placement.FirstBlock != next || g.Placement.EndBlock <= next {
					t.Errorf("GPU %d: plan budget %d (given %d), blocks %d..%d after %d", d, g.Plan.GPU.Budget, tc.budgets[d], g.Placement.FirstBlock, g.Placement.EndBlock, next)
				}
				next = g.Placement.EndBlock
			}
			cpu := h.CPULayers()
			if len(cpu) == 0 || tc.cpuLayers > 0 && len(cpu) != tc.cpuLayers || slices.ContainsFunc(h.GPUs, func(g HybridGPU) bool { return g.Plan.StreamedBytes+g.Plan.CPUBytes == 0 }) {
				t.Errorf("CPU layers %v, forced %d", cpu, tc.cpuLayers)
			}
			tot := h.Totals()
			var streamed int64
			for _, p := range h.Plans() {
				streamed += p.StreamedBytes
			}
			if tot.StreamedBytes != streamed || tot.PredictedTokS <= 0 || tc.strategy == paging.StrategyCPU && streamed != 0 {
				t.Errorf("totals %+v, streamed %d", tot, streamed)
			}
			sum := e.Summary()
			t.Logf("%s", sum)
			if !strings.Contains(sum, fmt.Sprintf("hybrid over %d GPUs", len(tc.budgets))) || strings.Count(sum, "fakegpu, layers") != len(tc.budgets) {
				t.Errorf("summary without each GPU's plan:\n%s", sum)
			}
			var cpuBlocks []int
			for _, l := range cpu {
				if l >= 1 && l <= lm.Config.NumLayers {
					cpuBlocks = append(cpuBlocks, l-1)
				}
			}
			if r := e.KV(); fmt.Sprint(r.HostBlocks) != fmt.Sprint(cpuBlocks) {
				t.Errorf("KV report's host blocks %v, the CPU's %v", r.HostBlocks, cpuBlocks)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			s.Close()
			for i := range want {
				if d := maxDiff(got[i], want[i]); d != 0 {
					t.Fatalf("step %d: logits differ from the direct run's by %g (CPU layers %v)", i, d, cpu)
				}
			}
			prompts := [][]int32{{1, 5, 9}, {7, 8, 9, 10, 11}, {3}}
			wantIDs, _ := runAlone(t, e, prompts, 3)
			gotIDs, _ := runBatched(t, e, prompts, 3, BatchOptions{MaxSequences: 3, StepTokens: 4, BlockSize: 4, KVBlocks: 8})
			for i := range prompts {
				if fmt.Sprint(gotIDs[i]) != fmt.Sprint(wantIDs[i]) {
					t.Errorf("batched request %d: %v, alone %v", i, gotIDs[i], wantIDs[i])
				}
			}
			for d, dev := range e.Devices() {
				if dev.PeakDeviceBytes > tc.budgets[d] {
					t.Errorf("GPU %d: peak %d over the budget %d", d, dev.PeakDeviceBytes, tc.budgets[d])
				}
			}
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			for d, g := range gpus {
				if g.pinned.Load() != 0 {
					t.Errorf("GPU %d: %d bytes of pinned memory left after Close", d, g.pinned.Load())
				}
			}
		})
	}
}

// TestHybridSeveralGPUsModels: the hybrid strategy over two fake GPUs, each
// with a budget of a third of the weights, runs a Q8_0 GGUF conversion and
// the mixtures of experts (Qwen3-MoE, and Mixtral as a BF16 GGUF file) with
// logits bit-identical to the model run directly (within 1e-5 for the
// mixtures, whose sparse blocks on the CPU round their experts' sum
// otherwise, on one GPU too) and the same ids, each GPU within its budget.
func TestHybridSeveralGPUsModels(t *testing.T) {
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 40}
	const steps = 5
	for _, m := range []struct {
		name string
		open func(t *testing.T) *loader.Model
		tol  float64
	}{
		{"q8_0", func(t *testing.T) *loader.Model { return openGGUF(t, fixtures.TinyLlamaF16Sharded, quant.Q8_0) }, 0},
		// A sparse block on the CPU's side rounds its experts' sum
		// otherwise (5e-7 on one GPU as on two).
		{"qwen3-moe", func(t *testing.T) *loader.Model { return openFixture(t, fixtures.TinyQwen3MoEF16) }, 1e-5},
		{"mixtral gguf", func(t *testing.T) *loader.Model { return openGGUF(t, fixtures.TinyMixtralBF16, quant.BF16) }, 1e-5},
	} {
		t.Run(m.name, func(t *testing.T) {
			lm := m.open(t)
			want := reference(t, lm, prompt, steps)
			budget := lm.WeightBytes() / 3
			gpus := []tensor.Backend{newFakeGPU(), newFakeGPU()}
			defer gpus[0].Close()
			defer gpus[1].Close()
			e, err := Open(context.Background(), lm, Options{Backends: gpus, Context: len(prompt) + steps, Chunk: 4, TwinMinTokens: 4,
				Memory: Memory{Budgets: []int64{budget}, Strategy: paging.StrategyHybrid}, Rates: &testRates})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			h := e.Hybrid()
			t.Logf("CPU layers %v, totals %+v", h.CPULayers(), h.Totals())
			if t0 := h.Totals(); t0.StreamedBytes+t0.CPUBytes == 0 {
				t.Fatalf("everything resident under %d per GPU", budget)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			s.Close()
			for i := range want {
				if d := maxDiff(got[i], want[i]); d > m.tol || nn.Argmax(got[i]) != nn.Argmax(want[i]) {
					t.Fatalf("step %d: logits differ from the direct run's by %g (want <= %g), or the id", i, d, m.tol)
				}
			}
			for d, dev := range e.Devices() {
				if dev.PeakDeviceBytes > budget {
					t.Errorf("GPU %d: peak %d over the budget %d", d, dev.PeakDeviceBytes, budget)
				}
			}
		})
	}
}

// TestHybridTwinsSkipHostOnlyLayers: while a prompt's chunks run on the
// twins, the pager's walk leaves out the layers that the CPU computes
// whatever the chunk (the embedding on the CPU's side, alone in a stage
// before a block on the GPU or in one with blocks, whose twin gets the
// rows from the CPU), where it used to take every layer and upload the
// embedding into the ring each time a chunk's head wrapped the walk around
// (on the 7B shape 262 MB, 4.9 ms of the H200's link, and the ring's room
// for the next chunk's first layer); a decode step goes back to the
// plan's sequence. The logits stay the direct model's.
func TestHybridTwinsSkipHostOnlyLayers(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17, 4}
	want := reference(t, lm, prompt, 1)
	for _, tc := range []struct {
		name      string
		strategy  paging.Strategy
		cpuLayers int
	}{
		{"planner's split", paging.StrategyHybrid, 0},
		{"two CPU layers", paging.StrategyHybrid, 2},
		{"every non-resident layer on the CPU, the embedding with blocks", paging.StrategyCPU, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu := newFakeGPU()
			defer gpu.Close()
			o := Options{Backends: []tensor.Backend{gpu}, Context: len(prompt) + 2, Chunk: 4, TwinMinTokens: 4,
				Memory: Memory{Budgets: []int64{400 << 10}, Strategy: tc.strategy, CPULayers: tc.cpuLayers}, Rates: &testRates}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			plan := e.Hybrid().Plan
			// The embedding on the CPU's side, the head alone on it.
			hostOnly := map[int]bool{}
			first, last := e.stages[0], e.stages[len(e.stages)-1]
			hostOnly[0] = first.Backend != tensor.Backend(gpu)
			hostOnly[lm.Config.NumLayers+1] = last.Backend != tensor.Backend(gpu) && last.Twin == nil
			if !hostOnly[0] && !hostOnly[lm.Config.NumLayers+1] {
				t.Fatalf("CPU layers %v: neither the embedding nor the head is the CPU's in twin mode", plan.CPULayers)
			}
			pager := e.servers[0].(*paging.Pager)
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.Forward(context.Background(), prompt, false, nil); err != nil {
				t.Fatal(err)
			}
			seq := pager.Sequence()
			for l := range lm.Config.LayerCount() {
				if in := slices.Contains(seq, l); in == hostOnly[l] {
					t.Errorf("CPU layers %v: layer %d in the twins' sequence %v: %v", plan.CPULayers, l, seq, in)
				}
			}
			logits, err := s.Forward(context.Background(), []int32{int32(nn.Argmax(want[0]))}, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(logits, want[1]) {
				t.Errorf("the decode step's logits differ from the direct model's")
			}
			if seq := pager.Sequence(); !slices.Equal(seq, plan.Sequence) {
				t.Errorf("decode: the pager's sequence %v, the plan's %v", seq, plan.Sequence)
			}
		})
	}
}
