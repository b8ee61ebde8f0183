package engine

import (
	"context"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// expertBudget is the budget of one device that holds lm's layers
// resident and slots experts, for Open with the options given.
func expertBudget(t *testing.T, lm *loader.Model, contextLen, chunk, slots int) int64 {
	t.Helper()
	info, err := nn.ModelInfo(lm, lm.Config)
	if err != nil {
		t.Fatal(err)
	}
	p, err := paging.Plan(info, 1<<40, paging.StrategyBalanced, contextLen, 1, paging.WithChunkTokens(chunk), paging.WithExpertCache(lm.Config.MoE.ExpertsPerToken))
	if err != nil {
		t.Fatal(err)
	}
	return p.PredictedPeakBytes - p.ExpertCacheBytes + int64(slots)*p.ExpertSlotBytes
}

// TestOpenPagesExperts: a mixture of experts through Open pages its
// experts in an expert cache the plan sizes, on one device and on two;
// decoding moves only missed and prefetched experts, Stats and the
// summary report the cache and ExpertGuesses the guesses; the logits are
// the model's run directly. With no budget the cache holds every expert,
// loaded by Open.
func TestOpenPagesExperts(t *testing.T) {
	lm := openFixture(t, fixtures.TinyQwen3MoEF16)
	prompt := []int32{1, 5, 9, 200, 3, 77, 18}
	const steps, chunk = 8, 8
	ctxLen := len(prompt) + steps
	want := reference(t, lm, prompt, steps)
	cfg := lm.Config
	k := cfg.MoE.ExpertsPerToken
	var eb int64
	x0 := cfg.LayerExperts(cfg.BlockLayer(0))[0]
	for _, r := range []arch.Role{arch.ExpertGate, arch.ExpertUp, arch.ExpertDown} {
		ti, _ := lm.Tensor(x0[r])
		eb += ti.Size
	}
	slots := k + 4
	for _, tc := range []struct {
		name    string
		devices int
		budget  int64
		policy  paging.ExpertPolicy
	}{
		{"no budget", 1, 0, ""},
		{"one device, lru", 1, expertBudget(t, lm, ctxLen, chunk, slots), paging.ExpertLRU},
		{"one device, lfu", 1, expertBudget(t, lm, ctxLen, chunk, slots), paging.ExpertLFU},
		{"two devices", 2, expertBudget(t, lm, ctxLen, chunk, 2*slots) / 2, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := Options{Backends: cpus(tc.devices), Context: ctxLen, Chunk: chunk, Memory: Memory{ExpertPolicy: tc.policy}}
			if tc.budget > 0 {
				o.Memory.Budgets = []int64{tc.budget}
			}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := e.Close(); err != nil {
					t.Error(err)
				}
			}()
			total := cfg.NumLayers * cfg.MoE.Experts
			st := e.Stats()
			if st.ExpertsTotal != total || st.ExpertSlots == 0 {
				t.Fatalf("stats: %d experts in %d slots, want %d experts", st.ExpertsTotal, st.ExpertSlots, total)
			}
			if tc.budget == 0 && (st.ExpertSlots != total || st.ExpertsCached != total) {
				t.Errorf("no budget: %d slots, %d cached after Open, want every expert", st.ExpertSlots, st.ExpertsCached)
			}
			if tc.budget > 0 && st.ExpertSlots >= total {
				t.Errorf("budget %d: the cache holds all %d experts", tc.budget, total)
			}
			if tc.policy != "" && st.ExpertPolicy != tc.policy {
				t.Errorf("policy %s, want %s", st.ExpertPolicy, tc.policy)
			}
			opened := st
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			logits, err := s.Forward(context.Background(), prompt, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			e.MarkStep()
			for i := range steps {
				for j := range logits {
					if logits[j] != want[i][j] {
						t.Fatalf("step %d logit %d: %v, direct %v", i, j, logits[j], want[i][j])
					}
				}
				if logits, err = s.Forward(context.Background(), []int32{int32(nn.Argmax(logits))}, false, nil); err != nil {
					t.Fatal(err)
				}
				e.MarkStep()
			}
			e.Experts() // settles the prefetches under way
			st = e.Stats()
			if st.ExpertHits+st.ExpertMisses != st.ExpertAcquires || st.ExpertAcquires == 0 {
				t.Errorf("%d hits + %d misses != %d acquires", st.ExpertHits, st.ExpertMisses, st.ExpertAcquires)
			}
			if st.ExpertBytesMoved != (st.ExpertMisses+st.ExpertPrefetches)*eb {
				t.Errorf("%d expert bytes moved for %d misses and %d prefetches of %d bytes", st.ExpertBytesMoved, st.ExpertMisses, st.ExpertPrefetches, eb)
			}
			guessed, right := e.ExpertGuesses()
			if tc.budget > 0 && (guessed != int64(steps*(cfg.NumLayers-tc.devices)*k) || right > guessed) {
				// A guess is for the next sparse block on the same device.
				t.Errorf("%d experts guessed (%d right), want %d", guessed, right, steps*(cfg.NumLayers-tc.devices)*k)
			}
			if tc.budget == 0 && (guessed != 0 || st.ExpertMisses != opened.ExpertMisses) {
				t.Errorf("every expert cached: %d guessed, %d misses after Open", guessed, st.ExpertMisses-opened.ExpertMisses)
			}
			if tc.budget > 0 {
				for _, d := range e.Devices() {
					if d.PeakDeviceBytes > d.BudgetBytes || d.Plan.Experts == 0 {
						t.Errorf("%s: peak %d over budget %d, or no expert cache (%d experts)", d.Name, d.PeakDeviceBytes, d.BudgetBytes, d.Plan.Experts)
					}
				}
			}
			r := e.Experts()
			if r == nil || r.Experts != total || r.Misses != st.ExpertMisses || r.Guessed != guessed || r.Routing != "router" || r.ExpertBytes != eb {
				t.Fatalf("report %+v, stats %+v", r, st)
			}
			w := r.Since(e2r(opened), steps)
			if w.Tokens != steps || w.Misses != st.ExpertMisses-opened.ExpertMisses || w.MissesPerToken != float64(w.Misses)/steps ||
				w.HitRate != float64(w.Hits)/float64(w.Acquires) || !strings.Contains(w.String(), "per token over 8") {
				t.Errorf("window %+v", w)
			}
			if !strings.Contains(e.Summary(), "experts: cache") {
				t.Errorf("summary without the expert cache:\n%s", e.Summary())
			}
		})
	}
}

