package arch

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// llamaJSON is a minimal Llama config; tests add and replace fields.
func llamaJSON(extra map[string]any) []byte {
	c := map[string]any{
		"architectures":       []string{"LlamaForCausalLM"},
		"model_type":          "llama",
		"hidden_size":         4096,
		"intermediate_size":   14336,
		"num_hidden_layers":   32,
		"num_attention_heads": 32,
		"vocab_size":          128256,
	}
	for k, v := range extra {
		if v == nil {
			delete(c, k)
		} else {
			c[k] = v
		}
	}
	b, _ := json.Marshal(c)
	return b
}

func TestParseConfigFields(t *testing.T) {
	llama3 := &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}
	cases := []struct {
		name  string
		json  []byte
		check func(t *testing.T, c *Config)
	}{
		{"defaults", llamaJSON(nil), func(t *testing.T, c *Config) {
			if c.NumKVHeads != 32 || c.HeadDim != 128 || c.RopeTheta != 10000 || c.RMSNormEps != 1e-6 ||
				c.BOS != -1 || c.EOS != nil || c.DType != tensor.F32 || c.RopeScaling != nil ||
				c.MaxPositions != 2048 || c.TieEmbeddings || c.QKVBias {
				t.Errorf("defaults: %+v", c)
			}
		}},
		{"transformers 5 rope_parameters llama3", llamaJSON(map[string]any{
			"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "dtype": "bfloat16", "bos_token_id": 128000,
			"eos_token_id": []int{128001, 128008, 128009}, "max_position_embeddings": 131072,
			"rope_parameters": map[string]any{"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
				"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
		}), func(t *testing.T, c *Config) {
			if c.RopeTheta != 500000 || !reflect.DeepEqual(c.RopeScaling, llama3) || c.NumKVHeads != 8 ||
				c.DType != tensor.BF16 || c.BOS != 128000 || !reflect.DeepEqual(c.EOS, []int{128001, 128008, 128009}) ||
				c.MaxPositions != 131072 || c.RMSNormEps != 1e-5 {
				t.Errorf("got %+v, scaling %+v", c, c.RopeScaling)
			}
		}},
		{"older rope_scaling with type", llamaJSON(map[string]any{
			"rope_theta": 500000.0, "torch_dtype": "float16",
			"rope_scaling": map[string]any{"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
		}), func(t *testing.T, c *Config) {
			if c.RopeTheta != 500000 || !reflect.DeepEqual(c.RopeScaling, llama3) || c.DType != tensor.F16 {
				t.Errorf("got %+v, scaling %+v", c, c.RopeScaling)
			}
		}},
		{"older rope_scaling with rope_type", llamaJSON(map[string]any{
			"rope_theta":   500000.0,
			"rope_scaling": map[string]any{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
		}), func(t *testing.T, c *Config) {
			if !reflect.DeepEqual(c.RopeScaling, llama3) {
				t.Errorf("scaling %+v", c.RopeScaling)
			}
		}},
		{"default rope type is no scaling", llamaJSON(map[string]any{
			"rope_parameters": map[string]any{"rope_theta": 1e6, "rope_type": "default"}, "rope_scaling": nil,
		}), func(t *testing.T, c *Config) {
			if c.RopeScaling != nil || c.RopeTheta != 1e6 {
				t.Errorf("scaling %+v theta %v", c.RopeScaling, c.RopeTheta)
			}
		}},
		{"explicit head_dim and null bos", llamaJSON(map[string]any{"head_dim": 64, "bos_token_id": nil, "eos_token_id": 2}), func(t *testing.T, c *Config) {
			if c.HeadDim != 64 || c.QDim() != 2048 || c.BOS != -1 || !reflect.DeepEqual(c.EOS, []int{2}) {
				t.Errorf("got %+v", c)
			}
		}},
		{"llama attention_bias", llamaJSON(map[string]any{"attention_bias": true, "tie_word_embeddings": true}), func(t *testing.T, c *Config) {
			if !c.QKVBias || !c.OutBias || !c.TieEmbeddings {
				t.Errorf("got %+v", c)
			}
		}},
		{"qwen2 always has q/k/v biases", llamaJSON(map[string]any{
			"architectures": []string{"Qwen2ForCausalLM"}, "model_type": "qwen2", "attention_bias": false,
			"use_sliding_window": false, "sliding_window": 4096, "rope_theta": 1000000.0,
		}), func(t *testing.T, c *Config) {
			if c.Family != Qwen2 || !c.QKVBias || c.OutBias || c.SlidingWindow != 0 || c.MaxPositions != 32768 {
				t.Errorf("got %+v", c)
			}
		}},
		{"mistral sliding window", llamaJSON(map[string]any{
			"architectures": []string{"MistralForCausalLM"}, "model_type": "mistral", "sliding_window": 4096, "attention_bias": true,
		}), func(t *testing.T, c *Config) {
			if c.Family != Mistral || c.SlidingWindow != 4096 || c.QKVBias {
				t.Errorf("got %+v", c)
			}
		}},
		{"model_type alone", llamaJSON(map[string]any{"architectures": nil, "model_type": "mistral", "sliding_window": nil}), func(t *testing.T, c *Config) {
			if c.Family != Mistral || c.SlidingWindow != 0 {
				t.Errorf("got %+v", c)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseConfig(tc.json)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}

func TestParseConfigErrors(t *testing.T) {
	cases := []struct {
		name string
		json []byte
		want string
	}{
		{"bad JSON", []byte(`{"hidden_size": `), "bad JSON"},
		{"not an object", []byte(`[1]`), "bad JSON"},
		{"unsupported architecture", llamaJSON(map[string]any{"architectures": []string{"GPT2LMHeadModel"}, "model_type": nil}), `unsupported architecture "GPT2LMHeadModel"`},
		{"unsupported model_type", llamaJSON(map[string]any{"architectures": nil, "model_type": "phi3"}), `unsupported model_type "phi3"`},
		{"nothing says the architecture", llamaJSON(map[string]any{"architectures": nil, "model_type": nil}), "no architectures or model_type"},
		{"architecture and model_type disagree", llamaJSON(map[string]any{"model_type": "qwen2"}), "does not match model_type"},
		{"missing hidden_size", llamaJSON(map[string]any{"hidden_size": nil}), "missing hidden_size"},
		{"missing vocab_size", llamaJSON(map[string]any{"vocab_size": nil}), "missing vocab_size"},
		{"float size", llamaJSON(map[string]any{"num_hidden_layers": 1.5}), "bad JSON"},
		{"zero layers", llamaJSON(map[string]any{"num_hidden_layers": 0}), "num_hidden_layers must be positive"},
		{"heads do not share", llamaJSON(map[string]any{"num_key_value_heads": 5}), "not a multiple of num_key_value_heads 5"},
		{"hidden not divisible", llamaJSON(map[string]any{"num_attention_heads": 30}), "not a multiple of num_attention_heads 30"},
		{"odd head_dim", llamaJSON(map[string]any{"head_dim": 127}), "head_dim 127 must be even"},
		{"bad eps", llamaJSON(map[string]any{"rms_norm_eps": -1}), "rms_norm_eps"},
		{"bad theta", llamaJSON(map[string]any{"rope_theta": 0}), "rope_theta"},
		{"unsupported rope type", llamaJSON(map[string]any{"rope_scaling": map[string]any{"type": "yarn", "factor": 4.0}}), `rope type "yarn" is not supported`},
		{"llama3 without factor", llamaJSON(map[string]any{"rope_parameters": map[string]any{"rope_type": "llama3", "rope_theta": 5e5}}), "needs factor"},
		{"llama3 bad factors", llamaJSON(map[string]any{"rope_parameters": map[string]any{"rope_type": "llama3", "factor": 8.0,
			"low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}), "bad llama3 rope scaling"},
		{"bad eos", llamaJSON(map[string]any{"eos_token_id": "x"}), `eos_token_id "x" is neither a token id nor a list of them`},
		{"eos over lines", indented(llamaJSON(map[string]any{"eos_token_id": []any{1, "two\nlines"}})), `eos_token_id [1,"two\nlines"] is neither`},
		{"long eos", indented(llamaJSON(map[string]any{"eos_token_id": append(make([]any, 100), "x")})), "eos_token_id [null,null,"},
		{"eos outside vocab", llamaJSON(map[string]any{"eos_token_id": 200000}), "eos_token_id 200000 outside"},
		{"bos list", indented(llamaJSON(map[string]any{"bos_token_id": []int{1, 2}})), "bos_token_id [1,2] is not one token id"},
		{"unknown dtype", llamaJSON(map[string]any{"torch_dtype": "float8"}), `unsupported dtype "float8"`},
		{"integer dtype", llamaJSON(map[string]any{"dtype": "int32"}), `unsupported dtype "int32"`},
		{"mlp bias", llamaJSON(map[string]any{"mlp_bias": true}), "mlp_bias"},
		{"gelu", llamaJSON(map[string]any{"hidden_act": "gelu"}), `hidden_act "gelu"`},
		{"qwen2 sliding window", llamaJSON(map[string]any{"architectures": []string{"Qwen2ForCausalLM"}, "model_type": "qwen2", "use_sliding_window": true}), "use_sliding_window"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseConfig(tc.json)
			if err == nil {
				t.Fatal("ParseConfig succeeded")
			}
			if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), "arch: config: ") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want ErrConfig mentioning %q", err, tc.want)
			}
			if msg := err.Error(); strings.ContainsAny(msg, "\r\n") || len(msg) > 200 {
				t.Errorf("error %q is more than one short line", msg)
			}
		})
	}
}

// indented is a config.json as people write them, over several lines.
func indented(compact []byte) []byte {
	var b bytes.Buffer
	if err := json.Indent(&b, compact, "", "  "); err != nil {
		panic(err)
	}
	return b.Bytes()
}

func TestConfigJSONRoundTrip(t *testing.T) {
	tiny, _ := Preset("tiny")
	var cfgs []*Config
	for _, name := range Presets() {
		c, err := Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		cfgs = append(cfgs, c)
	}
	l3 := tiny.Clone()
	l3.RopeTheta, l3.DType, l3.EOS, l3.BOS = 500000, tensor.BF16, []int{3, 4}, -1
	l3.RopeScaling = &RopeScaling{Type: "llama3", Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}
	q := tiny.Clone()
	q.SetFamily(Qwen2)
	q.TieEmbeddings, q.DType, q.EOS, q.RMSNormEps = true, tensor.F32, nil, 1e-6
	ms := tiny.Clone()
	ms.SetFamily(Mistral)
	ms.SlidingWindow = 4096
	ab := tiny.Clone()
	ab.QKVBias, ab.OutBias = true, true
	cfgs = append(cfgs, l3, q, ms, ab)
	for _, c := range cfgs {
		if err := c.Validate(); err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
		data, err := c.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		// It is plain JSON, also through encoding/json.
		if _, err := json.Marshal(c); err != nil {
			t.Fatal(err)
		}
		back, err := ParseConfig(data)
		if err != nil {
			t.Fatalf("%s\n%v", data, err)
		}
		if !reflect.DeepEqual(back, c) {
			t.Errorf("round trip\n got %+v\nwant %+v\n%s", back, c, data)
		}
		var raw map[string]any
		json.Unmarshal(data, &raw)
		rp, _ := raw["rope_parameters"].(map[string]any)
		if rp["rope_theta"] != c.RopeTheta {
			t.Errorf("rope_parameters %v", rp)
		}
		if !strings.Contains(string(data), `"rope_theta": `) || !strings.Contains(string(data), ".0") {
			t.Errorf("rope_theta not written as a float:\n%s", data)
		}
	}
}

func TestPresets(t *testing.T) {
	// Parameter counts of the real models these shapes copy.
	for _, tc := range []struct {
		name     string
		min, max int64
	}{
		{"tiny", 247360, 247360}, // the fixtures' total_parameters
		{"100m", 100e6, 140e6},
		{"1b", 1.0e9, 1.2e9},
		{"tinyllama-1.1b", 1.100e9, 1.101e9},        // TinyLlama-1.1B: 1,100,048,384
		{"llama2-7b", 6.738e9, 6.739e9},             // Llama-2-7b: 6,738,415,616
		{"mixtral-8x7b", 46702792704, 46702792704},  // Mixtral-8x7B-v0.1
		{"qwen3-30b-a3b", 30532122624, 30532122624}, // Qwen3-30B-A3B
	} {
		c, err := Preset(tc.name)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if n := c.NumParams(); n < tc.min || n > tc.max {
			t.Errorf("%s: %d parameters, want %d..%d", tc.name, n, tc.min, tc.max)
		}
	}
	if _, err := Preset("gpt-5"); err == nil || !strings.Contains(err.Error(), "tiny") {
		t.Errorf("unknown preset: %v", err)
	}
	c, _ := Preset("tiny")
	c.SetFamily(Qwen2)
	if err := c.Validate(); err != nil || c.Family != Qwen2 || !c.QKVBias {
		t.Errorf("SetFamily(Qwen2): %v %+v", err, c)
	}
	// Presets are fresh copies.
	c.HiddenSize = 1
	if d, _ := Preset("tiny"); d.HiddenSize != 64 {
		t.Error("Preset returned a shared config")
	}
}
