package arch

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// familyJSONOf is a small config of the family with the given architecture;
// extra adds and replaces fields (nil deletes one).
func familyJSONOf(architecture, modelType string, extra map[string]any) []byte {
	c := map[string]any{
		"architectures":       []string{architecture},
		"model_type":          modelType,
		"hidden_size":         64,
		"intermediate_size":   96,
		"num_hidden_layers":   4,
		"num_attention_heads": 4,
		"num_key_value_heads": 2,
		"vocab_size":          512,
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

func mixtralJSON(extra map[string]any) []byte {
	return familyJSONOf("MixtralForCausalLM", "mixtral", extra)
}

func qwen3MoEJSON(extra map[string]any) []byte {
	return familyJSONOf("Qwen3MoeForCausalLM", "qwen3_moe", extra)
}

func qwen2MoEJSON(extra map[string]any) []byte {
	return familyJSONOf("Qwen2MoeForCausalLM", "qwen2_moe", extra)
}

func TestParseMoEConfigs(t *testing.T) {
	cases := []struct {
		name string
		json []byte
		want func(c *Config) // edits the expected config, which starts as the parsed one with MoE and biases cleared
		moe  *MoE
	}{
		{"qwen3 defaults", familyJSONOf("Qwen3ForCausalLM", "qwen3", map[string]any{"num_key_value_heads": nil, "num_attention_heads": 32}), func(c *Config) {
			// Qwen3Config: head_dim 128 and 32 KV heads when not given.
			if c.HeadDim != 128 || c.NumKVHeads != 32 || !c.QKNorm || c.QKVBias || c.OutBias || c.RopeTheta != 10000 || c.MaxPositions != 32768 {
				t.Errorf("qwen3 defaults: %+v", c)
			}
		}, nil},
		{"qwen3 like the fixture", familyJSONOf("Qwen3ForCausalLM", "qwen3", map[string]any{
			"head_dim": 32, "attention_bias": true, "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": nil,
			"max_window_layers": 28, "layer_types": []string{"full_attention", "full_attention", "full_attention", "full_attention"},
			"rope_parameters": map[string]any{"rope_theta": 1e6, "rope_type": "default"},
		}), func(c *Config) {
			if c.HeadDim != 32 || c.QDim() != 128 || !c.QKNorm || !c.QKVBias || !c.OutBias || !c.TieEmbeddings || c.RopeTheta != 1e6 {
				t.Errorf("qwen3: %+v", c)
			}
		}, nil},
		{"mixtral defaults", mixtralJSON(map[string]any{"num_key_value_heads": nil, "head_dim": nil, "hidden_size": 128, "num_attention_heads": 8}), func(c *Config) {
			// MixtralConfig: rope_theta 1e6, eps 1e-5, 8 KV heads.
			if c.RopeTheta != 1e6 || c.RMSNormEps != 1e-5 || c.NumKVHeads != 8 || c.HeadDim != 16 || c.QKNorm || c.QKVBias {
				t.Errorf("mixtral defaults: %+v", c)
			}
		}, &MoE{Experts: 8, ExpertsPerToken: 2, ExpertSize: 96, SparseStep: 1, NormTopK: true}},
		{"mixtral with neutral fields", mixtralJSON(map[string]any{
			"num_local_experts": 4, "num_experts_per_tok": 1, "router_jitter_noise": 0.1, "router_aux_loss_coef": 0.02,
			"output_router_logits": true, "sliding_window": 128, "scoring_func": "softmax", "topk_method": "greedy",
			"n_group": nil, "moe_intermediate_size": 96, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": []int{},
		}), func(c *Config) {
			if c.SlidingWindow != 128 {
				t.Errorf("mixtral: %+v", c)
			}
		}, &MoE{Experts: 4, ExpertsPerToken: 1, ExpertSize: 96, SparseStep: 1, NormTopK: true}},
		{"qwen3_moe as transformers 5 writes it", qwen3MoEJSON(map[string]any{
			"num_local_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 48, "norm_topk_prob": true,
			"decoder_sparse_step": 1, "mlp_only_layers": []int{}, "head_dim": 16, "use_sliding_window": false,
		}), func(c *Config) {
			if !c.QKNorm || c.HeadDim != 16 || c.RopeTheta != 10000 {
				t.Errorf("qwen3_moe: %+v", c)
			}
		}, &MoE{Experts: 16, ExpertsPerToken: 4, ExpertSize: 48, SparseStep: 1, NormTopK: true}},
		{"qwen3_moe defaults", qwen3MoEJSON(map[string]any{"num_key_value_heads": nil}), func(c *Config) {
			if c.NumKVHeads != 4 {
				t.Errorf("qwen3_moe defaults: %+v", c)
			}
		}, &MoE{Experts: 128, ExpertsPerToken: 8, ExpertSize: 768, SparseStep: 1}},
		{"qwen3_moe with dense blocks", qwen3MoEJSON(map[string]any{
			"num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
			"decoder_sparse_step": 2, "mlp_only_layers": []int{3, 0, 3}, "attention_bias": true,
		}), func(c *Config) {
			if !c.QKVBias || !c.OutBias {
				t.Errorf("qwen3_moe attention_bias: %+v", c)
			}
			for i, want := range []bool{false, true, false, false} {
				if c.Sparse(i) != want {
					t.Errorf("block %d sparse %v, want %v", i, c.Sparse(i), want)
				}
			}
		}, &MoE{Experts: 8, ExpertsPerToken: 2, ExpertSize: 32, SparseStep: 2, DenseLayers: []int{0, 3}}},
		{"qwen2_moe as the hub writes it", qwen2MoEJSON(map[string]any{
			"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
			"norm_topk_prob": false, "decoder_sparse_step": 1, "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 21,
		}), func(c *Config) {
			if !c.QKVBias || c.OutBias || c.QKNorm || c.SlidingWindow != 0 {
				t.Errorf("qwen2_moe: %+v", c)
			}
		}, &MoE{Experts: 60, ExpertsPerToken: 4, ExpertSize: 1408, SharedExperts: 1, SharedSize: 5632, SparseStep: 1}},
		{"qwen2_moe without q/k/v biases", qwen2MoEJSON(map[string]any{"qkv_bias": false, "shared_expert_intermediate_size": 40}), func(c *Config) {
			if c.QKVBias || c.OutBias {
				t.Errorf("qwen2_moe qkv_bias false: %+v", c)
			}
		}, &MoE{Experts: 60, ExpertsPerToken: 4, ExpertSize: 1408, SharedExperts: 1, SharedSize: 40, SparseStep: 1}},
		{"synthetic routing", mixtralJSON(map[string]any{
			"strata_synthetic_routing": map[string]any{"skew": 1.2, "locality": 0.5, "seed": uint64(1) << 60},
		}), func(c *Config) {}, &MoE{Experts: 8, ExpertsPerToken: 2, ExpertSize: 96, SparseStep: 1, NormTopK: true,
			Synthetic: &SyntheticRouting{Skew: 1.2, Locality: 0.5, Seed: 1 << 60}}},
		{"llama ignores expert fields", llamaJSON(map[string]any{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 5}), func(c *Config) {}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseConfig(tc.json)
			if err != nil {
				t.Fatal(err)
			}
			tc.want(c)
			if !reflect.DeepEqual(c.MoE, tc.moe) {
				t.Errorf("MoE %+v, want %+v", c.MoE, tc.moe)
			}
			// What MarshalJSON writes parses back the same.
			back, err := ParseConfig(mustJSON(t, c))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(back, c) {
				t.Errorf("round trip\n got %+v %+v\nwant %+v %+v", back, back.MoE, c, c.MoE)
			}
		})
	}
}

func TestParseMoEConfigErrors(t *testing.T) {
	cases := []struct {
		name string
		json []byte
		want string
	}{
		{"sigmoid scores", qwen3MoEJSON(map[string]any{"scoring_func": "sigmoid"}), `scoring_func "sigmoid" is not supported`},
		{"grouped top-k", mixtralJSON(map[string]any{"topk_method": "noaux_tc"}), `topk_method "noaux_tc" is not supported`},
		{"expert groups", qwen3MoEJSON(map[string]any{"n_group": 8, "topk_group": 4}), "n_group 8 is not supported"},
		{"scaled routing", qwen3MoEJSON(map[string]any{"routed_scaling_factor": 2.5}), "routed_scaling_factor 2.5 is not supported"},
		{"moe layer frequency", qwen3MoEJSON(map[string]any{"moe_layer_freq": 2}), "moe_layer_freq 2 is not supported"},
		{"first dense blocks", mixtralJSON(map[string]any{"first_k_dense_replace": 1}), "first_k_dense_replace 1 is not supported"},
		{"shared experts elsewhere", mixtralJSON(map[string]any{"n_shared_experts": 2}), "n_shared_experts 2 is not supported"},
		{"experts spelled twice, differently", qwen3MoEJSON(map[string]any{"num_experts": 8, "num_local_experts": 16}), "num_experts 8 and num_local_experts 16 disagree"},
		{"no experts", qwen3MoEJSON(map[string]any{"num_experts": 0}), "num_experts 0 must be in 1..65536"},
		{"more per token than experts", mixtralJSON(map[string]any{"num_local_experts": 4, "num_experts_per_tok": 5}), "num_experts_per_tok 5 must be in 1..num_experts 4"},
		{"zero per token", mixtralJSON(map[string]any{"num_experts_per_tok": 0}), "num_experts_per_tok 0"},
		{"mixtral not renormalised", mixtralJSON(map[string]any{"norm_topk_prob": false}), "mixtral always renormalises"},
		{"mixtral expert size", mixtralJSON(map[string]any{"moe_intermediate_size": 48}), "moe_intermediate_size 48 is not supported"},
		{"mixtral shared expert", mixtralJSON(map[string]any{"shared_expert_intermediate_size": 48}), "mixtral has no shared expert"},
		{"mixtral sparse step", mixtralJSON(map[string]any{"decoder_sparse_step": 2}), "mixtral has experts in every block (decoder_sparse_step 2)"},
		{"mixtral dense blocks", mixtralJSON(map[string]any{"mlp_only_layers": []int{1}}), "mlp_only_layers [1]"},
		{"qwen3_moe shared expert", qwen3MoEJSON(map[string]any{"shared_expert_intermediate_size": 48}), "qwen3_moe has no shared expert"},
		{"qwen2_moe shared size 0", qwen2MoEJSON(map[string]any{"shared_expert_intermediate_size": 0}), "shared_expert_intermediate_size 0 must be in"},
		{"sparse step 0", qwen3MoEJSON(map[string]any{"decoder_sparse_step": 0}), "decoder_sparse_step 0 must be positive"},
		{"dense block outside", qwen3MoEJSON(map[string]any{"mlp_only_layers": []int{0, 4}}), "mlp_only_layers entry 4 outside the 4 blocks"},
		{"dense blocks not a list", qwen3MoEJSON(map[string]any{"mlp_only_layers": "all"}), "bad JSON"},
		{"negative expert size", qwen3MoEJSON(map[string]any{"moe_intermediate_size": -1}), "moe_intermediate_size -1"},
		{"sliding layers", familyJSONOf("Qwen3ForCausalLM", "qwen3", map[string]any{"layer_types": []string{"full_attention", "sliding_attention", "full_attention", "full_attention"}}),
			`layer_types[1] "sliding_attention" is not supported`},
		{"layer types for other layers", qwen2MoEJSON(map[string]any{"layer_types": []string{"full_attention"}}), "layer_types has 1 entries for 4 layers"},
		{"qwen3_moe sliding window", qwen3MoEJSON(map[string]any{"use_sliding_window": true}), "use_sliding_window=true is not supported"},
		{"qwen3 sliding window", familyJSONOf("Qwen3ForCausalLM", "qwen3", map[string]any{"use_sliding_window": true, "head_dim": 16}), "use_sliding_window=true is not supported"},
		{"odd hidden size", mixtralJSON(map[string]any{"hidden_size": 65, "head_dim": 16}), "hidden_size 65 must be even"},
		{"synthetic routing without a seed", mixtralJSON(map[string]any{"strata_synthetic_routing": map[string]any{"skew": 1, "locality": 0.5}}),
			"strata_synthetic_routing needs skew, locality and seed"},
		{"synthetic routing always local", qwen3MoEJSON(map[string]any{"strata_synthetic_routing": map[string]any{"skew": 1, "locality": 1, "seed": 3}}),
			"locality 1 must be in [0, 1)"},
		{"synthetic routing negative skew", qwen3MoEJSON(map[string]any{"strata_synthetic_routing": map[string]any{"skew": -1, "locality": 0, "seed": 3}}),
			"skew -1 must be in 0..100"},
		{"synthetic routing of a dense model", llamaJSON(map[string]any{"strata_synthetic_routing": map[string]any{"skew": 1, "locality": 0, "seed": 3}}),
			"strata_synthetic_routing: llama has no experts"},
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

// TestExpertNames checks the names of the new families' tensors against
// the ones their checkpoints on the hub use.
func TestExpertNames(t *testing.T) {
	mustParse := func(data []byte) *Config {
		c, err := ParseConfig(data)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	mixtral := mustParse(mixtralJSON(nil))
	qwen2 := mustParse(qwen2MoEJSON(map[string]any{"num_experts": 4, "shared_expert_intermediate_size": 40}))
	qwen3 := mustParse(qwen3MoEJSON(map[string]any{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": []int{1}}))
	for _, tc := range []struct {
		name  string
		c     *Config
		block int
		want  map[Role]string
		e3    [3]string // expert 3's gate, up, down
	}{
		{"mixtral", mixtral, 2, map[Role]string{
			Router: "model.layers.2.block_sparse_moe.gate.weight", MLPNorm: "model.layers.2.post_attention_layernorm.weight",
		}, [3]string{"model.layers.2.block_sparse_moe.experts.3.w1.weight", "model.layers.2.block_sparse_moe.experts.3.w3.weight", "model.layers.2.block_sparse_moe.experts.3.w2.weight"}},
		{"qwen2_moe", qwen2, 0, map[Role]string{
			Router: "model.layers.0.mlp.gate.weight", QBias: "model.layers.0.self_attn.q_proj.bias",
			SharedGate: "model.layers.0.mlp.shared_expert.gate_proj.weight", SharedUp: "model.layers.0.mlp.shared_expert.up_proj.weight",
			SharedDown: "model.layers.0.mlp.shared_expert.down_proj.weight", SharedScale: "model.layers.0.mlp.shared_expert_gate.weight",
		}, [3]string{"model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"}},
		{"qwen3_moe", qwen3, 2, map[Role]string{
			Router: "model.layers.2.mlp.gate.weight",
			QNorm:  "model.layers.2.self_attn.q_norm.weight", KNorm: "model.layers.2.self_attn.k_norm.weight",
		}, [3]string{"model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight", "model.layers.2.mlp.experts.3.down_proj.weight"}},
		{"qwen3_moe dense block", qwen3, 1, map[Role]string{
			Gate: "model.layers.1.mlp.gate_proj.weight", Down: "model.layers.1.mlp.down_proj.weight", Router: "",
		}, [3]string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			layer := tc.c.BlockLayer(tc.block)
			names := tc.c.LayerNames(layer)
			for r, want := range tc.want {
				if names[r] != want {
					t.Errorf("%v: %q, want %q", r, names[r], want)
				}
			}
			experts := tc.c.LayerExperts(layer)
			if tc.e3 == ([3]string{}) {
				if experts != nil || tc.c.ExpertTensors(tc.block, 0) != nil {
					t.Errorf("dense block has experts %v", experts)
				}
				return
			}
			if len(experts) != tc.c.MoE.Experts {
				t.Fatalf("%d expert tables, want %d", len(experts), tc.c.MoE.Experts)
			}
			got := [3]string{experts[3][ExpertGate], experts[3][ExpertUp], experts[3][ExpertDown]}
			if got != tc.e3 {
				t.Errorf("expert 3: %q, want %q", got, tc.e3)
			}
			specs := tc.c.ExpertTensors(tc.block, 3)
			in := tc.c.MoE.ExpertSize
			if len(specs) != 3 || specs[0].Expert != 3 || !specs[0].Shape.Equal([]int{in, 64}) || !specs[2].Shape.Equal([]int{64, in}) {
				t.Errorf("ExpertTensors(%d, 3) = %+v", tc.block, specs)
			}
			if tc.c.ExpertTensors(tc.block, tc.c.MoE.Experts) != nil || tc.c.ExpertTensors(tc.block, -1) != nil {
				t.Error("ExpertTensors accepts an expert outside the block")
			}
		})
	}
	if n := qwen3.MLPSize(); n != 96 {
		t.Errorf("qwen3_moe with a dense block: MLPSize %d, want intermediate_size 96", n)
	}
	if n := qwen2.MLPSize(); n != 1408 {
		t.Errorf("qwen2_moe: MLPSize %d, want the experts' 1408", n)
	}
}
