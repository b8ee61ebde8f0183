package arch

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestParseFamily(t *testing.T) {
	for _, tc := range []struct {
		name string
		want Family
	}{
		{"llama", Llama}, {"LLAMA", Llama}, {"LlamaForCausalLM", Llama},
		{"mistral", Mistral}, {"mistralforcausallm", Mistral},
		{"qwen2", Qwen2}, {"Qwen2ForCausalLM", Qwen2},
		{"qwen3", Qwen3}, {"mixtral", Mixtral}, {"MixtralForCausalLM", Mixtral},
		{"qwen2_moe", Qwen2MoE}, {"Qwen2MoeForCausalLM", Qwen2MoE}, {"qwen3_moe", Qwen3MoE}, {"Qwen3MoeForCausalLM", Qwen3MoE},
		{"gpt2", 0}, {"", 0}, {"qwen", 0}, {"Family(1)", 0},
	} {
		f, err := ParseFamily(tc.name)
		if tc.want == 0 {
			if err == nil || !strings.Contains(err.Error(), "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM") {
				t.Errorf("ParseFamily(%q) = %v, %v; want an error listing the architectures", tc.name, f, err)
			}
			continue
		}
		if err != nil || f != tc.want {
			t.Errorf("ParseFamily(%q) = %v, %v; want %v", tc.name, f, err, tc.want)
		}
	}
	for _, f := range Families() {
		if g, err := ParseFamily(f.String()); err != nil || g != f {
			t.Errorf("%v does not parse back: %v, %v", f, g, err)
		}
	}
	if s := Family(0).String(); s != "Family(0)" {
		t.Errorf("Family(0).String() = %q", s)
	}
}

