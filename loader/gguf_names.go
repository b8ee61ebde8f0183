package loader

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/arch"
)

// llama.cpp's names for the tensors and metadata of Llama-family models,
// and the row order its converter gives the query and key projections.
// Nothing here reads a config: these are tables and pure functions for the
// code that maps a GGUF model onto strata's.
//
// Tensor names (GGUF on the left, Hugging Face on the right):
//
//	token_embd.weight            model.embed_tokens.weight
//	output_norm.weight           model.norm.weight
//	output.weight                lm_head.weight (absent when tied to token_embd)
//	blk.N.attn_norm.weight       model.layers.N.input_layernorm.weight
//	blk.N.attn_q.weight, .bias   model.layers.N.self_attn.q_proj.weight, .bias
//	blk.N.attn_k.weight, .bias   model.layers.N.self_attn.k_proj.weight, .bias
//	blk.N.attn_v.weight, .bias   model.layers.N.self_attn.v_proj.weight, .bias
//	blk.N.attn_output.weight     model.layers.N.self_attn.o_proj.weight
//	blk.N.attn_q_norm.weight     model.layers.N.self_attn.q_norm.weight (qwen3)
//	blk.N.attn_k_norm.weight     model.layers.N.self_attn.k_norm.weight (qwen3)
//	blk.N.ffn_norm.weight        model.layers.N.post_attention_layernorm.weight
//	blk.N.ffn_gate.weight        model.layers.N.mlp.gate_proj.weight
//	blk.N.ffn_up.weight          model.layers.N.mlp.up_proj.weight
//	blk.N.ffn_down.weight        model.layers.N.mlp.down_proj.weight
//	rope_freqs.weight            (none: llama3 rope scaling factors, F32 [head_dim/2])
//
// A GGUF tensor's dimensions are listed innermost first, so a linear
// weight Hugging Face stores as [out, in] has ggml dims [in, out]; the
// bytes are the same row-major matrix (GGUFTensor.Shape gives [out, in]).
//
// Metadata: general.architecture names the family ("llama" also for
// Mistral and Mixtral files, "qwen2", "qwen3"); the model's numbers are
// under that name, {arch}.KEY, listed in GGUFConfigKeys. The tokenizer is
// under tokenizer.ggml.*: model ("llama" for SentencePiece, "gpt2" for
// byte-level BPE), pre (the pre-tokenizer's name), tokens (strings), scores
// (float32), token_type (int32: 1 normal, 2 unknown, 3 control, 4 user
// defined, 5 unused, 6 byte), merges (strings "a b"), bos_token_id,
// eos_token_id, unknown_token_id, padding_token_id (uint32), add_bos_token,
// add_eos_token (bool); tokenizer.chat_template is the Jinja template.
//
// Query and key rows: for the "llama" architecture (and only it among the
// families strata runs) the converter reorders the rows of attn_q and
// attn_k (weights and biases) inside each head, from Hugging Face's layout
// (the rotary pairs are i and i+d/2, rotate_half) to interleaved pairs (2i,
// 2i+1), which llama.cpp's rope for llama expects: with d the head size,
// GGUF row h*d + 2i + s holds Hugging Face row h*d + s*d/2 + i (s is 0 or
// 1, i < d/2). attn_k uses the key-value head count. UnpermuteQK undoes
// it; qwen2 and qwen3 files are not permuted.

// GGUF names of the tensors outside the blocks.
const (
	GGUFEmbedName  = "token_embd.weight"
	GGUFNormName   = "output_norm.weight"
	GGUFOutputName = "output.weight"
)

// ggufBlockNames pairs the names inside blk.N. with those inside
// model.layers.N.
var ggufBlockNames = [][2]string{
	{"attn_norm.weight", "input_layernorm.weight"},
	{"attn_q.weight", "self_attn.q_proj.weight"},
	{"attn_q.bias", "self_attn.q_proj.bias"},
	{"attn_k.weight", "self_attn.k_proj.weight"},
	{"attn_k.bias", "self_attn.k_proj.bias"},
	{"attn_v.weight", "self_attn.v_proj.weight"},
	{"attn_v.bias", "self_attn.v_proj.bias"},
	{"attn_output.weight", "self_attn.o_proj.weight"},
	{"attn_output.bias", "self_attn.o_proj.bias"},
	{"attn_q_norm.weight", "self_attn.q_norm.weight"},
	{"attn_k_norm.weight", "self_attn.k_norm.weight"},
	{"ffn_norm.weight", "post_attention_layernorm.weight"},
	{"ffn_gate.weight", "mlp.gate_proj.weight"},
	{"ffn_up.weight", "mlp.up_proj.weight"},
	{"ffn_down.weight", "mlp.down_proj.weight"},
}

