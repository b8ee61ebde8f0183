package nn

import (
	"slices"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// foldingCPU folds the norms and adds of one-row products (tensor.NormFuser)
// the way the separate operations compute them, and counts the folds.
type foldingCPU struct {
	tensor.Backend
	norms, adds int
}

func (f *foldingCPU) Unwrap() tensor.Backend { return f.Backend }

func (f *foldingCPU) Folds(x, g *tensor.Tensor, ws ...*tensor.Tensor) bool { return x.Shape()[0] == 1 }

func (f *foldingCPU) normed(x, g *tensor.Tensor, eps float32) (*tensor.Tensor, error) {
	h := tensor.New(tensor.F32, x.Shape())
	return h, f.RMSNorm(h, x, g, eps)
}

func (f *foldingCPU) NormMatMulMany(outs []*tensor.Tensor, x, g *tensor.Tensor, eps float32, ws []*tensor.Tensor) (bool, error) {
	f.norms++
	h, err := f.normed(x, g, eps)
	if err != nil {
		return false, err
	}
	return true, tensor.MatMulMany(f.Backend, outs, h, ws)
}

func (f *foldingCPU) NormGateUpSiLU(out, x, g *tensor.Tensor, eps float32, wGate, wUp *tensor.Tensor) (bool, error) {
	f.norms++
	h, err := f.normed(x, g, eps)
	if err != nil {
		return false, err
	}
	up := tensor.New(tensor.F32, out.Shape())
	return true, tensor.GateUpSiLU(f.Backend, out, up, h, wGate, wUp)
}

func (f *foldingCPU) MatMulAdd(out, x, w *tensor.Tensor) (bool, error) {
	f.adds++
	p := tensor.New(tensor.F32, out.Shape())
	if err := f.MatMul(p, x, w, nil); err != nil {
		return false, err
	}
	return true, f.Add(out, out, p)
}

// TestFoldedBlocks: on a backend that folds a decode step's norms into its
// products and its o and down products' adds into them (tensor.NormFuser),
// every block of a one-row step folds (two norms and two adds), the
// prompt's chunks do not, and the logits are bit for bit the unfolded
// model's (on the CPU the fold computes as the separate operations do,
// and an add then a norm is AddRMSNorm there), through a hook too (which
// sees x with every block's output added); Qwen3's q and k norms too.
func TestFoldedBlocks(t *testing.T) {
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyQwen3F16} {
		t.Run(name, func(t *testing.T) { testFoldedBlocks(t, name) })
	}
}

func testFoldedBlocks(t *testing.T, name string) {
	lm, cpu, hw := fixtureOnCPU(t, name)
	prompt := []int32{1, 5, 9, 200, 3, 77}
	const steps = 5
	run := func(b tensor.Backend, hook bool) ([]float32, [][]float32) {
		m, err := New(lm.Config, b, nil, hw)
		if err != nil {
			t.Fatal(err)
		}
		s, err := m.NewSession(len(prompt)+steps+1, 4)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		var seen [][]float32
		var h Hook
		if hook {
			h = func(layer int, x *tensor.Tensor) error {
				seen = append(seen, slices.Clone(x.F32()))
				return nil
			}
		}
		logits, err := s.Forward(t.Context(), prompt, false, h)
		if err != nil {
			t.Fatal(err)
		}
		all := slices.Clone(logits)
		for range steps {
			id := int32(Argmax(logits))
			if logits, err = s.Forward(t.Context(), []int32{id}, false, h); err != nil {
				t.Fatal(err)
			}
			all = append(all, logits...)
		}
		return all, seen
	}
	for _, hook := range []bool{false, true} {
		want, wantSeen := run(cpu, hook)
		f := &foldingCPU{Backend: cpu}
		got, gotSeen := run(f, hook)
		blocks := lm.Config.NumLayers
		if f.norms != 2*blocks*steps || f.adds != 2*blocks*steps {
			t.Errorf("hook %v: %d norms and %d adds folded, want %d each (two a block, %d blocks, %d one-row steps)", hook, f.norms, f.adds, 2*blocks*steps, blocks, steps)
		}
		if !slices.Equal(got, want) {
			t.Errorf("hook %v: the folded model's logits differ from the unfolded one's", hook)
		}
		if len(gotSeen) != len(wantSeen) {
			t.Fatalf("hook %v: the hook saw %d tensors folded, %d unfolded", hook, len(gotSeen), len(wantSeen))
		}
		for i := range gotSeen {
			if !slices.Equal(gotSeen[i], wantSeen[i]) {
				t.Errorf("hook %v: the hook's tensor %d differs folded", hook, i)
				break
			}
		}
	}
}
