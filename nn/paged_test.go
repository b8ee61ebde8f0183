package nn

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// newBudget is paging.NewBudget for a test.
func newBudget(t testing.TB, b tensor.Memory, limit int64, device string) *paging.Budget {
	t.Helper()
	bud, err := paging.NewBudget(b, limit, device)
	if err != nil {
		t.Fatal(err)
	}
	return bud
}

// generateIDs runs a prompt and greedy decoding, returning every logit it
// saw and the ids it chose.
func generateIDs(t *testing.T, m *Model, prompt []int32, steps, maxPos, chunk int) ([]float32, []int32) {
	t.Helper()
	s, err := m.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	logits, err := s.Forward(context.Background(), prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	return greedy(t, s, logits, m.cfg.VocabSize, steps)
}

// forwarder is a session's Forward: a Session's or a PipelineSession's.
type forwarder interface {
	Forward(ctx context.Context, ids []int32, all bool, hook Hook) ([]float32, error)
}

// greedy decodes steps greedy tokens on f after a prompt whose logits
// (every position's, or the last's) are first: first's logits and every
// step's after them, and the ids it chose.
func greedy(t *testing.T, f forwarder, first []float32, vocab, steps int) ([]float32, []int32) {
	t.Helper()
	all := append([]float32(nil), first...)
	last := first[len(first)-vocab:]
	var ids []int32
	for range steps {
		id := int32(Argmax(last))
		ids = append(ids, id)
		var err error
		if last, err = f.Forward(context.Background(), []int32{id}, false, nil); err != nil {
			t.Fatal(err)
		}
		all = append(all, last...)
	}
	return all, ids
}

// TestPagedBitIdentical runs the F16 fixtures (Llama, and Qwen3 with tied
// embeddings) with every strategy under a budget that holds only the
// ring, and under one with room to spare, and asserts the logits and ids
// are bit-identical to running with every weight resident; the budget's
// peak never passes its limit and nothing is left allocated after Close.
// With tied embeddings the plan shares the table between the embedding and
// the head, and a decoded token streams it once: under the aggressive
// strategy a token moves the plan's streamed bytes, the layers' bytes less
// the table.
func TestPagedBitIdentical(t *testing.T) {
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyQwen3F16} {
		t.Run(name, func(t *testing.T) { testPagedBitIdentical(t, name) })
	}
}