// GGUFConfigKeys pairs the metadata keys under {arch}. with the
// config.json fields they carry. rope.dimension_count is the number of
// rotated dimensions (the head size for these families); attention.key_length
// is written when the head size is not hidden/heads (qwen3); vocab_size may
// be absent (then it is the length of tokenizer.ggml.tokens);
// rope.scaling.* are written for rope_scaling (llama3's low/high frequency
// factors become the rope_freqs.weight tensor instead).
var GGUFConfigKeys = [][2]string{
	{"context_length", "max_position_embeddings"},
	{"embedding_length", "hidden_size"},
	{"block_count", "num_hidden_layers"},
	{"feed_forward_length", "intermediate_size"},
	{"attention.head_count", "num_attention_heads"},
	{"attention.head_count_kv", "num_key_value_heads"},
	{"attention.layer_norm_rms_epsilon", "rms_norm_eps"},
	{"attention.key_length", "head_dim"},
	{"attention.value_length", "head_dim"},
	{"rope.freq_base", "rope_theta"},
	{"rope.dimension_count", "head_dim"},
	{"rope.scaling.type", "rope_scaling.rope_type"},
	{"rope.scaling.factor", "rope_scaling.factor"},
	{"rope.scaling.original_context_length", "rope_scaling.original_max_position_embeddings"},
	{"vocab_size", "vocab_size"},
}

// GGUFPermutesQK reports whether llama.cpp's converter reorders the query
// and key rows for the architecture (general.architecture).
func GGUFPermutesQK(arch string) bool { return arch == "llama" }

// GGUFToHFName returns the Hugging Face name of a llama.cpp tensor name,
// or false for a name outside the table.
func GGUFToHFName(name string) (string, bool) {
	switch name {
	case GGUFEmbedName:
		return arch.EmbedName, true
	case GGUFNormName:
		return arch.NormName, true
	case GGUFOutputName:
		return arch.LMHeadName, true
	}
	rest, ok := strings.CutPrefix(name, "blk.")
	if !ok {
		return "", false
	}
	n, suffix, ok := cutLayer(rest)
	if !ok {
		return "", false
	}
	for _, p := range ggufBlockNames {
		if p[0] == suffix {
			return arch.BlockTensorName(n, p[1]), true
		}
	}
	return "", false
}

// HFToGGUFName returns the llama.cpp name of a Hugging Face tensor name,
// or false for a name outside the table.
func HFToGGUFName(name string) (string, bool) {
	switch name {
	case arch.EmbedName:
		return GGUFEmbedName, true
	case arch.NormName:
		return GGUFNormName, true
	case arch.LMHeadName:
		return GGUFOutputName, true
	}
	rest, ok := strings.CutPrefix(name, "model.layers.")
	if !ok {
		return "", false
	}
	n, suffix, ok := cutLayer(rest)
	if !ok {
		return "", false
	}
	for _, p := range ggufBlockNames {
		if p[1] == suffix {
			return fmt.Sprintf("blk.%d.%s", n, p[0]), true
		}
	}
	return "", false
}

