// Command trainbpe trains a byte-level BPE tokenizer (GPT-2's form) on
// text files and writes it as a Hugging Face tokenizer.json and
// tokenizer_config.json, which strata's tokenizer package, transformers and
// examples/synth -tokenizer-from read.
//
//	go run ./examples/trainbpe -data train.jsonl [-data more.txt] -out DIR
//	    [-vocab 4096] [-special '<pad>,<s>,</s>'] [-bos '<s>'] [-eos '</s>']
//	    [-min-frequency 2] [-force]
//
// A .jsonl file holds one {"text": ...} document a line; any other file is
// one document. The special tokens take the first ids (the defaults give
// BOS 1 and EOS 2, the ids of examples/synth's presets); the 256 bytes
// follow, then the merged tokens. The same files and flags give the same
// bytes. An existing tokenizer.json in -out is replaced only with -force.
// Exit status: 0 on success, 2 for a bad flag, 1 for any other error.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/loader/tokenizer"
)

func main() { cli.Main("trainbpe", run) }

// listFlag collects a repeated flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var data listFlag
	var out, special string
	var force bool
	o := tokenizer.BPEOptions{}
	fs := flag.NewFlagSet("trainbpe", flag.ContinueOnError)
	fs.Var(&data, "data", "training text `file` (.jsonl: a {\"text\": ...} document a line); repeat for more")
	fs.StringVar(&out, "out", "", "output `directory` for tokenizer.json and tokenizer_config.json (required)")
	fs.IntVar(&o.VocabSize, "vocab", 4096, "vocabulary size: special tokens, 256 bytes and merged tokens")
	fs.IntVar(&o.MinFrequency, "min-frequency", 2, "fewest occurrences of a pair that is merged")
	fs.StringVar(&special, "special", "<pad>,<s>,</s>", "comma-separated special tokens, given the first ids")
	fs.StringVar(&o.BOS, "bos", "<s>", "the special token Encode puts in front (empty: none)")
	fs.StringVar(&o.EOS, "eos", "</s>", "the special token that ends a document (empty: none)")
	fs.BoolVar(&force, "force", false, "replace the tokenizer already in -out")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return err
	}
	if len(data) == 0 || out == "" {
		return cli.Usagef("give -data FILE and -out DIR")
	}
	if special != "" {
		o.Special = strings.Split(special, ",")
	}
	if err := tokenizer.CheckBPEOptions(o); err != nil {
		return cli.UsageError{Err: err}
	}
	tokPath, cfgPath := filepath.Join(out, tokenizer.TokenizerFile), filepath.Join(out, tokenizer.ConfigFile)
	outputs := [][2]string{{"-out", tokPath}, {"-out", cfgPath}}
	for _, f := range outputs {
		if err := atomicfile.CheckNotInput(f[0], f[1], data...); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	if st, err := os.Stat(out); err == nil && !st.IsDir() {
		return cli.Usagef("-out %s is not a directory", out)
	}
	if _, err := os.Stat(tokPath); err == nil && !force {
		return cli.Usagef("-out %s already holds %s: give -force to replace it", out, tokenizer.TokenizerFile)
	}

	var docs []string
	var size int
	for _, path := range data {
		d, err := cli.ReadDocs(ctx, path)
		if err != nil {
			return fmt.Errorf("-data: %w", err)
		}
		docs = append(docs, d...)
		for _, s := range d {
			size += len(s)
		}
	}
	start := time.Now()
	bpe, err := tokenizer.TrainBPE(ctx, docs, o)
	if err != nil {
		return err
	}
	tok, err := tokenizer.Parse(bpe.TokenizerJSON, bpe.ConfigJSON)
	if err != nil {
		return fmt.Errorf("the tokenizer trained does not load: %w", err)
	}
	var ids int
	for _, d := range docs {
		enc, err := tok.Encode(d, false)
		if err != nil {
			return err
		}
		ids += len(enc)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if err := atomicfile.WriteFile(tokPath, bpe.TokenizerJSON); err != nil {
		return err
	}
	if err := atomicfile.WriteFile(cfgPath, bpe.ConfigJSON); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "trainbpe: %d documents, %d bytes: %d merges, vocabulary %d, %.2f bytes per token, in %s; wrote %s\n",
		len(docs), size, bpe.Merges, bpe.Vocab, float64(size)/float64(max(ids, 1)), time.Since(start).Round(time.Millisecond), out)
	return nil
}
