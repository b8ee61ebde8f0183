package nn

import (
	"context"
	"math"
	"slices"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

func newRouting(T, E, k int) *routing {
	r := &routing{
		expert: make([]int32, T*k), weight: make([]float32, T*k), count: make([]int, E), start: make([]int, E),
		tokens: make([]int32, T*k), table: make([]float32, T*k+T), slots: make([][]int32, k),
	}
	for j := range r.slots {
		r.slots[j] = make([]int32, T)
	}
	return r
}

// TestRoute checks the routing of a few tokens against weights worked out
// by hand: the softmax over all experts, the k best with the lower index
// first among equals, the renormalisation, and the grouping by expert.
func TestRoute(t *testing.T) {
	ln := func(v float64) float32 { return float32(math.Log(v)) }
	for _, tc := range []struct {
		name    string
		scores  [][]float32 // [T][E]
		k       int
		norm    bool
		experts [][]int32   // [T][k]
		weights [][]float64 // [T][k]
	}{
		{"top-2 renormalised", [][]float32{{ln(1), ln(4), ln(2), ln(3)}}, 2, true,
			[][]int32{{1, 3}}, [][]float64{{4.0 / 7, 3.0 / 7}}},
		{"top-2 softmax weights", [][]float32{{ln(1), ln(4), ln(2), ln(3)}}, 2, false,
			[][]int32{{1, 3}}, [][]float64{{0.4, 0.3}}},
		{"ties go to the lower index", [][]float32{{2, 5, 5, 1, 5}}, 2, false,
			[][]int32{{1, 2}}, nil},
		{"top-1 renormalised is 1", [][]float32{{0.5, -3, 7}}, 1, true,
			[][]int32{{2}}, [][]float64{{1}}},
		{"three tokens", [][]float32{{0, 9, 8}, {7, 0, 6}, {5, 4, 3}}, 2, true,
			[][]int32{{1, 2}, {0, 2}, {0, 1}}, nil},
		{"a large score does not overflow", [][]float32{{1000, 999, -1000}}, 2, false,
			[][]int32{{0, 1}}, [][]float64{{1 / (1 + math.Exp(-1)), math.Exp(-1) / (1 + math.Exp(-1))}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			T, E := len(tc.scores), len(tc.scores[0])
			r := newRouting(T, E, tc.k)
			r.route(slices.Concat(tc.scores...), T, E, tc.k, tc.norm, nil, 0, 0)
			for tok := range T {
				got := r.expert[tok*tc.k : (tok+1)*tc.k]
				if !slices.Equal(got, tc.experts[tok]) {
					t.Errorf("token %d chose %v, want %v", tok, got, tc.experts[tok])
				}
				for j := range tc.k {
					if tc.weights != nil && math.Abs(float64(r.weight[tok*tc.k+j])-tc.weights[tok][j]) > 1e-6 {
						t.Errorf("token %d weight %d: %v, want %v", tok, j, r.weight[tok*tc.k+j], tc.weights[tok][j])
					}
				}
			}
			// The grouping: rows by expert then token, each row's token and
			// weight, each token's slots pointing at its rows.
			row := 0
			for e := range E {
				if r.start[e] != row {
					t.Errorf("expert %d starts at row %d, want %d", e, r.start[e], row)
				}
				prev := int32(-1)
				for ; row < r.start[e]+r.count[e]; row++ {
					tok := r.tokens[row]
					if tok <= prev {
						t.Errorf("expert %d: tokens out of order at row %d", e, row)
					}
					prev = tok
					j := slices.Index(r.expert[tok*int32(tc.k):(tok+1)*int32(tc.k)], int32(e))
					if j < 0 || r.slots[j][tok] != int32(row) || r.table[row] != r.weight[int(tok)*tc.k+j] {
						t.Errorf("row %d (expert %d, token %d): slot %d, table %v", row, e, tok, j, r.table[row])
					}
				}
			}
			if row != T*tc.k {
				t.Errorf("%d rows grouped, want %d", row, T*tc.k)
			}
		})
	}
}

// TestScaleRows checks that the rotation scaleRows runs multiplies each row
// by its weight exactly, from any row of the table.
func TestScaleRows(t *testing.T) {
	b := tensor.NewCPU(1)
	defer b.Close()
	x := tensor.New(tensor.F32, tensor.Shape{3, 6})
	w := tensor.New(tensor.F32, tensor.Shape{5, 1})
	zero := tensor.New(tensor.F32, tensor.Shape{5, 1})
	xs := x.F32()
	for i := range xs {
		xs[i] = float32(math.Sin(float64(i)*1.7)) * 3
	}
	want := slices.Clone(xs)
	copy(w.F32(), []float32{9, 0.3, -1.25, 1e-3, 7})
	for r := range 3 {
		for j := range 6 {
			want[r*6+j] *= w.F32()[2+r]
		}
	}
	if err := scaleRows(tensor.Checked(b), x, w, zero, 2); err != nil {
		t.Fatal(err)
	}
	for i := range xs {
		if xs[i] != want[i] {
			t.Fatalf("element %d: %v, want %v", i, xs[i], want[i])
		}
	}
}

// TestSyntheticRouting checks the statistics of synthetic routing: uniform
// and independent with skew and locality 0, skewed and kept from position
// to position otherwise; the experts of a token are distinct, even when the
// skew makes one expert take nearly all the draws; and a position's experts
// do not depend on the chunk it is routed in.
func TestSyntheticRouting(t *testing.T) {
	for _, tc := range []struct {
		name           string
		E, k           int
		skew, locality float64
		// bounds on the most popular expert's share of the draws over the
		// uniform share, and on the share of a token's experts the
		// previous token had
		maxTop, minTop, minRepeat, maxRepeat float64
	}{
		{"uniform", 8, 2, 0, 0, 1.1, 0, 0.22, 0.28},
		{"uniform, 128 experts, top-8", 128, 8, 0, 0, 1.5, 0, 0.04, 0.085},
		{"skewed and local", 8, 2, 1.2, 0.6, 4, 2, 0.6, 1},
		{"local alone", 8, 2, 0, 0.8, 1.3, 0, 0.8, 1},
		{"one expert takes nearly every draw", 16, 8, 100, 0.3, 2.1, 1.9, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := &arch.Config{NumLayers: 2, MoE: &arch.MoE{Experts: tc.E, ExpertsPerToken: tc.k,
				Synthetic: &arch.SyntheticRouting{Skew: tc.skew, Locality: tc.locality, Seed: 5}}}
			g := newSynthRouter(cfg)
			const n = 20000
			counts := make([]int, tc.E)
			repeats := 0
			prev := make([]int32, tc.k)
			ex := make([]int32, tc.k)
			for pos := range n {
				g.pick(1, pos, ex)
				for j, e := range ex {
					counts[e]++
					if taken(ex[:j], e) {
						t.Fatalf("position %d: experts %v repeat", pos, ex)
					}
					if pos > 0 && taken(prev, e) {
						repeats++
					}
				}
				copy(prev, ex)
			}
			top := float64(slices.Max(counts)) / float64(n*tc.k) * float64(tc.E)
			repeat := float64(repeats) / float64((n-1)*tc.k)
			t.Logf("top expert %.2f times the uniform share, %.3f of experts repeated", top, repeat)
			if top > tc.maxTop || top < tc.minTop {
				t.Errorf("the top expert has %.2f times the uniform share, want %.2f..%.2f", top, tc.minTop, tc.maxTop)
			}
			if repeat < tc.minRepeat || repeat > tc.maxRepeat {
				t.Errorf("%.3f of each token's experts were the previous token's, want %.2f..%.2f", repeat, tc.minRepeat, tc.maxRepeat)
			}
		})
	}

	// Routed as one chunk of 5 or one token at a time, from position 7.
	cfg := &arch.Config{NumLayers: 3, MoE: &arch.MoE{Experts: 6, ExpertsPerToken: 2,
		Synthetic: &arch.SyntheticRouting{Skew: 0.5, Locality: 0.5, Seed: 9}}}
	g := newSynthRouter(cfg)
	scores := make([]float32, 5*6)
	chunk := newRouting(5, 6, 2)
	chunk.route(scores, 5, 6, 2, true, g, 2, 7)
	for tok := range 5 {
		one := newRouting(1, 6, 2)
		one.route(scores[tok*6:(tok+1)*6], 1, 6, 2, true, g, 2, 7+tok)
		if !slices.Equal(one.expert, chunk.expert[tok*2:(tok+1)*2]) {
			t.Errorf("position %d: %v alone, %v in a chunk", 7+tok, one.expert, chunk.expert[tok*2:(tok+1)*2])
		}
	}
}

