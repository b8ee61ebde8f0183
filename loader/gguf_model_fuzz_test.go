package loader

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/tensor/quant"
)

// FuzzGGUFModel opens arbitrary bytes as a GGUF model, reads every tensor
// whole and in part and builds and runs the tokenizer. Bad input must be
// an error, never a panic; a read of a tensor the model accepted stays
// inside its bytes.
func FuzzGGUFModel(f *testing.F) {
	c, _ := arch.Preset("tiny")
	c.NumLayers, c.VocabSize = 1, 8
	for _, seed := range []struct {
		family arch.Family
		base   quant.Type
		vocab  *tokenizer.GGUFVocab
	}{
		{arch.Llama, quant.Q8_0, &tokenizer.GGUFVocab{Model: "llama", Tokens: []string{"<unk>", "<s>", "</s>", "▁", "a", "b", "ab", "<0x41>"},
			Scores: []float32{0, 0, 0, -1, -2, -3, -1, 0}, Types: []int32{2, 3, 3, 1, 1, 1, 1, 6}, BOS: 1, EOS: 2, UNK: 0, AddBOS: true, AddSpacePrefix: true}},
		{arch.Qwen2, quant.F16, &tokenizer.GGUFVocab{Model: "gpt2", Pre: "qwen2", Tokens: []string{"a", "b", "ab", "Ġ", "Ġa", "c", "<|x|>", "d"},
			Merges: []string{"a b", "Ġ a"}, Types: []int32{1, 1, 1, 1, 1, 1, 3, 1}, BOS: -1, EOS: 6, UNK: -1}},
		{arch.Qwen3, quant.Q8_0, &tokenizer.GGUFVocab{Model: "gpt2", Pre: "qwen2", Tokens: []string{"a", "b", "ab", "Ġ", "Ġa", "c", "<|x|>", "d"},
			Merges: []string{"a b", "Ġ a"}, Types: []int32{1, 1, 1, 1, 1, 1, 3, 1}, BOS: -1, EOS: 6, UNK: -1}},
	} {
		cfg := c.Clone()
		cfg.SetFamily(seed.family)
		types, _, err := GGUFTensorTypes(cfg, seed.base)
		if err != nil {
			f.Fatal(err)
		}
		path := filepath.Join(f.TempDir(), "seed.gguf")
		err = WriteGGUFModel(context.Background(), path, GGUFModel{Config: cfg, Vocab: seed.vocab, Types: types,
			Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
				for i := range dst {
					dst[i] = float32((r0*7+i)%13) * 0.01
				}
				return nil
			}})
		if err != nil {
			f.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		g, err := ParseGGUF(bytes.NewReader(data), int64(len(data)), "fuzz.gguf")
		if err != nil {
			return
		}
		m, err := newGGUFModel("fuzz.gguf", g, bytesFile{bytes.NewReader(data)}, int64(len(data)))
		if err != nil {
			return
		}
		defer m.Close()
		ctx := context.Background()
		for _, ti := range m.Tensors() {
			buf := make([]byte, ti.Size)
			m.ReadInto(ctx, ti, buf)
			if ti.Size > 3 {
				m.ReadRange(ctx, ti, 1, buf[:ti.Size-3])
			}
			if len(ti.Shape) > 0 && ti.Shape.NumElements() < 1<<16 {
				cols := ti.Shape[len(ti.Shape)-1]
				if cols > 0 {
					rows := int(ti.Shape.NumElements()) / cols
					m.ReadRows(ctx, ti, 0, rows, make([]float32, rows*cols))
				}
			}
		}
		tok, err := m.Tokenizer()
		if err != nil || tok == nil {
			return
		}
		ids, err := tok.Encode("ab <|x|> a\u00e9b", true)
		if err != nil {
			return
		}
		tok.Decode(ids)
		tok.GGUFVocab(tok.VocabSize())
	})
}
