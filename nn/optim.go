package nn

import (
	"fmt"
	"math"

	"github.com/strata-llm/strata/tensor"
)

// Optimizer updates parameters from their gradients.
type Optimizer interface {
	// Step updates the master copy of every parameter of p that has a
	// gradient in g (already unscaled) and rounds it into the working
	// copy. Parameters without a gradient are left alone.
	Step(p *Params, g Grads) error
}

// update calls fn with the master copy and the gradient of every parameter
// of p that has a gradient in g, in p's order, and rounds each updated
// master into its working copy. A gradient whose size differs from its
// parameter's is an error. An update that leaves a NaN or an infinity in a
// working copy (the master's or one too large for its dtype) stops there
// with an error wrapping ErrNonFinite: the parameters updated so far keep
// their new values.
func update(p *Params, g Grads, fn func(name string, w, gv []float32)) error {
	for _, name := range p.names {
		t, ok := g[name]
		if !ok {
			continue
		}
		pr := p.byName[name]
		w, gv := pr.master, t.F32()
		if len(gv) != len(w) {
			return fmt.Errorf("nn: optimizer: gradient of %s has %d elements, the parameter %d", name, len(gv), len(w))
		}
		fn(name, w, gv)
		if i := pr.sync(); i >= 0 {
			dt := pr.work.DType()
			master := ""
			if dt != tensor.F32 {
				master = fmt.Sprintf(" (its F32 master copy %v)", w[i])
			}
			return fmt.Errorf("nn: optimizer: the step left %w in %s: element %d is %v in %v%s",
				ErrNonFinite, name, i, tensor.ElementF64(dt, pr.work.Bytes(), i), dt, master)
		}
	}
	return nil
}

// SGD is stochastic gradient descent with optional momentum and weight
// decay, as torch.optim.SGD (dampening 0, not Nesterov):
//
//	g ← grad + WeightDecay·w
//	b ← Momentum·b + g   (b ← g on the first step)
//	w ← w − LR·b         (w ← w − LR·g without momentum)
type SGD struct {
	LR, Momentum, WeightDecay float64
	buf                       map[string][]float32
}

// Step implements Optimizer.
func (o *SGD) Step(p *Params, g Grads) error {
	if err := o.Validate(); err != nil {
		return err
	}
	if o.buf == nil && o.Momentum != 0 {
		o.buf = map[string][]float32{}
	}
	return update(p, g, func(name string, w, gv []float32) {
		if o.Momentum == 0 {
			chunks(len(w), func(lo, hi int) {
				for i := lo; i < hi; i++ {
					w[i] = float32(float64(w[i]) - o.LR*(float64(gv[i])+o.WeightDecay*float64(w[i])))
				}
			})
		} else {
			b, seen := o.buf[name]
			if !seen {
				b = make([]float32, len(w))
				o.buf[name] = b
			}
			chunks(len(w), func(lo, hi int) {
				for i := lo; i < hi; i++ {
					d := float64(gv[i]) + o.WeightDecay*float64(w[i])
					if seen {
						d += o.Momentum * float64(b[i])
					}
					b[i] = float32(d)
					w[i] = float32(float64(w[i]) - o.LR*d)
				}
			})
		}
	})
}

// AdamW is Adam with decoupled weight decay, as torch.optim.AdamW
// (amsgrad off), in float32 arithmetic as torch's for float32 parameters:
// with t the step number from 1,
//
//	w ← w − LR·WeightDecay·w
//	m ← Beta1·m + (1−Beta1)·g
//	v ← Beta2·v + (1−Beta2)·g²
//	w ← w − LR·(m/(1−Beta1ᵗ)) / (sqrt(v/(1−Beta2ᵗ)) + Eps)
//
// NewAdamW sets PyTorch's defaults.
type AdamW struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
	t                                  int
	m, v                               map[string][]float32
}

