package nn

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

// synthCase is a model shape the fixtures do not cover.
type synthCase struct {
	name  string
	edit  func(c *arch.Config)
	dtype tensor.DType
}

var synthCases = []synthCase{
	{"mha-f32", func(c *arch.Config) { c.NumKVHeads = c.NumHeads }, tensor.F32},
	{"gqa-f16", func(c *arch.Config) { c.NumHeads, c.NumKVHeads = 6, 2; c.HeadDim = 8 }, tensor.F16},
	{"mqa-bf16", func(c *arch.Config) { c.NumKVHeads = 1 }, tensor.BF16},
	{"tied", func(c *arch.Config) { c.TieEmbeddings = true }, tensor.F16},
	{"qwen2-bias", func(c *arch.Config) {
		c.SetFamily(arch.Qwen2)
		c.RopeTheta = 1e6
	}, tensor.F32},
	{"llama-attention-bias", func(c *arch.Config) {
		c.QKVBias, c.OutBias = true, true
	}, tensor.F32},
	{"rope-theta-500k-llama3", func(c *arch.Config) {
		c.RopeTheta = 500000
		c.RopeScaling = &arch.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 16}
	}, tensor.F32},
	{"mistral-head-dim", func(c *arch.Config) {
		c.SetFamily(arch.Mistral)
		c.HeadDim = 32 // head_dim unequal to hidden/heads
	}, tensor.BF16},
	{"qwen3-bias-tied", func(c *arch.Config) {
		c.SetFamily(arch.Qwen3)
		c.HeadDim, c.QKVBias, c.OutBias, c.TieEmbeddings = 24, true, true, true
	}, tensor.F16},
	{"mixtral-top2", func(c *arch.Config) { c.SetFamily(arch.Mixtral) }, tensor.BF16},
	{"mixtral-top1-tied", func(c *arch.Config) {
		c.SetFamily(arch.Mixtral)
		c.MoE.Experts, c.MoE.ExpertsPerToken, c.TieEmbeddings = 5, 1, true
	}, tensor.F32},
	{"qwen3-moe-mlp-only-layers", func(c *arch.Config) {
		c.SetFamily(arch.Qwen3MoE)
		// Block 1 dense (mlp_only_layers), the others sparse; every token
		// picks 3 of 6.
		c.MoE = &arch.MoE{Experts: 6, ExpertsPerToken: 3, ExpertSize: 20, SparseStep: 1, DenseLayers: []int{1}, NormTopK: true}
	}, tensor.F16},
	{"qwen2-moe-shared-sparse-step-2", func(c *arch.Config) {
		c.SetFamily(arch.Qwen2MoE)
		// Block 1 sparse (decoder_sparse_step 2), the others dense.
		c.MoE = &arch.MoE{Experts: 4, ExpertsPerToken: 2, ExpertSize: 24, SharedExperts: 1, SharedSize: 60, SparseStep: 2}
	}, tensor.F32},
	{"qwen2-moe-top1-renormalised-no-bias", func(c *arch.Config) {
		c.SetFamily(arch.Qwen2MoE)
		c.QKVBias = false
		c.MoE = &arch.MoE{Experts: 3, ExpertsPerToken: 1, ExpertSize: 16, SharedExperts: 1, SharedSize: 90, SparseStep: 1, NormTopK: true}
	}, tensor.BF16},
}

// TestSynthesizedAgainstReference runs models of other shapes, written by
// the synthesiser, and compares every position's logits and every hidden
// state with the float64 reference.
func TestSynthesizedAgainstReference(t *testing.T) {
	for _, tc := range synthCases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := arch.Preset("tiny")
			if err != nil {
				t.Fatal(err)
			}
			cfg.NumLayers, cfg.VocabSize, cfg.IntermediateSize = 3, 97, 50
			tc.edit(cfg)
			dir := t.TempDir()
			lm, err := loader.SynthesizeOpen(context.Background(), dir, cfg, loader.SynthOptions{DType: tc.dtype, Seed: 7, MaxShardBytes: 20000})
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			ncfg := lm.Config
			ref := &refModel{cfg: ncfg, w: map[string][]float64{}}
			for _, ti := range lm.Tensors() {
				x, err := lm.ReadTensor(context.Background(), ti.Name)
				if err != nil {
					t.Fatal(err)
				}
				var v []float64
				for _, f := range x.ToF32() {
					v = append(v, float64(f))
				}
				ref.w[ti.Name] = v
			}
			b := tensor.NewCPU(2)
			defer b.Close()
			w, err := LoadWeights(context.Background(), lm, b, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer w.Close()
			m, err := New(ncfg, b, nil, w)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			ids := make([]int32, 20)
			for i := range ids {
				ids[i] = int32(rng.IntN(ncfg.VocabSize))
			}
			wantLogits, wantHidden := ref.forward(ids)

			s, err := m.NewSession(32, 7)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			hidden := make([][]float32, ncfg.NumLayers+2)
			hook := func(layer int, h *tensor.Tensor) error {
				hidden[layer] = append(hidden[layer], h.F32()...)
				return nil
			}
			// Prefill the first 12 positions, then decode one at a time.
			logits, err := s.Forward(context.Background(), ids[:12], true, hook)
			if err != nil {
				t.Fatal(err)
			}
			got := append([]float32(nil), logits...)
			for _, id := range ids[12:] {
				l, err := s.Forward(context.Background(), []int32{id}, false, hook)
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, l...)
			}
			if e := relErr(got, flatten(wantLogits)); e > 1e-4 {
				t.Errorf("logits: relative error %g against the float64 reference", e)
			}
			for layer := range hidden {
				if e := relErr(hidden[layer], flatten(wantHidden[min(layer, len(wantHidden)-1)])); layer != ncfg.NumLayers && e > 1e-4 {
					t.Errorf("layer %d hidden state: relative error %g", layer, e)
				}
			}
		})
	}
}

func flatten(m [][]float64) []float64 {
	var out []float64
	for _, r := range m {
		out = append(out, r...)
	}
	return out
}

// relErr is ||got-want|| / ||want||; NaN or a length mismatch is +Inf.
func relErr(got []float32, want []float64) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	var num, den float64
	for i := range got {
		d := float64(got[i]) - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	if math.IsNaN(num) || den == 0 {
		return math.Inf(1)
	}
	return math.Sqrt(num / den)
}
