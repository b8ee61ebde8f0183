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
	Llama    Family = iota + 1 // LlamaForCausalLM, model_type "llama"
	Mistral                    // MistralForCausalLM, model_type "mistral"
	Qwen2                      // Qwen2ForCausalLM, model_type "qwen2"
	Qwen3                      // Qwen3ForCausalLM, model_type "qwen3"
	Mixtral                    // MixtralForCausalLM, model_type "mixtral"
	Qwen2MoE                   // Qwen2MoeForCausalLM, model_type "qwen2_moe"
	Qwen3MoE                   // Qwen3MoeForCausalLM, model_type "qwen3_moe"
)

// bias says when a family's projections carry a bias.
type bias int

const (
	biasNever  bias = iota
	biasAlways      // whatever the config says
	biasFlag        // when attention_bias is set
	biasQKV         // when qkv_bias is set, which it is unless false (Qwen2-MoE)
)

// window says whether a family's sliding_window applies.
type window int

const (
	windowNone   window = iota // no sliding attention: sliding_window is ignored
	windowAlways               // sliding_window, when set, bounds attention
	windowFlag                 // only with use_sliding_window, which strata refuses
)

// quirks are what sets a family apart: a family adds its row here, and a
// field for each new quirk.
type quirks struct {
	modelType    string
	architecture string
	maxPositions int     // transformers' default max_position_embeddings
	ropeTheta    float64 // default rope_theta; 0 means 10000
	normEps      float64 // default rms_norm_eps; 0 means 1e-6
	headDim      int     // default head_dim; 0 means hidden_size/num_attention_heads
	kvHeads      int     // default num_key_value_heads; 0 means num_attention_heads

	qkvBias bias // q_proj, k_proj, v_proj
	outBias bias // o_proj
	window  window

	qkNorm  bool    // always has QKNorm: q_norm and k_norm per head
	experts experts // the mixture of experts's layout; none for a dense family
}

var families = map[Family]quirks{
	Llama:   {modelType: "llama", architecture: "LlamaForCausalLM", maxPositions: 2048, qkvBias: biasFlag, outBias: biasFlag},
	Mistral: {modelType: "mistral", architecture: "MistralForCausalLM", maxPositions: 4096 * 32, kvHeads: 8, window: windowAlways},
	Qwen2:   {modelType: "qwen2", architecture: "Qwen2ForCausalLM", maxPositions: 32768, qkvBias: biasAlways, window: windowFlag},
	Qwen3: {modelType: "qwen3", architecture: "Qwen3ForCausalLM", maxPositions: 32768, headDim: 128, kvHeads: 32,
		qkvBias: biasFlag, outBias: biasFlag, window: windowFlag, qkNorm: true},
	Mixtral: {modelType: "mixtral", architecture: "MixtralForCausalLM", maxPositions: 4096 * 32, ropeTheta: 1e6, normEps: 1e-5, kvHeads: 8,
		window: windowAlways, experts: mixtralExperts},
	Qwen2MoE: {modelType: "qwen2_moe", architecture: "Qwen2MoeForCausalLM", maxPositions: 32768, kvHeads: 16,
		qkvBias: biasQKV, window: windowFlag, experts: qwen2MoEExperts},
	Qwen3MoE: {modelType: "qwen3_moe", architecture: "Qwen3MoeForCausalLM", maxPositions: 32768, kvHeads: 4,
		qkvBias: biasFlag, outBias: biasFlag, window: windowFlag, qkNorm: true, experts: qwen3MoEExperts},
}

// Families lists the supported families.
func Families() []Family { return []Family{Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2MoE, Qwen3MoE} }

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

// modelTypes lists the supported model types, for messages.
func modelTypes() string {
	var names []string
	for _, f := range Families() {
		names = append(names, f.String())
	}
	return strings.Join(names, ", ")
}

// ParseFamily accepts a model type ("llama", "mistral", "qwen2", "qwen3",
// "mixtral", "qwen2_moe", "qwen3_moe") or an architecture class name
// ("Qwen2ForCausalLM"), in any case.
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
// biases and no o_proj bias, Qwen2-MoE q/k/v biases, Mistral and Mixtral
// no biases, Llama, Qwen3 and Qwen3-MoE none until QKVBias and OutBias are
// set (attention_bias); the sliding window is kept only for a family that
// has one; Qwen3 and Qwen3-MoE have q/k norms; a mixture of experts is kept
// for a family that has one, changed as the family requires (see
// MoE.fit), or made with the defaults of the family's transformers config
// when c has none, and dropped for a dense family. An unsupported Family is
// set as it is, for Validate to refuse.
func (c *Config) SetFamily(f Family) {
	c.Family = f
	q, ok := f.quirks()
	if !ok {
		return
	}
	c.QKVBias = q.qkvBias == biasAlways || q.qkvBias == biasQKV
	c.OutBias = q.outBias == biasAlways
	if q.window != windowAlways {
		c.SlidingWindow = 0
	}
	c.QKNorm = q.qkNorm
	c.setExperts(q.experts)
}

// validateFamily checks c against its family's quirks.
func (c *Config) validateFamily() error {
	q, ok := c.Family.quirks()
	if !ok {
		return cfgErr("unsupported family %v (supported: %s)", c.Family, modelTypes())
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
	case !c.QKNorm && q.qkNorm:
		return cfgErr("%v always has q/k norms (QKNorm must be true)", f)
	case c.MoE != nil && q.experts == nil:
		return cfgErr("%v has no mixture of experts", f)
	case c.MoE == nil && q.experts != nil:
		return cfgErr("%v needs its mixture of experts (MoE is nil)", f)
	}
	if c.MoE != nil {
		return c.validateMoE(q.experts)
	}
	return nil
}
