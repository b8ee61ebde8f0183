package nn

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

func TestArgmax(t *testing.T) {
	nan := float32(math.NaN())
	cases := []struct {
		in   []float32
		want int
	}{
		{[]float32{1, 3, 2}, 1},
		{[]float32{5, 5, 1}, 0},
		{[]float32{nan, -1, -2}, 1},
		{[]float32{-3}, 0},
		{nil, 0},
		{[]float32{nan}, 0},
		{[]float32{nan, nan, nan}, 0},
		{[]float32{nan, nan, -7}, 2},
		{[]float32{2, nan, 3, nan}, 2},
		{[]float32{4, nan, 3}, 0},
		{[]float32{float32(math.Inf(-1)), -1e30, float32(math.Inf(1)), 9}, 2},
		{[]float32{float32(math.Inf(-1)), float32(math.Inf(-1))}, 0},
		{[]float32{-1, 0, 0, -1}, 1},
	}
	for _, c := range cases {
		if got := Argmax(c.in); got != c.want {
			t.Errorf("Argmax(%v) = %d, want %d", c.in, got, c.want)
		}
	}
}

// sampleCounts draws n tokens and counts each.
func sampleCounts(t *testing.T, cfg SamplerConfig, logits []float32, n int) []int {
	t.Helper()
	s, err := NewSampler(cfg)
	if err != nil {
		t.Fatal(err)
	}
	counts := make([]int, len(logits))
	for i := 0; i < n; i++ {
		counts[s.Sample(logits)]++
	}
	return counts
}

func TestSamplerDistribution(t *testing.T) {
	// Probabilities at temperature 1: softmax of log(p) is p.
	p := []float64{0.5, 0.25, 0.15, 0.07, 0.03}
	logits := make([]float32, len(p))
	for i, v := range p {
		logits[i] = float32(math.Log(v))
	}
	const n = 200000
	within := func(got int, want float64) bool {
		sd := math.Sqrt(want * (1 - want) / n)
		return math.Abs(float64(got)/n-want) < 5*sd+1e-9
	}
	counts := sampleCounts(t, SamplerConfig{Temperature: 1, TopP: 1, Seed: 1}, logits, n)
	for i := range p {
		if !within(counts[i], p[i]) {
			t.Errorf("temperature 1: token %d drawn %d/%d times, want p=%v", i, counts[i], n, p[i])
		}
	}
	// Top-k 2 renormalises over the two best.
	counts = sampleCounts(t, SamplerConfig{Temperature: 1, TopK: 2, TopP: 1, Seed: 2}, logits, n)
	if counts[2]+counts[3]+counts[4] != 0 || !within(counts[0], 2.0/3) {
		t.Errorf("top-k 2: counts %v", counts)
	}
	// Top-p 0.8 keeps 0.5+0.25+0.15 = 0.9 (the smallest prefix reaching 0.8).
	counts = sampleCounts(t, SamplerConfig{Temperature: 1, TopP: 0.8, Seed: 3}, logits, n)
	if counts[3]+counts[4] != 0 || !within(counts[2], 0.15/0.9) {
		t.Errorf("top-p 0.8: counts %v", counts)
	}
	// A low temperature sharpens towards the argmax.
	counts = sampleCounts(t, SamplerConfig{Temperature: 0.1, TopP: 1, Seed: 4}, logits, 10000)
	if counts[0] < 9950 { // expected 10000/(1+2^-10+...) ≈ 9990
		t.Errorf("temperature 0.1: argmax drawn only %d/10000 times", counts[0])
	}
	// Same seed, same tokens.
	a := sampleCounts(t, SamplerConfig{Temperature: 1, TopP: 1, Seed: 9}, logits, 1000)
	b := sampleCounts(t, SamplerConfig{Temperature: 1, TopP: 1, Seed: 9}, logits, 1000)
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("seeded sampler not deterministic: %v vs %v", a, b)
		}
	}
}

func TestSamplerConfigValidate(t *testing.T) {
	if n := nonZero(sampleCounts(t, SamplerConfig{Temperature: 1, Seed: 1}, []float32{1, 1, 1, 1}, 2000)); n != 4 {
		t.Errorf("TopP left at its zero value: %d tokens drawn, want all 4", n)
	}
	bad := []SamplerConfig{{Temperature: -1}, {Temperature: math.Inf(1)}, {TopK: -2}, {TopP: 1.5}, {TopP: math.NaN()}}
	for _, c := range bad {
		if _, err := NewSampler(c); err == nil {
			t.Errorf("NewSampler(%+v) accepted", c)
		}
	}
}