// TestSyntheticRoutingForward runs a synthesised Mixtral with and without
// synthetic routing: the same weights give other logits when the synthetic
// draw replaces the router's choice, and the synthetic model's logits match
// within float32 rounding whether its prompt goes in one chunk or token by
// token (the draw depends on positions, not chunks).
func TestSyntheticRoutingForward(t *testing.T) {
	ctx := context.Background()
	logitsOf := func(syn *arch.SyntheticRouting, chunk int) []float32 {
		cfg, err := arch.Preset("tiny")
		if err != nil {
			t.Fatal(err)
		}
		cfg.NumLayers, cfg.VocabSize, cfg.IntermediateSize = 2, 97, 40
		cfg.SetFamily(arch.Mixtral)
		cfg.MoE.Experts, cfg.MoE.Synthetic = 6, syn
		lm, err := loader.SynthesizeOpen(ctx, t.TempDir(), cfg, loader.SynthOptions{Seed: 3})
		if err != nil {
			t.Fatal(err)
		}
		defer lm.Close()
		b := tensor.NewCPU(1)
		defer b.Close()
		w, err := LoadWeights(ctx, lm, b, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		m, err := New(lm.Config, b, nil, w)
		if err != nil {
			t.Fatal(err)
		}
		s, err := m.NewSession(16, chunk)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		logits, err := s.Forward(ctx, []int32{3, 14, 15, 92, 65, 35, 89, 79}, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		return slices.Clone(logits)
	}
	syn := &arch.SyntheticRouting{Skew: 1, Locality: 0.5, Seed: 4}
	router, synthetic, tokenwise := logitsOf(nil, 8), logitsOf(syn, 8), logitsOf(syn, 1)
	if d := maxAbsDiff(router, synthetic); d < 1e-3 {
		t.Errorf("synthetic routing changed the logits by %g: not applied", d)
	}
	if d := maxAbsDiff(synthetic, tokenwise); d > 1e-5 {
		t.Errorf("synthetic routing in one chunk and token by token differ by %g", d)
	}
}

// TestGuessRecord: a block prefetches during its first guessWarmUp
// guesses whatever their accuracy, then while at least half of its recent
// guesses' experts were chosen; after a run of wrong guesses a run of
// right ones turns its prefetches back on, and blocks count apart.
func TestGuessRecord(t *testing.T) {
	var g guessRecord
	for n := range guessWarmUp {
		if !g.worthPrefetching(2) {
			t.Fatalf("after %d guesses (warm-up): not prefetched", n)
		}
		g.add(2, 8, 0)
	}
	if g.worthPrefetching(2) {
		t.Error("after the warm-up, every guess wrong: still prefetched")
	}
	if !g.worthPrefetching(1) || !g.worthPrefetching(7) {
		t.Error("blocks without guesses: not prefetched")
	}
	right := 0
	for g.add(2, 8, 7); !g.worthPrefetching(2); g.add(2, 8, 7) {
		if right++; right > 20 {
			t.Fatal("20 guesses 7 of 8 right after the wrong ones: still held")
		}
	}
	t.Logf("prefetched again after %d guesses mostly right", right+1)
	for range 40 {
		g.add(2, 8, 4) // one in two: worth it
	}
	if !g.worthPrefetching(2) {
		t.Error("half of every guess right: held")
	}
	for range 40 {
		g.add(2, 8, 3)
	}
	if g.worthPrefetching(2) {
		t.Error("3 of 8 of every guess right: still prefetched")
	}
}
