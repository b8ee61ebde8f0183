package nn

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

// TestUpdateNonFinite: an update that leaves a NaN or an infinity in a
// working copy (a NaN gradient, a master beyond F16's range) is an error
// naming the parameter and element, with valid hyperparameters.
func TestUpdateNonFinite(t *testing.T) {
	f16 := func(v ...float32) *tensor.Tensor {
		x := tensor.New(tensor.F16, tensor.Shape{len(v)})
		tensor.F32ToF16(x.U16(), v)
		return x
	}
	bf16 := func(v ...float32) *tensor.Tensor {
		x := tensor.New(tensor.BF16, tensor.Shape{len(v)})
		tensor.F32ToBF16(x.U16(), v)
		return x
	}
	for _, c := range []struct {
		name  string
		w     *tensor.Tensor
		grad  []float32
		opt   Optimizer
		index int
	}{
		{"F16 overflow", f16(1, 65504, 2), []float32{0, -16, 0}, &SGD{LR: 1}, 1},
		{"F32 NaN gradient", f32Tensor(1, 2, 3), []float32{0, 0, float32(nan)}, &SGD{LR: 0.1}, 2},
		{"BF16 infinite gradient", bf16(1, 2, 3), []float32{float32(negInf), 0, 0}, NewAdamW(1e-3), 0},
		{"F16 NaN gradient, momentum", f16(1, 2, 3, 4), []float32{0, 0, 0, float32(nan)}, &SGD{LR: 0.1, Momentum: 0.9}, 3},
	} {
		p := testParams(t, map[string]*tensor.Tensor{"w": c.w})
		err := c.opt.Step(p, Grads{"w": f32Tensor(c.grad...)})
		if !errors.Is(err, ErrNonFinite) {
			t.Errorf("%s: %v, want ErrNonFinite", c.name, err)
			continue
		}
		if want := "left non-finite values in w: element " + itoa(c.index); !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %q does not name w and %s", c.name, err, want)
		}
		if err := p.CheckFinite(); !errors.Is(err, ErrNonFinite) {
			t.Errorf("%s: CheckFinite after the step: %v", c.name, err)
		}
	}
}

// TestTrainStepNonFiniteWeights: a step whose update pushes the F16
// embedding of the input tokens past F16's range, with valid
// hyperparameters, fails naming the table instead of training on.
func TestTrainStepNonFiniteWeights(t *testing.T) {
	p, m, _ := fixtureParams(t)
	tr, err := NewTrainer(m, TrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// 65519.9 rounds to F16's largest value, 65504; a step of AdamW moves
	// each element the inputs use by about LR (the gradients, scaled down
	// by the first norm, are far above Eps), and the ones moving up round
	// to +Inf. The forward sees finite values: the norms scale them.
	w := p.Master(arch.EmbedName)
	for i := range w {
		w[i] = 65519.9
	}
	p.Sync(arch.EmbedName)
	if err := p.CheckFinite(); err != nil {
		t.Fatalf("finite weights: %v", err)
	}
	opt := NewAdamW(1)
	opt.WeightDecay, opt.Eps = 0, 1e-30
	_, err = tr.Step(context.Background(), []int32{1, 42, 71, 345}, []int32{42, 71, 345, 81}, p, opt, NewLossScaler(1, 10))
	if !errors.Is(err, ErrNonFinite) || !strings.Contains(err.Error(), arch.EmbedName) {
		t.Fatalf("%v, want ErrNonFinite naming %s", err, arch.EmbedName)
	}
}

// TestSaveRefusesNonFinite: Save of parameters holding a NaN or an
// infinity, in the master or only in the working copy, fails naming the
// tensor before writing anything, and leaves an earlier checkpoint as it
// was.
func TestSaveRefusesNonFinite(t *testing.T) {
	const name = "model.layers.2.mlp.gate_proj.weight"
	for _, c := range []struct {
		what string
		v    float32
		want string
	}{
		{"NaN master", float32(nan), "element 9 is NaN"},
		{"-Inf master", float32(negInf), "element 9 is -Inf"},
		{"master beyond F16", 1e6, "element 9 is +Inf in F16"},
	} {
		t.Run(c.what, func(t *testing.T) {
			p, _, lm := fixtureParams(t)
			dir := filepath.Join(t.TempDir(), "out")
			if err := p.Save(context.Background(), dir, lm, 0); err != nil {
				t.Fatal(err)
			}
			old, err := os.ReadFile(filepath.Join(dir, "model.safetensors"))
			if err != nil {
				t.Fatal(err)
			}
			p.Master(name)[9] = c.v
			p.Sync(name)
			err = p.Save(context.Background(), dir, lm, 0)
			if !errors.Is(err, ErrNonFinite) || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("%v, want ErrNonFinite naming %s and %q", err, name, c.want)
			}
			now, err := os.ReadFile(filepath.Join(dir, "model.safetensors"))
			if err != nil || string(now) != string(old) {
				t.Errorf("the earlier checkpoint changed (%v)", err)
			}
			// Into a fresh directory: not even the directory is made.
			fresh := filepath.Join(t.TempDir(), "fresh")
			if err := p.Save(context.Background(), fresh, lm, 0); err == nil {
				t.Fatal("saved")
			}
			if _, err := os.Stat(fresh); !os.IsNotExist(err) {
				t.Errorf("a failed save left %s: %v", fresh, err)
			}
		})
	}
}
