package nn

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// TestContextRefused asks sessions, pipeline sessions and training windows
// for more positions than the fixture's context (max_position_embeddings
// 256, or a sliding window): each is refused with ErrContextTooLong naming
// the limit, before anything is allocated; at the limit they work.
func TestContextRefused(t *testing.T) {
	m0, _, done := openFixture(t, fixtures.TinyLlamaBF16)
	defer done()
	if got := m0.Config().MaxPositions; got != 256 {
		t.Fatalf("MaxPositions %d, want the fixture's 256", got)
	}
	ctx := context.Background()
	cases := []struct {
		name    string
		window  int
		maxPos  int // asked for
		refused string
	}{
		{"max positions", 0, 257, "context of 256 (max_position_embeddings)"},
		{"huge", 0, 1 << 40, "context of 256"},
		{"at max positions", 0, 256, ""},
		{"window", 16, 17, "sliding attention window of 16 (sliding_window)"},
		{"at the window", 16, 16, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := m0.Config()
			if c.window > 0 {
				cfg.SetFamily(arch.Mistral) // the family with a sliding window
				cfg.SlidingWindow = c.window
			}
			b := tensor.NewCPU(1)
			defer b.Close()
			bud := newBudget(t, b, 1<<30, "cpu")
			defer bud.Close()
			check := func(what string, err error) {
				t.Helper()
				if c.refused == "" {
					if err != nil {
						t.Errorf("%s: %v", what, err)
					}
					return
				}
				if !errors.Is(err, ErrContextTooLong) || !strings.Contains(err.Error(), c.refused) {
					t.Errorf("%s: %v, want ErrContextTooLong naming %q", what, err, c.refused)
				}
				if bud.Peak() != 0 {
					t.Errorf("%s: %d bytes allocated before the refusal", what, bud.Peak())
				}
			}

			m, err := New(cfg, b, bud, m0.weights)
			if err != nil {
				t.Fatal(err)
			}
			s, err := m.NewSession(c.maxPos, 8)
			check("session", err)
			s.Close() // nil when refused

			pl, err := NewPipeline(cfg, []Stage{
				{Backend: b, Alloc: bud, Weights: m0.weights, FirstBlock: 0, EndBlock: 2},
				{Backend: b, Alloc: bud, Weights: m0.weights, FirstBlock: 2, EndBlock: cfg.NumLayers},
			})
			if err != nil {
				t.Fatal(err)
			}
			ps, err := pl.NewSession(c.maxPos, 8)
			check("pipeline session", err)
			ps.Close()

			if c.refused == "" || c.maxPos > 1<<20 {
				return // training within the context is the trainer tests' business
			}
			tr, err := NewTrainer(m, TrainOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()
			ids := make([]int32, c.maxPos)
			_, err = tr.LossAndGrads(ctx, ids, ids, Grads{}, 1)
			check("training window", err)
		})
	}
}
