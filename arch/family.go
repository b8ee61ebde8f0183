package arch

import (
	"fmt"
	"strings"
)

// Family is a model family: one transformers model class, with its config
// defaults, its tensors and its quirks. The zero Family is none.
type Family int

// The supported families.
const (
	Llama   Family = iota + 1 // LlamaForCausalLM, model_type "llama"
	Mistral                   // MistralForCausalLM, model_type "mistral"
	Qwen2                     // Qwen2ForCausalLM, model_type "qwen2"
)

// bias says when a family's projections carry a bias.
type bias int

const (
	biasNever  bias = iota
	biasAlways      // whatever the config says
	biasFlag        // when attention_bias is set
)

// window says whether a family's sliding_window applies.
type window int

const (
	windowNone   window = iota // no sliding attention: sliding_window is ignored
	windowAlways               // sliding_window, when set, bounds attention
	windowFlag                 // only with use_sliding_window, which strata refuses
)

// quirks are what sets a family apart. A family to come (Qwen3, the
// mixtures of experts) adds its row here, and a field for each new quirk:
// qkNorm for per-head q/k norms, experts for a mixture-of-experts MLP.
type quirks struct {
	modelType    string
	architecture string
	maxPositions int // transformers' default max_position_embeddings

	qkvBias bias // q_proj, k_proj, v_proj
	outBias bias // o_proj
	window  window

	qkNorm  bool // may have QKNorm (no family yet)
	experts bool // may have MoE (no family yet)
}

var families = map[Family]quirks{
	Llama:   {modelType: "llama", architecture: "LlamaForCausalLM", maxPositions: 2048, qkvBias: biasFlag, outBias: biasFlag},
	Mistral: {modelType: "mistral", architecture: "MistralForCausalLM", maxPositions: 4096 * 32, window: windowAlways},
	Qwen2:   {modelType: "qwen2", architecture: "Qwen2ForCausalLM", maxPositions: 32768, qkvBias: biasAlways, window: windowFlag},
}

// Families lists the supported families.
func Families() []Family { return []Family{Llama, Mistral, Qwen2} }

func (f Family) quirks() (quirks, bool) {
	q, ok := families[f]
	return q, ok
}

// String returns the family's model_type: "llama", "mistral", "qwen2".
func (f Family) String() string {
	if q, ok := f.quirks(); ok {
		return q.modelType
	}
	return fmt.Sprintf("Family(%d)", int(f))
}

// Architecture returns the family's transformers class name, such as
// "LlamaForCausalLM", or "" for an unsupported Family.
func (f Family) Architecture() string {
	q, _ := f.quirks()
	return q.architecture
}

// Architectures lists the supported architecture class names, in the
// order of Families.
func Architectures() []string {
	var names []string
	for _, f := range Families() {
		names = append(names, f.Architecture())
	}
	return names
}

// ParseFamily accepts a model type ("llama", "mistral", "qwen2") or an
// architecture class name ("Qwen2ForCausalLM"), in any case.
func ParseFamily(name string) (Family, error) {
	for _, f := range Families() {
		if strings.EqualFold(name, f.String()) || strings.EqualFold(name, f.Architecture()) {
			return f, nil
		}
	}
	return 0, fmt.Errorf("arch: unsupported architecture %q (supported: %s)", name, strings.Join(Architectures(), ", "))
}

// familyOf returns the family whose class name is exactly arch.
func familyOf(arch string) (Family, bool) {
	for _, f := range Families() {
		if f.Architecture() == arch {
			return f, true
		}
	}
	return 0, false
}

// SetFamily switches c to family f, setting what f implies: Qwen2 has q/k/v
// biases and no o_proj bias, Mistral no biases, Llama none until QKVBias
// and OutBias are set (a Llama with attention_bias); the sliding window is
// kept only for a family that has one. An unsupported Family is set as it
// is, for Validate to refuse.
func (c *Config) SetFamily(f Family) {
	c.Family = f
	q, ok := f.quirks()
	if !ok {
		return
	}
	c.QKVBias, c.OutBias = q.qkvBias == biasAlways, q.outBias == biasAlways
	if q.window != windowAlways {
		c.SlidingWindow = 0
	}
}

// validateFamily checks c against its family's quirks.
func (c *Config) validateFamily() error {
	q, ok := c.Family.quirks()
	if !ok {
		return cfgErr("unsupported family %v (supported: %s)", c.Family, strings.Join(Architectures(), ", "))
	}
	f := c.Family
	switch {
	case q.qkvBias == biasAlways && !c.QKVBias:
		return cfgErr("%v always has q/k/v biases (QKVBias must be true)", f)
	case q.qkvBias == biasNever && c.QKVBias:
		return cfgErr("%v has no q/k/v biases", f)
	case q.outBias == biasAlways && !c.OutBias:
		return cfgErr("%v always has an o_proj bias (OutBias must be true)", f)
	case q.outBias == biasNever && c.OutBias:
		return cfgErr("%v has no o_proj bias", f)
	case q.qkvBias == biasFlag && q.outBias == biasFlag && c.QKVBias != c.OutBias:
		return cfgErr("%v's attention_bias gives q/k/v and o_proj biases together (QKVBias %v, OutBias %v)", f, c.QKVBias, c.OutBias)
	case q.window != windowAlways && c.SlidingWindow != 0:
		return cfgErr("%v has no sliding window (SlidingWindow %d)", f, c.SlidingWindow)
	case c.QKNorm && !q.qkNorm:
		return cfgErr("%v has no q/k norms", f)
	case c.MoE != nil && !q.experts:
		return cfgErr("%v has no mixture of experts", f)
	}
	return nil
}