// NewAdamW returns AdamW with learning rate lr and PyTorch's defaults:
// betas 0.9 and 0.999, eps 1e-8, weight decay 0.01.
func NewAdamW(lr float64) *AdamW {
	return &AdamW{LR: lr, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
}

// Steps is the number of updates made so far.
func (o *AdamW) Steps() int { return o.t }

// Step implements Optimizer.
func (o *AdamW) Step(p *Params, g Grads) error {
	if err := o.Validate(); err != nil {
		return err
	}
	if o.m == nil {
		o.m, o.v = map[string][]float32{}, map[string][]float32{}
	}
	o.t++
	bc1 := 1 - math.Pow(o.Beta1, float64(o.t))
	bc2 := 1 - math.Pow(o.Beta2, float64(o.t))
	c := &adamConsts{
		b1: float32(o.Beta1), c1: float32(1 - o.Beta1), b2: float32(o.Beta2), c2: float32(1 - o.Beta2),
		decay: float32(1 - o.LR*o.WeightDecay), stepSize: float32(o.LR / bc1),
		invSqrtBC2: float32(1 / math.Sqrt(bc2)), eps: float32(o.Eps),
	}
	return update(p, g, func(name string, w, gv []float32) {
		m, v := o.m[name], o.v[name]
		if m == nil {
			m, v = make([]float32, len(w)), make([]float32, len(w))
			o.m[name], o.v[name] = m, v
		}
		chunks(len(gv), func(lo, hi int) { adamUpdate(w[lo:hi], gv[lo:hi], m[lo:hi], v[lo:hi], c) })
	})
}

// LossScaler is a dynamic loss scale for mixed-precision training: the loss
// is multiplied by Scale before the backward so that small gradients
// survive reduced precision, and the gradients divided by it before the
// update. Gradients that overflow (an infinity or a NaN) skip the step and
// multiply the scale by BackoffFactor; after GrowthInterval steps in a row
// without overflow the scale is multiplied by GrowthFactor.
type LossScaler struct {
	Scale          float32
	GrowthFactor   float32 // > 1
	BackoffFactor  float32 // in (0, 1)
	GrowthInterval int     // good steps before growing
	MinScale       float32 // the scale never falls below this (> 0)

	good    int // good steps since the last change
	skipped int
}

// NewLossScaler returns a scaler starting at scale that doubles it after
// growthInterval good steps and halves it on overflow, never below 2⁻²⁴.
func NewLossScaler(scale float32, growthInterval int) *LossScaler {
	return &LossScaler{Scale: scale, GrowthFactor: 2, BackoffFactor: 0.5, GrowthInterval: growthInterval, MinScale: 1.0 / (1 << 24)}
}

// Unscale checks the gradients of a step run at s.Scale. When any is not
// finite it reduces the scale and returns false: the caller skips the
// update. Otherwise it divides them by the scale, counts a good step
// (growing the scale after GrowthInterval of them) and returns true.
func (s *LossScaler) Unscale(g Grads) bool {
	scale := s.Scale
	if !s.observe(g.AllFinite()) {
		return false
	}
	if scale != 1 {
		g.Scale(1 / scale)
	}
	return true
}

// observe records the outcome of a step run at s.Scale: gradients that are
// not finite reduce the scale; finite ones count a good step, growing the
// scale after GrowthInterval of them. It returns finite.
func (s *LossScaler) observe(finite bool) bool {
	if !finite {
		s.Scale = max(s.Scale*s.BackoffFactor, s.MinScale)
		s.good = 0
		s.skipped++
		return false
	}
	s.good++
	if s.GrowthInterval > 0 && s.good >= s.GrowthInterval {
		if grown := s.Scale * s.GrowthFactor; !math.IsInf(float64(grown), 0) {
			s.Scale = grown
		}
		s.good = 0
	}
	return true
}

// Skipped is the number of steps skipped for overflow so far.
func (s *LossScaler) Skipped() int { return s.skipped }
