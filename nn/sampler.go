package nn

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
)

// SamplerConfig chooses how the next token is picked from the logits.
// Temperature 0 is greedy decoding; TopK 0 disables that filter. TopP is
// Hugging Face's top_p: the smallest set of most likely tokens whose
// probability reaches TopP is kept, and always at least the most likely
// one, so TopP 1 keeps every token and a tiny TopP only the most likely.
// The zero value means unset, that is 1, so that SamplerConfig{Temperature:
// 0.8} samples from the whole distribution; Hugging Face's top_p = 0 (keep
// the most likely token) is TopPMostLikely.
type SamplerConfig struct {
	Temperature float64
	TopK        int
	TopP        float64
	Seed        uint64
}

// TopPMostLikely is the TopP that keeps only the most likely token, what
// Hugging Face's top_p = 0 means (TopP's own zero value means 1).
const TopPMostLikely = math.SmallestNonzeroFloat64

// Validate reports settings that are out of range.
func (c SamplerConfig) Validate() error {
	switch {
	case c.Temperature < 0 || math.IsNaN(c.Temperature) || math.IsInf(c.Temperature, 0):
		return fmt.Errorf("nn: temperature %v must be a finite number >= 0", c.Temperature)
	case c.TopK < 0:
		return fmt.Errorf("nn: top-k %d must be >= 0", c.TopK)
	case c.TopP < 0 || c.TopP > 1 || math.IsNaN(c.TopP):
		return fmt.Errorf("nn: top-p %v must be within [0, 1]", c.TopP)
	}
	return nil
}

// Sampler picks tokens from logits. It is deterministic for a seed.
type Sampler struct {
	cfg   SamplerConfig
	rng   *rand.Rand
	idx   []int
	probs []float64
}

// NewSampler returns a sampler for cfg.
func NewSampler(cfg SamplerConfig) (*Sampler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Sampler{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))}, nil
}

// Argmax returns the index of the largest logit (the first on ties; NaN is
// never chosen over a number).
func Argmax(logits []float32) int {
	best := 0
	for i, v := range logits {
		if v > logits[best] || math.IsNaN(float64(logits[best])) && !math.IsNaN(float64(v)) {
			best = i
		}
	}
	return best
}

// Sample picks the next token from one position's logits.
func (s *Sampler) Sample(logits []float32) int {
	if s.cfg.Temperature == 0 {
		return Argmax(logits)
	}
	// Candidates sorted by logit, descending, cut to top-k.
	s.idx = s.idx[:0]
	for i := range logits {
		s.idx = append(s.idx, i)
	}
	sort.SliceStable(s.idx, func(a, b int) bool { return logits[s.idx[a]] > logits[s.idx[b]] })
	n := len(s.idx)
	if s.cfg.TopK > 0 && s.cfg.TopK < n {
		n = s.cfg.TopK
	}
	cand := s.idx[:n]
	// Softmax with temperature over the candidates.
	s.probs = s.probs[:0]
	maxL := float64(logits[cand[0]])
	sum := 0.0
	for _, i := range cand {
		p := math.Exp((float64(logits[i]) - maxL) / s.cfg.Temperature)
		s.probs = append(s.probs, p)
		sum += p
	}
	for i := range s.probs {
		s.probs[i] /= sum
	}
	// Top-p: the smallest prefix whose mass reaches TopP, at least one
	// token (a tiny TopP keeps the first; 0 is unset).
	if p := s.cfg.TopP; p > 0 && p < 1 {
		acc := 0.0
		for i, q := range s.probs {
			acc += q
			if acc >= p {
				s.probs = s.probs[:i+1]
				cand = cand[:i+1]
				break
			}
		}
		sum = acc
	} else {
		sum = 1
	}
	r := s.rng.Float64() * sum
	for i, q := range s.probs {
		r -= q
		if r < 0 {
			return cand[i]
		}
	}
	return cand[len(cand)-1]
}
