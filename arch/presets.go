package arch

import (
	"fmt"
	"strings"

	"github.com/strata-llm/strata/tensor"
)

// presets are Llama shapes for Synthesize. "tiny" has the shape of the
// embedded fixtures (so their tokenizers fit it) and is what tests of other
// packages should synthesise.
var presets = []struct {
	name                                        string
	hidden, layers, heads, kv, inter, vocab, mx int
	eps                                         float64
}{
	{"tiny", 64, 4, 4, 2, 172, 512, 256, 1e-5},
	{"100m", 768, 12, 12, 12, 2048, 32000, 2048, 1e-5},
	{"1b", 2048, 16, 32, 8, 8192, 32000, 4096, 1e-5},
	{"tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000, 2048, 1e-5},
	{"llama2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 1e-5},
}

// Presets lists the preset names Preset accepts.
func Presets() []string {
	names := make([]string, len(presets))
	for i, p := range presets {
		names[i] = p.name
	}
	return names
}

// Preset returns a new Llama config of a named shape: "tiny" (the shape of
// the embedded fixtures: hidden 64, 4 layers, 4 heads, 2 KV heads, vocab
// 512), "100m", "1b", "tinyllama-1.1b" or "llama2-7b". The dtype is F16,
// rope_theta 10000, BOS 1 and EOS 2; callers may change any field (call
// Validate afterwards).
func Preset(name string) (*Config, error) {
	for _, p := range presets {
		if p.name == strings.ToLower(name) {
			return &Config{
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
			}, nil
		}
	}
	return nil, fmt.Errorf("arch: unknown preset %q (have %s)", name, strings.Join(Presets(), ", "))
}
