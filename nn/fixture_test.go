package nn

import (
	"context"
	"math"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// reference is what transformers computed for a fixture.
type reference struct {
	inputIDs  []int32
	logits    []float32 // [T, vocab]
	hidden    [][]float32
	greedy    []int32
	margin    []float32
	vocab     int
	numHidden int
}

func loadReference(t *testing.T, dir string, layers int) *reference {
	t.Helper()
	f, err := loader.OpenSafetensors(dir + "/reference.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx := context.Background()
	read := func(name string) *tensor.Tensor {
		x, err := f.ReadTensor(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	ids64 := func(x *tensor.Tensor) []int32 {
		var out []int32
		for _, v := range x.I64() {
			out = append(out, int32(v))
		}
		return out
	}
	r := &reference{
		inputIDs: ids64(read("input_ids")),
		greedy:   ids64(read("greedy_ids")),
		margin:   read("greedy_margin").F32(),
	}
	lg := read("logits")
	r.logits, r.vocab = lg.F32(), lg.Shape()[1]
	for i := 0; i <= layers; i++ {
		r.hidden = append(r.hidden, read("hidden."+itoa(i)).F32())
	}
	return r
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}

func maxAbsDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	d := 0.0
	for i := range a {
		x := math.Abs(float64(a[i]) - float64(b[i]))
		if math.IsNaN(x) {
			return math.Inf(1)
		}
		d = math.Max(d, x)
	}
	return d
}

// openFixture loads a fixture on the CPU backend with every weight resident.
func openFixture(t *testing.T, name string) (*Model, *loader.Model, func()) {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(name))
	if err != nil {
		t.Fatal(err)
	}
	cfg := lm.Config
	b := tensor.NewCPU(0)
	w, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(cfg, b, nil, w)
	if err != nil {
		t.Fatal(err)
	}
	return m, lm, func() { w.Close(); lm.Close(); b.Close() }
}

func TestFixtures(t *testing.T) {
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16,
		fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			m, _, done := openFixture(t, name)
			defer done()
			cfg := m.Config()
			ref := loadReference(t, fixtures.Dir(name), cfg.NumLayers)
			ctx := context.Background()

			// Prefill in one chunk and in chunks of 5: logits at every
			// position and every layer's hidden state.
			for _, chunk := range []int{64, 5} {
				s, err := m.NewSession(64, chunk)
				if err != nil {
					t.Fatal(err)
				}
				hidden := make([][]float32, cfg.NumLayers+2)
				hook := func(layer int, h *tensor.Tensor) error {
					buf := make([]byte, h.NumBytes())
					if err := m.Backend().Download(buf, h); err != nil {
						return err
					}
					ht, _ := tensor.FromBytes(tensor.F32, h.Shape(), buf)
					hidden[layer] = append(hidden[layer], ht.F32()...)
					return nil
				}
				logits, err := s.Forward(ctx, ref.inputIDs, true, hook)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("chunk %d: logits max abs diff %.3g", chunk, maxAbsDiff(logits, ref.logits))
				if d := maxAbsDiff(logits, ref.logits); d > 1e-3 {
					t.Errorf("chunk %d: logits differ from transformers by %g (max abs), want <= 1e-3", chunk, d)
				}
				// hidden.0 is the embedding, hidden.i the output of block
				// i-1 for 0<i<L, hidden.L the final norm (layer L+1 here).
				for i, want := range ref.hidden {
					got := hidden[i]
					if i == cfg.NumLayers {
						got = hidden[i+1]
					}
					if d := maxAbsDiff(got, want); d > 1e-3 {
						t.Errorf("chunk %d: hidden.%d differs by %g, want <= 1e-3", chunk, i, d)
					}
				}
				s.Close()
			}

			// Greedy decoding with the KV cache.
			s, err := m.NewSession(64, 16)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			logits, err := s.Forward(ctx, ref.inputIDs, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			checked := 0
			for k, want := range ref.greedy {
				got := Argmax(logits)
				if ref.margin[k] > 1e-3 {
					checked++
					if int32(got) != want {
						t.Fatalf("greedy step %d: got id %d, transformers chose %d (margin %g)", k, got, want, ref.margin[k])
					}
				}
				// Continue from transformers' choice so one near-tie does
				// not derail the steps after it.
				if logits, err = s.Forward(ctx, []int32{want}, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			if checked < len(ref.greedy)/2 {
				t.Errorf("only %d of %d greedy steps had a margin above 1e-3", checked, len(ref.greedy))
			}
		})
	}
}