// cutLayer splits "N.suffix" with N a canonical decimal layer number.
func cutLayer(s string) (int, string, bool) {
	num, suffix, ok := strings.Cut(s, ".")
	if !ok || num == "" || (len(num) > 1 && num[0] == '0') {
		return 0, "", false
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 {
		return 0, "", false
	}
	return n, suffix, true
}

// UnpermuteQK reorders the rows of a llama-architecture attn_q or attn_k
// tensor (or bias) from GGUF order back to Hugging Face order: src holds
// rows equal-sized rows of heads heads; dst receives them reordered. A row
// is moved whole, so src may be F32, F16 or quantized data (a GGUF row is
// whole blocks), and a bias is rows single-element rows. heads is the
// query head count for attn_q, the key-value head count for attn_k. dst
// and src must not overlap.
func UnpermuteQK(dst, src []byte, rows, heads int) error {
	return permuteRows(dst, src, rows, heads, false)
}

// PermuteQK is the converter's reordering, the inverse of UnpermuteQK: Hugging
// Face order to GGUF order, for writing llama-architecture GGUF files.
func PermuteQK(dst, src []byte, rows, heads int) error {
	return permuteRows(dst, src, rows, heads, true)
}

func permuteRows(dst, src []byte, rows, heads int, toGGUF bool) error {
	switch {
	case rows <= 0 || heads <= 0 || rows%heads != 0 || (rows/heads)%2 != 0:
		return fmt.Errorf("loader: permute q/k rows: %d rows are not %d heads of an even size", rows, heads)
	case len(src) != len(dst) || len(src)%rows != 0:
		return fmt.Errorf("loader: permute q/k rows: %d source and %d destination bytes are not %d equal rows", len(src), len(dst), rows)
	}
	rb := len(src) / rows
	d := rows / heads
	for h := range heads {
		for i := range d / 2 {
			for s := range 2 {
				g := h*d + 2*i + s   // row in GGUF order
				f := h*d + s*d/2 + i // the same row in Hugging Face order
				if toGGUF {
					g, f = f, g
				}
				copy(dst[f*rb:(f+1)*rb], src[g*rb:(g+1)*rb])
			}
		}
	}
	return nil
}

// llama.cpp's names for a mixture of experts inside blk.N.: the router
// [n_expert, hidden] and, per projection, the experts of the block stacked
// in one 3-D tensor of ggml dims [in, out, n_expert], each expert's matrix
// contiguous (expert E is the E-th n-th of the tensor's bytes):
//
//	blk.N.ffn_gate_inp.weight    the router (mlp.gate, block_sparse_moe.gate)
//	blk.N.ffn_gate_exps.weight   experts.E.gate_proj (Mixtral's w1)
//	blk.N.ffn_up_exps.weight     experts.E.up_proj (w3)
//	blk.N.ffn_down_exps.weight   experts.E.down_proj (w2)
//
// Metadata: {arch}.expert_count, {arch}.expert_used_count (top-k), and for
// qwen3moe {arch}.expert_feed_forward_length (moe_intermediate_size).
const (
	ggufRouterSuffix   = "ffn_gate_inp.weight"
	ggufGateExpsSuffix = "ffn_gate_exps.weight"
	ggufUpExpsSuffix   = "ffn_up_exps.weight"
	ggufDownExpsSuffix = "ffn_down_exps.weight"
)

// GGUFExpertName returns the llama.cpp name of a mixture of experts'
// tensor spec: the router's, or the stacked tensor holding a routed
// expert's projection (spec.Expert says which n-th of it); false for any
// other spec.
func GGUFExpertName(spec arch.Spec) (string, bool) {
	var suffix string
	switch spec.Role {
	case arch.Router:
		suffix = ggufRouterSuffix
	case arch.ExpertGate:
		suffix = ggufGateExpsSuffix
	case arch.ExpertUp:
		suffix = ggufUpExpsSuffix
	case arch.ExpertDown:
		suffix = ggufDownExpsSuffix
	default:
		return "", false
	}
	rest, ok := strings.CutPrefix(spec.Name, "model.layers.")
	if !ok {
		return "", false
	}
	n, _, ok := cutLayer(rest)
	if !ok {
		return "", false
	}
	return fmt.Sprintf("blk.%d.%s", n, suffix), true
}

// isGGUFStackedExperts reports whether a llama.cpp name is a stacked
// experts tensor (blk.N.ffn_*_exps.weight).
func isGGUFStackedExperts(name string) bool {
	rest, ok := strings.CutPrefix(name, "blk.")
	if !ok {
		return false
	}
	_, suffix, ok := cutLayer(rest)
	return ok && (suffix == ggufGateExpsSuffix || suffix == ggufUpExpsSuffix || suffix == ggufDownExpsSuffix)
}
