package arch

import (
	"fmt"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// layoutConfigs are the tiny preset in the variants whose tensors differ.
func layoutConfigs(t *testing.T) map[string]*Config {
	t.Helper()
	tiny, err := Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	qwen := tiny.Clone()
	qwen.SetFamily(Qwen2)
	qwen.TieEmbeddings = true
	bias := tiny.Clone()
	bias.QKVBias, bias.OutBias = true, true
	gqa := tiny.Clone()
	gqa.NumHeads, gqa.NumKVHeads, gqa.HeadDim = 8, 2, 32 // q dim 256 != hidden 64
	qwen3 := tiny.Clone()
	qwen3.SetFamily(Qwen3)
	qwen3.HeadDim, qwen3.QKVBias, qwen3.OutBias = 32, true, true
	mixtral := tiny.Clone()
	mixtral.SetFamily(Mixtral)
	qwen3MoE := tiny.Clone()
	qwen3MoE.SetFamily(Qwen3MoE)
	qwen3MoE.MoE = &MoE{Experts: 6, ExpertsPerToken: 2, ExpertSize: 24, SparseStep: 2, DenseLayers: []int{3}}
	qwen2MoE := tiny.Clone()
	qwen2MoE.SetFamily(Qwen2MoE)
	qwen2MoE.MoE = &MoE{Experts: 4, ExpertsPerToken: 1, ExpertSize: 24, SharedExperts: 1, SharedSize: 40, SparseStep: 1}
	return map[string]*Config{"llama": tiny, "qwen2-tied": qwen, "llama-attention-bias": bias, "gqa-head-dim": gqa,
		"qwen3-bias": qwen3, "mixtral": mixtral, "qwen3-moe-step-2": qwen3MoE, "qwen2-moe-shared": qwen2MoE}
}

func TestBlockNames(t *testing.T) {
	c, _ := Preset("tiny")
	c.QKVBias, c.OutBias = true, true
	want := map[Role]string{
		AttnNorm: "model.layers.3.input_layernorm.weight",
		Q:        "model.layers.3.self_attn.q_proj.weight",
		QBias:    "model.layers.3.self_attn.q_proj.bias",
		K:        "model.layers.3.self_attn.k_proj.weight",
		KBias:    "model.layers.3.self_attn.k_proj.bias",
		V:        "model.layers.3.self_attn.v_proj.weight",
		VBias:    "model.layers.3.self_attn.v_proj.bias",
		O:        "model.layers.3.self_attn.o_proj.weight",
		OBias:    "model.layers.3.self_attn.o_proj.bias",
		MLPNorm:  "model.layers.3.post_attention_layernorm.weight",
		Gate:     "model.layers.3.mlp.gate_proj.weight",
		Up:       "model.layers.3.mlp.up_proj.weight",
		Down:     "model.layers.3.mlp.down_proj.weight",
	}
	n := c.LayerNames(c.BlockLayer(3))
	for r := Role(0); r < numRoles; r++ {
		if n[r] != want[r] {
			t.Errorf("block 3 %v: %q, want %q", r, n[r], want[r])
		}
	}
	c.QKVBias, c.OutBias = false, false
	n = c.LayerNames(c.BlockLayer(3))
	for _, r := range []Role{QBias, KBias, VBias, OBias} {
		if n[r] != "" {
			t.Errorf("without biases, %v is %q", r, n[r])
		}
	}
	if n := c.LayerNames(0); n[Embed] != EmbedName || n[Q] != "" {
		t.Errorf("embedding layer names %q", n)
	}
}

func TestLayers(t *testing.T) {
	for name, c := range layoutConfigs(t) {
		t.Run(name, func(t *testing.T) {
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			L := c.NumLayers
			if c.LayerCount() != L+2 || c.HeadLayer() != L+1 || c.BlockLayer(0) != 1 {
				t.Fatalf("LayerCount %d, HeadLayer %d, BlockLayer(0) %d for %d blocks", c.LayerCount(), c.HeadLayer(), c.BlockLayer(0), L)
			}
			for _, bad := range []int{-1, L + 2} {
				if _, _, ok := c.LayerKind(bad); ok || c.LayerTensors(bad) != nil {
					t.Errorf("layer %d is accepted", bad)
				}
			}
			stored := map[string]tensor.Shape{}
			for _, s := range c.ExpectedTensors() {
				if _, dup := stored[s.Name]; dup {
					t.Errorf("ExpectedTensors lists %s twice", s.Name)
				}
				stored[s.Name] = s.Shape
			}
			var params int64
			seen := map[string]bool{}
			for layer := range c.LayerCount() {
				kind, block, ok := c.LayerKind(layer)
				if !ok {
					t.Fatalf("layer %d: not a layer", layer)
				}
				specs := c.LayerTensors(layer)
				names := c.LayerNames(layer)
				experts := c.LayerExperts(layer)
				roles := map[Role]bool{}
				perExpert := map[[2]int]bool{}
				for _, s := range specs {
					if s.Role.IsExpert() {
						if k := [2]int{int(s.Role), s.Expert}; perExpert[k] {
							t.Errorf("layer %d has two %v tensors of expert %d", layer, s.Role, s.Expert)
						} else {
							perExpert[k] = true
						}
						if s.Expert >= len(experts) || experts[s.Expert][s.Role] != s.Name || names[s.Role] != "" {
							t.Errorf("layer %d: %s is not expert %d's %v in LayerExperts alone", layer, s.Name, s.Expert, s.Role)
						}
					} else if roles[s.Role] {
						t.Errorf("layer %d has two %v tensors", layer, s.Role)
					} else if names[s.Role] != s.Name {
						t.Errorf("layer %d: LayerNames[%v] = %q, LayerTensors says %q", layer, s.Role, names[s.Role], s.Name)
					}
					roles[s.Role] = true
					if want, ok := stored[s.Name]; !ok || !want.Equal(s.Shape) {
						t.Errorf("layer %d: %s %v is not stored with that shape (%v, %v)", layer, s.Name, s.Shape, want, ok)
					}
					if b, ok := BlockOf(s.Name); ok != (kind == Block) || ok && b != block {
						t.Errorf("layer %d (%v %d): BlockOf(%s) = %d, %v", layer, kind, block, s.Name, b, ok)
					}
					if !seen[s.Name] {
						params += s.Shape.NumElements()
					}
					seen[s.Name] = true
				}
				switch kind {
				case Embedding:
					if layer != 0 || len(specs) != 1 || specs[0].Role != Embed {
						t.Errorf("embedding layer %d: %v", layer, specs)
					}
				case Block:
					want := 9
					if c.QKVBias {
						want += 3
					}
					if c.OutBias {
						want++
					}
					if c.QKNorm {
						want += 2
					}
					if c.Sparse(block) {
						want += 1 - 3 + 3*c.MoE.Experts + 4*c.MoE.SharedExperts // router, experts, shared expert and its gate
						if len(experts) != c.MoE.Experts || len(perExpert) != 3*c.MoE.Experts || roles[Gate] || !roles[Router] {
							t.Errorf("sparse block %d: %d expert tables, %d expert tensors, roles %v", block, len(experts), len(perExpert), roles)
						}
					} else if experts != nil || roles[Router] || !roles[Gate] {
						t.Errorf("dense block %d: expert tables %v, roles %v", block, experts, roles)
					}
					if roles[QNorm] != c.QKNorm || roles[KNorm] != c.QKNorm {
						t.Errorf("block %d q/k norms %v, config says %v", block, roles, c.QKNorm)
					}
					if len(specs) != want || layer != c.BlockLayer(block) {
						t.Errorf("block %d (layer %d): %d tensors, want %d", block, layer, len(specs), want)
					}
					if roles[QBias] != c.QKVBias || roles[OBias] != c.OutBias {
						t.Errorf("block %d biases %v, config says q/k/v %v, o %v", block, roles, c.QKVBias, c.OutBias)
					}
				case Head:
					head := names[LMHead]
					if layer != c.HeadLayer() || names[FinalNorm] != NormName || (head == EmbedName) != c.TieEmbeddings || (head == LMHeadName) == c.TieEmbeddings {
						t.Errorf("head layer %d: %q (tied %v)", layer, names, c.TieEmbeddings)
					}
				}
			}
			if len(seen) != len(stored) || params != c.NumParams() {
				t.Errorf("the layers hold %d tensors, %d parameters; ExpectedTensors %d, NumParams %d", len(seen), params, len(stored), c.NumParams())
			}
		})
	}
}

func TestBlockOf(t *testing.T) {
	for _, tc := range []struct {
		name  string
		block int
		ok    bool
	}{
		{"model.layers.0.input_layernorm.weight", 0, true},
		{"model.layers.31.self_attn.rotary_emb.inv_freq", 31, true},
		{"model.layers.7", 7, true},
		{"model.layers.x.mlp.up_proj.weight", 0, false},
		{"model.layers.-1.mlp.up_proj.weight", 0, false},
		{"model.layers..mlp", 0, false},
		{EmbedName, 0, false},
		{NormName, 0, false},
		{"layers.3.mlp.up_proj.weight", 0, false},
	} {
		if b, ok := BlockOf(tc.name); b != tc.block || ok != tc.ok {
			t.Errorf("BlockOf(%q) = %d, %v; want %d, %v", tc.name, b, ok, tc.block, tc.ok)
		}
	}
}

func TestRoleAndKindNames(t *testing.T) {
	for r, want := range map[Role]string{Embed: "embed", Q: "q", OBias: "o_bias", LMHead: "lm_head", numRoles: fmt.Sprintf("Role(%d)", int(numRoles)), -1: "Role(-1)"} {
		if r.String() != want {
			t.Errorf("Role %d: %q, want %q", int(r), r, want)
		}
	}
	for k, want := range map[LayerKind]string{Embedding: "embedding", Block: "block", Head: "head", 7: "LayerKind(7)"} {
		if k.String() != want {
			t.Errorf("LayerKind %d: %q, want %q", int(k), k, want)
		}
	}
}
