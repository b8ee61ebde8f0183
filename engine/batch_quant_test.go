package engine

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// openGGUF writes fixture name as a GGUF file of base type in a temporary
// directory, as examples/convert does, and opens it.
func openGGUF(t *testing.T, name string, base quant.Type) *loader.Model {
	t.Helper()
	ctx := context.Background()
	src := openFixture(t, name)
	types, _, err := loader.GGUFTensorTypes(src.Config, base)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := src.Tokenizer()
	if err != nil {
		t.Fatal(err)
	}
	v, err := tok.GGUFVocab(src.Config.VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), name+"-"+base.String()+".gguf")
	err = loader.WriteGGUFModel(ctx, path, loader.GGUFModel{Config: src.Config, Vocab: v, Types: types, FileType: loader.GGUFFileType(base),
		Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
			ti, _ := src.Tensor(spec.Name)
			return src.ReadRows(ctx, ti, r0, r1, dst)
		}})
	if err != nil {
		t.Fatal(err)
	}
	lm, err := loader.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	return lm
}

// managedCPU is a CPU backend with "managed memory" (ordinary memory, the
// prefetches and advice do nothing), so that the unified memory modes run
// on any machine.
type managedCPU struct {
	*tensor.CPU
	allocs int
}

func (m *managedCPU) Name() string { return "managedcpu" }

func (m *managedCPU) AllocManaged(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	m.allocs++
	return m.Alloc(dt, shape)
}
func (m *managedCPU) PrefetchToDevice(*tensor.Tensor) error   { return nil }
func (m *managedCPU) PrefetchToHost(*tensor.Tensor) error     { return nil }
func (m *managedCPU) AdviseHost(*tensor.Tensor) error         { return nil }
func (m *managedCPU) AdviseDeviceAccess(*tensor.Tensor) error { return nil }

// synthGGUF writes a random model of the tiny preset widened to 256 (the
// fixtures' rows of 64 and 172 are not whole Q4_K super-blocks) as a GGUF
// file of base type, every tensor in it, and opens it.
func synthGGUF(t *testing.T, base quant.Type) *loader.Model {
	t.Helper()
	c, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	c.HiddenSize, c.HeadDim, c.IntermediateSize, c.NumLayers = 256, 64, 512, 3
	path := filepath.Join(t.TempDir(), "synth-"+base.String()+".gguf")
	fb, err := loader.SynthesizeGGUF(context.Background(), path, c, base, loader.SynthOptions{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(fb) != 0 {
		t.Fatalf("fallbacks %q", fb)
	}
	lm, err := loader.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	return lm
}

// TestBatcherQuantized: a fixture converted to GGUF Q8_0, and a 256-wide
// model written as GGUF Q4_K, give through the batcher each request's
// greedy ids of a session run alone, bit for bit, with the weights
// resident, streamed under a budget, and in both unified memory modes
// (whose weights come from managed memory).
func TestBatcherQuantized(t *testing.T) {
	const ctxLen, block = 32, 4
	prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77, 12, 8, 40, 2, 6}, {7}, {3, 4, 5, 6, 7}, {11, 12}}
	for _, m := range []struct {
		base quant.Type
		open func(t *testing.T) *loader.Model
	}{
		{quant.Q8_0, func(t *testing.T) *loader.Model { return openGGUF(t, fixtures.TinyLlamaF16Sharded, quant.Q8_0) }},
		{quant.Q4_K, func(t *testing.T) *loader.Model { return synthGGUF(t, quant.Q4_K) }},
	} {
		base := m.base
		lm := m.open(t)
		quantized := 0
		for _, ti := range lm.Tensors() {
			if ti.DType.String() == base.String() {
				quantized++
			}
		}
		if quantized < lm.Config.NumLayers {
			t.Fatalf("%v: %d tensors of the file are %v", base, quantized, base)
		}
		// A budget of about half the weights streams some layers.
		var weights int64
		for _, ti := range lm.Tensors() {
			weights += ti.Size
		}
		budget := weights / 2
		for _, tc := range []struct {
			name     string
			mode     paging.MemoryMode
			strategy paging.Strategy
			budget   int64
		}{
			{name: "resident"},
			{name: "streamed", strategy: paging.StrategyBalanced, budget: budget},
			{name: "unified", mode: paging.ModeUnified, budget: budget},
			{name: "unified-noprefetch", mode: paging.ModeUnifiedNoPrefetch, budget: budget},
		} {
			t.Run(base.String()+"/"+tc.name, func(t *testing.T) {
				dev := &managedCPU{CPU: tensor.NewCPU(1)}
				o := Options{Backends: []tensor.Backend{dev}, Context: ctxLen, Chunk: 8, Memory: Memory{Mode: tc.mode, Strategy: tc.strategy}}
				if tc.budget > 0 {
					o.Memory.Budgets = []int64{tc.budget}
				}
				e, err := Open(context.Background(), lm, o)
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				if e.Mode() != paging.ModeExplicit && dev.allocs == 0 {
					t.Fatalf("mode %s allocated no managed memory", e.Mode())
				}
				if p := e.Devices()[0].Plan; tc.budget > 0 && len(p.StreamedLayers) == 0 {
					t.Fatalf("nothing streamed under a budget of %d", tc.budget)
				}
				const steps = 5
				want := make([][]int32, len(prompts))
				for i, p := range prompts {
					s, err := e.NewSession()
					if err != nil {
						t.Fatal(err)
					}
					for _, l := range decode(t, s, p, steps) {
						want[i] = append(want[i], int32(nn.Argmax(l)))
					}
					s.Close()
				}
				b, err := e.NewBatcher(BatchOptions{MaxSequences: 3, StepTokens: 8, BlockSize: block})
				if err != nil {
					t.Fatal(err)
				}
				got, ends := submitAll(t, b, greedyRequests(prompts, steps+1))
				for i := range prompts {
					if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) || ends[i].Err != nil {
						t.Errorf("request %d: %v (end %+v), alone %v", i, got[i], ends[i], want[i])
					}
				}
				if st := b.Stats(); st.BatchSizeSum <= st.Steps {
					t.Errorf("no step ran more than one sequence: %+v", st)
				}
				if err := b.Close(context.Background()); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}
