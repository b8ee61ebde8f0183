package arch

import (
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// Hugging Face names of the tensors outside the decoder blocks.
const (
	EmbedName  = "model.embed_tokens.weight"
	NormName   = "model.norm.weight"
	LMHeadName = "lm_head.weight"
)

// BlockTensorName returns the Hugging Face name of a tensor of decoder block
// i, e.g. BlockTensorName(3, "self_attn.q_proj.weight") is
// "model.layers.3.self_attn.q_proj.weight".
func BlockTensorName(i int, suffix string) string {
	return fmt.Sprintf("model.layers.%d.%s", i, suffix)
}

// TensorSpec is a tensor the architecture needs: its name and shape
// ([out_features, in_features] for linear weights).
type TensorSpec struct {
	Name  string
	Shape tensor.Shape
}

// blockSpecs lists the tensors of decoder block i in the order they are
// used.
func (c *Config) blockSpecs(i int) []TensorSpec {
	h, q, kv, in := c.HiddenSize, c.QDim(), c.KVDim(), c.IntermediateSize
	s := func(suffix string, shape ...int) TensorSpec {
		return TensorSpec{BlockTensorName(i, suffix), tensor.Shape(shape)}
	}
	specs := []TensorSpec{
		s("input_layernorm.weight", h),
		s("self_attn.q_proj.weight", q, h),
	}
	if c.QKVBias {
		specs = append(specs, s("self_attn.q_proj.bias", q))
	}
	specs = append(specs, s("self_attn.k_proj.weight", kv, h))
	if c.QKVBias {
		specs = append(specs, s("self_attn.k_proj.bias", kv))
	}
	specs = append(specs, s("self_attn.v_proj.weight", kv, h))
	if c.QKVBias {
		specs = append(specs, s("self_attn.v_proj.bias", kv))
	}
	specs = append(specs, s("self_attn.o_proj.weight", h, q))
	if c.OutBias {
		specs = append(specs, s("self_attn.o_proj.bias", h))
	}
	return append(specs,
		s("post_attention_layernorm.weight", h),
		s("mlp.gate_proj.weight", in, h),
		s("mlp.up_proj.weight", in, h),
		s("mlp.down_proj.weight", h, in),
	)
}

// LayerTensors lists the tensors layer `layer` holds, in the order
// the forward pass uses them: layer 0 is the embedding, layers 1..NumLayers
// the decoder blocks, layer NumLayers+1 the final norm and LM head (the
// embedding table in place of lm_head.weight when the embeddings are tied).
// It returns nil for a layer outside 0..NumLayers+1.
func (c *Config) LayerTensors(layer int) []TensorSpec {
	v, h := c.VocabSize, c.HiddenSize
	switch {
	case layer == 0:
		return []TensorSpec{{EmbedName, tensor.Shape{v, h}}}
	case layer >= 1 && layer <= c.NumLayers:
		return c.blockSpecs(layer - 1)
	case layer == c.NumLayers+1:
		head := TensorSpec{LMHeadName, tensor.Shape{v, h}}
		if c.TieEmbeddings {
			head.Name = EmbedName
		}
		return []TensorSpec{{NormName, tensor.Shape{h}}, head}
	}
	return nil
}

// ExpectedTensors lists every tensor the architecture stores, each once, in
// file order: embedding, blocks, final norm, then lm_head.weight unless the
// embeddings are tied.
func (c *Config) ExpectedTensors() []TensorSpec {
	specs := []TensorSpec{{EmbedName, tensor.Shape{c.VocabSize, c.HiddenSize}}}
	for i := range c.NumLayers {
		specs = append(specs, c.blockSpecs(i)...)
	}
	specs = append(specs, TensorSpec{NormName, tensor.Shape{c.HiddenSize}})
	if !c.TieEmbeddings {
		specs = append(specs, TensorSpec{LMHeadName, tensor.Shape{c.VocabSize, c.HiddenSize}})
	}
	return specs
}
