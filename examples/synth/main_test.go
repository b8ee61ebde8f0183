package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

func TestBadFlags(t *testing.T) {
	out := t.TempDir()
	for _, args := range [][]string{
		{},
		{"-out", out, "-bogus"},
		{"-out", out, "-preset", "huge"},
		{"-out", out, "-arch", "gpt2"},
		{"-out", out, "-dtype", "int8"},
		{"-out", out, "-shard-size", "2XB"},
		{"-out", out, "-heads", "5"},
		{"-out", out, "-kv-heads", "3"},
		{"-out", out, "-layers", "-1"},
		{"-out", out, "-head-dim", "15"},
		{"-out", out, "-rope-theta", "0"},
		{"-out", out, "-tokenizer-from", filepath.Join(out, "none")},
		{"-out", out, "extra"},
		{"-out", out, "-experts", "4"},
		{"-out", out, "-router-skew", "1"},
		{"-out", out, "-preset", "mixtral-8x7b", "-router-locality", "0.5"},
		{"-out", out, "-preset", "mixtral-8x7b", "-router-skew", "1", "-router-locality", "1"},
		{"-out", out, "-preset", "mixtral-8x7b", "-router-skew", "-1"},
		{"-out", out, "-preset", "mixtral-8x7b", "-experts-per-tok", "9"},
		{"-out", out, "-preset", "qwen3-30b-a3b", "-expert-size", "0"},
	} {
		_, _, err := runArgs(args...)
		if !cli.IsUsage(err) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%v: %v, want a one-line usage error", args, err)
		}
	}
	var stdout, stderr bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &stdout, &stderr); !errors.Is(err, flag.ErrHelp) || !strings.Contains(stderr.String(), "-preset") {
		t.Errorf("-h: %v, stderr %q", err, stderr.String())
	}
}

func TestSynthCLI(t *testing.T) {
	out := t.TempDir()
	args := []string{"-out", out, "-preset", "tiny", "-arch", "qwen2", "-tie", "-dtype", "bf16", "-layers", "2",
		"-hidden", "128", "-heads", "8", "-kv-heads", "2", "-seed", "9", "-shard-size", "100KB", "-rope-theta", "1e6",
		"-tokenizer-from", fixtures.Dir(fixtures.TinyLlamaF16Sharded)}
	stdout, _, err := runArgs(args...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stdout, "bytes") || !strings.Contains(stdout, "MB/s") {
		t.Errorf("stdout %q lacks bytes written and MB/s", stdout)
	}
	m, err := loader.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c := m.Config
	if c.Family != arch.Qwen2 || !c.TieEmbeddings || c.DType != tensor.BF16 || c.NumLayers != 2 || c.HiddenSize != 128 ||
		c.NumHeads != 8 || c.NumKVHeads != 2 || c.HeadDim != 16 || c.RopeTheta != 1e6 || c.VocabSize != 512 || c.IntermediateSize != 172 {
		t.Errorf("config %+v", c)
	}
	if len(m.Files()) < 2 {
		t.Errorf("100KB shards gave %v", m.Files())
	}
	if _, err := loader.OpenSafetensors(filepath.Join(out, m.Files()[0])); err != nil {
		t.Error(err)
	}
	if !fileExists(filepath.Join(out, "tokenizer.json")) {
		t.Error("tokenizer not copied")
	}
}

