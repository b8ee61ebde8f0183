package arch

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/tensor"
)

// Hugging Face names of the tensors outside the decoder blocks.
const (
	EmbedName  = "model.embed_tokens.weight"
	NormName   = "model.norm.weight"
	LMHeadName = "lm_head.weight"
)

// blockPrefix begins the name of every tensor of a decoder block:
// "model.layers.3.self_attn.q_proj.weight" belongs to block 3.
const blockPrefix = "model.layers."

// BlockTensorName returns the Hugging Face name of a tensor of decoder block
// i, e.g. BlockTensorName(3, "self_attn.q_proj.weight") is
// "model.layers.3.self_attn.q_proj.weight".
func BlockTensorName(i int, suffix string) string {
	return blockPrefix + strconv.Itoa(i) + "." + suffix
}

// Role says what a tensor does in the model.
type Role int

// The roles of every family. A block with a mixture of experts holds
// Router and the experts' roles in place of Gate, Up and Down.
const (
	Embed     Role = iota // token embedding table [vocab, hidden]
	AttnNorm              // RMS norm weight before attention [hidden]
	Q                     // query projection [q dim, hidden]
	QBias                 // [q dim]
	K                     // key projection [kv dim, hidden]
	KBias                 // [kv dim]
	V                     // value projection [kv dim, hidden]
	VBias                 // [kv dim]
	O                     // attention output projection [hidden, q dim]
	OBias                 // [hidden]
	MLPNorm               // RMS norm weight before the MLP [hidden]
	Gate                  // [intermediate, hidden]
	Up                    // [intermediate, hidden]
	Down                  // [hidden, intermediate]
	FinalNorm             // RMS norm weight after the last block [hidden]
	LMHead                // [vocab, hidden]; the embedding table when tied
)

// The roles of the q/k norms and of the mixtures of experts. A sparse
// block holds one tensor of each expert role per routed expert
// (Role.IsExpert, Spec.Expert).
const (
	QNorm       Role = LMHead + 1 + iota // RMS norm weight of each query head [head dim] (Qwen3)
	KNorm                                // RMS norm weight of each key head [head dim]
	Router                               // scores of the routed experts [experts, hidden]
	ExpertGate                           // one routed expert's gate projection [expert size, hidden]
	ExpertUp                             // [expert size, hidden]
	ExpertDown                           // [hidden, expert size]
	SharedGate                           // the shared expert's gate projection [shared size, hidden]
	SharedUp                             // [shared size, hidden]
	SharedDown                           // [hidden, shared size]
	SharedScale                          // the shared expert's gate [1, hidden]: its output is scaled by sigmoid(h·w)
	numRoles
)

var roleNames = [numRoles]string{
	"embed", "attn_norm", "q", "q_bias", "k", "k_bias", "v", "v_bias", "o", "o_bias",
	"mlp_norm", "gate", "up", "down", "final_norm", "lm_head",
	"q_norm", "k_norm", "router", "expert_gate", "expert_up", "expert_down",
	"shared_gate", "shared_up", "shared_down", "shared_scale",
}

