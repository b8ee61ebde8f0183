package nn

import (
	"context"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

// refLoss is the mean next-token cross-entropy of the float64 reference
// model.
func refLoss(r *refModel, inputs, targets []int32) float64 {
	logits, _ := r.forward(inputs)
	s, n := 0.0, 0
	for t, z := range logits {
		if targets[t] < 0 {
			continue
		}
		mx := math.Inf(-1)
		for _, v := range z {
			mx = math.Max(mx, v)
		}
		sum := 0.0
		for _, v := range z {
			sum += math.Exp(v - mx)
		}
		s += mx + math.Log(sum) - z[targets[t]]
		n++
	}
	return s / float64(n)
}

// TestTrainGradsFiniteDifferences checks the whole backward on model shapes
// the fixtures do not cover (tied embeddings, biases, multi- and
// single-query attention, BF16 and F32 weights, llama3 rotary scaling)
// against central finite differences of the float64 reference model, at a
// sample of every parameter's entries (its largest gradient and random
// ones).
func TestTrainGradsFiniteDifferences(t *testing.T) {
	cases := synthCases
	if testing.Short() {
		cases = cases[:4]
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := arch.Preset("tiny")
			if err != nil {
				t.Fatal(err)
			}
			cfg.NumLayers, cfg.VocabSize, cfg.IntermediateSize, cfg.HiddenSize = 2, 53, 40, 32
			cfg.HeadDim = 8
			tc.edit(cfg)
			lm, err := loader.SynthesizeOpen(context.Background(), t.TempDir(), cfg, loader.SynthOptions{DType: tc.dtype, Seed: 11})
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			ncfg := lm.Config
			params, err := LoadParams(context.Background(), lm)
			if err != nil {
				t.Fatal(err)
			}
			ref := &refModel{cfg: ncfg, w: map[string][]float64{}}
			for _, name := range params.Names() {
				ref.w[name] = to64(params.Tensor(name).ToF32())
			}
			b := tensor.NewCPU(2)
			defer b.Close()
			m, err := New(ncfg, b, nil, params)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(9, 9))
			ids := make([]int32, 9)
			for i := range ids {
				ids[i] = int32(rng.IntN(ncfg.VocabSize))
			}
			inputs, targets := NextToken(ids)
			targets = append([]int32(nil), targets...)
			targets[2] = -1 // an ignored position
			tr, err := CheckpointSequential(m, 2)
			if ncfg.QKNorm || ncfg.MoE != nil {
				// Inference only: the trainer refuses them.
				if err == nil || !strings.Contains(err.Error(), "cannot be trained") {
					t.Fatalf("CheckpointSequential of a %v model: %v, want a refusal", ncfg.Family, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			g := Grads{}
			st, err := tr.LossAndGrads(context.Background(), inputs, targets, g, 1)
			if err != nil {
				t.Fatal(err)
			}
			if want := refLoss(ref, inputs, targets); math.Abs(st.Loss-want) > 1e-5*want {
				t.Errorf("loss %.8g, float64 reference %.8g", st.Loss, want)
			}
			if len(g) != len(params.Names()) {
				t.Errorf("%d gradients for %d parameters", len(g), len(params.Names()))
			}
			const h = 1e-4
			worst := 0.0
			for _, name := range params.Names() {
				gv := g[name].F32()
				w := ref.w[name]
				big, idx := 0, []int{}
				for i, v := range gv {
					if math.Abs(float64(v)) > math.Abs(float64(gv[big])) {
						big = i
					}
				}
				idx = append(idx, big, rng.IntN(len(w)), rng.IntN(len(w)))
				scale := math.Abs(float64(gv[big]))
				for _, i := range idx {
					old := w[i]
					w[i] = old + h
					up := refLoss(ref, inputs, targets)
					w[i] = old - h
					down := refLoss(ref, inputs, targets)
					w[i] = old
					fd := (up - down) / (2 * h)
					e := math.Abs(float64(gv[i])-fd) / math.Max(scale, 1e-3)
					worst = max(worst, e)
					if e > 1e-3 {
						t.Errorf("%s[%d]: gradient %.6g, finite difference %.6g", name, i, gv[i], fd)
					}
				}
			}
			t.Logf("worst error relative to each tensor's largest gradient: %.2g", worst)
		})
	}
}
