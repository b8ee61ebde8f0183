package nn

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// fixtureGrads reads the fixture's grads.safetensors: the loss and the
// gradient of every parameter, by parameter name.
func fixtureGrads(t *testing.T, dir string) (float64, map[string][]float32) {
	t.Helper()
	f, err := loader.OpenSafetensors(dir + "/grads.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]float32{}
	var loss float64
	for _, ti := range f.Tensors() {
		x, err := f.ReadTensor(context.Background(), ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		if ti.Name == "loss" {
			loss = float64(x.F32()[0])
			continue
		}
		name, ok := cutPrefix(ti.Name, "grad.")
		if !ok {
			t.Fatalf("unexpected tensor %s in grads.safetensors", ti.Name)
		}
		out[name] = x.F32()
	}
	return loss, out
}

func cutPrefix(s, p string) (string, bool) {
	if len(s) >= len(p) && s[:len(p)] == p {
		return s[len(p):], true
	}
	return s, false
}

// relErr32 is ||got-want|| / ||want|| in float64.
func relErr32(got, want []float32) float64 {
	w := make([]float64, len(want))
	for i, v := range want {
		w[i] = float64(v)
	}
	return relErr(got, w)
}

// compareGrads checks every reference gradient against got within tol
// (relative, per tensor) and that got has no others.
func compareGrads(t *testing.T, what string, got Grads, want map[string][]float32, tol float64) float64 {
	t.Helper()
	worst := 0.0
	for name, w := range want {
		g, ok := got[name]
		if !ok {
			t.Errorf("%s: no gradient for %s", what, name)
			continue
		}
		e := relErr32(g.F32(), w)
		worst = max(worst, e)
		if e > tol {
			t.Errorf("%s: %s: relative error %.3g, want <= %g", what, name, e, tol)
		}
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("%s: gradient for %s, which the reference lacks", what, name)
		}
	}
	return worst
}

// referenceIDs returns the fixture prompt.
func referenceIDs(t *testing.T, dir string) []int32 {
	t.Helper()
	f, err := loader.OpenSafetensors(dir + "/reference.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	x, err := f.ReadTensor(context.Background(), "input_ids")
	if err != nil {
		t.Fatal(err)
	}
	var ids []int32
	for _, v := range x.I64() {
		ids = append(ids, int32(v))
	}
	return ids
}

// TestTrainGradsMatchFixture runs checkTrainFixture on the CPU.
func TestTrainGradsMatchFixture(t *testing.T) {
	b := tensor.NewCPU(2)
	defer b.Close()
	checkTrainFixture(t, b)
}

// openFixtureModel opens the F16 fixture with its config, the reference
// gradients and the prompt as next-token inputs and targets.
func openFixtureModel(t *testing.T) (lm *loader.Model, cfg *arch.Config, wantLoss float64, want map[string][]float32, inputs, targets []int32) {
	t.Helper()
	dir := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	lm, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	cfg = lm.Config
	wantLoss, want = fixtureGrads(t, dir)
	inputs, targets = NextToken(referenceIDs(t, dir))
	return lm, cfg, wantLoss, want, inputs, targets
}

// checkTrainFixture compares the loss and every gradient computed on b with
// those transformers computed (F32, from the stored F16 weights), without
// checkpoints and with 2 and 4 segments, and checks that checkpointed
// gradients equal the plain ones, that the peak activation bytes are those
// TrainActivationBytes predicts and that the budget counted the same, that
// device gradients stay within TrainGradientBytes (none are charged on the
// host), and that nothing stays allocated.
func checkTrainFixture(t *testing.T, b tensor.Backend) {
	lm, cfg, wantLoss, want, inputs, targets := openFixtureModel(t)
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	_, onHost := b.(*tensor.CPU)

	var plain Grads
	var peaks []int64
	for _, segments := range []int{0, 1, 2, 4} {
		budget := newBudget(t, b, 1<<30, b.Name())
		m, err := New(cfg, b, budget, hw)
		if err != nil {
			t.Fatal(err)
		}
		tr, err := CheckpointSequential(m, segments)
		if err != nil {
			t.Fatal(err)
		}
		g := Grads{}
		st, err := tr.LossAndGrads(context.Background(), inputs, targets, g, 1)
		if err != nil {
			t.Fatal(err)
		}
		if err := tr.Close(); err != nil {
			t.Error(err)
		}
		what := fmt.Sprintf("%s, %d segments", b.Name(), segments)
		if d := math.Abs(st.Loss-wantLoss) / wantLoss; d > 1e-5 {
			t.Errorf("%s: loss %.7g, transformers %.7g", what, st.Loss, wantLoss)
		}
		worst := compareGrads(t, what, g, want, 1e-4)
		t.Logf("%s: loss %.6f (transformers %.6f), worst relative gradient error %.2g, peak activations %d B, recomputed %d blocks",
			what, st.Loss, wantLoss, worst, st.PeakActivationBytes, st.RecomputedBlocks)
		if plain == nil {
			plain = g
		} else {
			for name, p := range plain {
				if e := relErr32(g[name].F32(), p.F32()); e > 1e-6 {
					t.Errorf("%s: %s differs from the plain gradient by %.3g (relative)", what, name, e)
				}
			}
		}
		if pred := TrainActivationBytes(cfg, len(inputs), segments); st.PeakActivationBytes != pred {
			t.Errorf("%s: peak activations %d B, TrainActivationBytes predicts %d", what, st.PeakActivationBytes, pred)
		}
		// A device's caching allocator rounds each block up (by under
		// 1/64, at least 512 bytes): the budget charges what it takes.
		if p := categoryPeak(budget, paging.Activations); !withinRounding(b, p, st.PeakActivationBytes) {
			t.Errorf("%s: the budget's activation peak is %d B, the trainer counted %d", what, p, st.PeakActivationBytes)
		}
		gp := categoryPeak(budget, paging.Gradients)
		if onHost && gp != 0 || !onHost && (gp <= 0 || !withinRounding(b, gp, min(gp, TrainGradientBytes(cfg)))) {
			t.Errorf("%s: gradients peaked at %d B of the budget; want 0 on the host, within (0, %d] on a device", what, gp, TrainGradientBytes(cfg))
		}
		if held := budget.Used() - budget.UsedBy(paging.Cached) - deviceFixed(b); held != 0 {
			t.Errorf("%s: %d bytes still allocated after the pass", what, held)
		}
		wantRecomputed := 0
		if segments > 1 {
			wantRecomputed = tr.bounds[segments-1]
		}
		if st.RecomputedBlocks != wantRecomputed {
			t.Errorf("%s: recomputed %d blocks, want %d", what, st.RecomputedBlocks, wantRecomputed)
		}
		peaks = append(peaks, st.PeakActivationBytes)
		if err := budget.Close(); err != nil {
			t.Error(err)
		}
	}
	// 0 and 1 segment are the same pass; more segments keep less.
	if peaks[0] != peaks[1] || !(peaks[2] < peaks[1] && peaks[3] < peaks[2]) {
		t.Errorf("peak activations for 0, 1, 2, 4 segments: %v, want equal then falling", peaks)
	}
}

// TestTrainForwardMatchesInference checks that the training forward's
// hidden states are the inference forward's bit for bit, checkpointed or
// not.
func TestTrainForwardMatchesInference(t *testing.T) {
	m, _, done := openFixture(t, fixtures.TinyLlamaBF16)
	defer done()
	c := m.Config()
	ids := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3, 99, 7}
	want := make([][]float32, c.NumLayers+2)
	s, err := m.NewSession(32, 32)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Forward(context.Background(), ids, true, func(layer int, h *tensor.Tensor) error {
		want[layer] = append([]float32(nil), h.F32()...)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, segments := range []int{1, 3} {
		got := make([][]float32, c.NumLayers+2)
		calls := 0
		tr, err := NewTrainer(m, TrainOptions{Segments: segments, Hook: func(layer int, h *tensor.Tensor) error {
			calls++
			got[layer] = append([]float32(nil), h.F32()...)
			return nil
		}})
		if err != nil {
			t.Fatal(err)
		}
		targets := append(append([]int32(nil), ids[1:]...), -1)
		if _, err := tr.LossAndGrads(context.Background(), ids, targets, Grads{}, 1); err != nil {
			t.Fatal(err)
		}
		if calls != c.NumLayers+2 {
			t.Errorf("%d segments: hook called %d times, want %d (recomputation must not call it)", segments, calls, c.NumLayers+2)
		}
		for layer := range want {
			if len(got[layer]) != len(want[layer]) {
				t.Fatalf("%d segments: layer %d: %d values, inference %d", segments, layer, len(got[layer]), len(want[layer]))
			}
			for i := range want[layer] {
				if got[layer][i] != want[layer][i] {
					t.Fatalf("%d segments: layer %d value %d is %v, inference %v", segments, layer, i, got[layer][i], want[layer][i])
				}
			}
		}
	}
}

// TestTrainPaged runs checkTrainPaged on the CPU.
func TestTrainPaged(t *testing.T) {
	b := tensor.NewCPU(2)
	defer b.Close()
	checkTrainPaged(t, b)
}

// checkTrainPaged runs the backward on b with weights paged under a budget
// smaller than the model: gradients equal the resident run's, the pager
// serves the reverse sweep without thrashing (the bytes it moves for the
// backward stay near the forward's), and the budget is never exceeded.
func checkTrainPaged(t *testing.T, b tensor.Backend) {
	lm, cfg, _, want, inputs, targets := openFixtureModel(t)
	T := len(inputs)
	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, onHost := b.(*tensor.CPU)

	for _, segments := range []int{1, 2} {
		for _, strategy := range []paging.Strategy{paging.StrategyMinimal, paging.StrategyBalanced, "balanced+room"} {
			spare := int64(0)
			if strategy == "balanced+room" { // room for some weights to stay
				strategy, spare = paging.StrategyBalanced, lm.WeightBytes()/6
			}
			what := fmt.Sprintf("%s, %s, %d segments, %d spare bytes", b.Name(), strategy, segments, spare)
			info := info
			info.Reserve = TrainReserve(cfg, T, segments, !onHost)
			extra := TrainWorkspaceBytes(cfg, T, segments)
			if !onHost {
				extra += TrainGradientBytes(cfg)
			}
			// The smallest budget the strategy plans with, leaving room for
			// the training's activations (and device gradients).
			_, err := paging.Plan(info, 1, strategy, T, 1, paging.WithDevice(b))
			var be *paging.BudgetError
			if !errors.As(err, &be) {
				t.Fatalf("%s: a 1-byte budget planned: %v", what, err)
			}
			limit := be.Needed + spare
			if limit-extra-deviceFixed(b) >= lm.WeightBytes() {
				t.Fatalf("%s: the smallest budget %d holds the whole model (%d B) beside %d B of workspace: nothing would page",
					what, limit, lm.WeightBytes(), extra)
			}
			plan, err := paging.Plan(info, limit, strategy, T, 1, paging.WithDevice(b))
			if err != nil {
				t.Fatal(err)
			}
			budget := newBudget(t, b, limit, b.Name())
			pager, err := paging.NewPager(Source(lm), budget, plan, paging.Options{})
			if err != nil {
				t.Fatal(err)
			}
			m, err := New(cfg, b, budget, pager)
			if err != nil {
				t.Fatal(err)
			}
			var fwdBytes int64
			tr, err := NewTrainer(m, TrainOptions{Segments: segments, Hook: func(layer int, _ *tensor.Tensor) error {
				if layer == cfg.NumLayers+1 { // the final norm: the forward's weights are in
					fwdBytes = pager.Stats().BytesHostToDevice
				}
				return nil
			}})
			if err != nil {
				t.Fatal(err)
			}
			g := Grads{}
			st, err := tr.LossAndGrads(context.Background(), inputs, targets, g, 1)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			if err := tr.Close(); err != nil {
				t.Error(err)
			}
			compareGrads(t, what, g, want, 1e-4)
			ps := pager.Stats()
			bwdBytes := ps.BytesHostToDevice - fwdBytes
			// The backward sweeps the blocks once more, and the recomputed
			// ones twice; allow one extra load of the largest layer.
			var largest, blocks int64
			for i, l := range lm.Layers() {
				largest = max(largest, l.Bytes)
				if i >= 1 && i <= cfg.NumLayers {
					blocks += l.Bytes
				}
			}
			recomputed := float64(st.RecomputedBlocks) / float64(cfg.NumLayers)
			limitBwd := int64(float64(fwdBytes)*(1+recomputed)) + largest
			t.Logf("%s: budget %d B (weights %d B), forward moved %d B, backward %d B, %d loads, %d evictions, peak %d B",
				what, limit, lm.WeightBytes(), fwdBytes, bwdBytes, ps.Loads, ps.Evictions, budget.Peak())
			if fwdBytes < blocks/2 {
				t.Errorf("%s: the forward moved only %d B of %d B of blocks: the budget did not force paging", what, fwdBytes, blocks)
			}
			if bwdBytes > limitBwd {
				t.Errorf("%s: the backward moved %d B, more than %d B (forward %d B): thrashing", what, bwdBytes, limitBwd, fwdBytes)
			}
			if budget.Peak() > limit {
				t.Errorf("%s: peak %d B over the budget %d B", what, budget.Peak(), limit)
			}
			if err := pager.Close(); err != nil {
				t.Error(err)
			}
			if err := budget.Close(); err != nil {
				t.Errorf("%s: %v", what, err)
			}
		}
	}
}

// categoryPeak returns the peak bytes a budget allocated to a category.
// deviceFixed is the device memory the backend holds outside allocations
// (a library's workspace), which a budget charges from the start.
func deviceFixed(b tensor.Memory) int64 {
	if ca, ok := tensor.Caching(b); ok {
		return ca.Fixed()
	}
	return 0
}

// withinRounding reports whether charged is what a budget charges for
// allocations of want bytes in all: exactly want without a caching
// allocator, otherwise at least want and at most the rounding of the
// blocks (under 1/64 each, 512 bytes at least) above it.
func withinRounding(b tensor.Memory, charged, want int64) bool {
	if _, ok := tensor.Caching(b); !ok {
		return charged == want
	}
	return charged >= want && charged <= want+want/64+64<<10
}

func categoryPeak(bg *paging.Budget, c paging.Category) int64 {
	for _, cs := range bg.Categories() {
		if cs.Category == c.String() {
			return cs.PeakAllocated
		}
	}
	return -1
}

// TestTrainStagedGrads runs the device backends' gradient path on the CPU:
// each layer's gradients in buffers from the allocator, copied to a staging
// buffer and added into the Grads by a goroutine while the next layer
// computes. The gradients are those of the direct path bit for bit, with a
// tied embedding (the head's and the embedding's uses meet in one tensor),
// and a second pass adds onto the first, while one that overwrites (as
// Step's does) gives the first pass's gradients again. Run under -race this
// checks the additions in flight against the embedding's.
func TestTrainStagedGrads(t *testing.T) {
	ctx := context.Background()
	lc, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	lc.TieEmbeddings = true
	lm, err := loader.SynthesizeOpen(ctx, t.TempDir(), lc, loader.SynthOptions{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	b := tensor.NewCPU(2)
	defer b.Close()
	hw, err := LoadWeights(ctx, lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	ids := make([]int32, 41)
	for i := range ids {
		ids[i] = int32((i*131 + 7) % cfg.VocabSize)
	}
	inputs, targets := NextToken(ids)
	for _, segments := range []int{1, 2} {
		run := func(staged bool) (first, second Grads) {
			budget := newBudget(t, b, 1<<30, "cpu")
			defer budget.Close()
			m, err := New(cfg, b, budget, hw)
			if err != nil {
				t.Fatal(err)
			}
			tr, err := CheckpointSequential(m, segments)
			if err != nil {
				t.Fatal(err)
			}
			tr.stageGrads = staged
			defer tr.Close()
			g := Grads{}
			if _, err := tr.LossAndGrads(ctx, inputs, targets, g, 1); err != nil {
				t.Fatal(err)
			}
			first = Grads{}
			for name, x := range g {
				first[name] = tensor.New(tensor.F32, x.Shape())
				copy(first[name].F32(), x.F32())
			}
			if _, err := tr.LossAndGrads(ctx, inputs, targets, g, 1); err != nil {
				t.Fatal(err)
			}
			// A pass that overwrites (Step's) forgets the two before it.
			over := Grads{}
			for name, x := range g {
				over[name] = tensor.New(tensor.F32, x.Shape())
				copy(over[name].F32(), x.F32())
			}
			if _, err := tr.lossAndGrads(ctx, inputs, targets, over, 1, true); err != nil {
				t.Fatal(err)
			}
			for name, x := range first {
				if !bytes.Equal(over[name].Bytes(), x.Bytes()) {
					t.Errorf("staged %v, %d segments: %s after an overwriting pass differs from the first pass", staged, segments, name)
				}
			}
			if staged {
				if gp := categoryPeak(budget, paging.Gradients); gp <= 0 || gp > TrainGradientBytes(cfg) {
					t.Errorf("staged gradients peaked at %d B, want within (0, %d]", gp, TrainGradientBytes(cfg))
				}
			}
			if budget.Used() != 0 {
				t.Errorf("%d bytes still allocated", budget.Used())
			}
			return first, g
		}
		want1, want2 := run(false)
		got1, got2 := run(true)
		if len(got1) != len(want1) {
			t.Fatalf("%d segments: %d gradients staged, %d direct", segments, len(got1), len(want1))
		}
		for name, w := range want1 {
			if !bytes.Equal(got1[name].Bytes(), w.Bytes()) {
				t.Errorf("%d segments: %s differs between the staged and the direct path", segments, name)
			}
			if e := relErr32(got2[name].F32(), want2[name].F32()); e > 1e-6 {
				t.Errorf("%d segments: %s after two passes differs by %.3g (relative)", segments, name, e)
			}
		}
	}
}
