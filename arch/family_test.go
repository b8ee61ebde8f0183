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
	for _, f := range Families() {
		c.SetFamily(f)
		if err := c.Validate(); err != nil {
			t.Errorf("SetFamily(%v) gives a config Validate refuses: %v", f, err)
		}
	}
}