// String returns the role's name: "q", "attn_norm", "lm_head".
func (r Role) String() string {
	if r >= 0 && r < numRoles {
		return roleNames[r]
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// Spec is a tensor the architecture needs: its name, its role and its
// shape ([out_features, in_features] for linear weights), and for the
// roles of a routed expert (Role.IsExpert) the expert it belongs to.
type Spec struct {
	Name   string
	Role   Role
	Shape  tensor.Shape
	Expert int // the routed expert, 0..MoE.Experts-1, for an expert role; 0 otherwise
}

// Names is a layer's name table: the tensor name of each role, "" for a
// role the layer does not hold. Index it with a Role. The experts' roles
// are in the tables of LayerExperts, one per expert.
type Names [numRoles]string

// LayerKind says what a layer holds.
type LayerKind int

// The kinds of layers, in model order.
const (
	Embedding LayerKind = iota // the token embedding table
	Block                      // one decoder block
	Head                       // final norm and LM head
)

// String returns "embedding", "block" or "head".
func (k LayerKind) String() string {
	switch k {
	case Embedding:
		return "embedding"
	case Block:
		return "block"
	case Head:
		return "head"
	}
	return fmt.Sprintf("LayerKind(%d)", int(k))
}

// LayerCount is the number of layers, NumLayers+2. Layers are the units
// the runtime loads, pages and places on devices, numbered in model order:
// layer 0 is the embedding, layers 1..NumLayers the decoder blocks (block i
// is layer i+1), layer NumLayers+1 the final norm and LM head. With tied
// embeddings the head layer holds the embedding table as its LM head, so
// that tensor is in two layers.
func (c *Config) LayerCount() int { return c.NumLayers + 2 }

// EmbedLayer is the layer holding the embedding table: 0.
func (c *Config) EmbedLayer() int { return 0 }

// BlockLayer is the layer holding decoder block i.
func (c *Config) BlockLayer(i int) int { return i + 1 }

// HeadLayer is the layer holding the final norm and the LM head.
func (c *Config) HeadLayer() int { return c.NumLayers + 1 }

// LayerKind says what layer holds, and for a decoder block its number (-1
// otherwise). ok is false for a layer outside 0..NumLayers+1.
func (c *Config) LayerKind(layer int) (kind LayerKind, block int, ok bool) {
	switch {
	case layer == 0:
		return Embedding, -1, true
	case layer >= 1 && layer <= c.NumLayers:
		return Block, layer - 1, true
	case layer == c.NumLayers+1:
		return Head, -1, true
	}
	return 0, -1, false
}

// BlockTensors lists the tensors of decoder block i in the order the
// forward pass uses them.
func (c *Config) BlockTensors(i int) []Spec {
	h, q, kv := c.HiddenSize, c.QDim(), c.KVDim()
	s := func(suffix string, r Role, shape ...int) Spec {
		return Spec{Name: BlockTensorName(i, suffix), Role: r, Shape: tensor.Shape(shape)}
	}
	specs := []Spec{
		s("input_layernorm.weight", AttnNorm, h),
		s("self_attn.q_proj.weight", Q, q, h),
	}
	if c.QKVBias {
		specs = append(specs, s("self_attn.q_proj.bias", QBias, q))
	}
	if c.QKNorm {
		specs = append(specs, s("self_attn.q_norm.weight", QNorm, c.HeadDim))
	}
	specs = append(specs, s("self_attn.k_proj.weight", K, kv, h))
	if c.QKVBias {
		specs = append(specs, s("self_attn.k_proj.bias", KBias, kv))
	}
	if c.QKNorm {
		specs = append(specs, s("self_attn.k_norm.weight", KNorm, c.HeadDim))
	}
	specs = append(specs, s("self_attn.v_proj.weight", V, kv, h))
	if c.QKVBias {
		specs = append(specs, s("self_attn.v_proj.bias", VBias, kv))
	}
	specs = append(specs, s("self_attn.o_proj.weight", O, h, q))
	if c.OutBias {
		specs = append(specs, s("self_attn.o_proj.bias", OBias, h))
	}
	specs = append(specs, s("post_attention_layernorm.weight", MLPNorm, h))
	return append(specs, c.mlpTensors(i)...)
}

// LayerTensors lists the tensors layer `layer` holds, in the order the
// forward pass uses them (see LayerCount for the numbering). It returns nil
// for a layer outside 0..NumLayers+1.
func (c *Config) LayerTensors(layer int) []Spec {
	v, h := c.VocabSize, c.HiddenSize
	kind, block, ok := c.LayerKind(layer)
	switch {
	case !ok:
		return nil
	case kind == Embedding:
		return []Spec{{Name: EmbedName, Role: Embed, Shape: tensor.Shape{v, h}}}
	case kind == Block:
		return c.BlockTensors(block)
	}
	head := Spec{Name: LMHeadName, Role: LMHead, Shape: tensor.Shape{v, h}}
	if c.TieEmbeddings {
		head.Name = EmbedName
	}
	return []Spec{{Name: NormName, Role: FinalNorm, Shape: tensor.Shape{h}}, head}
}

// LayerNames returns the name table of layer `layer`: what LayerTensors
// lists, by role, but for the routed experts' tensors (see LayerExperts).
// The forward pass looks its weights up through it.
func (c *Config) LayerNames(layer int) Names {
	var n Names
	for _, s := range c.LayerTensors(layer) {
		if !s.Role.IsExpert() {
			n[s.Role] = s.Name
		}
	}
	return n
}

// ExpectedTensors lists every tensor the architecture stores, each once, in
// file order: embedding, blocks, final norm, then lm_head.weight unless the
// embeddings are tied.
func (c *Config) ExpectedTensors() []Spec {
	specs := []Spec{{Name: EmbedName, Role: Embed, Shape: tensor.Shape{c.VocabSize, c.HiddenSize}}}
	for i := range c.NumLayers {
		specs = append(specs, c.BlockTensors(i)...)
	}
	specs = append(specs, Spec{Name: NormName, Role: FinalNorm, Shape: tensor.Shape{c.HiddenSize}})
	if !c.TieEmbeddings {
		specs = append(specs, Spec{Name: LMHeadName, Role: LMHead, Shape: tensor.Shape{c.VocabSize, c.HiddenSize}})
	}
	return specs
}

// BlockOf returns the decoder block a tensor name belongs to, for a name of
// the form model.layers.N.*, whether or not the architecture needs it.
func BlockOf(name string) (block int, ok bool) {
	rest, ok := strings.CutPrefix(name, blockPrefix)
	if !ok {
		return 0, false
	}
	num, _, _ := strings.Cut(rest, ".")
	i, err := strconv.Atoi(num)
	if err != nil || i < 0 {
		return 0, false
	}
	return i, true
}
