package arch_test

import (
	"fmt"
	"log"

	"github.com/strata-llm/strata/arch"
)

func ExampleParseConfig() {
	cfg, err := arch.ParseConfig([]byte(`{
		"architectures": ["Qwen2ForCausalLM"],
		"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
		"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
		"tie_word_embeddings": true
	}`))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(cfg.Family, cfg.Family.Architecture(), cfg.LayerCount(), "layers, q/k/v biases:", cfg.QKVBias)
	for _, s := range cfg.LayerTensors(cfg.BlockLayer(0))[:3] {
		fmt.Println(s.Role, s.Name, s.Shape)
	}
	head := cfg.LayerNames(cfg.HeadLayer())
	fmt.Println("lm head:", head[arch.LMHead])
	// Output:
	// qwen2 Qwen2ForCausalLM 4 layers, q/k/v biases: true
	// attn_norm model.layers.0.input_layernorm.weight [64]
	// q model.layers.0.self_attn.q_proj.weight [64, 64]
	// q_bias model.layers.0.self_attn.q_proj.bias [64]
	// lm head: model.embed_tokens.weight
}

func ExampleParseConfig_error() {
	_, err := arch.ParseConfig([]byte(`{"model_type": "gpt2"}`))
	fmt.Println(err)
	// Output:
	// arch: config: unsupported model_type "gpt2" (supported: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe)
}