// e2r is the report of stats taken earlier, as Engine.Experts reports.
func e2r(st paging.Stats) *ExpertReport {
	return &ExpertReport{Acquires: st.ExpertAcquires, Hits: st.ExpertHits, Misses: st.ExpertMisses, BytesMoved: st.ExpertBytesMoved,
		Prefetches: st.ExpertPrefetches, PrefetchHits: st.ExpertPrefetchHits}
}

// TestOpenPagesGGUFExperts: a mixture of experts converted to a float GGUF
// file (its experts stacked per projection) pages its experts one by one
// under a budget that holds a few of them, and decodes with the logits of
// the safetensors model run directly, bit for bit.
func TestOpenPagesGGUFExperts(t *testing.T) {
	prompt := []int32{1, 5, 9, 200, 3, 77, 18}
	const steps, chunk = 6, 8
	ctxLen := len(prompt) + steps
	for _, tc := range []struct {
		fixture string
		base    quant.Type
	}{
		{fixtures.TinyQwen3MoEF16, quant.F16},
		{fixtures.TinyMixtralBF16, quant.F32},
	} {
		t.Run(tc.fixture, func(t *testing.T) {
			want := reference(t, openFixture(t, tc.fixture), prompt, steps)
			lm := openGGUF(t, tc.fixture, tc.base)
			cfg := lm.Config
			var eb int64
			for _, name := range cfg.LayerExperts(cfg.BlockLayer(0))[1] {
				if ti, ok := lm.Tensor(name); ok {
					eb += ti.Size
				}
			}
			budget := expertBudget(t, lm, ctxLen, chunk, cfg.MoE.ExpertsPerToken+2)
			e, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: ctxLen, Chunk: chunk, Memory: Memory{Budgets: []int64{budget}}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			total := cfg.NumLayers * cfg.MoE.Experts
			if st := e.Stats(); st.ExpertsTotal != total || st.ExpertSlots == 0 || st.ExpertSlots >= total {
				t.Fatalf("stats: %d experts in %d slots, want %d experts in fewer slots", st.ExpertsTotal, st.ExpertSlots, total)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			logits, err := s.Forward(context.Background(), prompt, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			for i := range steps {
				for j := range logits {
					if math.Float32bits(logits[j]) != math.Float32bits(want[i][j]) {
						t.Fatalf("step %d logit %d: %v, the safetensors model's %v", i, j, logits[j], want[i][j])
					}
				}
				if logits, err = s.Forward(context.Background(), []int32{int32(nn.Argmax(logits))}, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			e.Experts() // settles the prefetches under way
			st := e.Stats()
			if st.ExpertMisses == 0 || st.ExpertBytesMoved != (st.ExpertMisses+st.ExpertPrefetches)*eb {
				t.Errorf("%d expert bytes moved for %d misses and %d prefetches of %d bytes", st.ExpertBytesMoved, st.ExpertMisses, st.ExpertPrefetches, eb)
			}
		})
	}
}

// dequantizedGGUF writes lm (a GGUF model) again as an F32 GGUF file, each
// tensor's values as lm's dequantized, and opens it: the float model that
// lm's quantized products approximate.
func dequantizedGGUF(t *testing.T, lm *loader.Model, tok *loader.Model) *loader.Model {
	t.Helper()
	ctx := context.Background()
	types := map[string]quant.Type{}
	for _, spec := range lm.Config.ExpectedTensors() {
		types[spec.Name] = quant.F32
	}
	tk, err := tok.Tokenizer()
	if err != nil {
		t.Fatal(err)
	}
	v, err := tk.GGUFVocab(lm.Config.VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "dequantized.gguf")
	cfg := *lm.Config
	cfg.DType = tensor.F32
	err = loader.WriteGGUFModel(ctx, path, loader.GGUFModel{Config: &cfg, Vocab: v, Types: types, FileType: loader.GGUFFileType(quant.F32),
		Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
			ti, _ := lm.Tensor(spec.Name)
			return lm.ReadRows(ctx, ti, r0, r1, dst)
		}})
	if err != nil {
		t.Fatal(err)
	}
	m, err := loader.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// relRMS is the RMS of got - want over the RMS of want.
func relRMS(got, want []float32) float64 {
	var d, w float64
	for i := range want {
		d += (float64(got[i]) - float64(want[i])) * (float64(got[i]) - float64(want[i]))
		w += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(d / w)
}

// TestOpenPagesQuantizedExperts: a mixture of experts converted to a Q8_0
// GGUF file keeps its experts in Q8_0 (Qwen3-MoE's down projections, rows
// of 48, in F16), pages them one by one in their stored size under a
// budget that holds a few, and decodes with the logits of the same file
// run directly, bit for bit; the expert bytes moved are the misses' and
// prefetches' Q8_0 bytes. Its logits at every prompt position are those
// of the F32 model of the dequantized weights within 1e-3 relative RMS (the
// quantized products round the activations to 16 bits per block), and the
// fixture's own within 3e-2 (the quantization of the weights; measured
// 1e-4 and 1.8e-2).
func TestOpenPagesQuantizedExperts(t *testing.T) {
	prompt := []int32{1, 5, 9, 200, 3, 77, 18}
	const steps, chunk = 6, 8
	ctxLen := len(prompt) + steps
	for _, fixture := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(fixture, func(t *testing.T) {
			src := openFixture(t, fixture)
			lm := openGGUF(t, fixture, quant.Q8_0)
			cfg := lm.Config
			var eb, q8 int64
			x1 := cfg.LayerExperts(cfg.BlockLayer(0))[1]
			for _, r := range []arch.Role{arch.ExpertGate, arch.ExpertUp, arch.ExpertDown} {
				name := x1[r]
				ti, ok := lm.Tensor(name)
				if !ok {
					t.Fatalf("no tensor %s", name)
				}
				eb += ti.Size
				if ti.DType == tensor.Q8_0 {
					q8++
					if want, _ := tensor.Q8_0.ShapeBytes(ti.Shape); ti.Size != want {
						t.Errorf("%s: %d bytes, Q8_0 %v takes %d", name, ti.Size, ti.Shape, want)
					}
				}
			}
			if q8 < 2 {
				t.Fatalf("%d of expert 1's projections in Q8_0, want 2 or 3", q8)
			}
			want := reference(t, lm, prompt, steps)
			budget := expertBudget(t, lm, ctxLen, chunk, cfg.MoE.ExpertsPerToken+2)
			e, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: ctxLen, Chunk: chunk, Memory: Memory{Budgets: []int64{budget}}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			total := cfg.NumLayers * cfg.MoE.Experts
			if st := e.Stats(); st.ExpertsTotal != total || st.ExpertSlots == 0 || st.ExpertSlots >= total {
				t.Fatalf("stats: %d experts in %d slots, want %d experts in fewer slots", st.ExpertsTotal, st.ExpertSlots, total)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			for i := range want {
				for j := range want[i] {
					if math.Float32bits(got[i][j]) != math.Float32bits(want[i][j]) {
						t.Fatalf("step %d logit %d: %v paged, %v direct", i, j, got[i][j], want[i][j])
					}
				}
			}
			e.Experts() // settles the prefetches under way
			st := e.Stats()
			if st.ExpertMisses == 0 || st.ExpertBytesMoved != (st.ExpertMisses+st.ExpertPrefetches)*eb {
				t.Errorf("%d expert bytes moved for %d misses and %d prefetches of %d bytes", st.ExpertBytesMoved, st.ExpertMisses, st.ExpertPrefetches, eb)
			}

			all := func(m *loader.Model) []float32 {
				t.Helper()
				b := tensor.NewCPU(1)
				defer b.Close()
				hw, err := nn.LoadWeights(context.Background(), m, b, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer hw.Close()
				nm, err := nn.New(m.Config, b, nil, hw)
				if err != nil {
					t.Fatal(err)
				}
				s, err := nm.NewSession(len(prompt), chunk)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				l, err := s.Forward(context.Background(), prompt, true, nil)
				if err != nil {
					t.Fatal(err)
				}
				return l
			}
			q, deq, ref := all(lm), all(dequantizedGGUF(t, lm, src)), all(src)
			dq, dr := relRMS(q, deq), relRMS(q, ref)
			t.Logf("logits at %d positions: relative RMS %.2e from the dequantized F32 model, %.2e from the fixture's", len(prompt), dq, dr)
			if dq > 1e-3 || dr > 3e-2 {
				t.Errorf("relative RMS %.2e from the dequantized model (bound 1e-3), %.2e from the fixture (bound 3e-2)", dq, dr)
			}
		})
	}
}

// TestOpenExpertsOnCPU: with experts paged under a budget that holds a
// few, a missing expert is computed on the CPU from host memory instead of
// uploaded as Memory.ExpertsCPU says: always, never, or auto with rates
// that make the CPU cheaper (a slow link) or dearer (a slow CPU) than the
// upload of an expert, or a CPU slower than the link for one expert, with
// which no miss goes to the CPU however many a layer has (the layer is
// charged the CPU's path and the link's in series, as the H200 ran them);
// on one device and on two. The logits of a prompt and of decode steps are the model's
// run directly, bit for bit (the device is a CPU too); experts on the CPU
// are counted in Stats, the report and the summary, and their bytes are
// not moved: the bytes moved are the misses' and prefetches' only.
func TestOpenExpertsOnCPU(t *testing.T) {
	prompt := []int32{1, 5, 9, 200, 3, 77, 18}
	const steps, chunk = 6, 8
	ctxLen := len(prompt) + steps
	slowLink := &paging.Rates{H2D: 1e6, CPU: 1e12}
	slowCPU := &paging.Rates{H2D: 1e12, CPU: 1e6}
	for _, fixture := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		lm := openFixture(t, fixture)
		cfg := lm.Config
		want := reference(t, lm, prompt, steps)
		var eb int64
		x0 := cfg.LayerExperts(cfg.BlockLayer(0))[0]
		for _, r := range []arch.Role{arch.ExpertGate, arch.ExpertUp, arch.ExpertDown} {
			ti, _ := lm.Tensor(x0[r])
			eb += ti.Size
		}
		slots := cfg.MoE.ExpertsPerToken + 2
		// Each expert uploads in 1 ms and takes the CPU 1.5: the link
		// is sooner for each, and the CPU's products do not hide behind
		// the others' uploads.
		split := &paging.Rates{H2D: float64(eb) * 1e3, CPU: float64(eb) / 1.5e-3}
		for _, tc := range []struct {
			name    string
			devices int
			policy  paging.ExpertCPUPolicy
			rates   *paging.Rates
			onCPU   bool // some experts computed on the CPU
		}{
			{"always", 1, paging.ExpertCPUAlways, nil, true},
			{"never", 1, paging.ExpertCPUNever, slowLink, false},
			{"auto, slow link", 1, paging.ExpertCPUAuto, slowLink, true},
			{"auto, slow CPU", 1, paging.ExpertCPUAuto, slowCPU, false},
			{"auto, a CPU slower than each upload", 1, paging.ExpertCPUAuto, split, false},
			{"auto without rates", 1, "", nil, false},
			{"always, two devices", 2, paging.ExpertCPUAlways, nil, true},
		} {
			t.Run(fixture+"/"+tc.name, func(t *testing.T) {
				budget := expertBudget(t, lm, ctxLen, chunk, tc.devices*slots) / int64(tc.devices)
				o := Options{Backends: cpus(tc.devices), Context: ctxLen, Chunk: chunk, Rates: tc.rates,
					Memory: Memory{Budgets: []int64{budget}, ExpertsCPU: tc.policy}}
				e, err := Open(context.Background(), lm, o)
				if err != nil {
					t.Fatal(err)
				}
				defer func() {
					if err := e.Close(); err != nil {
						t.Error(err)
					}
				}()
				if st := e.Stats(); st.ExpertSlots == 0 || st.ExpertSlots >= st.ExpertsTotal {
					t.Fatalf("%d slots of %d experts: nothing pages", st.ExpertSlots, st.ExpertsTotal)
				}
				s, err := e.NewSession()
				if err != nil {
					t.Fatal(err)
				}
				got := decode(t, s, prompt, steps)
				for i := range want {
					for j := range want[i] {
						if math.Float32bits(got[i][j]) != math.Float32bits(want[i][j]) {
							t.Fatalf("step %d logit %d: %v, direct %v", i, j, got[i][j], want[i][j])
						}
					}
				}
				r := e.Experts()
				st := e.Stats()
				t.Logf("%s", r)
				if (st.ExpertsOnCPU > 0) != tc.onCPU || st.ExpertCPUBytes != st.ExpertsOnCPU*eb || st.ExpertCPUTokens < st.ExpertsOnCPU {
					t.Errorf("%d experts on the CPU (%d bytes, %d tokens of %d-byte experts), want some: %v", st.ExpertsOnCPU, st.ExpertCPUBytes, st.ExpertCPUTokens, eb, tc.onCPU)
				}
				if st.ExpertBytesMoved != (st.ExpertMisses+st.ExpertPrefetches)*eb {
					t.Errorf("%d expert bytes moved for %d misses and %d prefetches of %d bytes", st.ExpertBytesMoved, st.ExpertMisses, st.ExpertPrefetches, eb)
				}
				if r.OnCPU != st.ExpertsOnCPU || tc.onCPU && (!strings.Contains(r.String(), "experts on the CPU") || !strings.Contains(e.Summary(), "experts computed on the CPU")) {
					t.Errorf("report %+v; summary:\n%s", r, e.Summary())
				}
				if st.ExpertsPinned != 0 {
					t.Errorf("%d experts left pinned", st.ExpertsPinned)
				}
				if auto := tc.policy == paging.ExpertCPUAuto && tc.rates != nil; (r.Rates != nil) != auto || auto && *r.Rates != *tc.rates || auto && !strings.Contains(r.String(), "split by link") {
					t.Errorf("the report's rates %+v, want those auto split with (%v): %s", r.Rates, auto, r)
				}
			})
		}
	}
}

// lookupGPU is a fakeGPU whose ordinary uploads cost what the CUDA
// backend's do: a look-up of the source among its pinned allocations (it
// records how many were live at each), and whose hand-over takes a
// known time (handDelay each way).
type lookupGPU struct {
	*fakeGPU
	mu        sync.Mutex
	live      int // pinned allocations not freed
	maxLookup int // the most live at an Upload
	downloads int
}

const handDelay = 100 * time.Microsecond

// spin waits d on the calling goroutine (a sleep of 100 us takes a
// millisecond on some hosts).
func spin(d time.Duration) {
	for t0 := time.Now(); time.Since(t0) < d; {
	}
}

func (g *lookupGPU) AllocPinned(n int64) ([]byte, error) {
	g.mu.Lock()
	g.live++
	g.mu.Unlock()
	return g.fakeGPU.AllocPinned(n)
}

func (g *lookupGPU) FreePinned(b []byte) error {
	g.mu.Lock()
	g.live--
	g.mu.Unlock()
	return g.fakeGPU.FreePinned(b)
}

func (g *lookupGPU) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	g.mu.Lock()
	g.maxLookup = max(g.maxLookup, g.live)
	g.mu.Unlock()
	spin(handDelay)
	return g.fakeGPU.Upload(dst, off, src)
}

func (g *lookupGPU) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	g.mu.Lock()
	g.downloads++
	g.mu.Unlock()
	spin(handDelay)
	return g.fakeGPU.Download(dst, src)
}

func (g *lookupGPU) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	if err := g.fakeGPU.Upload(dst, off, src); err != nil {
		return nil, err
	}
	return func() error { return nil }, nil
}

// TestExpertRatesHandoff: -experts-cpu auto measures its rates at Open
// over one expert of the model, as the CPU computes it, with the
// hand-over decode makes (a download of the rows once the compute is done,
// an upload from ordinary memory). The expert's copies for the CPU's
// measurement are one pinned allocation, not one per matrix repeated to
// the measured size: on the GPU the fixtures' tiny experts made tens of
// thousands of them, and each upload of the hand-over, which looks its
// source up among them, measured 0.9 ms (TestCUDAExpertsOnCPU on the
// H200) where decode's take 20 us. A hand-over is measured as half of a
// download and an upload of the fake's known time, not less; the CPU's
// rate over a chunk's rows and over two products at once are measured too.
func TestExpertRatesHandoff(t *testing.T) {
	rb, cb := rateBytes, cpuRateMinBytes
	rateBytes, cpuRateMinBytes = 1<<20, 8<<20 // 8 MiB of 12 KiB experts: hundreds of copies
	t.Cleanup(func() { rateBytes, cpuRateMinBytes = rb, cb })
	prompt := []int32{1, 5, 9}
	const ctxLen, chunk = 8, 4
	lm := openFixture(t, fixtures.TinyMixtralBF16)
	gpu := &lookupGPU{fakeGPU: newFakeGPU()}
	defer gpu.Close()
	budget := expertBudget(t, lm, ctxLen, chunk, lm.Config.MoE.ExpertsPerToken+2)
	e, err := Open(context.Background(), lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: chunk,
		Memory: Memory{Budgets: []int64{budget}, ExpertsCPU: paging.ExpertCPUAuto}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	r := e.expertRates
	if r == nil {
		t.Fatal("auto measured no rates")
	}
	gpu.mu.Lock()
	lookup, downloads := gpu.maxLookup, gpu.downloads
	gpu.mu.Unlock()
	t.Logf("rates: H2D %.2f GB/s, CPU %.2f GB/s (%.2f over a chunk's rows), hand-over %v; at most %d pinned allocations live at a hand-over's upload", r.H2D/1e9, r.CPU/1e9, r.CPURows/1e9, r.Handoff, lookup)
	if lookup > 2 {
		t.Errorf("%d pinned allocations live while the hand-over was measured, want at most 2 (the copy's and the CPU's)", lookup)
	}
	if downloads == 0 || r.Handoff < handDelay || r.Handoff > 50*handDelay {
		t.Errorf("hand-over %v over %d downloads, want half of a download and an upload of %v each (and not 50 times that)", r.Handoff, downloads, handDelay)
	}
	if !(r.CPURows > 0) || !(r.CPUExperts > 0) {
		t.Errorf("the CPU's rate over a chunk's rows %v, over two products at once %v, want them measured", r.CPURows, r.CPUExperts)
	}
	s, err := e.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Forward(context.Background(), prompt, false, nil); err != nil {
		t.Fatal(err)
	}
}
