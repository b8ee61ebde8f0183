package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// TestFinetuneHyperparameterFlags: every float flag refuses NaN, both
// infinities and values outside its range the same way, as a usage error
// of one line naming the flag, before anything is trained or saved; the
// edges of each range train.
func TestFinetuneHyperparameterFlags(t *testing.T) {
	data := writeData(t)
	nonFinite := []string{"NaN", "Inf", "+Inf", "-Inf"}
	cases := []struct {
		flag  string
		extra []string // other flags the case needs
		bad   []string
	}{
		{"lr", nil, []string{"0", "-1e-3", "2", "1e30", "-1e30"}},
		{"lr", []string{"-optimizer", "sgd"}, []string{"0", "1.5", "1e30"}},
		{"weight-decay", nil, []string{"-0.1", "1.5", "1e30"}},
		{"weight-decay", []string{"-optimizer", "sgd"}, []string{"-1", "2"}},
		{"momentum", []string{"-optimizer", "sgd"}, []string{"1", "-0.5", "1e30"}},
		{"momentum", nil, []string{"0.9"}}, // adamw has none
		{"max-grad-norm", nil, []string{"-1", "-1e-9"}},
		{"loss-scale", nil, []string{"-1", "1e39", "1e-50"}},
	}
	for _, c := range cases {
		for _, v := range append(c.bad, nonFinite...) {
			save := filepath.Join(t.TempDir(), "out")
			args := append([]string{"-data", data, "-steps", "1", "-seq-len", "8", "-quiet", "-save", save, "-" + c.flag, v}, c.extra...)
			stdout, _, err := runArgs(t, args...)
			if !cli.IsUsage(err) {
				t.Errorf("-%s %s %v: error %v, want a usage error", c.flag, v, c.extra, err)
				continue
			}
			if msg := err.Error(); !strings.Contains(msg, "-"+c.flag+" ") || strings.Contains(msg, "\n") {
				t.Errorf("-%s %s: error %q is not one line naming the flag", c.flag, v, msg)
			}
			if stdout != "" {
				t.Errorf("-%s %s: trained: %q", c.flag, v, stdout)
			}
			if _, err := os.Stat(save); !os.IsNotExist(err) {
				t.Errorf("-%s %s: -save directory exists (%v)", c.flag, v, err)
			}
		}
	}
	if _, _, err := runArgs(t, "-data", data, "-loss-scale-interval", "-1"); !cli.IsUsage(err) || !strings.Contains(err.Error(), "-loss-scale-interval") {
		t.Errorf("-loss-scale-interval -1: %v", err)
	}
	// The edges of the ranges train.
	for _, args := range [][]string{
		{"-optimizer", "sgd", "-lr", "1", "-momentum", "0.9", "-weight-decay", "1", "-max-grad-norm", "0"},
		{"-lr", "1e-9", "-weight-decay", "0", "-loss-scale", "3e38", "-loss-scale-interval", "0"},
	} {
		out, _, err := runArgs(t, append([]string{"-data", data, "-steps", "1", "-seq-len", "8", "-quiet"}, args...)...)
		if err != nil || len(losses(t, out)) != 1 {
			t.Errorf("%q: %v\n%s", args, err, out)
		}
	}
}

// TestFinetuneNonFiniteWeights: copies of both fixtures with a NaN or an
// infinity in one weight fail before training, naming the tensor, and
// save nothing.
func TestFinetuneNonFiniteWeights(t *testing.T) {
	const name = "model.layers.2.self_attn.k_proj.weight"
	data := writeData(t)
	for _, c := range []struct {
		fixture string
		bits    uint32
		want    string
	}{
		{fixtures.TinyLlamaF16Sharded, 0x7e00, "element 40 is NaN"},
		{fixtures.TinyLlamaF16Sharded, 0x7c00, "element 40 is +Inf"},
		{fixtures.TinyLlamaBF16, 0x7fc1, "element 40 is NaN"},
		{fixtures.TinyLlamaBF16, 0xff80, "element 40 is -Inf"},
	} {
		dir := fixturetest.Copy(t, c.fixture)
		fixturetest.SetBits(t, dir, name, 40, c.bits)
		save := filepath.Join(t.TempDir(), "out")
		stdout, _, err := runArgs(t, "-model", dir, "-data", data, "-steps", "2", "-seq-len", "8", "-quiet", "-save", save)
		if err == nil || cli.IsUsage(err) {
			t.Fatalf("%s: error %v, want a plain error", c.fixture, err)
		}
		if msg := err.Error(); !strings.Contains(msg, name) || !strings.Contains(msg, c.want) || strings.Contains(msg, "\n") {
			t.Errorf("%s: error %q, want one line naming %s and %q", c.fixture, msg, name, c.want)
		}
		if stdout != "" {
			t.Errorf("%s: trained: %q", c.fixture, stdout)
		}
		if _, err := os.Stat(save); !os.IsNotExist(err) {
			t.Errorf("%s: -save directory exists (%v)", c.fixture, err)
		}
	}
}

// TestFinetuneOverflow: finite weights whose forward overflows float32
// (block 2's MLP norm scaled by 1e30, stored in BF16) stop training at the
// first step, naming the block, instead of skipping every step and saving;
// F16 weights that an update pushes past F16's range are refused by nn's
// tests (TestTrainStepNonFiniteWeights).
func TestFinetuneOverflow(t *testing.T) {
	dir := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
	fixturetest.Replace(t, dir, "model.layers.2.post_attention_layernorm.weight", tensor.BF16,
		func(_ int, v float32) float32 { return v * 1e30 })
	save := filepath.Join(t.TempDir(), "out")
	_, _, err := runArgs(t, "-model", dir, "-data", writeData(t), "-steps", "3", "-seq-len", "8", "-quiet", "-save", save)
	const want = "step 1: nn: train: the loss is NaN: non-finite values (NaN) first appear in the output of block 2 (layer 3) at position 0"
	if err == nil || cli.IsUsage(err) || err.Error() != want {
		t.Fatalf("error %v, want %q", err, want)
	}
	if _, err := os.Stat(save); !os.IsNotExist(err) {
		t.Errorf("-save directory exists (%v)", err)
	}
	// -grads-out writes no gradients of a non-finite loss.
	out := filepath.Join(t.TempDir(), "grads.safetensors")
	_, _, err = runArgs(t, "-model", dir, "-grads-out", out, "-ids", "1,42,71,345")
	if err == nil || !strings.Contains(err.Error(), "block 2 (layer 3)") {
		t.Errorf("-grads-out: %v", err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("-grads-out wrote %s (%v)", out, err)
	}
}
