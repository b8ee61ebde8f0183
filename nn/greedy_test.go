package nn

import (
	"context"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// hostArgmax is a backend with a tensor.Argmaxer that finds each row's
// largest element on the host, as a device would on its side; it counts
// its calls, and the downloads of anything else.
type hostArgmax struct {
	tensor.Backend
	argmaxes, downloads int
	fail                bool // Argmax fails
}

func (h *hostArgmax) Unwrap() tensor.Backend { return h.Backend }

func (h *hostArgmax) Download(dst []byte, src *tensor.Tensor) error {
	h.downloads++
	return h.Backend.Download(dst, src)
}

func (h *hostArgmax) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	h.downloads++
	return tensor.DownloadComputed(h.Backend, dst, src)
}

func (h *hostArgmax) Argmax(x *tensor.Tensor) ([]int32, error) {
	h.argmaxes++
	if h.fail {
		return nil, errors.New("argmax refused")
	}
	rows, n := 1, x.Len()
	if len(x.Shape()) == 2 {
		rows, n = x.Shape()[0], x.Shape()[1]
	}
	buf := make([]float32, rows*n)
	if err := h.Backend.Download(unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), 4*len(buf)), x); err != nil {
		return nil, err
	}
	out := make([]int32, rows)
	for r := range out {
		row := buf[r*n : (r+1)*n]
		out[r] = int32(Argmax(row))
		for _, v := range row {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				out[r] = -1
			}
		}
	}
	return out, nil
}

// TestGreedy decodes the F16 fixture with Greedy and with Forward and
// Argmax on the host, and checks the ids are the same: on a backend with
// an Argmaxer, which Greedy asks for every step's id instead of
// downloading the logits, and on one without, where Greedy is Forward and
// Argmax. Logits that overflow (the lm head's, scaled) are Forward's
// error through either path, naming the lm head, and add no position; so
// does a failing argmax, after which Forward downloads the logits again.
func TestGreedy(t *testing.T) {
	ctx := context.Background()
	prompt := []int32{1, 42, 71, 345, 81, 14}
	const steps = 40
	ids := func(m *Model, greedy bool) []int32 {
		t.Helper()
		s, err := m.NewSession(64, 4)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		var out []int32
		var next int32
		for i := range steps {
			in := []int32{next}
			if i == 0 {
				in = prompt
			}
			if greedy {
				next, err = s.Greedy(ctx, in)
			} else {
				var logits []float32
				logits, err = s.Forward(ctx, in, false, nil)
				next = int32(Argmax(logits))
			}
			if err != nil {
				t.Fatalf("step %d: %v", i, err)
			}
			out = append(out, next)
		}
		return out
	}
	lm, cpuM, hw := openCPU(t, fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	want := ids(cpuM, false)
	if got := ids(cpuM, true); !slices.Equal(got, want) {
		t.Errorf("Greedy without an Argmaxer: %v, Forward and Argmax %v", got, want)
	}
	ha := &hostArgmax{Backend: cpuM.backend}
	m, err := New(lm.Config, ha, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(m, true); !slices.Equal(got, want) {
		t.Errorf("Greedy with an Argmaxer: %v, Forward and Argmax %v", got, want)
	}
	if ha.argmaxes != steps || ha.downloads != 0 {
		t.Errorf("Greedy with an Argmaxer: %d argmaxes, %d downloads for %d steps; want one argmax a step and no logits downloaded", ha.argmaxes, ha.downloads, steps)
	}
	if ids(m, false); ha.downloads < steps {
		t.Errorf("Forward on the same backend: %d downloads counted for %d steps", ha.downloads, steps)
	}
	// A Greedy whose argmax fails adds no position, and the session's
	// next Forward downloads its logits as before.
	s, err := m.NewSession(64, 4)
	if err != nil {
		t.Fatal(err)
	}
	ha.fail, ha.downloads = true, 0
	if _, err := s.Greedy(ctx, prompt); err == nil || !strings.Contains(err.Error(), "argmax refused") || s.Pos() != 0 {
		t.Errorf("Greedy with a failing argmax: %v at position %d, want its error at 0", err, s.Pos())
	}
	ha.fail = false
	if logits, err := s.Forward(ctx, prompt, false, nil); err != nil || int32(Argmax(logits)) != want[0] || ha.downloads != 1 || s.Pos() != len(prompt) {
		t.Errorf("Forward after it: %v, id %d (want %d), %d downloads, position %d", err, Argmax(logits), want[0], ha.downloads, s.Pos())
	}
	s.Close()

	dir := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
	fixturetest.Replace(t, dir, "model.norm.weight", tensor.BF16, setTo(1e30))
	fixturetest.Replace(t, dir, "lm_head.weight", tensor.BF16, scaleBy(1e10))
	lm, cpuM, hw = openCPU(t, dir)
	ha = &hostArgmax{Backend: cpuM.backend}
	m, err = New(lm.Config, ha, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	for _, mm := range []*Model{cpuM, m} {
		s, err := mm.NewSession(32, 4)
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.Greedy(ctx, overflowPrompt)
		var ne *NonFiniteError
		if !errors.As(err, &ne) || ne.Name != "the lm head" || s.Pos() != 0 {
			t.Errorf("Greedy of logits that overflow: %v at position %d, want Forward's error naming the lm head at 0", err, s.Pos())
		}
		s.Close()
	}
	if ha.argmaxes != 1 {
		t.Errorf("%d argmaxes for the overflowing step, want 1 (then Forward names the layer)", ha.argmaxes)
	}
}
