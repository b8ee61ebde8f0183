package main

import (
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// TestNonFinite: weights holding a NaN or an infinity fail naming the
// tensor, and finite weights whose forward overflows fail naming the first
// layer that produced NaN or infinite values, resident, paged under a
// budget and spread over two devices; nothing is generated and no token is
// printed.
func TestNonFinite(t *testing.T) {
	const weight = "model.layers.1.mlp.down_proj.weight"
	nanF16 := fixturetest.Copy(t, fixtures.TinyLlamaF16Sharded)
	fixturetest.SetBits(t, nanF16, weight, 5, 0x7e00)
	infBF16 := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
	fixturetest.SetBits(t, infBF16, weight, 5, 0xff80)
	// An MLP norm of 1e30: finite, but block 2's gate and up projections
	// multiply to more than float32 holds.
	overflow := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
	fixturetest.Replace(t, overflow, "model.layers.2.post_attention_layernorm.weight", tensor.BF16,
		func(_ int, v float32) float32 { return v * 1e30 })
	const layerMsg = "non-finite values (NaN) first appear in the output of block 2 (layer 3) at prompt position 0"

	placements := map[string][]string{
		"resident":    nil,
		"paged":       {"-gpu-memory-limit", "190KiB", "-offload", "minimal"},
		"two devices": {"-device", "cpu", "-devices", "0,1"},
	}
	for _, c := range []struct {
		name, dir, want string
	}{
		{"f16 NaN weight", nanF16, "tensor " + weight + ": element 5 is NaN"},
		{"bf16 -Inf weight", infBF16, "tensor " + weight + ": element 5 is -Inf"},
		{"bf16 overflow", overflow, layerMsg},
	} {
		for where, extra := range placements {
			t.Run(c.name+"/"+where, func(t *testing.T) {
				args := append([]string{"-model", c.dir, "-ids", "1,42,71,345,81", "-max-new-tokens", "4", "-quiet"}, extra...)
				stdout, _, err := runArgs(t, args...)
				if err == nil || cli.IsUsage(err) {
					t.Fatalf("error %v, want a plain error (exit status 1)", err)
				}
				if msg := err.Error(); !strings.Contains(msg, c.want) || strings.Contains(msg, "\n") {
					t.Errorf("error %q, want one line with %q", msg, c.want)
				}
				if strings.TrimSpace(stdout) != "" {
					t.Errorf("tokens printed before the error: %q", stdout)
				}
			})
		}
	}
}
