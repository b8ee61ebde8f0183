package nn

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// openCPU loads the model in dir onto a CPU backend, every weight resident.
func openCPU(t *testing.T, dir string) (*loader.Model, *Model, *HostWeights) {
	t.Helper()
	lm, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	cfg := lm.Config
	b := tensor.NewCPU(1)
	t.Cleanup(func() { b.Close() })
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(hw.Close)
	m, err := New(cfg, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	return lm, m, hw
}

func scaleBy(f float32) func(int, float32) float32 {
	return func(_ int, v float32) float32 { return v * f }
}

func setTo(f float32) func(int, float32) float32 {
	return func(int, float32) float32 { return f }
}

var overflowPrompt = []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}

// TestForwardNonFiniteNamesLayer builds models whose weights are all
// finite but whose forward overflows float32 in a known layer, and checks
// that Forward (one device and a two-stage pipeline, every logit row or
// only the last, in chunks) fails with a *NonFiniteError naming that layer
// and the first position, adds no positions, and calls the caller's hook
// only for the first run.
func TestForwardNonFiniteNamesLayer(t *testing.T) {
	type change struct {
		tensor string
		dt     tensor.DType
		fn     func(int, float32) float32
	}
	cases := []struct {
		name    string
		fixture string
		changes []change
		layer   int
		what    string
	}{
		// An MLP norm of 1e30 makes the gate and up projections about
		// 1e30, their product overflows, and the down projection sums
		// infinities of both signs.
		{"bf16 block 2", fixtures.TinyLlamaBF16, []change{{"model.layers.2.post_attention_layernorm.weight", tensor.BF16, scaleBy(1e30)}}, 3, "block 2"},
		{"f16 block 1, the norm stored as F32", fixtures.TinyLlamaF16Sharded, []change{{"model.layers.1.post_attention_layernorm.weight", tensor.F32, scaleBy(1e30)}}, 2, "block 1"},
		{"bf16 block 0 attention", fixtures.TinyLlamaBF16, []change{
			{"model.layers.0.input_layernorm.weight", tensor.BF16, scaleBy(1e30)},
			{"model.layers.0.self_attn.o_proj.weight", tensor.BF16, scaleBy(1e12)},
		}, 1, "block 0"},
		// A final norm weight of 3e38 overflows where the normalised
		// hidden state exceeds about 1.1.
		{"bf16 final norm", fixtures.TinyLlamaBF16, []change{{"model.norm.weight", tensor.BF16, setTo(3e38)}}, 5, "the final norm"},
		// A final norm of 1e30 stays finite; the LM head's products of
		// about 1e39 do not.
		{"bf16 lm head", fixtures.TinyLlamaBF16, []change{
			{"model.norm.weight", tensor.BF16, setTo(1e30)},
			{"lm_head.weight", tensor.BF16, scaleBy(1e10)},
		}, 5, "the lm head"},
	}
	ctx := context.Background()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := fixturetest.Copy(t, c.fixture)
			for _, ch := range c.changes {
				fixturetest.Replace(t, dir, ch.tensor, ch.dt, ch.fn)
			}
			_, m, hw := openCPU(t, dir)
			check := func(what string, err error, pos int, all bool) {
				t.Helper()
				// Without all, the only logits are the last position's.
				wantPos := 0
				if c.what == "the lm head" && !all {
					wantPos = len(overflowPrompt) - 1
				}
				var ne *NonFiniteError
				if !errors.As(err, &ne) || !errors.Is(err, ErrNonFinite) {
					t.Fatalf("%s: %v, want a *NonFiniteError", what, err)
				}
				if ne.Layer != c.layer || ne.Name != c.what || ne.Pos != wantPos {
					t.Errorf("%s: %+v, want %s (layer %d) at position %d", what, ne, c.what, c.layer, wantPos)
				}
				if v := float64(ne.Value); !math.IsNaN(v) && !math.IsInf(v, 0) {
					t.Errorf("%s: value %v is finite", what, v)
				}
				if msg := err.Error(); strings.Contains(msg, "\n") || !strings.Contains(msg, c.what) {
					t.Errorf("%s: message %q", what, msg)
				}
				if pos != 0 {
					t.Errorf("%s: the failed forward left the session at position %d", what, pos)
				}
			}
			for _, chunk := range []int{4, 32} {
				for _, all := range []bool{false, true} {
					s, err := m.NewSession(32, chunk)
					if err != nil {
						t.Fatal(err)
					}
					calls := 0
					hook := func(int, *tensor.Tensor) error { calls++; return nil }
					_, err = s.Forward(ctx, overflowPrompt, all, hook)
					check("session", err, s.Pos(), all)
					chunks := (len(overflowPrompt) + chunk - 1) / chunk
					if want := chunks * (m.cfg.NumLayers + 2); calls != want {
						t.Errorf("the hook ran %d times, once per layer and chunk is %d", calls, want)
					}
					s.Close()
				}
			}
			// The same across two devices.
			p, err := NewPipeline(&m.cfg, []Stage{
				{Backend: tensor.NewCPU(1), Weights: hw, FirstBlock: 0, EndBlock: 2},
				{Backend: tensor.NewCPU(1), Weights: hw, FirstBlock: 2, EndBlock: m.cfg.NumLayers},
			})
			if err != nil {
				t.Fatal(err)
			}
			ps, err := p.NewSession(32, 4)
			if err != nil {
				t.Fatal(err)
			}
			defer ps.Close()
			_, err = ps.Forward(ctx, overflowPrompt, false, nil)
			check("pipeline", err, ps.Pos(), false)
		})
	}
}

