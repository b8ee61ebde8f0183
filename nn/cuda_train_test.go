package nn

import (
	"context"
	"math"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

// TestCUDATrainGrads runs the trainer on the GPU over the F16 fixture, as
// the CPU tests do (checkTrainFixture, checkTrainPaged): the loss and every
// gradient against transformers' within 1e-4 relative, with and without
// checkpoints, the activation and device gradient peaks, and again under
// budgets that force layer paging. (cuda.TestModelsLeaveNothing checks
// that nothing stays allocated.)
func TestCUDATrainGrads(t *testing.T) {
	b := openCUDA(t)
	t.Run("resident", func(t *testing.T) { checkTrainFixture(t, b) })
	t.Run("paged", func(t *testing.T) { checkTrainPaged(t, b) })
	if err := tensor.Sync(b); err != nil {
		t.Fatal(err)
	}
}

// TestCUDATrainMatchesCPU checks the GPU trainer against the CPU one, an
// independent implementation of every backward, on synthesised shapes the
// fixture lacks: tied embeddings, Llama attention biases (q, k, v and o), multi-query attention,
// head_dim 64 and 128, BF16 and F32 weights.
func TestCUDATrainMatchesCPU(t *testing.T) {
	b := openCUDA(t)
	ctx := context.Background()
	cpu := tensor.NewCPU(2)
	defer cpu.Close()
	cases := []struct {
		name   string
		dtype  tensor.DType
		adjust func(c *arch.Config)
	}{
		{"tied-mqa-f16", tensor.F16, func(c *arch.Config) { c.TieEmbeddings = true; c.NumKVHeads = 1 }},
		{"llama-bias-bf16", tensor.BF16, func(c *arch.Config) { c.QKVBias = true; c.OutBias = true; c.RopeTheta = 1e6 }},
		{"headdim128-f32", tensor.F32, func(c *arch.Config) { c.HeadDim = 128; c.NumHeads = 4; c.NumKVHeads = 2 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			lc, err := arch.Preset("tiny")
			if err != nil {
				t.Fatal(err)
			}
			tc.adjust(lc)
			lm, err := loader.SynthesizeOpen(ctx, t.TempDir(), lc, loader.SynthOptions{DType: tc.dtype, Seed: 5})
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			cfg := lm.Config
			ids := make([]int32, 97)
			for i := range ids {
				ids[i] = int32((i*7919 + 13) % cfg.VocabSize)
			}
			inputs, next := NextToken(ids)
			targets := append([]int32(nil), next...) // next shares ids' storage
			targets[5] = -1                          // an ignored position
			grads := func(be tensor.Backend) (Grads, float64) {
				hw, err := LoadWeights(ctx, lm, be, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer hw.Close()
				m, err := New(cfg, be, nil, hw)
				if err != nil {
					t.Fatal(err)
				}
				tr, err := CheckpointSequential(m, 2)
				if err != nil {
					t.Fatal(err)
				}
				defer tr.Close()
				g := Grads{}
				st, err := tr.LossAndGrads(ctx, inputs, targets, g, 1)
				if err != nil {
					t.Fatal(err)
				}
				return g, st.Loss
			}
			want, wantLoss := grads(cpu)
			got, gotLoss := grads(b)
			if d := math.Abs(gotLoss-wantLoss) / wantLoss; d > 1e-5 {
				t.Errorf("loss %.7g on the GPU, %.7g on the CPU", gotLoss, wantLoss)
			}
			ref := map[string][]float32{}
			for name, g := range want {
				ref[name] = g.F32()
			}
			worst := compareGrads(t, tc.name, got, ref, 1e-4)
			t.Logf("%s: %d gradients, worst relative difference from the CPU %.2g", tc.name, len(ref), worst)
		})
	}
}
