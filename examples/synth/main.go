// Command synth writes a random-weight Llama-family model in Hugging Face
// format (config.json, safetensors shards and index), or as a GGUF file,
// quantized or not, for demos, tests and benchmarks of models larger than
// the GPU, mixtures of experts included.
//
//	go run ./examples/synth -out /tmp/llama7b -preset llama2-7b -dtype f16
//	go run ./examples/synth -out /tmp/llama7b-q4_k.gguf -preset llama2-7b -dtype q4_k
//	go run ./examples/synth -out /tmp/tiny -preset tiny -tokenizer-from loader/fixtures/tiny-llama-bf16
//	go run ./examples/synth -out /tmp/mixtral -preset mixtral-8x7b -router-skew 1.2 -router-locality 0.5
//	go run ./examples/synth -out /tmp/mixtral-q8_0.gguf -preset mixtral-8x7b -dtype q8_0 -router-skew 0
//
// Shape flags override the preset. The same flags and seed give the same
// bytes. A random router picks experts in its own way, neither uniformly
// nor like a trained one; -router-skew writes synthetic routing into
// config.json instead (arch.SyntheticRouting: Zipf popularity of exponent
// -router-skew, 0 for uniform, and -router-locality, the chance that a
// token keeps each of the previous token's experts; in a GGUF file
// strata's metadata keys loader.GGUFSyntheticSkew and the others, which
// llama.cpp ignores), which strata runs and reports label as synthetic. It prints the bytes written and the write speed. The model is
// written into a temporary directory beside -out and takes its place when
// complete; a directory that already holds a model is replaced only with
// -force, and one that holds anything else is refused.
//
// An -out ending in .gguf is written as a GGUF file (loader.SynthesizeGGUF),
// as a quantized -dtype always is: the F32 model of the seed, each tensor
// stored as examples/convert would store it (norms F32, the LM head Q6_K
// for the 4- to 6-bit types), quantized as it is written, so that the 7B
// shape needs no more memory than the tiny one. An existing file is
// replaced only with -force.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

func main() { cli.Main("synth", run) }

type options struct {
	out, preset, arch, dtype, shardSize, tokenizerFrom string
	tie, force, gguf                                   bool
	base                                               quant.Type // the GGUF file's
	seed                                               int64
	ropeTheta, routerSkew, routerLocality              float64
	shape                                              map[string]*int
}