// TestForwardNonFiniteMidSequence: weights that go bad between two decode
// steps are caught at the step's position, the session keeps its place,
// and once the weights are good again the step gives the logits of an
// undisturbed session.
func TestForwardNonFiniteMidSequence(t *testing.T) {
	ctx := context.Background()
	_, m, hw := openCPU(t, fixtures.Dir(fixtures.TinyLlamaBF16))
	ref, err := m.NewSession(32, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	if _, err := ref.Forward(ctx, overflowPrompt, false, nil); err != nil {
		t.Fatal(err)
	}
	want, err := ref.Forward(ctx, []int32{7}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	want = append([]float32(nil), want...)

	s, err := m.NewSession(32, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Forward(ctx, overflowPrompt, false, nil); err != nil {
		t.Fatal(err)
	}
	const name = "model.layers.2.post_attention_layernorm.weight"
	w := hw.layers[3][name].U16()
	saved := append([]uint16(nil), w...)
	for i := range w {
		w[i] = tensor.BF16FromF32(1e30)
	}
	_, err = s.Forward(ctx, []int32{7}, false, nil)
	var ne *NonFiniteError
	if !errors.As(err, &ne) || ne.Layer != 3 || ne.Pos != len(overflowPrompt) {
		t.Fatalf("%v, want block 2 at position %d", err, len(overflowPrompt))
	}
	if s.Pos() != len(overflowPrompt) {
		t.Fatalf("session at %d after the failed step, want %d", s.Pos(), len(overflowPrompt))
	}
	copy(w, saved)
	got, err := s.Forward(ctx, []int32{7}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("logit %d after the retry: %v, an undisturbed session %v", i, got[i], want[i])
		}
	}
}

// TestNonFiniteWeightsRefusedOnLoad: a NaN in a weight file stops loading
// and paging with the loader's error naming the tensor, on both fixtures.
func TestNonFiniteWeightsRefusedOnLoad(t *testing.T) {
	const name = "model.layers.1.self_attn.v_proj.weight"
	for _, c := range []struct {
		fixture string
		bits    uint32
	}{
		{fixtures.TinyLlamaF16Sharded, 0x7e00},
		{fixtures.TinyLlamaBF16, 0x7fc0},
	} {
		dir := fixturetest.Copy(t, c.fixture)
		fixturetest.SetBits(t, dir, name, 33, c.bits)
		lm, err := loader.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer lm.Close()
		cfg := lm.Config
		b := tensor.NewCPU(1)
		defer b.Close()
		checkErr := func(what string, err error) {
			t.Helper()
			var ne *loader.NonFiniteError
			if !errors.As(err, &ne) || ne.Tensor != name || ne.Index != 33 || !strings.Contains(err.Error(), name) {
				t.Errorf("%s %s: %v, want the loader's error naming %s", c.fixture, what, err, name)
			}
		}
		_, err = LoadWeights(context.Background(), lm, b, nil)
		checkErr("LoadWeights", err)
		_, err = LoadParams(context.Background(), lm)
		checkErr("LoadParams", err)

		info, err := ModelInfo(lm, cfg)
		if err != nil {
			t.Fatal(err)
		}
		plan, err := paging.Plan(info, 1<<30, paging.StrategyMinimal, 32, 1)
		if err != nil {
			t.Fatal(err)
		}
		bud := newBudget(t, b, 1<<30, "cpu")
		pager, err := paging.NewPager(Source(lm), bud, plan, paging.Options{})
		if err != nil {
			t.Fatal(err)
		}
		m, err := New(cfg, b, bud, pager)
		if err != nil {
			t.Fatal(err)
		}
		s, err := m.NewSession(32, 8)
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.Forward(context.Background(), overflowPrompt, false, nil)
		checkErr("paged Forward", err)
		s.Close()
		pager.Close()
		bud.Close()
	}
}
