package nn

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// fixtureParams loads the F16 fixture's parameters and a model reading them
// on the CPU backend.
func fixtureParams(t *testing.T) (*Params, *Model, *loader.Model) {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	cfg := lm.Config
	p, err := LoadParams(context.Background(), lm)
	if err != nil {
		t.Fatal(err)
	}
	b := tensor.NewCPU(2)
	t.Cleanup(func() { b.Close() })
	m, err := New(cfg, b, nil, p)
	if err != nil {
		t.Fatal(err)
	}
	return p, m, lm
}

// inferenceLoss is the mean next-token cross-entropy from the inference
// forward's logits, in float64.
func inferenceLoss(t *testing.T, m *Model, ids []int32) float64 {
	t.Helper()
	s, err := m.NewSession(len(ids), len(ids))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	logits, err := s.Forward(context.Background(), ids, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	V, sum := m.Config().VocabSize, 0.0
	for i := 0; i+1 < len(ids); i++ {
		z := logits[i*V : (i+1)*V]
		mx := math.Inf(-1)
		for _, v := range z {
			mx = math.Max(mx, float64(v))
		}
		e := 0.0
		for _, v := range z {
			e += math.Exp(float64(v) - mx)
		}
		sum += mx + math.Log(e) - float64(z[ids[i+1]])
	}
	return sum / float64(len(ids)-1)
}

// TestTrainStepLossFalls trains the F16 fixture on its prompt with AdamW, a
// loss scaler and checkpoints: the loss falls, the scale grows after its
// interval of good steps, and the inference forward of the updated F16
// working copies gives the loss the trainer reports for them.
func TestTrainStepLossFalls(t *testing.T) {
	p, m, _ := fixtureParams(t)
	ids := referenceIDs(t, fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	inputs, targets := NextToken(ids)
	tr, err := NewTrainer(m, TrainOptions{Segments: 2, MaxGradNorm: 1})
	if err != nil {
		t.Fatal(err)
	}
	opt := NewAdamW(1e-2)
	scaler := NewLossScaler(1024, 10)
	var losses []float64
	for range 24 {
		r, err := tr.Step(context.Background(), inputs, targets, p, opt, scaler)
		if err != nil {
			t.Fatal(err)
		}
		if r.Skipped {
			t.Fatalf("step skipped at scale %v", r.Scale)
		}
		losses = append(losses, r.Loss)
	}
	t.Logf("loss %.4f -> %.4f over %d steps; scale %v", losses[0], losses[len(losses)-1], len(losses), scaler.Scale)
	if !(losses[len(losses)-1] < 0.5*losses[0]) {
		t.Errorf("loss went from %.4f to %.4f: it did not halve", losses[0], losses[len(losses)-1])
	}
	if scaler.Scale != 4096 {
		t.Errorf("scale %v after 24 good steps with interval 10, want 4096", scaler.Scale)
	}
	st, err := tr.LossAndGrads(context.Background(), inputs, targets, Grads{}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if want := inferenceLoss(t, m, ids); math.Abs(st.Loss-want) > 1e-5*want {
		t.Errorf("trainer loss %.7g, inference forward's %.7g", st.Loss, want)
	}
}

// TestTrainStepOverflowSkips runs a step whose scaled gradients overflow
// float32 (a loss scale of 2¹²⁷ and gradients above 2, the loss itself
// finite): the update is
// skipped, no weight changes and the scale is halved. A step whose loss is
// not finite (an F16 weight overflowed to infinity) is an error naming the
// block that produced it, with or without a scaler: no scale fixes the
// forward.
func TestTrainStepOverflowSkips(t *testing.T) {
	p, m, _ := fixtureParams(t)
	inputs, targets := NextToken(referenceIDs(t, fixtures.Dir(fixtures.TinyLlamaF16Sharded)))
	tr, err := NewTrainer(m, TrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// A final norm of 1000 makes the LM head's gradient about 1000 times
	// larger, the logits still far from overflowing.
	for i := range p.Master(arch.NormName) {
		p.Master(arch.NormName)[i] = 1000
	}
	p.Sync(arch.NormName)
	before := map[string][]byte{}
	for _, n := range p.Names() {
		before[n] = append([]byte(nil), p.Tensor(n).Bytes()...)
	}
	const big = float32(1 << 127)
	scaler := NewLossScaler(big, 100)
	r, err := tr.Step(context.Background(), inputs, targets, p, &SGD{LR: 0.1}, scaler)
	if err != nil {
		t.Fatal(err)
	}
	if !r.Skipped || scaler.Scale != big/2 || scaler.Skipped() != 1 || math.IsNaN(r.Loss) || math.IsInf(r.Loss, 0) {
		t.Fatalf("skipped %v, scale %v, loss %v: want a skipped step of finite loss and the scale halved", r.Skipped, scaler.Scale, r.Loss)
	}
	for _, n := range p.Names() {
		if string(before[n]) != string(p.Tensor(n).Bytes()) {
			t.Fatalf("%s changed in a skipped step", n)
		}
	}

	name := "model.layers.1.mlp.up_proj.weight"
	p.Master(name)[5] = 1e6 // beyond F16's range: the working copy is +Inf
	p.Sync(name)
	if v := tensor.F16ToF32One(p.Tensor(name).U16()[5]); !math.IsInf(float64(v), 1) {
		t.Fatalf("working copy %v, want +Inf", v)
	}
	for _, sc := range []*LossScaler{NewLossScaler(1024, 100), nil} {
		_, err := tr.Step(context.Background(), inputs, targets, p, &SGD{LR: 0.1}, sc)
		var ne *NonFiniteError
		if !errors.As(err, &ne) || ne.Layer != 2 || !strings.Contains(err.Error(), "loss is NaN") {
			t.Errorf("scaler %v: %v, want the loss's error naming block 1", sc != nil, err)
		}
		if sc != nil && sc.Skipped() != 0 {
			t.Error("a non-finite loss counted as a skipped step")
		}
	}
	if _, err := tr.LossAndGrads(context.Background(), inputs, targets, Grads{}, float32(math.Inf(1))); err == nil {
		t.Error("an infinite loss scale was accepted")
	}
}

// TestParamsSave trains a step, saves the checkpoint, and reads it back with
// the loader: the forward of the saved model equals the forward of the
// trained parameters bit for bit, the config and tokenizer came along, and
// a second save into the same directory replaces the first (sharded this
// time).
func TestParamsSave(t *testing.T) {
	p, m, lm := fixtureParams(t)
	ids := referenceIDs(t, fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	inputs, targets := NextToken(ids)
	tr, err := NewTrainer(m, TrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Step(context.Background(), inputs, targets, p, NewAdamW(1e-2), nil); err != nil {
		t.Fatal(err)
	}
	trained, _ := generateIDs(t, m, ids, 4, 32, 32)

	dir := filepath.Join(t.TempDir(), "out")
	for _, shard := range []int64{0, 100_000} {
		if err := p.Save(context.Background(), dir, lm, shard); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} {
			if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
				t.Errorf("shard %d: %v", shard, err)
			}
		}
		_, errSingle := os.Stat(filepath.Join(dir, "model.safetensors"))
		_, errIndex := os.Stat(filepath.Join(dir, "model.safetensors.index.json"))
		if (shard == 0) != (errSingle == nil) || (shard == 0) == (errIndex == nil) {
			t.Errorf("shard %d: model.safetensors %v, index %v", shard, errSingle, errIndex)
		}
		saved, err := loader.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		cfg := saved.Config
		hw, err := LoadWeights(context.Background(), saved, m.Backend(), nil)
		if err != nil {
			t.Fatal(err)
		}
		m2, err := New(cfg, m.Backend(), nil, hw)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := generateIDs(t, m2, ids, 4, 32, 32)
		for i := range trained {
			if got[i] != trained[i] {
				t.Fatalf("shard %d: logit %d of the saved model is %v, the trained parameters give %v", shard, i, got[i], trained[i])
			}
		}
		hw.Close()
		saved.Close()
	}
	if err := p.Save(context.Background(), lm.Dir, lm, 0); err == nil {
		t.Error("saving over the source directory was accepted")
	}
}

// TestParamsSaveTied checks that a model with tied embeddings is saved
// without lm_head.weight and that its single table got both uses'
// gradient.
func TestParamsSaveTied(t *testing.T) {
	cfg, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cfg.NumLayers, cfg.VocabSize, cfg.TieEmbeddings = 1, 40, true
	src := t.TempDir()
	lm, err := loader.SynthesizeOpen(context.Background(), src, cfg, loader.SynthOptions{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	p, err := LoadParams(context.Background(), lm)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range p.Names() {
		if n == arch.LMHeadName {
			t.Fatal("tied parameters list lm_head.weight")
		}
	}
	dir := t.TempDir()
	if err := p.Save(context.Background(), dir, lm, 0); err != nil {
		t.Fatal(err)
	}
	f, err := loader.OpenSafetensors(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, ti := range f.Tensors() {
		if ti.Name == arch.LMHeadName {
			t.Error("the tied checkpoint holds lm_head.weight")
		}
	}
	if len(f.Tensors()) != len(p.Names()) {
		t.Errorf("%d tensors saved, %d parameters", len(f.Tensors()), len(p.Names()))
	}
}

func TestTrainErrors(t *testing.T) {
	p, m, _ := fixtureParams(t)
	ctx := context.Background()
	tr, err := NewTrainer(m, TrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	V := int32(m.Config().VocabSize)
	for _, tc := range []struct {
		name            string
		inputs, targets []int32
		grads           Grads
		scale           float32
	}{
		{"no tokens", nil, nil, Grads{}, 1},
		{"targets mismatch", []int32{1, 2}, []int32{2}, Grads{}, 1},
		{"input outside vocab", []int32{1, V}, []int32{2, 3}, Grads{}, 1},
		{"negative input", []int32{-1, 2}, []int32{2, 3}, Grads{}, 1},
		{"target outside vocab", []int32{1, 2}, []int32{2, V}, Grads{}, 1},
		{"all ignored", []int32{1, 2}, []int32{-1, -1}, Grads{}, 1},
		{"nil grads", []int32{1, 2}, []int32{2, 3}, nil, 1},
		{"negative scale", []int32{1, 2}, []int32{2, 3}, Grads{}, -1},
		{"NaN scale", []int32{1, 2}, []int32{2, 3}, Grads{}, float32(math.NaN())},
		{"wrong gradient shape", []int32{1, 2}, []int32{2, 3}, Grads{arch.NormName: tensor.New(tensor.F32, tensor.Shape{3})}, 1},
	} {
		if _, err := tr.LossAndGrads(ctx, tc.inputs, tc.targets, tc.grads, tc.scale); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	if _, err := CheckpointSequential(m, m.Config().NumLayers+1); err == nil {
		t.Error("more segments than blocks were accepted")
	}

	// A budget too small for the activations: an out-of-memory error and
	// nothing left allocated.
	cfg := m.Config()
	budget := newBudget(t, m.Backend(), TrainActivationBytes(cfg, 11, 1)/2, "cpu")
	defer budget.Close()
	small, err := New(m.Config(), m.Backend(), budget, p)
	if err != nil {
		t.Fatal(err)
	}
	tr, err = NewTrainer(small, TrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ids := referenceIDs(t, fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	inputs, targets := NextToken(ids)
	_, err = tr.LossAndGrads(ctx, inputs, targets, Grads{}, 1)
	if !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Errorf("half the activation bytes: error %v, want one wrapping ErrOutOfMemory", err)
	}
	if budget.Used() != 0 {
		t.Errorf("%d bytes left allocated after a failed pass", budget.Used())
	}
	// A cancelled context stops the pass.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	tr, _ = NewTrainer(m, TrainOptions{})
	if _, err := tr.LossAndGrads(cctx, inputs, targets, Grads{}, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled context: %v", err)
	}
}
