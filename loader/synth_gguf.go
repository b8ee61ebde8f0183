package loader

import (
	"context"
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/sync/errgroup"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// SynthesizeGGUF writes a random-weight model of shape cfg as a GGUF file
// at path, its tensors of the types GGUFTensorTypes gives for base (Q8_0,
// Q4_K, ..., or F16, BF16, F32): the F32 model Synthesize writes for the
// same seed, quantized tensor by tensor, row by row, as the file is
// written, so that a model of any size is written in a few hundred MB of
// memory. opts.TokenizerFrom, if set, is a model directory whose
// tokenizer is written as the file's (it must be one GGUF can describe:
// tokenizer.GGUFVocab); opts.DType and opts.MaxShardBytes do not apply.
// The file is written under a temporary name and renamed into place: a
// failure leaves path as it was. fallbacks lists the tensors whose rows
// are not whole blocks of their type (GGUFTensorTypes).
func SynthesizeGGUF(ctx context.Context, path string, cfg *arch.Config, base quant.Type, opts SynthOptions) (fallbacks []string, err error) {
	if cfg == nil {
		return nil, errors.New("loader: synthesize: nil config")
	}
	c := cfg.Clone()
	c.DType = tensor.F16
	if base == quant.BF16 || base == quant.F32 {
		c.DType, _ = tensor.FromQuant(base)
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	types, fallbacks, err := GGUFTensorTypes(c, base)
	if err != nil {
		return nil, err
	}
	var vocab *tokenizer.GGUFVocab
	if opts.TokenizerFrom != "" {
		if _, err := checkTokenizer(opts.TokenizerFrom, c.VocabSize); err != nil {
			return nil, err
		}
		tok, err := tokenizer.Load(opts.TokenizerFrom)
		if err != nil {
			return nil, fmt.Errorf("loader: synthesize: %w", err)
		}
		if vocab, err = tok.GGUFVocab(c.VocabSize); err != nil {
			return nil, fmt.Errorf("loader: synthesize: %w", err)
		}
	}
	workers := opts.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	tables := map[[2]float32]*levelTable{}
	rows := func(spec arch.Spec, r0, r1 int, dst []float32) error {
		center, halfWidth := synthInit(c, spec)
		tab := tables[[2]float32{center, halfWidth}]
		if tab == nil {
			tab = newLevelTable(tensor.F32, center, halfWidth)
			tables[[2]float32{center, halfWidth}] = tab
		}
		g := &uniformGen{tab: tab, key: tensorKey(opts.Seed, spec.Name)}
		cols := r1 - r0
		if cols > 0 {
			cols = len(dst) / cols
		}
		// The rows are drawn in parallel pieces (each element's value
		// depends on its position only): a model of tens of GB is
		// bound by this, not by the quantization, which is parallel too.
		per := max(1, (r1-r0+workers-1)/workers)
		var eg errgroup.Group
		for a := r0; a < r1; a += per {
			b := min(a+per, r1)
			eg.Go(func() error {
				part := dst[(a-r0)*cols : (b-r0)*cols]
				raw := make([]byte, 4*len(part))
				if err := g.fill(raw, 4*int64(a)*int64(cols)); err != nil {
					return err
				}
				return quant.F32.Dequantize(part, raw)
			})
		}
		return eg.Wait()
	}
	err = WriteGGUFModel(ctx, path, GGUFModel{Config: c, Vocab: vocab, Name: "strata synthetic", Types: types,
		FileType: GGUFFileType(base), Rows: rows, Workers: opts.Workers, Progress: opts.Progress})
	if err != nil {
		return nil, err
	}
	return fallbacks, nil
}
