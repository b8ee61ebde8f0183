package loader_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// TestSynthesizeGGUF: a synthesised GGUF model is the F32 model Synthesize
// writes for the seed, each tensor encoded in its type (an F16 file's
// weights are the F16 model's bytes), with the tokenizer given; the bytes
// do not depend on the number of workers.
func TestSynthesizeGGUF(t *testing.T) {
	ctx := context.Background()
	c, _ := arch.Preset("tiny")
	c.HiddenSize, c.HeadDim, c.IntermediateSize, c.NumLayers = 256, 64, 512, 2
	dir := t.TempDir()
	ref32, err := loader.SynthesizeOpen(ctx, filepath.Join(dir, "f32"), c, loader.SynthOptions{Seed: 7, DType: tensor.F32})
	if err != nil {
		t.Fatal(err)
	}
	defer ref32.Close()
	ref16, err := loader.SynthesizeOpen(ctx, filepath.Join(dir, "f16"), c, loader.SynthOptions{Seed: 7, DType: tensor.F16})
	if err != nil {
		t.Fatal(err)
	}
	defer ref16.Close()
	for _, base := range []quant.Type{quant.Q4_K, quant.Q8_0, quant.F16} {
		t.Run(base.String(), func(t *testing.T) {
			var files [][]byte
			for _, workers := range []int{1, 3} {
				path := filepath.Join(t.TempDir(), "m.gguf")
				fb, err := loader.SynthesizeGGUF(ctx, path, c, base, loader.SynthOptions{Seed: 7, Workers: workers,
					TokenizerFrom: fixtures.Dir(fixtures.TinyLlamaBF16)})
				if err != nil {
					t.Fatal(err)
				}
				if len(fb) != 0 { // every row is whole super-blocks
					t.Errorf("fallbacks %q", fb)
				}
				b, _ := os.ReadFile(path)
				files = append(files, b)
				if workers > 1 {
					continue
				}
				m, err := loader.Open(path)
				if err != nil {
					t.Fatal(err)
				}
				defer m.Close()
				if tok, err := m.Tokenizer(); err != nil || tok == nil || tok.VocabSize() != c.VocabSize {
					t.Fatalf("tokenizer %v, %v", tok, err)
				}
				for _, spec := range c.ExpectedTensors() {
					ti, _ := m.Tensor(spec.Name)
					got, err := m.ReadTensor(ctx, spec.Name)
					if err != nil {
						t.Fatal(err)
					}
					var want []byte
					switch {
					case ti.DType == tensor.F16:
						x, _ := ref16.ReadTensor(ctx, spec.Name)
						want = x.Bytes()
					case ti.DType == tensor.F32:
						x, _ := ref32.ReadTensor(ctx, spec.Name)
						want = x.Bytes()
					default:
						x, _ := ref32.ReadTensor(ctx, spec.Name)
						q, _ := ti.DType.Quant()
						want = make([]byte, ti.Size)
						if err := q.Quantize(want, x.F32()); err != nil {
							t.Fatal(err)
						}
					}
					if !bytes.Equal(got.Bytes(), want) {
						t.Errorf("%s (%v): not the synthesised values encoded", spec.Name, ti.DType)
					}
				}
			}
			if !bytes.Equal(files[0], files[1]) {
				t.Error("the file depends on the number of workers")
			}
		})
	}
}

// TestSynthesizeGGUFMemory: writing a model of 134 MB takes a few chunks'
// worth of memory, not a tensor's or the model's.
func TestSynthesizeGGUFMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 134 MB")
	}
	c, _ := arch.Preset("tiny")
	c.HiddenSize, c.NumHeads, c.NumKVHeads, c.HeadDim, c.IntermediateSize, c.NumLayers, c.VocabSize = 1024, 16, 16, 64, 2816, 4, 8000
	var peak uint64
	var ms runtime.MemStats
	path := filepath.Join(t.TempDir(), "m.gguf")
	_, err := loader.SynthesizeGGUF(context.Background(), path, c, quant.F16, loader.SynthOptions{Seed: 1,
		Progress: func(int64, int64) {
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapAlloc)
		}})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(path)
	if peak == 0 || peak > 100<<20 {
		t.Errorf("the heap peaked at %d MB writing a file of %d MB", peak>>20, st.Size()>>20)
	}
	t.Logf("the heap peaked at %d MB writing a file of %d MB", peak>>20, st.Size()>>20)
}
