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
	heap  []int // the heap's storage, apart from idx
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
	// The best starts at the first number (nothing is greater than a NaN,
	// and a NaN is greater than nothing); then one comparison an element,
	// which no NaN passes.
	first := 0
	for first < len(logits) && logits[first] != logits[first] {
		first++
	}
	if first == len(logits) {
		return 0 // empty, or every logit NaN
	}
	best, bv := first, logits[first]
	for i := first + 1; i < len(logits); i++ {
		if v := logits[i]; v > bv {
			best, bv = i, v
		}
	}
	return best
}

// Sample picks the next token from one position's logits.
//
// It never sorts the whole vocabulary: with top-k the k best candidates
// are selected with a heap of k and only they are sorted; with top-p alone
// a heap over every token (built in linear time) gives them in order until
// the kept mass reaches top-p, usually after a few dozen of a vocabulary of
// 150,000. The distribution is the one a full sort gives: candidates in
// descending order of logit (ties by token id), the weights
// exp((logit - max) / T), their sum over the candidates (in token-id order
// over the whole vocabulary, in candidate order under top-k), the top-p
// prefix cut where its mass first reaches TopP of that sum, and the token
// drawn by walking the prefix in order (with neither filter, every token
// in id order).
func (s *Sampler) Sample(logits []float32) int {
	if s.cfg.Temperature == 0 {
		return Argmax(logits)
	}
	n := len(logits)
	maxL := math.Inf(-1)
	for _, v := range logits {
		if f := float64(v); f > maxL {
			maxL = f
		}
	}
	w := func(i int) float64 { return math.Exp((float64(logits[i]) - maxL) / s.cfg.Temperature) }
	k := n
	if s.cfg.TopK > 0 && s.cfg.TopK < n {
		k = s.cfg.TopK
	}
	topP := s.cfg.TopP > 0 && s.cfg.TopP < 1
	// cand holds the candidates in order as far as they are needed; next
	// gives the following one, for top-p over the whole vocabulary.
	s.idx, s.probs = s.idx[:0], s.probs[:0]
	var sum float64
	var next func() (int, bool)
	if k < n {
		s.idx = topKIndices(s.idx, logits, k)
		for _, i := range s.idx {
			p := w(i)
			s.probs = append(s.probs, p)
			sum += p
		}
		j := 0
		next = func() (int, bool) {
			if j == len(s.idx) {
				return 0, false
			}
			j++
			return j - 1, true
		}
	} else {
		for i := range logits {
			sum += w(i)
		}
		if !topP {
			// Every token, with no filter: the draw walks them in id
			// order, which is the same distribution as any other order.
			r := s.rng.Float64() * sum
			for i := range logits {
				if r -= w(i); r < 0 {
					return i
				}
			}
			return n - 1
		}
		h := newLogitHeap(logits, s.heap)
		defer func() { s.heap = h.h[:0] }()
		next = func() (int, bool) {
			if h.len() == 0 {
				return 0, false
			}
			i := h.pop()
			s.idx = append(s.idx, i)
			s.probs = append(s.probs, w(i))
			return len(s.idx) - 1, true
		}
	}
	kept := sum
	if topP {
		acc, target, cut := 0.0, s.cfg.TopP*sum, 0
		for {
			j, ok := next()
			if !ok {
				break
			}
			acc += s.probs[j]
			cut = j + 1
			if acc >= target {
				break
			}
		}
		s.idx, s.probs, kept = s.idx[:cut], s.probs[:cut], acc
	}
	r := s.rng.Float64() * kept
	for j, q := range s.probs {
		r -= q
		if r < 0 {
			return s.idx[j]
		}
	}
	return s.idx[len(s.idx)-1]
}

// before orders candidates: the larger logit first, the smaller id on
// ties; a NaN counts as the smallest logit.
func before(logits []float32, a, b int) bool {
	la, lb := logits[a], logits[b]
	switch {
	case la > lb || lb != lb && la == la:
		return true
	case la == lb || la != la && lb != lb:
		return a < b
	}
	return false
}

// topKIndices appends the k best token ids to dst, in order: a heap of the
// k best so far with the worst on top, then a sort of the k.
func topKIndices(dst []int, logits []float32, k int) []int {
	h := dst[:0]
	worse := func(a, b int) bool { return before(logits, b, a) } // a is worse than b
	down := func(i int) {
		for {
			l, r, m := 2*i+1, 2*i+2, i
			if l < len(h) && worse(h[l], h[m]) {
				m = l
			}
			if r < len(h) && worse(h[r], h[m]) {
				m = r
			}
			if m == i {
				return
			}
			h[i], h[m] = h[m], h[i]
			i = m
		}
	}
	for i := range logits {
		if len(h) < k {
			h = append(h, i)
			for c := len(h) - 1; c > 0; {
				p := (c - 1) / 2
				if !worse(h[c], h[p]) {
					break
				}
				h[c], h[p] = h[p], h[c]
				c = p
			}
			continue
		}
		if before(logits, i, h[0]) {
			h[0] = i
			down(0)
		}
	}
	sort.Slice(h, func(a, b int) bool { return before(logits, h[a], h[b]) })
	return h
}

// logitHeap pops token ids best first.
type logitHeap struct {
	logits []float32
	h      []int
}

// newLogitHeap heapifies every token id, in linear time, in buf's storage.
func newLogitHeap(logits []float32, buf []int) *logitHeap {
	h := &logitHeap{logits: logits, h: buf[:0]}
	for i := range logits {
		h.h = append(h.h, i)
	}
	for i := len(h.h)/2 - 1; i >= 0; i-- {
		h.down(i)
	}
	return h
}

func (h *logitHeap) len() int { return len(h.h) }

func (h *logitHeap) down(i int) {
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < len(h.h) && before(h.logits, h.h[l], h.h[m]) {
			m = l
		}
		if r < len(h.h) && before(h.logits, h.h[r], h.h[m]) {
			m = r
		}
		if m == i {
			return
		}
		h.h[i], h.h[m] = h.h[m], h.h[i]
		i = m
	}
}

func (h *logitHeap) pop() int {
	top := h.h[0]
	last := len(h.h) - 1
	h.h[0] = h.h[last]
	h.h = h.h[:last]
	if last > 0 {
		h.down(0)
	}
	return top
}