func testPagedBitIdentical(t *testing.T, fixture string) {
	lm, err := loader.Open(fixtures.Dir(fixture))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	const steps, maxPos, chunk = 12, 32, 8

	b := tensor.NewCPU(1)
	defer b.Close()
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := New(cfg, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	wantLogits, wantIDs := generateIDs(t, ref, prompt, steps, maxPos, chunk)
	hw.Close()

	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The smallest budget any streaming plan accepts.
	_, err = paging.Plan(info, 1, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("a 1-byte budget planned: %v", err)
	}
	minBudget := be.Needed
	for _, strategy := range []paging.Strategy{paging.StrategyNone, paging.StrategyMinimal, paging.StrategyBalanced, paging.StrategyAggressive} {
		for _, budget := range []int64{minBudget, minBudget + lm.WeightBytes()/2, 1 << 30} {
			plan, err := paging.Plan(info, budget, strategy, maxPos, 1, paging.WithChunkTokens(chunk))
			if strategy == paging.StrategyNone && budget < 1<<30 {
				if err == nil {
					t.Errorf("strategy none planned a model of %d bytes in %d", lm.WeightBytes(), budget)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s at %d: %v", strategy, budget, err)
			}
			bud := newBudget(t, b, budget, "cpu")
			pager, err := paging.NewPager(Source(lm), bud, plan, paging.Options{})
			if err != nil {
				t.Fatal(err)
			}
			m, err := New(cfg, b, bud, pager)
			if err != nil {
				t.Fatal(err)
			}
			gotLogits, gotIDs := generateIDs(t, m, prompt, steps, maxPos, chunk)
			for i := range wantIDs {
				if gotIDs[i] != wantIDs[i] {
					t.Fatalf("%s at %d bytes: ids %v, resident run %v", strategy, budget, gotIDs, wantIDs)
				}
			}
			for i := range wantLogits {
				if gotLogits[i] != wantLogits[i] {
					t.Fatalf("%s at %d bytes: logit %d is %v, resident run %v", strategy, budget, i, gotLogits[i], wantLogits[i])
				}
			}
			// At the smallest budget the weights must have streamed: more
			// bytes moved than the model holds.
			if st := pager.Stats(); budget == minBudget && st.BytesHostToDevice <= lm.WeightBytes() {
				t.Errorf("%s at the minimum budget moved only %d bytes for %d of weights", strategy, st.BytesHostToDevice, lm.WeightBytes())
			}
			if bud.Peak() > budget {
				t.Errorf("%s: peak %d over the budget %d", strategy, bud.Peak(), budget)
			}
			var layerBytes int64
			for _, lp := range plan.Layers {
				layerBytes += lp.Bytes
			}
			if tied := cfg.TieEmbeddings; tied != (plan.SharedBytes > 0) || tied && (plan.Layers[0].Shared == nil || plan.Layers[0].Shared.From != len(plan.Layers)-1) {
				t.Errorf("%s: tied embeddings %v, the plan shares %d bytes (first layer: %+v)", strategy, tied, plan.SharedBytes, plan.Layers[0].Shared)
			}
			if strategy == paging.StrategyAggressive && budget == minBudget {
				if got := decodeBytes(t, m, pager, prompt, maxPos, chunk); got != plan.StreamedBytes || plan.StreamedBytes != layerBytes-plan.SharedBytes {
					t.Errorf("aggressive: a token moves %d bytes, the plan streams %d per pass, the layers list %d (shared %d)", got, plan.StreamedBytes, layerBytes, plan.SharedBytes)
				}
			}
			if err := pager.Close(); err != nil {
				t.Error(err)
			}
			if err := bud.Close(); err != nil {
				t.Errorf("%s: %v", strategy, err)
			}
			if bud.Used() != 0 {
				t.Errorf("%s: %d bytes still allocated after Close", strategy, bud.Used())
			}
		}
	}
}

// decodeBytes is the bytes a decoded token moves to the device, the mean
// of three after a prompt.
func decodeBytes(t *testing.T, m *Model, pager *paging.Pager, prompt []int32, maxPos, chunk int) int64 {
	t.Helper()
	s, err := m.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Forward(ctx, prompt, false, nil); err != nil {
		t.Fatal(err)
	}
	before := pager.Stats().BytesHostToDevice
	for i := range 3 {
		if _, err := s.Forward(ctx, []int32{int32(i + 5)}, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	return (pager.Stats().BytesHostToDevice - before) / 3
}

// TestReserveCountsWhatNNAllocates: the reserve nn gives the planner adds
// up to its own byte counts, for a session (KV cache, rotary tables,
// forward buffers, the logits only with the head) and for training.
func TestReserveCountsWhatNNAllocates(t *testing.T) {
	cfg := &arch.Config{HiddenSize: 64, IntermediateSize: 172, NumLayers: 5, NumHeads: 4, NumKVHeads: 2, HeadDim: 16, VocabSize: 300, RopeTheta: 1e4}
	r := Reserve(cfg)
	const maxPos, chunk, batch = 37, 9, 2
	bytes := func(r paging.Reserve, cat paging.Category, blocks int) int64 {
		return r.Bytes(cat, blocks, maxPos, chunk, batch, nil)
	}
	if got, want := bytes(r, paging.KVCache, cfg.NumLayers), batch*KVCacheBytes(cfg, maxPos, tensor.F32); got != want {
		t.Errorf("KV cache %d, want %d", got, want)
	}
	if got, want := bytes(r, paging.Workspace, cfg.NumLayers), batch*(RopeBytes(cfg, maxPos)+GraphPositionBytes); got != want {
		t.Errorf("rotary tables and the graphs' position %d, want %d", got, want)
	}
	if got, want := bytes(r, paging.Activations, cfg.NumLayers), batch*ActivationBytes(cfg, chunk); got != want {
		t.Errorf("activations %d, want %d", got, want)
	}
	info := paging.ModelInfo{Layers: make([]paging.LayerInfo, cfg.NumLayers+2), NumLayers: cfg.NumLayers, Reserve: r}
	first := info.Stage(paging.Placement{FirstBlock: 0, EndBlock: 2, Layers: []int{0, 1, 2}})
	if got, want := bytes(first.Reserve, paging.Activations, 2), batch*(ActivationBytes(cfg, chunk)-4*chunk*int64(cfg.VocabSize)); got != want {
		t.Errorf("a stage without the head: activations %d, want %d (no logits)", got, want)
	}
	for _, onDevice := range []bool{false, true} {
		tr := TrainReserve(cfg, 20, 2, onDevice)
		var got int64
		for _, c := range []paging.Category{paging.KVCache, paging.Activations, paging.Workspace, paging.Gradients} {
			got += bytes(tr, c, cfg.NumLayers)
		}
		want := TrainWorkspaceBytes(cfg, 20, 2)
		if onDevice {
			want += TrainGradientBytes(cfg)
		}
		if got != want || bytes(tr, paging.KVCache, cfg.NumLayers) != 0 {
			t.Errorf("training reserve (gradients on the device %v): %d, want %d and no KV cache", onDevice, got, want)
		}
	}
}

// TestSourceRanges: the model source reads any run of whole rows of a
// tensor as its whole read holds them, on every fixture, and refuses a
// tensor it does not have and a range outside the tensor.
func TestSourceRanges(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{fixtures.TinyLlamaBF16, fixtures.TinyLlamaF16Sharded, fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16} {
		t.Run(name, func(t *testing.T) {
			lm, err := loader.Open(fixtures.Dir(name))
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			src := Source(lm).(paging.RangeSource)
			ranges := 0
			for l := range src.NumLayers() {
				for _, s := range src.LayerTensors(l) {
					whole := make([]byte, s.Bytes)
					if err := src.ReadTensor(ctx, l, s.Name, whole); err != nil {
						t.Fatal(err)
					}
					row := s.Bytes / int64(max(s.Shape[0], 1))
					for _, rows := range []int64{1, 3, 64} {
						for off := int64(0); off < s.Bytes; off += rows * row {
							part := make([]byte, min(rows*row, s.Bytes-off))
							if err := src.ReadTensorRange(ctx, l, s.Name, off, part); err != nil {
								t.Fatalf("layer %d %s: %d bytes at %d: %v", l, s.Name, len(part), off, err)
							}
							if !bytes.Equal(part, whole[off:off+int64(len(part))]) {
								t.Fatalf("layer %d %s: %d bytes at %d differ from the whole read's", l, s.Name, len(part), off)
							}
							ranges++
						}
					}
				}
			}
			if ranges == 0 {
				t.Fatal("no range read")
			}
			s := src.LayerTensors(0)[0]
			if err := src.ReadTensorRange(ctx, 0, "no.such.tensor", 0, make([]byte, 2)); err == nil || !strings.HasPrefix(err.Error(), "nn: ") {
				t.Errorf("a tensor the model lacks: %v", err)
			}
			if err := src.ReadTensorRange(ctx, 0, s.Name, s.Bytes-1, make([]byte, 2)); err == nil {
				t.Error("a range past the tensor's end was read")
			}
		})
	}
}

// TestStageSourceRanges: a stage of a source that reads ranges reads them
// too, in its own numbering, and refuses a layer it lacks; a stage of a
// source that does not read ranges does not claim to.
func TestStageSourceRanges(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaBF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	ctx := context.Background()
	st, ok := StageSource(Source(lm), []int{2, 3}).(paging.RangeSource)
	if !ok {
		t.Fatal("a stage of the model source reads no ranges")
	}
	s := st.LayerTensors(1)[1]
	whole := make([]byte, s.Bytes)
	if err := st.ReadTensor(ctx, 1, s.Name, whole); err != nil {
		t.Fatal(err)
	}
	part := make([]byte, s.Bytes/2)
	if err := st.ReadTensorRange(ctx, 1, s.Name, s.Bytes/4, part); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(part, whole[s.Bytes/4:s.Bytes/4+int64(len(part))]) {
		t.Errorf("stage layer 1 %s: a range differs from the whole read's", s.Name)
	}
	if err := st.ReadTensorRange(ctx, 2, s.Name, 0, part); err == nil || !strings.HasPrefix(err.Error(), "nn: stage has no layer 2") {
		t.Errorf("a layer the stage lacks: %v", err)
	}
	if _, ok := StageSource(wholeSource{Source(lm)}, []int{0}).(paging.RangeSource); ok {
		t.Error("a stage of a source without ranges claims to read them")
	}
}

// wholeSource hides a source's ranges.
type wholeSource struct{ paging.Source }

// TestStageSourceMapped: the model's Source and a stage of it give the
// pager the weight files' mappings (paging.MappedSource), a stage's layer
// l being the model's layer it was given as; with STRATA_MMAP=0 they give
// none.
func TestStageSourceMapped(t *testing.T) {
	for _, mmap := range []string{"", "0"} {
		t.Run("STRATA_MMAP="+mmap, func(t *testing.T) {
			t.Setenv(loader.MmapEnv, mmap)
			lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaBF16))
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			full := Source(lm)
			stage := StageSource(full, []int{2, 3})
			ms, ok := stage.(paging.MappedSource)
			if !ok {
				t.Fatal("a stage of the model's source is not a paging.MappedSource")
			}
			if _, ok := stage.(paging.RangeSource); !ok {
				t.Fatal("a stage of the model's source reads no ranges")
			}
			if got := len(ms.MappedRegions()); (got > 0) != (mmap == "") {
				t.Fatalf("%d mapped regions", got)
			}
			for _, spec := range full.LayerTensors(3) {
				b, ok, err := ms.MappedTensor(1, spec.Name)
				if err != nil || ok != (mmap == "") {
					t.Fatalf("MappedTensor(1, %s): in place %v, %v", spec.Name, ok, err)
				}
				if !ok {
					continue
				}
				want := make([]byte, spec.Bytes)
				if err := full.ReadTensor(context.Background(), 3, spec.Name, want); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(b, want) {
					t.Errorf("stage layer 1 %s: not the model's layer 3 bytes", spec.Name)
				}
			}
			if _, _, err := ms.MappedTensor(2, "x"); err == nil {
				t.Error("MappedTensor of a layer outside the stage succeeded")
			}
		})
	}
}
