package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// TestSynthGGUF: a quantized -dtype writes a GGUF file of that type with
// the tokenizer given; an existing file is replaced only with -force, and
// a cancelled run leaves it as it was.
func TestSynthGGUF(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "m.gguf")
	args := []string{"-out", out, "-preset", "tiny", "-layers", "2", "-hidden", "256", "-heads", "4", "-kv-heads", "2",
		"-intermediate", "512", "-dtype", "q4_k", "-tokenizer-from", fixtures.Dir(fixtures.TinyLlamaF16Sharded)}
	stdout, _, err := runArgs(args...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stdout, "bits per weight") || !strings.Contains(stdout, "Q4_K GGUF") {
		t.Errorf("stdout %q", stdout)
	}
	m, err := loader.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range m.Config.ExpectedTensors() {
		ti, _ := m.Tensor(spec.Name)
		want := tensor.Q4_K
		switch {
		case spec.Role == arch.LMHead:
			want = tensor.Q6_K
		case len(spec.Shape) == 1:
			want = tensor.F32
		}
		if ti.DType != want {
			t.Errorf("%s is %v, want %v", spec.Name, ti.DType, want)
		}
	}
	if tok, err := m.Tokenizer(); err != nil || tok == nil {
		t.Errorf("tokenizer %v, %v", tok, err)
	}
	m.Close()
	before, _ := os.ReadFile(out)
	if _, _, err := runArgs(args...); !cli.IsUsage(err) || !strings.Contains(err.Error(), "-force") {
		t.Errorf("an existing file without -force: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := runContext(ctx, append(args, "-force", "-seed", "2")...); err == nil {
		t.Error("a cancelled run succeeded")
	}
	if after, _ := os.ReadFile(out); string(after) != string(before) {
		t.Error("the file changed")
	}
	if _, _, err := runArgs(append(args, "-force", "-seed", "2")...); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadFile(out); string(after) == string(before) {
		t.Error("-force with another seed wrote the same file")
	}
	filetest.NoTemps(t, dir)
}

// TestSynthGGUFQwen3: -arch qwen3 writes a qwen3 GGUF file that opens as
// the config synth made: q/k norms, a head size apart from hidden/heads.
func TestSynthGGUFQwen3(t *testing.T) {
	out := filepath.Join(t.TempDir(), "m.gguf")
	if _, _, err := runArgs("-out", out, "-preset", "tiny", "-arch", "qwen3", "-layers", "2", "-head-dim", "32", "-dtype", "q8_0"); err != nil {
		t.Fatal(err)
	}
	m, err := loader.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c := m.Config
	if a, _ := m.GGUF().Metadata.String("general.architecture"); a != "qwen3" || c.Family != arch.Qwen3 || !c.QKNorm || c.HeadDim != 32 || c.NumLayers != 2 {
		t.Errorf("architecture %q, config %+v", a, c)
	}
	if ti, ok := m.Tensor("model.layers.1.self_attn.k_norm.weight"); !ok || ti.DType != tensor.F32 || !ti.Shape.Equal(tensor.Shape{32}) {
		t.Errorf("k_norm: %v, %v", ti, ok)
	}
}

// TestSynthGGUFBadFlags: flags that do not fit a GGUF file are usage
// errors of one line, and nothing is written.
func TestSynthGGUFBadFlags(t *testing.T) {
	dir := t.TempDir()
	isDir := filepath.Join(dir, "d.gguf")
	os.Mkdir(isDir, 0o755)
	for _, args := range [][]string{
		{"-out", filepath.Join(dir, "model"), "-dtype", "q8_0"},
		{"-out", filepath.Join(dir, "m.gguf"), "-dtype", "q8_0", "-shard-size", "1MB"},
		{"-out", filepath.Join(dir, "m.gguf"), "-dtype", "q2_k"},
		{"-out", filepath.Join(dir, "m.gguf"), "-dtype", "q8_0", "-arch", "qwen2_moe"},
		{"-out", filepath.Join(dir, "m.gguf"), "-dtype", "q8_0", "-arch", "qwen2_moe", "-router-skew", "1"},
		{"-out", isDir, "-dtype", "q8_0", "-force"},
		{"-out", filepath.Join(dir, "none", "m.gguf"), "-dtype", "q8_0"},
	} {
		_, _, err := runArgs(append(args, "-preset", "tiny")...)
		if !cli.IsUsage(err) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%v: %v, want a one-line usage error", args, err)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("the directory holds %v", ents)
	}
}