// TestValidateFamily checks each family's quirks: a config that breaks one
// is refused, and one that keeps them survives MarshalJSON and ParseConfig
// unchanged.
func TestValidateFamily(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(c *Config)
		want string // "" when valid
	}{
		{"llama", func(c *Config) {}, ""},
		{"llama attention_bias", func(c *Config) { c.QKVBias, c.OutBias = true, true }, ""},
		{"llama q/k/v bias alone", func(c *Config) { c.QKVBias = true }, "attention_bias gives q/k/v and o_proj biases together"},
		{"llama o_proj bias alone", func(c *Config) { c.OutBias = true }, "attention_bias gives q/k/v and o_proj biases together"},
		{"llama sliding window", func(c *Config) { c.SlidingWindow = 64 }, "llama has no sliding window"},
		{"mistral window", func(c *Config) { c.SetFamily(Mistral); c.SlidingWindow = 64 }, ""},
		{"mistral q/k/v bias", func(c *Config) { c.SetFamily(Mistral); c.QKVBias = true }, "mistral has no q/k/v biases"},
		{"mistral o_proj bias", func(c *Config) { c.SetFamily(Mistral); c.OutBias = true }, "mistral has no o_proj bias"},
		{"qwen2", func(c *Config) { c.SetFamily(Qwen2) }, ""},
		{"qwen2 without q/k/v bias", func(c *Config) { c.SetFamily(Qwen2); c.QKVBias = false }, "qwen2 always has q/k/v biases"},
		{"qwen2 o_proj bias", func(c *Config) { c.SetFamily(Qwen2); c.OutBias = true }, "qwen2 has no o_proj bias"},
		{"qwen2 sliding window", func(c *Config) { c.SetFamily(Qwen2); c.SlidingWindow = 64 }, "qwen2 has no sliding window"},
		{"qk norm", func(c *Config) { c.QKNorm = true }, "llama has no q/k norms"},
		{"experts", func(c *Config) { c.MoE = &MoE{Experts: 8, ExpertsPerToken: 2, ExpertSize: 64, SparseStep: 1} }, "llama has no mixture of experts"},
		{"qwen3", func(c *Config) { c.SetFamily(Qwen3); c.HeadDim = 32 }, ""},
		{"qwen3 attention_bias", func(c *Config) { c.SetFamily(Qwen3); c.QKVBias, c.OutBias = true, true }, ""},
		{"qwen3 without q/k norms", func(c *Config) { c.SetFamily(Qwen3); c.QKNorm = false }, "qwen3 always has q/k norms"},
		{"qwen3 experts", func(c *Config) {
			c.SetFamily(Qwen3)
			c.MoE = &MoE{Experts: 8, ExpertsPerToken: 2, ExpertSize: 64, SparseStep: 1}
		}, "qwen3 has no mixture of experts"},
		{"mixtral", func(c *Config) { c.SetFamily(Mixtral); c.SlidingWindow = 128 }, ""},
		{"mixtral top-1 of 3", func(c *Config) { c.SetFamily(Mixtral); c.MoE.Experts, c.MoE.ExpertsPerToken = 3, 1 }, ""},
		{"mixtral without experts", func(c *Config) { c.SetFamily(Mixtral); c.MoE = nil }, "mixtral needs its mixture of experts"},
		{"mixtral q/k norms", func(c *Config) { c.SetFamily(Mixtral); c.QKNorm = true }, "mixtral has no q/k norms"},
		{"mixtral expert size", func(c *Config) { c.SetFamily(Mixtral); c.MoE.ExpertSize = 32 }, "mixtral experts have intermediate_size 172"},
		{"mixtral without renormalising", func(c *Config) { c.SetFamily(Mixtral); c.MoE.NormTopK = false }, "always renormalises"},
		{"mixtral dense layers", func(c *Config) { c.SetFamily(Mixtral); c.MoE.DenseLayers = []int{1} }, "experts in every block"},
		{"mixtral shared expert", func(c *Config) { c.SetFamily(Mixtral); c.MoE.SharedExperts, c.MoE.SharedSize = 1, 64 }, "mixtral has no shared expert"},
		{"more chosen than experts", func(c *Config) { c.SetFamily(Mixtral); c.MoE.ExpertsPerToken = 9 }, "num_experts_per_tok 9 must be in 1..num_experts 8"},
		{"no experts", func(c *Config) { c.SetFamily(Mixtral); c.MoE.Experts = 0 }, "num_experts 0"},
		{"odd hidden", func(c *Config) { c.SetFamily(Mixtral); c.HiddenSize = 65 }, "hidden_size 65 must be even"},
		{"qwen3_moe", func(c *Config) {
			c.SetFamily(Qwen3MoE)
			c.MoE = &MoE{Experts: 6, ExpertsPerToken: 3, ExpertSize: 24, SparseStep: 2, DenseLayers: []int{0, 3}}
		}, ""},
		{"qwen3_moe shared expert", func(c *Config) { c.SetFamily(Qwen3MoE); c.MoE.SharedExperts, c.MoE.SharedSize = 1, 64 }, "qwen3_moe has no shared expert"},
		{"qwen3_moe sparse step 0", func(c *Config) { c.SetFamily(Qwen3MoE); c.MoE.SparseStep = 0 }, "decoder_sparse_step 0"},
		{"qwen3_moe dense layer outside", func(c *Config) { c.SetFamily(Qwen3MoE); c.MoE.DenseLayers = []int{4} }, "mlp_only_layers entry 4 outside the 4 blocks"},
		{"qwen3_moe dense layers repeated", func(c *Config) { c.SetFamily(Qwen3MoE); c.MoE.DenseLayers = []int{1, 1} }, "not ascending"},
		{"qwen2_moe", func(c *Config) { c.SetFamily(Qwen2MoE); c.MoE.NormTopK = true }, ""},
		{"qwen2_moe without q/k/v biases", func(c *Config) { c.SetFamily(Qwen2MoE); c.QKVBias = false }, ""},
		{"qwen2_moe o_proj bias", func(c *Config) { c.SetFamily(Qwen2MoE); c.OutBias = true }, "qwen2_moe has no o_proj bias"},
		{"qwen2_moe without shared expert", func(c *Config) { c.SetFamily(Qwen2MoE); c.MoE.SharedExperts, c.MoE.SharedSize = 0, 0 }, "qwen2_moe always has a shared expert"},
		{"qwen2_moe two shared experts", func(c *Config) { c.SetFamily(Qwen2MoE); c.MoE.SharedExperts = 2 }, "2 shared experts"},
		{"qwen2_moe shared size 0", func(c *Config) { c.SetFamily(Qwen2MoE); c.MoE.SharedSize = 0 }, "shared_expert_intermediate_size 0"},
		{"no family", func(c *Config) { c.Family = 0 }, "unsupported family Family(0)"},
		{"unknown family", func(c *Config) { c.SetFamily(Family(99)) }, "unsupported family Family(99)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Preset("tiny")
			if err != nil {
				t.Fatal(err)
			}
			tc.edit(c)
			err = c.Validate()
			if tc.want != "" {
				if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Validate: %v, want ErrConfig mentioning %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatalf("Validate: %v", err)
			}
			back, err := ParseConfig(mustJSON(t, c))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(back, c) {
				t.Errorf("round trip\n got %+v\nwant %+v", back, c)
			}
		})
	}
}