// TestSynthMoE writes small models of the mixture-of-experts presets'
// families, some with synthetic routing, some as GGUF files with
// quantized experts, and reads them back.
func TestSynthMoE(t *testing.T) {
	small := []string{"-hidden", "64", "-layers", "2", "-heads", "4", "-kv-heads", "2", "-vocab", "512", "-dtype", "bf16"}
	for _, tc := range []struct {
		name  string
		args  []string
		check func(c *arch.Config) bool
		says  string
		gguf  tensor.DType // the type of expert 1's up projection in block 1 of a GGUF file
	}{
		{"mixtral, synthetic routing", []string{"-preset", "mixtral-8x7b", "-intermediate", "48", "-experts", "4", "-experts-per-tok", "1",
			"-router-skew", "1.2", "-router-locality", "0.5", "-seed", "7"},
			func(c *arch.Config) bool {
				return c.Family == arch.Mixtral && c.RopeTheta == 1e6 && reflect.DeepEqual(*c.MoE, arch.MoE{Experts: 4, ExpertsPerToken: 1,
					ExpertSize: 48, SparseStep: 1, NormTopK: true, Synthetic: &arch.SyntheticRouting{Skew: 1.2, Locality: 0.5, Seed: 7}})
			}, "4 experts of 48, 1 per token, synthetic routing (skew 1.2, locality 0.5)", 0},
		{"qwen3-moe", []string{"-preset", "qwen3-30b-a3b", "-head-dim", "16", "-experts", "8", "-experts-per-tok", "2", "-expert-size", "24"},
			func(c *arch.Config) bool {
				return c.Family == arch.Qwen3MoE && c.QKNorm && c.HeadDim == 16 && c.MoE.Synthetic == nil &&
					c.MoE.Experts == 8 && c.MoE.ExpertsPerToken == 2 && c.MoE.ExpertSize == 24 && c.MoE.NormTopK
			}, "8 experts of 24, 2 per token, routing by the random router", 0},
		{"qwen2-moe from the tiny preset", []string{"-arch", "qwen2_moe", "-experts", "4", "-experts-per-tok", "2", "-expert-size", "32", "-router-skew", "0"},
			func(c *arch.Config) bool {
				return c.Family == arch.Qwen2MoE && c.QKVBias && c.MoE.SharedExperts == 1 && c.MoE.Synthetic != nil && c.MoE.Synthetic.Skew == 0
			}, "a shared expert of 5632", 0},
		{"mixtral q8_0 gguf, synthetic routing", []string{"-preset", "mixtral-8x7b", "-intermediate", "96", "-experts", "4", "-experts-per-tok", "2",
			"-router-skew", "1.2", "-router-locality", "0.5", "-seed", "7", "-dtype", "q8_0"},
			func(c *arch.Config) bool {
				return c.Family == arch.Mixtral && reflect.DeepEqual(*c.MoE, arch.MoE{Experts: 4, ExpertsPerToken: 2,
					ExpertSize: 96, SparseStep: 1, NormTopK: true, Synthetic: &arch.SyntheticRouting{Skew: 1.2, Locality: 0.5, Seed: 7}})
			}, "synthetic routing (skew 1.2, locality 0.5)", tensor.Q8_0},
		{"qwen3-moe f16 gguf, uniform synthetic routing", []string{"-preset", "qwen3-30b-a3b", "-head-dim", "16", "-experts", "8", "-experts-per-tok", "2",
			"-expert-size", "32", "-router-skew", "0", "-dtype", "f16"},
			func(c *arch.Config) bool {
				return c.Family == arch.Qwen3MoE && c.MoE.Experts == 8 && c.MoE.Synthetic != nil && c.MoE.Synthetic.Skew == 0 && c.MoE.Synthetic.Locality == 0
			}, "synthetic routing (skew 0, locality 0)", tensor.F16},
		{"qwen3-moe q4_k gguf", []string{"-preset", "qwen3-30b-a3b", "-hidden", "256", "-head-dim", "16", "-experts", "4", "-experts-per-tok", "2",
			"-expert-size", "256", "-dtype", "q4_k"},
			func(c *arch.Config) bool {
				return c.Family == arch.Qwen3MoE && c.MoE.Experts == 4 && c.MoE.Synthetic == nil
			}, "routing by the random router", tensor.Q4_K},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := t.TempDir()
			args := append(append([]string{"-out", out}, small...), tc.args...)
			if tc.gguf != 0 {
				out = filepath.Join(out, "m.gguf")
				args[1] = out
			}
			stdout, _, err := runArgs(args...)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(stdout, tc.says) {
				t.Errorf("stdout %q does not say %q", stdout, tc.says)
			}
			m, err := loader.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if !tc.check(m.Config) {
				t.Errorf("config %+v, MoE %+v", m.Config, m.Config.MoE)
			}
			if tc.gguf != 0 {
				name := m.Config.LayerExperts(m.Config.BlockLayer(1))[1][arch.ExpertUp]
				if ti, ok := m.Tensor(name); !ok || ti.DType != tc.gguf {
					t.Errorf("%s: %+v, want %v", name, ti, tc.gguf)
				}
			}
		})
	}
}

func runArgs(args ...string) (stdout, stderr string, err error) {
	return runContext(context.Background(), args...)
}

func runContext(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	var o, e bytes.Buffer
	err = run(ctx, args, &o, &e)
	return o.String(), e.String(), err
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{
		"0": 0, "2GB": 2e9, "500MB": 500e6, "1GiB": 1 << 30, "1.5gb": 1.5e9, "123": 123, "10 KiB": 10 << 10, "7B": 7,
	} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "GB", "-1GB", "2XB", "1e30GB"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) succeeded", in)
		}
	}
}
