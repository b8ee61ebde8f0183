package paging

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestTiedEmbeddingsOnce: in a model with tied embeddings the embedding
// table is listed by the first layer and the head; the plan places it once,
// as the head's (the first layer notes it as shared), and a cyclic decode
// moves it once per token: under every streaming strategy and budget the
// bytes per token are at most the untied twin's (the same model with a
// head of its own) less the table when the twin streams both copies, and
// that under the aggressive strategy, which streams everything (a pass
// streams exactly the table less; a mean over tokens is within four
// layers of that over the tokens measured, as prefetches cross marks).
// Every acquire of either layer gets the table's bytes (one device
// tensor when both are held), the budget's peak stays within the plan's
// prediction and the budget, and nothing is left after Close.
func TestTiedEmbeddingsOnce(t *testing.T) {
	const blocks, vocab, hidden, steps = 6, 512, 64, 24
	tied := tiedSynth(blocks, hidden, 96, 32, vocab)
	untied := llamaSynth(blocks, hidden, 96, 32, vocab)
	table := int64(vocab * hidden * 2)
	n := tied.NumLayers()
	ti, ui := smallDims(tied, blocks), smallDims(untied, blocks)
	W, lmax := totalAndMax(ui) // the untied twin's weights: the tied model's layers list as many bytes
	// A token's prefetches of the next token's first layers land on
	// either side of a mark: the mean of steps tokens is within a window
	// of layers (and one) over steps of the bytes a pass moves.
	tol := float64(4*lmax) / steps
	cases := []struct {
		strategy Strategy
		frac     float64 // of the twin's weights, beside the reserve
	}{
		{StrategyAggressive, 1},
		{StrategyAggressive, 0.1},
		{StrategyMinimal, 0.3},
		{StrategyMinimal, 0.6},
		{StrategyBalanced, 0.3},
		{StrategyBalanced, 0.6},
		{StrategyBalanced, 0.9},
		{StrategyBalanced, 2},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%s/%.0f%%", tc.strategy, 100*tc.frac), func(t *testing.T) {
			p0, err := Plan(ui, 1<<40, StrategyAggressive, 32, 1)
			if err != nil {
				t.Fatal(err)
			}
			fixed := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes
			budget := max(fixed+int64(tc.frac*float64(W)), p0.MinBudgetBytes+table)
			run := func(src *synthSource, info ModelInfo) (*PlanResult, Stats) {
				plan, err := Plan(info, budget, tc.strategy, 32, 1)
				if err != nil {
					t.Fatal(err)
				}
				fb := newFake()
				bg := newBudget(t, fb, budget, "fake")
				free := nnReserve(t, bg, plan)
				pg, err := NewPager(src, bg, plan, Options{})
				if err != nil {
					t.Fatal(err)
				}
				headReads := src.calls[n-1].Load() // the source serves every case
				sweep(t, pg, src, forward(n))      // residents load
				waitIdle(pg)
				pg.MarkStep()
				for range steps {
					sweep(t, pg, src, forward(n))
					waitIdle(pg)
					pg.MarkStep()
				}
				if src.tied != nil { // the head and the next token's embedding held at once share the table
					head, err := pg.Acquire(context.Background(), n-1)
					if err != nil {
						t.Fatal(err)
					}
					emb, err := pg.Acquire(context.Background(), 0)
					if err != nil {
						t.Fatal(err)
					}
					if name := "model.embed_tokens.weight"; head[name] != emb[name] || head[name] == nil {
						t.Errorf("the head and the embedding hold different tensors for the tied table")
					}
					pg.Release(0)
					pg.Release(n - 1)
				}
				if src.tied != nil && tc.strategy == StrategyAggressive {
					// Without a host cache each load of the head reads it:
					// once a token, and once for the warm-up and the
					// acquires above, not again for the embedding.
					if got, most := (src.calls[n-1].Load()-headReads)/2, int64(steps+2); got > most {
						t.Errorf("the head loaded %d times in %d tokens and a warm-up: its table was loaded again for the embedding", got, steps)
					}
				}
				st := pg.Stats()
				if peak := bg.Peak(); peak > budget || peak > plan.PredictedPeakBytes {
					t.Errorf("peak %d over the budget %d or the plan's prediction %d", peak, budget, plan.PredictedPeakBytes)
				}
				free()
				if err := pg.Close(); err != nil {
					t.Error(err)
				}
				if err := bg.Close(); err != nil {
					t.Error(err)
				}
				if nt, live, pinned := fb.outstanding(); nt != 0 || live != 0 || pinned != 0 {
					t.Errorf("after Close %d tensors, %d bytes, %d pinned", nt, live, pinned)
				}
				return plan, st
			}
			tp, tst := run(tied, ti)
			up, ust := run(untied, ui)
			t.Logf("tied: %s; %.0f bytes per token. untied: %.0f bytes per token", tp, tst.BytesPerStep, ust.BytesPerStep)
			sh := tp.Layers[0].Shared
			if sh == nil || sh.From != n-1 || sh.Bytes != table || len(sh.Names) != 1 || sh.Names[0] != "model.embed_tokens.weight" {
				t.Fatalf("the first layer's shared tensors: %+v, want the table of %d bytes from layer %d", sh, table, n-1)
			}
			for l, lp := range tp.Layers[1:] {
				if lp.Shared != nil {
					t.Errorf("layer %d shares %+v", l+1, lp.Shared)
				}
			}
			if up.SharedBytes != 0 || tp.SharedBytes != table {
				t.Errorf("shared bytes: tied %d, untied %d; want %d and 0", tp.SharedBytes, up.SharedBytes, table)
			}
			if tp.WeightBytes != up.WeightBytes-table || tp.ResidentBytes+tp.StreamedBytes != tp.WeightBytes {
				t.Errorf("tied weights %d (resident %d, streamed %d), untied %d: want the table counted once", tp.WeightBytes, tp.ResidentBytes, tp.StreamedBytes, up.WeightBytes)
			}
			if lp := tp.Layers[0]; lp.ResidentBytes != 0 || lp.StreamedBytes != 0 {
				t.Errorf("the first layer holds %d resident and %d streamed bytes of its own, want none", lp.ResidentBytes, lp.StreamedBytes)
			}
			if !strings.Contains(tp.String(), fmt.Sprintf("layer 0 shares %s with layer %d", FormatSize(table), n-1)) {
				t.Errorf("the plan's summary does not say what it shares: %s", tp)
			}
			upStreamsBoth := up.Layers[0].StreamedBytes == table && strings.Contains(strings.Join(up.Layers[n-1].Streamed, " "), "lm_head")
			for _, r := range []struct {
				what string
				st   Stats
				plan *PlanResult
			}{{"tied", tst, tp}, {"untied", ust, up}} {
				if d := r.st.BytesPerStep - float64(r.plan.StreamedBytes); d > tol || d < -tol {
					t.Errorf("%s moves %.0f bytes per token, its plan streams %d per pass", r.what, r.st.BytesPerStep, r.plan.StreamedBytes)
				}
			}
			switch {
			case tc.strategy == StrategyAggressive:
				if tp.StreamedBytes != up.StreamedBytes-table { // and each moves its plan's, within tol
					t.Errorf("aggressive: tied streams %d per pass and moves %.0f per token, untied %d and %.0f: want the table's %d less", tp.StreamedBytes, tst.BytesPerStep, up.StreamedBytes, ust.BytesPerStep, table)
				}
			case upStreamsBoth:
				if tst.BytesPerStep > ust.BytesPerStep-float64(table)+2*tol {
					t.Errorf("tied moves %.0f bytes per token, untied %.0f streaming both copies of the table (%d)", tst.BytesPerStep, ust.BytesPerStep, table)
				}
			default:
				if tst.BytesPerStep > ust.BytesPerStep+2*tol {
					t.Errorf("tied moves %.0f bytes per token, untied %.0f", tst.BytesPerStep, ust.BytesPerStep)
				}
			}
		})
	}
}

