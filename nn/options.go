package nn

import (
	"fmt"
	"math"
	"strconv"
)

// The ranges the training hyperparameters must lie in. Each is finite; the
// bounds keep a step from making finite weights non-finite by itself and
// refuse values no fine-tuning run means (a learning rate of 1e30).
var (
	// LR of SGD and AdamW: fine-tuning uses 1e-6 to 1e-2, plain SGD on a
	// small model up to 1.
	lrRange = span{lo: 0, hi: 1, loOpen: true}
	// Momentum of SGD, Beta1 and Beta2 of AdamW: 1 never forgets.
	decayRateRange = span{lo: 0, hi: 1, hiOpen: true}
	// WeightDecay of SGD and AdamW: with LR at most 1, AdamW's decoupled
	// decay multiplies the weights by 1 - LR·WeightDecay >= 0.
	weightDecayRange = span{lo: 0, hi: 1}
	// Eps of AdamW.
	epsRange = span{lo: 0, hi: 1, loOpen: true}
	// MaxGradNorm of TrainOptions: 0 does not clip.
	gradNormRange = span{lo: 0, hi: math.Inf(1)}
	// Scale and MinScale of a LossScaler: positive float32 values.
	scaleRange = span{lo: 0, hi: math.MaxFloat32, loOpen: true}
	// GrowthFactor of a LossScaler: 1 never grows.
	growthRange = span{lo: 1, hi: math.MaxFloat32}
	// BackoffFactor of a LossScaler.
	backoffRange = span{lo: 0, hi: 1, loOpen: true, hiOpen: true}
)

// span is an interval of finite values; hi may be +Inf for "no upper
// bound", which still excludes +Inf itself.
type span struct {
	lo, hi         float64
	loOpen, hiOpen bool
}

func (r span) has(v float64) bool {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return false
	case v < r.lo || r.loOpen && v == r.lo:
		return false
	case v > r.hi || r.hiOpen && v == r.hi:
		return false
	}
	return true
}

func (r span) String() string {
	num := func(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }
	if math.IsInf(r.hi, 1) {
		if r.loOpen {
			return "finite and > " + num(r.lo)
		}
		return "finite and >= " + num(r.lo)
	}
	l, h := "[", "]"
	if r.loOpen {
		l = "("
	}
	if r.hiOpen {
		h = ")"
	}
	return "in " + l + num(r.lo) + ", " + num(r.hi) + h
}

// OptionError reports a training hyperparameter outside its range: a NaN,
// an infinity, or a finite value no training means. The Validate methods of
// SGD, AdamW, TrainOptions and LossScaler return it; Step refuses to run
// with one.
type OptionError struct {
	Owner  string  // "sgd", "adamw", "train" or "loss scaler"
	Option string  // the field: "LR", "Momentum", "MaxGradNorm", ...
	Value  float64 // the value given
	Range  string  // what the field accepts: "in (0, 1]", "finite and >= 0"
}

func (e *OptionError) Error() string {
	return fmt.Sprintf("nn: %s: %s %v must be %s", e.Owner, e.Option, e.Value, e.Range)
}

// field is one hyperparameter to validate.
type field struct {
	name  string
	value float64
	r     span
}

// validate returns an *OptionError for the first field outside its range.
func validate(owner string, fields ...field) error {
	for _, f := range fields {
		if !f.r.has(f.value) {
			return &OptionError{Owner: owner, Option: f.name, Value: f.value, Range: f.r.String()}
		}
	}
	return nil
}

// Validate checks the hyperparameters: LR in (0, 1], Momentum in [0, 1),
// WeightDecay in [0, 1], none NaN or infinite. Step calls it.
func (o *SGD) Validate() error {
	return validate("sgd",
		field{"LR", o.LR, lrRange},
		field{"Momentum", o.Momentum, decayRateRange},
		field{"WeightDecay", o.WeightDecay, weightDecayRange})
}

// Validate checks the hyperparameters: LR in (0, 1], Beta1 and Beta2 in
// [0, 1), Eps in (0, 1], WeightDecay in [0, 1], none NaN or infinite. Step
// calls it.
func (o *AdamW) Validate() error {
	return validate("adamw",
		field{"LR", o.LR, lrRange},
		field{"Beta1", o.Beta1, decayRateRange},
		field{"Beta2", o.Beta2, decayRateRange},
		field{"Eps", o.Eps, epsRange},
		field{"WeightDecay", o.WeightDecay, weightDecayRange})
}

// Validate checks the options: Segments >= 0, MaxGradNorm finite and >= 0.
// NewTrainer calls it (a Segments larger than the model's blocks is its
// error).
func (o TrainOptions) Validate() error {
	if o.Segments < 0 {
		return &OptionError{Owner: "train", Option: "Segments", Value: float64(o.Segments), Range: ">= 0"}
	}
	return validate("train", field{"MaxGradNorm", o.MaxGradNorm, gradNormRange})
}

// Validate checks the scaler: Scale and MinScale positive float32 values,
// GrowthFactor finite and >= 1, BackoffFactor in (0, 1), GrowthInterval >=
// 0. Trainer.Step calls it.
func (s *LossScaler) Validate() error {
	if s.GrowthInterval < 0 {
		return &OptionError{Owner: "loss scaler", Option: "GrowthInterval", Value: float64(s.GrowthInterval), Range: ">= 0"}
	}
	return validate("loss scaler",
		field{"Scale", float64(s.Scale), scaleRange},
		field{"GrowthFactor", float64(s.GrowthFactor), growthRange},
		field{"BackoffFactor", float64(s.BackoffFactor), backoffRange},
		field{"MinScale", float64(s.MinScale), scaleRange})
}
