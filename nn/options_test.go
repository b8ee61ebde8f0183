package nn

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

var (
	nan    = math.NaN()
	posInf = math.Inf(1)
	negInf = math.Inf(-1)
)

// TestOptionsValidate sets each hyperparameter of SGD, AdamW, TrainOptions
// and LossScaler in turn to NaN, ±Inf and finite values outside its range,
// and to its edges: Validate names the field of each bad value and accepts
// the edges.
func TestOptionsValidate(t *testing.T) {
	type setter func(v float64) interface{ Validate() error }
	sgd := func(set func(*SGD, float64)) setter {
		return func(v float64) interface{ Validate() error } {
			o := &SGD{LR: 1e-3, Momentum: 0.9, WeightDecay: 0.01}
			set(o, v)
			return o
		}
	}
	adamw := func(set func(*AdamW, float64)) setter {
		return func(v float64) interface{ Validate() error } {
			o := NewAdamW(1e-3)
			set(o, v)
			return o
		}
	}
	train := func(set func(*TrainOptions, float64)) setter {
		return func(v float64) interface{ Validate() error } {
			o := TrainOptions{MaxGradNorm: 1}
			set(&o, v)
			return o
		}
	}
	scaler := func(set func(*LossScaler, float64)) setter {
		return func(v float64) interface{ Validate() error } {
			s := NewLossScaler(65536, 50)
			set(s, v)
			return s
		}
	}
	nonFinite := []float64{nan, posInf, negInf}
	cases := []struct {
		option string
		set    setter
		bad    []float64
		good   []float64
	}{
		{"LR", sgd(func(o *SGD, v float64) { o.LR = v }), []float64{0, -1e-3, 1.5, 1e30, -1e30}, []float64{1e-9, 1}},
		{"Momentum", sgd(func(o *SGD, v float64) { o.Momentum = v }), []float64{1, -0.1, 2, 1e30}, []float64{0, 0.999}},
		{"WeightDecay", sgd(func(o *SGD, v float64) { o.WeightDecay = v }), []float64{-0.01, 1.01, 1e30}, []float64{0, 1}},
		{"LR", adamw(func(o *AdamW, v float64) { o.LR = v }), []float64{0, -1, 2, 1e30}, []float64{1e-9, 1}},
		{"Beta1", adamw(func(o *AdamW, v float64) { o.Beta1 = v }), []float64{1, -0.5, 1e30}, []float64{0, 0.99}},
		{"Beta2", adamw(func(o *AdamW, v float64) { o.Beta2 = v }), []float64{1, -0.5, 1.5}, []float64{0, 0.9999}},
		{"Eps", adamw(func(o *AdamW, v float64) { o.Eps = v }), []float64{0, -1e-8, 2, 1e30}, []float64{1e-30, 1}},
		{"WeightDecay", adamw(func(o *AdamW, v float64) { o.WeightDecay = v }), []float64{-1, 1.5, 1e30}, []float64{0, 1}},
		{"MaxGradNorm", train(func(o *TrainOptions, v float64) { o.MaxGradNorm = v }), []float64{-1, -1e-9}, []float64{0, 1e30}},
		{"Segments", train(func(o *TrainOptions, v float64) { o.Segments = int(v) }), []float64{-1}, []float64{0, 4}},
		{"Scale", scaler(func(s *LossScaler, v float64) { s.Scale = float32(v) }), []float64{0, -1, 1e39}, []float64{1e-30, math.MaxFloat32}},
		{"GrowthFactor", scaler(func(s *LossScaler, v float64) { s.GrowthFactor = float32(v) }), []float64{0, 0.5, -2}, []float64{1, 4}},
		{"BackoffFactor", scaler(func(s *LossScaler, v float64) { s.BackoffFactor = float32(v) }), []float64{0, 1, -0.5, 2}, []float64{1e-6, 0.99}},
		{"MinScale", scaler(func(s *LossScaler, v float64) { s.MinScale = float32(v) }), []float64{0, -1}, []float64{1e-30, 1}},
		{"GrowthInterval", scaler(func(s *LossScaler, v float64) { s.GrowthInterval = int(v) }), []float64{-1}, []float64{0, 1000}},
	}
	for _, c := range cases {
		bad := c.bad
		if c.option != "Segments" && c.option != "GrowthInterval" { // ints
			bad = append(bad, nonFinite...)
		}
		for _, v := range bad {
			err := c.set(v).Validate()
			var oe *OptionError
			if !errors.As(err, &oe) || oe.Option != c.option {
				t.Errorf("%s %v: %v, want an *OptionError naming %s", c.option, v, err, c.option)
				continue
			}
			if msg := err.Error(); !strings.Contains(msg, c.option) || !strings.Contains(msg, "must be") {
				t.Errorf("%s %v: message %q", c.option, v, msg)
			}
		}
		for _, v := range c.good {
			if err := c.set(v).Validate(); err != nil {
				t.Errorf("%s %v: %v", c.option, v, err)
			}
		}
	}
}

// TestBadOptionsRefused: a Step with a bad hyperparameter changes nothing;
// NewTrainer and Trainer.Step refuse bad options and scalers.
func TestBadOptionsRefused(t *testing.T) {
	p := testParams(t, map[string]*tensor.Tensor{"w": f32Tensor(1, 2)})
	g := Grads{"w": f32Tensor(0.5, 0.5)}
	for _, opt := range []Optimizer{
		&SGD{LR: 1e-3, WeightDecay: nan},
		&SGD{LR: 1e-3, Momentum: nan},
		&SGD{LR: 1e30},
		&SGD{}, // no learning rate
		&AdamW{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: posInf},
		&AdamW{LR: 1e30, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8},
		&AdamW{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: nan},
	} {
		var oe *OptionError
		if err := opt.Step(p, g); !errors.As(err, &oe) {
			t.Errorf("%+v: %v, want an *OptionError", opt, err)
		}
		if w := p.Master("w"); w[0] != 1 || w[1] != 2 {
			t.Fatalf("%+v changed the weights to %v", opt, w)
		}
	}

	fp, m, _ := fixtureParams(t)
	if _, err := NewTrainer(m, TrainOptions{MaxGradNorm: nan}); err == nil {
		t.Error("NewTrainer took a NaN MaxGradNorm")
	}
	tr, err := NewTrainer(m, TrainOptions{})
	if err != nil {
		t.Fatal(err)
	}
	before := append([]float32(nil), fp.Master(arch.NormName)...)
	bad := NewLossScaler(65536, 10)
	bad.BackoffFactor = 1
	var oe *OptionError
	if _, err := tr.Step(context.Background(), []int32{1, 2, 3}, []int32{2, 3, 4}, fp, NewAdamW(1e-3), bad); !errors.As(err, &oe) || oe.Option != "BackoffFactor" {
		t.Errorf("a scaler that never backs off: %v", err)
	}
	for i, v := range fp.Master(arch.NormName) {
		if v != before[i] {
			t.Fatal("a refused step changed the weights")
		}
	}
}
