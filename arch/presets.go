package arch

import (
	"fmt"
	"strings"

	"github.com/strata-llm/strata/tensor"
)

// presets are shapes for Synthesize: Llama ones, and mixtures of experts
// whose edit sets what differs. "tiny" has the shape of the embedded
// fixtures (so their tokenizers fit it) and is what tests of other
// packages should synthesise.
var presets = []struct {
	name                                        string
	hidden, layers, heads, kv, inter, vocab, mx int
	eps                                         float64
	edit                                        func(c *Config)
}{
	{"tiny", 64, 4, 4, 2, 172, 512, 256, 1e-5, nil},
	{"100m", 768, 12, 12, 12, 2048, 32000, 2048, 1e-5, nil},
	{"1b", 2048, 16, 32, 8, 8192, 32000, 4096, 1e-5, nil},
	{"tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000, 2048, 1e-5, nil},
	{"llama2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 1e-5, nil},
	// Mixtral-8x7B: 8 experts of the dense MLP's size, 2 per token.
	{"mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 32768, 1e-5, func(c *Config) {
		c.SetFamily(Mixtral)
		c.RopeTheta = 1e6
	}},
	// Qwen3-30B-A3B: 128 experts of 768, 8 per token, head_dim 128.
	{"qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 40960, 1e-6, func(c *Config) {
		c.SetFamily(Qwen3MoE)
		c.HeadDim, c.RopeTheta = 128, 1e6
		c.MoE = &MoE{Experts: 128, ExpertsPerToken: 8, ExpertSize: 768, SparseStep: 1, NormTopK: true}
	}},
}

// Presets lists the preset names Preset accepts.
func Presets() []string {
	names := make([]string, len(presets))
	for i, p := range presets {
		names[i] = p.name
	}
	return names
}

// Preset returns a new config of a named shape: the Llama shapes "tiny"
// (the shape of the embedded fixtures: hidden 64, 4 layers, 4 heads, 2 KV
// heads, vocab 512), "100m", "1b", "tinyllama-1.1b" and "llama2-7b", and
// the mixtures of experts "mixtral-8x7b" and "qwen3-30b-a3b". The dtype is
// F16, BOS 1 and EOS 2, rope_theta 10000 (1e6 for the mixtures of
// experts); callers may change any field (call Validate afterwards).
func Preset(name string) (*Config, error) {
	for _, p := range presets {
		if p.name == strings.ToLower(name) {
			c := &Config{
				Family:           Llama,
				HiddenSize:       p.hidden,
				IntermediateSize: p.inter,
				NumLayers:        p.layers,
				NumHeads:         p.heads,
				NumKVHeads:       p.kv,
				HeadDim:          p.hidden / p.heads,
				VocabSize:        p.vocab,
				RMSNormEps:       p.eps,
				RopeTheta:        10000,
				MaxPositions:     p.mx,
				BOS:              1,
				EOS:              []int{2},
				DType:            tensor.F16,
			}
			if p.edit != nil {
				p.edit(c)
			}
			return c, nil
		}
	}
	return nil, fmt.Errorf("arch: unknown preset %q (have %s)", name, strings.Join(Presets(), ", "))
}