// TestSharedTensors: the planner shares a tensor only between a layer and
// the one before it in the cyclic order, under the same name, dtype and
// shape, never through a layer that borrows itself, and not at all when
// the plan follows a sequence or streams layers whole (PlanHybrid's).
func TestSharedTensors(t *testing.T) {
	e := spec("embed", tensor.F16, tensor.Shape{64, 8})
	a := spec("a", tensor.F16, tensor.Shape{8, 8})
	b := spec("b", tensor.F16, tensor.Shape{8, 8})
	other := spec("embed", tensor.F16, tensor.Shape{32, 16}) // same name and bytes, another shape
	layers := func(ls ...[]TensorSpec) []LayerInfo {
		var out []LayerInfo
		for _, ts := range ls {
			li := LayerInfo{Tensors: ts}
			for _, s := range ts {
				li.Bytes += s.Bytes
			}
			out = append(out, li)
		}
		return out
	}
	cases := []struct {
		name   string
		layers []LayerInfo
		want   map[int]int // borrower -> lender
	}{
		{"tied", layers([]TensorSpec{e}, []TensorSpec{a}, []TensorSpec{b, e}), map[int]int{0: 2}},
		{"untied", layers([]TensorSpec{e}, []TensorSpec{a}, []TensorSpec{b}), nil},
		{"another shape", layers([]TensorSpec{e}, []TensorSpec{a}, []TensorSpec{b, other}), nil},
		{"not adjacent", layers([]TensorSpec{e}, []TensorSpec{a}, []TensorSpec{b, e}, []TensorSpec{a}), nil},
		{"adjacent blocks", layers([]TensorSpec{e}, []TensorSpec{a}, []TensorSpec{a, b}), map[int]int{2: 1}},
		{"no chains", layers([]TensorSpec{a}, []TensorSpec{a}, []TensorSpec{a}), map[int]int{1: 0}},
		{"one layer", layers([]TensorSpec{e}), nil},
	}
	for _, tc := range cases {
		got := map[int]int{}
		for l, sh := range sharedTensors(tc.layers) {
			if sh != nil {
				got[l] = sh.From
			}
		}
		if len(got) != len(tc.want) {
			t.Errorf("%s: shared %v, want %v", tc.name, got, tc.want)
			continue
		}
		for l, from := range tc.want {
			if got[l] != from {
				t.Errorf("%s: shared %v, want %v", tc.name, got, tc.want)
			}
		}
	}
	info := ModelInfo{Layers: layers([]TensorSpec{e}, []TensorSpec{a}, []TensorSpec{b, e})}
	for _, opt := range []PlanOption{WithSequence([]int{0, 1, 2}), WithStreamedWhole([]int{1})} {
		p, err := Plan(info, 1<<20, StrategyBalanced, 4, 1, opt)
		if err != nil {
			t.Fatal(err)
		}
		if p.SharedBytes != 0 || p.Layers[0].Shared != nil || p.WeightBytes != info.Layers[0].Bytes+info.Layers[1].Bytes+info.Layers[2].Bytes {
			t.Errorf("a plan with a sequence or layers streamed whole shares %d bytes", p.SharedBytes)
		}
	}
}

// TestTiedHostLayerRefused: a layer that borrows its tensors from another
// layer's device copy cannot be computed from host memory; the pager says
// so rather than hand the CPU a layer without its table.
func TestTiedHostLayerRefused(t *testing.T) {
	src := tiedSynth(2, 16, 24, 8, 32)
	plan, err := Plan(smallDims(src, 2), 1<<20, StrategyAggressive, 8, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, newFake(), 1<<20, "fake")
	defer bg.Close()
	_, err = NewPager(src, bg, plan, Options{HostLayers: []int{0}})
	if err == nil || !strings.Contains(err.Error(), "paging: host layer 0: the plan shares 1 of its tensors with layer 3") {
		t.Fatalf("a borrower as a host layer: %v", err)
	}
	p, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.HostLayer(context.Background(), 0); err == nil || !strings.Contains(err.Error(), "shares") {
		t.Errorf("HostLayer of a borrower: %v", err)
	}
}
