// Command convert writes a model as a GGUF file, quantized or not, that
// strata and llama.cpp both read:
//
//	go run ./examples/convert -model /models/llama-2-7b -out llama-2-7b-q4_k.gguf -quantize q4_k
//
// The model is a Hugging Face directory or a GGUF file (which is
// requantized). -quantize names the base type: q8_0, q4_0, q4_k, q5_k or
// q6_k, or f16, bf16, f32. The linear weights and the token embedding are
// stored in it, the norms and biases in F32, the LM head in Q6_K for the
// 4- to 6-bit types (loader.GGUFTensorTypes: llama.cpp's choices without
// an importance matrix; q4_k is its Q4_K_S less the few Q5_K tensors). A
// weight whose rows are not whole blocks of its type is written as F16,
// and convert says so. The query and key rows of the llama architecture
// are permuted as llama.cpp's converter permutes them. A mixture of
// experts (Mixtral, Qwen3-MoE) has its router in F32 and each block's
// experts stacked per projection as llama.cpp stacks them, in the base
// type like the other linear weights (a projection whose rows are not
// whole blocks in F16, one line per block). The tokenizer is
// written as a GGUF vocabulary (tokenizer.GGUFVocab); one GGUF cannot
// describe is an error, unless -no-tokenizer leaves it out.
//
// The file is written under a temporary name beside -out and renamed when
// complete: a failed or cancelled run leaves -out as it was. An existing
// -out is replaced only with -force, and never when it is one of the
// model's files. Each tensor is quantized row by row as it is written, so
// a model larger than memory converts in a few hundred MB.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/tensor/quant"
)

func main() { cli.Main("convert", run) }

// bases are the -quantize values.
var bases = []quant.Type{quant.Q8_0, quant.Q4_0, quant.Q4_K, quant.Q5_K, quant.Q6_K, quant.F16, quant.BF16, quant.F32}

func baseNames() string {
	var s []string
	for _, b := range bases {
		s = append(s, strings.ToLower(b.String()))
	}
	return strings.Join(s, ", ")
}

type options struct {
	model, out, quantize, name string
	force, noTokenizer, quiet  bool
	threads                    int
	base                       quant.Type
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("convert", flag.ContinueOnError)
	o := &options{}
	fs.StringVar(&o.model, "model", "", "Hugging Face model `directory` or GGUF file to convert (required)")
	fs.StringVar(&o.out, "out", "", "GGUF `file` to write (required)")
	fs.StringVar(&o.quantize, "quantize", "f16", "base `type`: "+baseNames())
	fs.StringVar(&o.name, "name", "", "general.name of the file (default: the model's directory or file name)")
	fs.BoolVar(&o.force, "force", false, "replace -out if it exists")
	fs.BoolVar(&o.noTokenizer, "no-tokenizer", false, "write no tokenizer (for a tokenizer GGUF cannot describe)")
	fs.IntVar(&o.threads, "threads", 0, "goroutines quantizing rows; 0 is all cores")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress on stderr")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return nil, err
	}
	switch {
	case o.model == "":
		return nil, cli.Usagef("-model is required")
	case o.out == "":
		return nil, cli.Usagef("-out is required")
	case o.threads < 0:
		return nil, cli.Usagef("-threads must not be negative, got %d", o.threads)
	}
	t, err := quant.ParseType(o.quantize)
	ok := false
	for _, b := range bases {
		ok = ok || err == nil && t == b
	}
	if !ok {
		return nil, cli.Usagef("-quantize: unknown type %q (have %s)", o.quantize, baseNames())
	}
	o.base = t
	if o.name == "" {
		o.name = strings.TrimSuffix(filepath.Base(filepath.Clean(o.model)), filepath.Ext(o.model))
	}
	return o, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	lm, err := cli.OpenModel(o.model)
	if err != nil {
		return err
	}
	defer lm.Close()
	if err := cli.CheckOutputs([][2]string{{"-out", o.out}}, cli.InputsOf(lm)); err != nil {
		return err
	}
	if st, err := os.Stat(o.out); err == nil && !o.force {
		if st.IsDir() {
			return cli.Usagef("-out %s is a directory", o.out)
		}
		return cli.Usagef("-out %s exists: give -force to replace it", o.out)
	}
	cfg := lm.Config

	var vocab *tokenizer.GGUFVocab
	if !o.noTokenizer {
		tok, err := lm.Tokenizer()
		if err != nil {
			return err
		}
		if tok == nil {
			fmt.Fprintf(stderr, "convert: %s has no tokenizer; the file holds none\n", o.model)
		} else if vocab, err = tok.GGUFVocab(cfg.VocabSize); err != nil {
			return fmt.Errorf("%w (give -no-tokenizer to write the weights without it)", err)
		}
	}
	types, fallbacks, err := loader.GGUFTensorTypes(cfg, o.base)
	if err != nil {
		return err
	}
	for _, f := range fallbacks {
		fmt.Fprintf(stderr, "convert: %s\n", f)
	}

	start := time.Now()
	model := loader.GGUFModel{Config: cfg, Vocab: vocab, Name: o.name, Types: types, FileType: loader.GGUFFileType(o.base),
		Workers: o.threads,
		Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
			t, ok := lm.Tensor(spec.Name)
			if !ok {
				return fmt.Errorf("the model has no tensor %s", spec.Name)
			}
			return lm.ReadRows(ctx, t, r0, r1, dst)
		}}
	bar := cli.NewProgress(stderr, "convert", o.quiet)
	model.Progress = bar.Bytes
	if err := loader.WriteGGUFModel(ctx, o.out, model); err != nil {
		if errors.Is(err, context.Canceled) && ctx.Err() != nil {
			return ctx.Err()
		}
		return err
	}
	elapsed := time.Since(start)

	// Check what was written the way every consumer will read it.
	m, err := loader.Open(o.out)
	if err != nil {
		return fmt.Errorf("the file written does not open: %w", err)
	}
	defer m.Close()
	st, err := os.Stat(o.out)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "convert: wrote %s: %s, %d tensors, %d bytes (%.2f GB), %.2f bits per weight, in %.2fs\n",
		o.out, strings.ToLower(o.base.String()), len(m.GGUF().Tensors()), st.Size(), float64(st.Size())/1e9,
		8*float64(m.WeightBytes())/float64(cfg.NumParams()), elapsed.Seconds())
	return nil
}
