package nn

import (
	"context"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// slowBackend sleeps in each RMSNorm and counts the attention's positions:
// a CPU with a known cost per block.
type slowBackend struct {
	tensor.Backend
	norm      time.Duration
	positions *int
}

func (s slowBackend) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	time.Sleep(s.norm)
	return s.Backend.RMSNorm(out, x, w, eps)
}

func (s slowBackend) Attention(out *tensor.Tensor, a tensor.Attn) error {
	*s.positions = a.Pos0 + 1
	return s.Backend.Attention(out, a)
}

// fixtureBlock returns a fixture's config and its block 0's weights on the
// CPU.
func fixtureBlock(t *testing.T, name string) (*loader.Model, LayerWeights) {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	hw, err := LoadWeights(context.Background(), lm, tensor.NewCPU(2), nil)
	if err != nil {
		t.Fatal(err)
	}
	lw, err := hw.Acquire(context.Background(), lm.Config.BlockLayer(0))
	if err != nil {
		t.Fatal(err)
	}
	return lm, lw
}

// TestTimeBlock: a block timed alone takes at least what its backend's
// known costs add up to (two norms of 3 ms: the attention's and the
// MLP's), attends over the positions asked for, and every copy of its
// weights is used; bad arguments are refused.
func TestTimeBlock(t *testing.T) {
	for _, name := range []string{fixtures.TinyLlamaBF16, fixtures.TinyQwen3F16} {
		lm, lw := fixtureBlock(t, name)
		var positions int
		b := slowBackend{Backend: tensor.NewCPU(2), norm: 3 * time.Millisecond, positions: &positions}
		copies := []LayerWeights{lw, lw, lw}
		d, err := TimeBlock(context.Background(), lm.Config, b, copies, 0, 100, 2, SessionOptions{KVDType: tensor.F16})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s: block 0 at 100 positions: %v", name, d)
		if d < 6*time.Millisecond || d > time.Second {
			t.Errorf("%s: block timed %v, want at least the 6 ms of its two norms", name, d)
		}
		if positions != 101 {
			t.Errorf("%s: the attention ran over %d positions, want 101", name, positions)
		}
	}
	lm, lw := fixtureBlock(t, fixtures.TinyLlamaBF16)
	cfg := lm.Config
	for _, tc := range []struct {
		name       string
		w          []LayerWeights
		block, pos int
		n          int
	}{
		{"no weights", nil, 0, 10, 1},
		{"no steps", []LayerWeights{lw}, 0, 10, 0},
		{"block past the last", []LayerWeights{lw}, cfg.NumLayers, 10, 1},
		{"negative position", []LayerWeights{lw}, 0, -1, 1},
		{"past the context", []LayerWeights{lw}, 0, cfg.ContextLength(), 1},
		{"weights missing", []LayerWeights{{}}, 0, 10, 1},
	} {
		if _, err := TimeBlock(context.Background(), cfg, tensor.NewCPU(2), tc.w, tc.block, tc.pos, tc.n, SessionOptions{}); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	mx, mlw := fixtureBlock(t, fixtures.TinyMixtralBF16)
	if _, err := TimeBlock(context.Background(), mx.Config, tensor.NewCPU(2), []LayerWeights{mlw}, 0, 10, 1, SessionOptions{}); err == nil {
		t.Error("a sparse block: no error")
	}
}

// TestTimeBlockCycles: each step takes the next copy of the weights.
func TestTimeBlockCycles(t *testing.T) {
	cw := &cyclingWeights{w: []LayerWeights{{"a": nil}, {"b": nil}}}
	var got []string
	for range 3 {
		lw, _ := cw.Acquire(context.Background(), 1)
		for k := range lw {
			got = append(got, k)
		}
	}
	if len(got) != 3 || got[0] != "a" || got[1] != "b" || got[2] != "a" {
		t.Errorf("copies served %v, want a b a", got)
	}
}

// TestBlockTimer: each Step computes the block once at the position asked
// for (its two norms' known cost, the attention over pos+1 positions),
// after the untimed steps NewBlockTimer runs over each copy.
func TestBlockTimer(t *testing.T) {
	lm, lw := fixtureBlock(t, fixtures.TinyLlamaBF16)
	var positions, norms int
	b := countingBackend{slowBackend: slowBackend{Backend: tensor.NewCPU(2), norm: time.Millisecond, positions: &positions}, norms: &norms}
	bt, err := NewBlockTimer(context.Background(), lm.Config, b, []LayerWeights{lw, lw}, 0, 20, SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer bt.Close()
	if norms != 4 {
		t.Errorf("warm-up over two copies ran %d norms, want 4", norms)
	}
	for range 3 {
		t0 := time.Now()
		if err := bt.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(t0); d < 2*time.Millisecond {
			t.Errorf("a step took %v, less than its two norms of 1 ms", d)
		}
	}
	if norms != 10 || positions != 21 {
		t.Errorf("after 3 steps: %d norms (want 10), attention over %d positions (want 21)", norms, positions)
	}
}

// countingBackend is a slowBackend that counts its norms.
type countingBackend struct {
	slowBackend
	norms *int
}

func (c countingBackend) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	*c.norms++
	return c.slowBackend.RMSNorm(out, x, w, eps)
}