func mustJSON(t *testing.T, c *Config) []byte {
	t.Helper()
	b, err := c.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestSetFamily(t *testing.T) {
	c, _ := Preset("tiny")
	c.QKVBias, c.OutBias = true, true
	c.SetFamily(Mistral)
	c.SlidingWindow = 128
	if c.Family != Mistral || c.QKVBias || c.OutBias || c.SlidingWindow != 128 {
		t.Fatalf("SetFamily(Mistral): %+v", c)
	}
	c.SetFamily(Qwen2)
	if c.Family != Qwen2 || !c.QKVBias || c.OutBias || c.SlidingWindow != 0 {
		t.Fatalf("SetFamily(Qwen2): %+v", c)
	}
	c.SetFamily(Llama)
	if c.Family != Llama || c.QKVBias || c.OutBias || c.SlidingWindow != 0 {
		t.Fatalf("SetFamily(Llama): %+v", c)
	}
	c.SetFamily(Qwen3MoE)
	if !c.QKNorm || c.MoE == nil || !reflect.DeepEqual(*c.MoE, MoE{Experts: 128, ExpertsPerToken: 8, ExpertSize: 768, SparseStep: 1}) {
		t.Fatalf("SetFamily(Qwen3MoE): %+v, MoE %+v", c, c.MoE)
	}
	c.MoE.DenseLayers, c.MoE.SparseStep, c.MoE.NormTopK = []int{2}, 2, false
	c.SetFamily(Qwen2MoE) // keeps the experts and adds the shared one
	if c.QKNorm || !c.QKVBias || c.MoE.Experts != 128 || c.MoE.SharedExperts != 1 || c.MoE.SharedSize != 5632 || c.MoE.SparseStep != 2 {
		t.Fatalf("SetFamily(Qwen2MoE): %+v, MoE %+v", c, c.MoE)
	}
	c.SetFamily(Mixtral) // every block sparse, experts of intermediate_size, renormalised
	if m := c.MoE; m.ExpertSize != c.IntermediateSize || m.SharedExperts != 0 || m.SharedSize != 0 || m.SparseStep != 1 || m.DenseLayers != nil || !m.NormTopK || m.Experts != 128 {
		t.Fatalf("SetFamily(Mixtral): MoE %+v", m)
	}
	c.SetFamily(Qwen2)
	if c.MoE != nil || c.QKNorm {
		t.Fatalf("SetFamily(Qwen2) keeps %+v", c)
	}
	for _, f := range Families() {
		c.SetFamily(f)
		if err := c.Validate(); err != nil {
			t.Errorf("SetFamily(%v) gives a config Validate refuses: %v", f, err)
		}
	}
}