func parseFlags(args []string, stderr io.Writer) (*options, *arch.Config, loader.SynthOptions, error) {
	fs := flag.NewFlagSet("synth", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o := &options{shape: map[string]*int{}}
	fs.StringVar(&o.out, "out", "", "output directory, or a .gguf file (required)")
	fs.BoolVar(&o.force, "force", false, "replace the model already in -out")
	fs.StringVar(&o.preset, "preset", "tiny", "shape preset: "+strings.Join(arch.Presets(), ", "))
	fs.StringVar(&o.arch, "arch", "", "architecture: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe or qwen3_moe (default: the preset's)")
	fs.BoolVar(&o.tie, "tie", false, "tie the LM head to the embedding table")
	fs.StringVar(&o.dtype, "dtype", "f16", "weight dtype: f16, bf16 or f32; or "+quantNames()+" (a GGUF file)")
	fs.Int64Var(&o.seed, "seed", 1, "random seed")
	fs.StringVar(&o.shardSize, "shard-size", "2GB", "largest shard (e.g. 500MB, 2GB, 1GiB); 0 writes one file")
	fs.Float64Var(&o.ropeTheta, "rope-theta", 0, "rotary base (default: the preset's)")
	fs.StringVar(&o.tokenizerFrom, "tokenizer-from", "", "copy tokenizer.json and tokenizer_config.json from this model directory")
	fs.Float64Var(&o.routerSkew, "router-skew", 0, "synthetic routing: Zipf exponent of the experts' popularity, 0 for uniform (default: the router's own choice)")
	fs.Float64Var(&o.routerLocality, "router-locality", 0, "synthetic routing: chance a token keeps each expert of the previous token (with -router-skew)")
	for _, f := range []struct{ name, help string }{
		{"hidden", "hidden size"}, {"layers", "number of decoder blocks"}, {"heads", "attention heads"},
		{"kv-heads", "key/value heads"}, {"intermediate", "MLP intermediate size"}, {"vocab", "vocabulary size"},
		{"head-dim", "head dimension (default hidden/heads)"}, {"max-pos", "max_position_embeddings"},
		{"experts", "routed experts of a mixture of experts"}, {"experts-per-tok", "experts each token is routed to"},
		{"expert-size", "intermediate size of a routed expert (moe_intermediate_size)"},
	} {
		o.shape[f.name] = fs.Int(f.name, 0, f.help+" (overrides the preset)")
	}
	usage := func() {
		fmt.Fprintln(stderr, "usage: synth -out DIR [-force] [-preset NAME] [shape flags] [-arch A] [-tie] [-dtype D] [-seed S] [-shard-size SIZE] [-rope-theta X] [-tokenizer-from DIR] [-router-skew S [-router-locality P]]")
		fs.SetOutput(stderr)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	fs.Usage = func() {} // errors are reported in one line by run
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage()
			return nil, nil, loader.SynthOptions{}, err
		}
		return nil, nil, loader.SynthOptions{}, cli.UsageError{Err: err}
	}
	bad := func(format string, args ...any) (*options, *arch.Config, loader.SynthOptions, error) {
		return nil, nil, loader.SynthOptions{}, cli.Usagef(format, args...)
	}
	if fs.NArg() > 0 {
		return bad("unexpected argument %q", fs.Arg(0))
	}
	if o.out == "" {
		return bad("-out DIR is required")
	}
	cfg, err := arch.Preset(o.preset)
	if err != nil {
		return bad("-preset: unknown preset %q (have %s)", o.preset, strings.Join(arch.Presets(), ", "))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for name, dst := range map[string]*int{
		"hidden": &cfg.HiddenSize, "layers": &cfg.NumLayers, "heads": &cfg.NumHeads, "kv-heads": &cfg.NumKVHeads,
		"intermediate": &cfg.IntermediateSize, "vocab": &cfg.VocabSize, "head-dim": &cfg.HeadDim,
		"max-pos": &cfg.MaxPositions,
	} {
		if set[name] {
			if *o.shape[name] <= 0 {
				return bad("-%s must be positive, got %d", name, *o.shape[name])
			}
			*dst = *o.shape[name]
		}
	}
	// Keep the preset's KV sharing and head_dim consistent with new sizes.
	if set["heads"] && !set["kv-heads"] {
		cfg.NumKVHeads = cfg.NumHeads
	}
	if (set["hidden"] || set["heads"]) && !set["head-dim"] {
		if cfg.HiddenSize%cfg.NumHeads != 0 {
			return bad("-hidden %d is not a multiple of -heads %d (or give -head-dim)", cfg.HiddenSize, cfg.NumHeads)
		}
		cfg.HeadDim = cfg.HiddenSize / cfg.NumHeads
	}
	family := cfg.Family
	if o.arch != "" {
		f, err := arch.ParseFamily(o.arch)
		if err != nil {
			return bad("-arch: unknown architecture %q (have llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe)", o.arch)
		}
		family = f
	}
	// Switching family, or changing the sizes of the preset's, keeps what
	// the family requires (a Mixtral's experts are as wide as
	// -intermediate).
	cfg.SetFamily(family)
	for name, dst := range map[string]func(m *arch.MoE) *int{
		"experts":         func(m *arch.MoE) *int { return &m.Experts },
		"experts-per-tok": func(m *arch.MoE) *int { return &m.ExpertsPerToken },
		"expert-size":     func(m *arch.MoE) *int { return &m.ExpertSize },
	} {
		if !set[name] {
			continue
		}
		if cfg.MoE == nil {
			return bad("-%s: %s has no experts", name, cfg.Family)
		}
		if *o.shape[name] <= 0 {
			return bad("-%s must be positive, got %d", name, *o.shape[name])
		}
		*dst(cfg.MoE) = *o.shape[name]
	}
	switch {
	case set["router-locality"] && !set["router-skew"]:
		return bad("-router-locality needs -router-skew")
	case set["router-skew"] && cfg.MoE == nil:
		return bad("-router-skew: %s has no experts", cfg.Family)
	case set["router-skew"]:
		cfg.MoE.Synthetic = &arch.SyntheticRouting{Skew: o.routerSkew, Locality: o.routerLocality, Seed: uint64(o.seed)}
	}
	cfg.TieEmbeddings = o.tie
	if set["rope-theta"] {
		cfg.RopeTheta = o.ropeTheta
	}
	o.gguf = strings.EqualFold(filepath.Ext(o.out), ".gguf")
	dt, err := tensor.ParseDType(o.dtype)
	switch {
	case err == nil && dt.IsFloat():
		o.base, _ = dt.Quant()
	case err == nil && isQuantBase(dt):
		if !o.gguf {
			return bad("-dtype %s writes a GGUF file: give -out FILE.gguf", o.dtype)
		}
		o.base, _ = dt.Quant()
		dt = tensor.F16 // the config's, and the fallback for rows that are not whole blocks
	default:
		return bad("-dtype: unknown dtype %q (have f16, bf16, f32, %s)", o.dtype, quantNames())
	}
	cfg.DType = dt
	if o.gguf && set["shard-size"] {
		return bad("-shard-size does not apply to a GGUF file")
	}
	if _, err := loader.GGUFArchitecture(cfg); o.gguf && err != nil {
		return bad("-out %s: %s (llama, mistral, qwen2, qwen3, mixtral and qwen3_moe are)", o.out, strings.TrimPrefix(err.Error(), "loader: "))
	}
	if o.tokenizerFrom != "" {
		if st, err := os.Stat(o.tokenizerFrom); err != nil || !st.IsDir() {
			return bad("-tokenizer-from: %s is not a directory", o.tokenizerFrom)
		}
	}
	shard, err := parseSize(o.shardSize)
	if err != nil {
		return bad("-shard-size: %v", err)
	}
	if err := cfg.Validate(); err != nil {
		return bad("%s", strings.TrimPrefix(strings.TrimPrefix(err.Error(), "arch: config: "), "loader: config: "))
	}
	return o, cfg, loader.SynthOptions{DType: dt, Seed: o.seed, MaxShardBytes: shard, TokenizerFrom: o.tokenizerFrom}, nil
}

// experts describes the mixture of experts, if any, for the summary line.
func experts(c *arch.Config) string {
	m := c.MoE
	if m == nil {
		return ""
	}
	s := fmt.Sprintf(" %d experts of %d, %d per token,", m.Experts, m.ExpertSize, m.ExpertsPerToken)
	if m.SharedExperts > 0 {
		s += fmt.Sprintf(" a shared expert of %d,", m.SharedSize)
	}
	if syn := m.Synthetic; syn != nil {
		s += fmt.Sprintf(" synthetic routing (skew %g, locality %g),", syn.Skew, syn.Locality)
	} else {
		s += " routing by the random router,"
	}
	return s
}

// quantBases are the quantized -dtype values.
var quantBases = []tensor.DType{tensor.Q8_0, tensor.Q4_0, tensor.Q4_K, tensor.Q5_K, tensor.Q6_K}

func isQuantBase(dt tensor.DType) bool { return slices.Contains(quantBases, dt) }

func quantNames() string {
	var s []string
	for _, d := range quantBases {
		s = append(s, strings.ToLower(d.String()))
	}
	return strings.Join(s, ", ")
}

// parseSize reads a byte count with an optional unit: B, KB, MB, GB, TB
// (powers of 1000, as Hugging Face counts shard sizes) or KiB, MiB, GiB,
// TiB.
func parseSize(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	units := []struct {
		suffix string
		mult   float64
	}{
		{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"TIB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1},
	}
	mult := 1.0
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 || v*mult > 1<<62 {
		return 0, fmt.Errorf("bad size %q (want e.g. 2GB, 500MB, 1GiB or 0)", s)
	}
	return int64(v * mult), nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, cfg, opts, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.gguf {
		return runGGUF(ctx, o, cfg, opts, stdout, stderr)
	}
	if err := checkOut(o); err != nil {
		return err
	}

	total := cfg.NumParams() * int64(cfg.DType.Size())
	fmt.Fprintf(stdout, "synth: %s %s, %d layers, hidden %d, %d heads (%d KV), intermediate %d,%s vocab %d, %.3g M parameters, %s, %.1f MB of weights\n",
		o.preset, cfg.Family.Architecture(), cfg.NumLayers, cfg.HiddenSize, cfg.NumHeads, cfg.NumKVHeads, cfg.IntermediateSize,
		experts(cfg), cfg.VocabSize, float64(cfg.NumParams())/1e6, cfg.DType, float64(total)/1e6)
	start := time.Now()
	opts.Progress = cli.NewProgress(stderr, "synth", false).Bytes
	if err := loader.Synthesize(ctx, o.out, cfg, opts); err != nil {
		return err
	}
	elapsed := time.Since(start)

	// Check what was written the way every consumer will read it.
	m, err := loader.Open(o.out)
	if err != nil {
		return fmt.Errorf("the model written does not open: %w", err)
	}
	defer m.Close()
	var fileBytes int64
	for _, name := range m.Files() {
		st, err := os.Stat(filepath.Join(o.out, name))
		if err != nil {
			return err
		}
		fileBytes += st.Size()
	}
	fmt.Fprintf(stdout, "synth: wrote %s: %d files, %d bytes (%.2f GB) in %.2fs, %.0f MB/s\n",
		o.out, len(m.Files()), fileBytes, float64(fileBytes)/1e9, elapsed.Seconds(), float64(fileBytes)/1e6/elapsed.Seconds())
	return nil
}

// checkOut checks -out before any work: it is not the -tokenizer-from
// directory, its parent exists and takes new entries, and it is new, empty,
// or holds a model (replaced only with -force) and nothing else.
func checkOut(o *options) error {
	if err := atomicfile.CheckNotInput("-out", o.out, o.tokenizerFrom); err != nil {
		return cli.UsageError{Err: err}
	}
	if err := atomicfile.CheckDir("-out", o.out); err != nil {
		return cli.UsageError{Err: err}
	}
	hasModel, err := loader.CheckModelDir(o.out)
	if err != nil {
		return cli.UsageError{Err: fmt.Errorf("-out: %w", err)}
	}
	if hasModel && !o.force {
		return cli.Usagef("-out %s already holds a model: give -force to replace it", o.out)
	}
	return nil
}

// runGGUF writes the model as a GGUF file.
func runGGUF(ctx context.Context, o *options, cfg *arch.Config, opts loader.SynthOptions, stdout, stderr io.Writer) error {
	if err := atomicfile.CheckNotInput("-out", o.out, o.tokenizerFrom); err != nil {
		return cli.UsageError{Err: err}
	}
	if err := atomicfile.Check("-out", o.out); err != nil {
		return cli.UsageError{Err: err}
	}
	if st, err := os.Stat(o.out); err == nil {
		switch {
		case st.IsDir():
			return cli.Usagef("-out %s is a directory", o.out)
		case !o.force:
			return cli.Usagef("-out %s exists: give -force to replace it", o.out)
		}
	}
	types, _, err := loader.GGUFTensorTypes(cfg, o.base)
	if err != nil {
		return err
	}
	var total int64
	for _, spec := range cfg.ExpectedTensors() {
		n, _ := types[spec.Name].Bytes(spec.Shape.NumElements())
		total += n
	}
	fmt.Fprintf(stdout, "synth: %s %s, %d layers, hidden %d, %d heads (%d KV), intermediate %d,%s vocab %d, %.3g M parameters, %s GGUF, %.1f MB of weights\n",
		o.preset, cfg.Family.Architecture(), cfg.NumLayers, cfg.HiddenSize, cfg.NumHeads, cfg.NumKVHeads, cfg.IntermediateSize,
		experts(cfg), cfg.VocabSize, float64(cfg.NumParams())/1e6, o.base, float64(total)/1e6)
	start := time.Now()
	opts.Progress = cli.NewProgress(stderr, "synth", false).Bytes
	fallbacks, err := loader.SynthesizeGGUF(ctx, o.out, cfg, o.base, opts)
	if err != nil {
		return err
	}
	for _, f := range fallbacks {
		fmt.Fprintf(stderr, "synth: %s\n", f)
	}
	elapsed := time.Since(start)
	m, err := loader.Open(o.out)
	if err != nil {
		return fmt.Errorf("the model written does not open: %w", err)
	}
	defer m.Close()
	st, err := os.Stat(o.out)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "synth: wrote %s: %d bytes (%.2f GB), %.2f bits per weight, in %.2fs, %.0f MB/s\n",
		o.out, st.Size(), float64(st.Size())/1e9, 8*float64(m.WeightBytes())/float64(cfg.NumParams()),
		elapsed.Seconds(), float64(st.Size())/1e6/elapsed.Seconds())
	return nil
}