// TestTopPZeroIsGreedy checks Hugging Face's meaning of top_p = 0: only
// the most likely token is kept (min_tokens_to_keep is 1), whatever the
// temperature and top-k, so sampling picks what Argmax picks, ties
// included; a small top-p above 0 keeps more than one token.
func TestTopPZeroIsGreedy(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	random := make([]float32, 300)
	for i := range random {
		random[i] = float32(rng.NormFloat64())
	}
	cases := []struct {
		name   string
		logits []float32
	}{
		{"random", random},
		{"flat", []float32{1, 1, 1, 1}},
		{"tie for first", []float32{0.5, 2, 2, -1}},
		{"close second", []float32{3, 3.001, 2.999}},
	}
	for _, c := range cases {
		want := Argmax(c.logits)
		for _, cfg := range []SamplerConfig{
			{Temperature: 1, TopP: TopPMostLikely},
			{Temperature: 100, TopP: TopPMostLikely},
			{Temperature: 0.5, TopK: 3, TopP: TopPMostLikely},
		} {
			cfg.Seed = 7
			counts := sampleCounts(t, cfg, c.logits, 2000)
			if counts[want] != 2000 {
				t.Errorf("%s, %+v: argmax %d drawn %d/2000 times", c.name, cfg, want, counts[want])
			}
		}
	}
	// On a flat distribution a top-p just above 0 still keeps one token,
	// one of 0.3 keeps two.
	flat := []float32{1, 1, 1, 1}
	if n := nonZero(sampleCounts(t, SamplerConfig{Temperature: 1, TopP: 1e-9, Seed: 1}, flat, 2000)); n != 1 {
		t.Errorf("top-p 1e-9: %d tokens drawn, want 1", n)
	}
	if n := nonZero(sampleCounts(t, SamplerConfig{Temperature: 1, TopP: 0.3, Seed: 1}, flat, 2000)); n != 2 {
		t.Errorf("top-p 0.3: %d tokens drawn, want 2", n)
	}
}

func nonZero(counts []int) int {
	n := 0
	for _, c := range counts {
		if c > 0 {
			n++
		}
	}
	return n
}

// refSample is the sampler's distribution computed the plain way: every
// token sorted (stable, by logit descending), cut to top-k, the weights
// summed as Sample documents, the top-p prefix, the walk.
func refSample(cfg SamplerConfig, logits []float32, u float64) int {
	n := len(logits)
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return before(logits, idx[a], idx[b]) })
	maxL := math.Inf(-1)
	for _, v := range logits {
		maxL = math.Max(maxL, float64(v))
	}
	w := func(i int) float64 { return math.Exp((float64(logits[i]) - maxL) / cfg.Temperature) }
	k := n
	if cfg.TopK > 0 && cfg.TopK < n {
		k = cfg.TopK
	}
	cand := idx[:k]
	var sum float64
	if k < n {
		for _, i := range cand {
			sum += w(i)
		}
	} else {
		for i := range logits {
			sum += w(i)
		}
	}
	kept := sum
	if k == n && !(cfg.TopP > 0 && cfg.TopP < 1) {
		cand = make([]int, n) // no filter: id order
		for i := range cand {
			cand[i] = i
		}
	}
	if cfg.TopP > 0 && cfg.TopP < 1 {
		acc := 0.0
		for j, i := range cand {
			acc += w(i)
			if acc >= cfg.TopP*sum {
				cand = cand[:j+1]
				break
			}
		}
		kept = acc
	}
	r := u * kept
	for _, i := range cand {
		if r -= w(i); r < 0 {
			return i
		}
	}
	return cand[len(cand)-1]
}

// TestSampleMatchesFullSort: for random logits (with ties), temperatures,
// top-k and top-p, Sample draws the same token as the full sort for the
// same random numbers, over thousands of draws.
func TestSampleMatchesFullSort(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for it := range 300 {
		n := 1 + rng.IntN(2000)
		logits := make([]float32, n)
		for i := range logits {
			logits[i] = float32(rng.NormFloat64() * 3)
			if rng.IntN(10) == 0 {
				logits[i] = float32(rng.IntN(3)) // ties
			}
		}
		cfg := SamplerConfig{Temperature: []float64{0.3, 1, 2.5}[rng.IntN(3)], TopK: []int{0, 1, 5, 50, n, n + 3}[rng.IntN(6)],
			TopP: []float64{0, 1, 0.5, 0.9, 1e-9}[rng.IntN(5)], Seed: uint64(it)}
		s, err := NewSampler(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ref := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
		for d := range 20 {
			got, want := s.Sample(logits), refSample(cfg, logits, ref.Float64())
			if got != want {
				t.Fatalf("iteration %d draw %d, %+v, %d tokens: %d, the full sort draws %d", it, d, cfg, n, got, want)
			}
		}
	}
}

// BenchmarkSample152k times a draw from a vocabulary of 152,064 (Qwen's)
// with the usual settings, against the full sort it replaces.
func BenchmarkSample152k(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	logits := make([]float32, 152064)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64() * 4)
	}
	for _, cfg := range []SamplerConfig{
		{Temperature: 0.7, TopP: 0.9},
		{Temperature: 0.7, TopK: 40},
		{Temperature: 0.7, TopK: 40, TopP: 0.9},
		{Temperature: 1},
	} {
		b.Run(fmt.Sprintf("T%v_k%d_p%v", cfg.Temperature, cfg.TopK, cfg.TopP), func(b *testing.B) {
			s, _ := NewSampler(cfg)
			for b.Loop() {
				s.Sample(logits)
			}
		})
		b.Run(fmt.Sprintf("fullsort/T%v_k%d_p%v", cfg.Temperature, cfg.TopK, cfg.TopP), func(b *testing.B) {
			r := rand.New(rand.NewPCG(3, 4))
			for b.Loop() {
				refSample(cfg, logits, r.Float64())
			}
		})
	}
}
