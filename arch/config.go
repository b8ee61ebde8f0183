package arch

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/tensor"
)

// Config is the part of a Hugging Face config.json that strata needs to run
// a Llama-family decoder. ParseConfig fills it from the JSON, applying the
// defaults transformers applies; MarshalJSON writes it back.
type Config struct {
	// Family is the model family: Family.Architecture() is the config's
	// architectures[0], Family.String() its model_type.
	Family Family

	HiddenSize       int
	IntermediateSize int
	NumLayers        int // num_hidden_layers
	NumHeads         int // num_attention_heads
	NumKVHeads       int // num_key_value_heads; defaults to NumHeads
	HeadDim          int // defaults to HiddenSize/NumHeads
	VocabSize        int

	RMSNormEps  float64      // rms_norm_eps; the kernels take it as NormEps()
	RopeTheta   float64      // rope_theta
	RopeScaling *RopeScaling // nil when none or "default"

	// TieEmbeddings (tie_word_embeddings) is true when the LM head is the
	// embedding table: the model stores no lm_head.weight.
	TieEmbeddings bool
	// QKVBias is true when q_proj, k_proj and v_proj have biases: always
	// for Qwen2, for Llama when attention_bias is set, never for Mistral.
	QKVBias bool
	// OutBias is true when o_proj has a bias too: Llama with
	// attention_bias set. Qwen2 and Mistral never have one.
	OutBias bool

	MaxPositions int // max_position_embeddings
	// SlidingWindow is Mistral's attention window in positions; 0 means
	// full causal attention.
	SlidingWindow int

	BOS int   // bos_token_id; -1 when absent
	EOS []int // eos_token_id: none, one or several

	DType tensor.DType // stored dtype named by the config (F32 if absent)

	// QKNorm is true when each head's queries and keys pass through an
	// RMS norm over the head (q_norm, k_norm of [HeadDim]) before the
	// rotary embedding: always for Qwen3 and Qwen3-MoE, never otherwise.
	QKNorm bool
	// MoE describes the mixture-of-experts MLP of Mixtral, Qwen2-MoE and
	// Qwen3-MoE; nil for a dense model.
	MoE *MoE
}

// MoE is the shape of a mixture-of-experts MLP. In a sparse block a router
// [Experts, hidden] scores the experts of each token; the token goes
// through the ExpertsPerToken best, weighted by their softmax over all the
// experts (renormalised over the chosen ones when NormTopK), and through
// the shared expert, if any, weighted by a sigmoid gate. Block i is sparse
// when i+1 is a multiple of SparseStep and i is not in DenseLayers; the
// others have a dense MLP of IntermediateSize.
type MoE struct {
	Experts         int // routed experts in a sparse block (num_experts, num_local_experts)
	ExpertsPerToken int // experts each token is routed to (num_experts_per_tok)
	// ExpertSize is the intermediate size of one routed expert
	// (moe_intermediate_size; Mixtral's intermediate_size).
	ExpertSize int
	// SharedExperts is 1 when every token also passes through a shared
	// expert of intermediate size SharedSize (Qwen2-MoE's shared_expert
	// and shared_expert_intermediate_size), 0 for none.
	SharedExperts int
	SharedSize    int
	SparseStep    int   // every SparseStep-th block is sparse (decoder_sparse_step); 1 for all
	DenseLayers   []int // blocks with a dense MLP whatever SparseStep says (mlp_only_layers), ascending
	NormTopK      bool  // the chosen experts' weights are renormalised to sum to 1 (norm_topk_prob)
	// Synthetic, when set, replaces the router's choice of experts by a
	// synthetic one (see SyntheticRouting); nil for a real model.
	Synthetic *SyntheticRouting
}

// RopeScaling describes a rescaling of the rotary embedding's frequencies.
// The only type strata supports is "llama3".
type RopeScaling struct {
	Type                 string // "llama3"
	Factor               float64
	LowFreqFactor        float64
	HighFreqFactor       float64
	OriginalMaxPositions int
}

// ropeJSON is both spellings of the rotary settings: transformers 5's
// rope_parameters and the older rope_scaling.
type ropeJSON struct {
	RopeTheta                     *float64 `json:"rope_theta,omitempty"`
	RopeType                      string   `json:"rope_type,omitempty"`
	Type                          string   `json:"type,omitempty"`
	Factor                        *float64 `json:"factor,omitempty"`
	LowFreqFactor                 *float64 `json:"low_freq_factor,omitempty"`
	HighFreqFactor                *float64 `json:"high_freq_factor,omitempty"`
	OriginalMaxPositionEmbeddings *int     `json:"original_max_position_embeddings,omitempty"`
}

type configJSON struct {
	Architectures         []string        `json:"architectures"`
	ModelType             string          `json:"model_type"`
	HiddenSize            *int            `json:"hidden_size"`
	IntermediateSize      *int            `json:"intermediate_size"`
	NumHiddenLayers       *int            `json:"num_hidden_layers"`
	NumAttentionHeads     *int            `json:"num_attention_heads"`
	NumKeyValueHeads      *int            `json:"num_key_value_heads"`
	HeadDim               *int            `json:"head_dim"`
	VocabSize             *int            `json:"vocab_size"`
	RMSNormEps            *float64        `json:"rms_norm_eps"`
	RopeTheta             *float64        `json:"rope_theta"`
	RopeParameters        *ropeJSON       `json:"rope_parameters"`
	RopeScaling           *ropeJSON       `json:"rope_scaling"`
	TieWordEmbeddings     *bool           `json:"tie_word_embeddings"`
	AttentionBias         *bool           `json:"attention_bias"`
	MLPBias               *bool           `json:"mlp_bias"`
	HiddenAct             *string         `json:"hidden_act"`
	MaxPositionEmbeddings *int            `json:"max_position_embeddings"`
	SlidingWindow         *int            `json:"sliding_window"`
	UseSlidingWindow      *bool           `json:"use_sliding_window"`
	BOSTokenID            json.RawMessage `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
	TorchDType            *string         `json:"torch_dtype"`
	DType                 *string         `json:"dtype"`
}

// ParseConfig parses a Hugging Face config.json, applies the defaults of the
// architecture's transformers config class, and validates the result.
func ParseConfig(data []byte) (*Config, error) {
	var j configJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return nil, cfgErr("bad JSON: %v", err)
	}
	c := &Config{BOS: -1}

	// The family, from the architecture or else the model type.
	switch {
	case len(j.Architectures) > 0:
		f, ok := familyOf(j.Architectures[0])
		if !ok {
			return nil, cfgErr("unsupported architecture %q (supported: the classes of %s)", j.Architectures[0], modelTypes())
		}
		c.Family = f
	case j.ModelType != "":
		f, err := ParseFamily(j.ModelType)
		if err != nil {
			return nil, cfgErr("unsupported model_type %q (supported: %s)", j.ModelType, modelTypes())
		}
		c.Family = f
	default:
		return nil, cfgErr("no architectures or model_type")
	}
	if j.ModelType != "" && j.ModelType != c.Family.String() {
		return nil, cfgErr("architecture %s does not match model_type %q", c.Family.Architecture(), j.ModelType)
	}
	q, _ := c.Family.quirks()

	// Sizes that have no sensible default.
	required := []struct {
		name string
		p    *int
		dst  *int
	}{
		{"hidden_size", j.HiddenSize, &c.HiddenSize},
		{"intermediate_size", j.IntermediateSize, &c.IntermediateSize},
		{"num_hidden_layers", j.NumHiddenLayers, &c.NumLayers},
		{"num_attention_heads", j.NumAttentionHeads, &c.NumHeads},
		{"vocab_size", j.VocabSize, &c.VocabSize},
	}
	for _, r := range required {
		if r.p == nil {
			return nil, cfgErr("missing %s", r.name)
		}
		*r.dst = *r.p
	}
	c.NumKVHeads = c.NumHeads
	if q.kvHeads > 0 {
		c.NumKVHeads = q.kvHeads
	}
	if j.NumKeyValueHeads != nil {
		c.NumKVHeads = *j.NumKeyValueHeads
	}
	if j.HeadDim != nil {
		c.HeadDim = *j.HeadDim
	} else if q.headDim > 0 {
		c.HeadDim = q.headDim
	} else if c.NumHeads > 0 {
		if c.HiddenSize%c.NumHeads != 0 {
			return nil, cfgErr("hidden_size %d is not a multiple of num_attention_heads %d and head_dim is not given", c.HiddenSize, c.NumHeads)
		}
		c.HeadDim = c.HiddenSize / c.NumHeads
	}

	// Defaults of the family's transformers config class (LlamaConfig,
	// MistralConfig, Qwen2Config...).
	c.RMSNormEps = 1e-6
	if q.normEps > 0 {
		c.RMSNormEps = q.normEps
	}
	if j.RMSNormEps != nil {
		c.RMSNormEps = *j.RMSNormEps
	}
	c.MaxPositions = q.maxPositions
	if j.MaxPositionEmbeddings != nil {
		c.MaxPositions = *j.MaxPositionEmbeddings
	}
	if j.TieWordEmbeddings != nil {
		c.TieEmbeddings = *j.TieWordEmbeddings
	}
	if j.MLPBias != nil && *j.MLPBias {
		return nil, cfgErr("mlp_bias=true is not supported")
	}
	if j.HiddenAct != nil && *j.HiddenAct != "silu" {
		return nil, cfgErr("hidden_act %q is not supported (want silu)", *j.HiddenAct)
	}
	flag := j.AttentionBias != nil && *j.AttentionBias
	c.QKVBias = q.qkvBias == biasAlways || q.qkvBias == biasFlag && flag
	c.OutBias = q.outBias == biasAlways || q.outBias == biasFlag && flag
	c.QKNorm = q.qkNorm
	if err := parseFamilyFields(data, c, q); err != nil {
		return nil, err
	}
	switch q.window {
	case windowAlways:
		if j.SlidingWindow != nil {
			c.SlidingWindow = *j.SlidingWindow
		}
	case windowFlag:
		if j.UseSlidingWindow != nil && *j.UseSlidingWindow {
			return nil, cfgErr("%v use_sliding_window=true is not supported", c.Family)
		}
	}

	// Rotary embedding: rope_parameters (transformers 5) wins over the
	// older top-level rope_theta and rope_scaling.
	c.RopeTheta = 10000
	if q.ropeTheta > 0 {
		c.RopeTheta = q.ropeTheta
	}
	if j.RopeTheta != nil {
		c.RopeTheta = *j.RopeTheta
	}
	rope := j.RopeScaling
	if j.RopeParameters != nil {
		if j.RopeParameters.RopeTheta != nil {
			c.RopeTheta = *j.RopeParameters.RopeTheta
		}
		rope = j.RopeParameters
	}
	if rope != nil {
		rs, err := parseRope(rope)
		if err != nil {
			return nil, err
		}
		c.RopeScaling = rs
	}

	// Special tokens.
	if len(j.BOSTokenID) > 0 && string(j.BOSTokenID) != "null" {
		ids, err := parseTokenIDs(j.BOSTokenID)
		if err != nil || len(ids) != 1 {
			return nil, cfgErr("bos_token_id %s is not one token id", oneline.JSON(j.BOSTokenID))
		}
		c.BOS = ids[0]
	}
	if len(j.EOSTokenID) > 0 && string(j.EOSTokenID) != "null" {
		ids, err := parseTokenIDs(j.EOSTokenID)
		if err != nil {
			return nil, cfgErr("eos_token_id %s is neither a token id nor a list of them", oneline.JSON(j.EOSTokenID))
		}
		c.EOS = ids
	}

	// Stored dtype: transformers 5 writes dtype, older versions torch_dtype.
	c.DType = tensor.F32
	for _, s := range []*string{j.DType, j.TorchDType} {
		if s != nil && *s != "" {
			dt, err := tensor.ParseDType(*s)
			if err != nil || !dt.IsFloat() {
				return nil, cfgErr("unsupported dtype %q", *s)
			}
			c.DType = dt
			break
		}
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

func parseRope(r *ropeJSON) (*RopeScaling, error) {
	typ := r.RopeType
	if typ == "" {
		typ = r.Type
	}
	switch typ {
	case "", "default":
		return nil, nil
	case "llama3":
	default:
		return nil, cfgErr("rope type %q is not supported (supported: default, llama3)", typ)
	}
	rs := &RopeScaling{Type: typ}
	missing := func(name string) error {
		return cfgErr("rope type %s needs %s", typ, name)
	}
	if r.Factor == nil {
		return nil, missing("factor")
	}
	if r.LowFreqFactor == nil {
		return nil, missing("low_freq_factor")
	}
	if r.HighFreqFactor == nil {
		return nil, missing("high_freq_factor")
	}
	if r.OriginalMaxPositionEmbeddings == nil {
		return nil, missing("original_max_position_embeddings")
	}
	rs.Factor, rs.LowFreqFactor, rs.HighFreqFactor = *r.Factor, *r.LowFreqFactor, *r.HighFreqFactor
	rs.OriginalMaxPositions = *r.OriginalMaxPositionEmbeddings
	return rs, nil
}

// parseTokenIDs accepts an integer or a list of integers.
func parseTokenIDs(raw json.RawMessage) ([]int, error) {
	var one int
	if err := json.Unmarshal(raw, &one); err == nil {
		return []int{one}, nil
	}
	var many []int
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, err
	}
	return many, nil
}

// Validate reports a configuration strata cannot run or write: an
// unsupported family or one its quirks rule out (a bias or a sliding
// window it does not have), non-positive sizes, heads that do not divide,
// an odd head dimension, bad rotary or norm settings, token ids outside the
// vocabulary, or a non-float dtype.
func (c *Config) Validate() error {
	if err := c.validateFamily(); err != nil {
		return err
	}
	sizes := []struct {
		name string
		v    int
	}{
		{"hidden_size", c.HiddenSize}, {"intermediate_size", c.IntermediateSize},
		{"num_hidden_layers", c.NumLayers}, {"num_attention_heads", c.NumHeads},
		{"num_key_value_heads", c.NumKVHeads}, {"head_dim", c.HeadDim},
		{"vocab_size", c.VocabSize}, {"max_position_embeddings", c.MaxPositions},
	}
	for _, s := range sizes {
		if s.v <= 0 {
			return cfgErr("%s must be positive, got %d", s.name, s.v)
		}
		if s.v > 1<<24 {
			return cfgErr("%s %d is implausibly large", s.name, s.v)
		}
	}
	if c.NumHeads%c.NumKVHeads != 0 {
		return cfgErr("num_attention_heads %d is not a multiple of num_key_value_heads %d", c.NumHeads, c.NumKVHeads)
	}
	if c.HeadDim%2 != 0 {
		return cfgErr("head_dim %d must be even for the rotary embedding", c.HeadDim)
	}
	if !(c.RMSNormEps > 0) || math.IsInf(c.RMSNormEps, 0) {
		return cfgErr("rms_norm_eps %v must be positive", c.RMSNormEps)
	}
	if !(c.RopeTheta > 0) || math.IsInf(c.RopeTheta, 0) {
		return cfgErr("rope_theta %v must be positive", c.RopeTheta)
	}
	if s := c.RopeScaling; s != nil {
		if s.Type != "llama3" {
			return cfgErr("rope type %q is not supported (supported: default, llama3)", s.Type)
		}
		if !(s.Factor > 0) || !(s.LowFreqFactor > 0) || !(s.HighFreqFactor > s.LowFreqFactor) || s.OriginalMaxPositions <= 0 {
			return cfgErr("bad llama3 rope scaling (factor %v, low_freq_factor %v, high_freq_factor %v, original_max_position_embeddings %d)",
				s.Factor, s.LowFreqFactor, s.HighFreqFactor, s.OriginalMaxPositions)
		}
	}
	if c.SlidingWindow < 0 {
		return cfgErr("sliding_window %d must not be negative", c.SlidingWindow)
	}
	if c.BOS < -1 || c.BOS >= c.VocabSize {
		return cfgErr("bos_token_id %d outside the vocabulary of %d", c.BOS, c.VocabSize)
	}
	for _, id := range c.EOS {
		if id < 0 || id >= c.VocabSize {
			return cfgErr("eos_token_id %d outside the vocabulary of %d", id, c.VocabSize)
		}
	}
	if !c.DType.IsFloat() {
		return cfgErr("dtype %v is not a float type", c.DType)
	}
	return nil
}

// ContextLength is the most positions a session or a training window may
// span: the smaller of MaxPositions and SlidingWindow (strata does not
// implement sliding attention, so it runs only contexts within the window),
// each when set; 0 when neither is.
func (c *Config) ContextLength() int {
	n := c.MaxPositions
	if w := c.SlidingWindow; w > 0 && (n == 0 || w < n) {
		n = w
	}
	return n
}

// NormEps is RMSNormEps in the float32 the norm kernels take.
func (c *Config) NormEps() float32 { return float32(c.RMSNormEps) }

// QDim is the width of the query projection, NumHeads*HeadDim.
func (c *Config) QDim() int { return c.NumHeads * c.HeadDim }

// KVDim is the width of each of the key and value projections,
// NumKVHeads*HeadDim.
func (c *Config) KVDim() int { return c.NumKVHeads * c.HeadDim }

// NumParams is the number of weights the model stores (the embedding counted
// once when the LM head is tied to it).
func (c *Config) NumParams() int64 {
	var n int64
	for _, s := range c.ExpectedTensors() {
		n += s.Shape.NumElements()
	}
	return n
}

// MarshalJSON writes the config as a Hugging Face config.json that
// transformers 4 and 5 both load: rope_parameters for transformers 5, and
// the top-level rope_theta (and rope_scaling when set) for older versions.
func (c *Config) MarshalJSON() ([]byte, error) {
	type kv struct {
		k string
		v any
	}
	dtypeName := map[tensor.DType]string{tensor.F32: "float32", tensor.F16: "float16", tensor.BF16: "bfloat16"}[c.DType]
	if dtypeName == "" {
		return nil, cfgErr("dtype %v is not a float type", c.DType)
	}
	rope := map[string]any{"rope_theta": jsonFloat(c.RopeTheta), "rope_type": "default"}
	var scaling map[string]any
	if s := c.RopeScaling; s != nil {
		scaling = map[string]any{
			"rope_type":                        s.Type,
			"factor":                           jsonFloat(s.Factor),
			"low_freq_factor":                  jsonFloat(s.LowFreqFactor),
			"high_freq_factor":                 jsonFloat(s.HighFreqFactor),
			"original_max_position_embeddings": s.OriginalMaxPositions,
		}
		for k, v := range scaling {
			rope[k] = v
		}
	}
	var bos any
	if c.BOS >= 0 {
		bos = c.BOS
	}
	var eos any
	switch len(c.EOS) {
	case 0:
	case 1:
		eos = c.EOS[0]
	default:
		eos = c.EOS
	}
	fields := []kv{
		{"architectures", []string{c.Family.Architecture()}},
		{"model_type", c.Family.String()},
		{"hidden_size", c.HiddenSize},
		{"intermediate_size", c.IntermediateSize},
		{"num_hidden_layers", c.NumLayers},
		{"num_attention_heads", c.NumHeads},
		{"num_key_value_heads", c.NumKVHeads},
		{"head_dim", c.HeadDim},
		{"hidden_act", "silu"},
		{"vocab_size", c.VocabSize},
		{"max_position_embeddings", c.MaxPositions},
		{"rms_norm_eps", jsonFloat(c.RMSNormEps)},
		{"rope_theta", jsonFloat(c.RopeTheta)},
		{"rope_parameters", rope},
	}
	if scaling != nil {
		fields = append(fields, kv{"rope_scaling", scaling})
	}
	fields = append(fields,
		kv{"tie_word_embeddings", c.TieEmbeddings},
		kv{"attention_dropout", jsonFloat(0)},
		kv{"initializer_range", jsonFloat(0.02)},
		kv{"use_cache", true},
		kv{"bos_token_id", bos},
		kv{"eos_token_id", eos},
		kv{"dtype", dtypeName},
		kv{"torch_dtype", dtypeName},
	)
	switch c.Family {
	case Llama:
		fields = append(fields, kv{"attention_bias", c.QKVBias}, kv{"mlp_bias", false}, kv{"pretraining_tp", 1})
	case Mistral:
		var sw any
		if c.SlidingWindow > 0 {
			sw = c.SlidingWindow
		}
		fields = append(fields, kv{"sliding_window", sw})
	case Qwen2:
		fields = append(fields, kv{"use_sliding_window", false}, kv{"sliding_window", nil}, kv{"max_window_layers", c.NumLayers})
	default:
		for _, f := range c.familyJSON() {
			fields = append(fields, kv(f))
		}
	}
	var b bytes.Buffer
	b.WriteString("{\n")
	for i, f := range fields {
		v, err := json.Marshal(f.v)
		if err != nil {
			return nil, cfgErr("%s: %v", f.k, err)
		}
		fmt.Fprintf(&b, "  %q: %s", f.k, v)
		if i < len(fields)-1 {
			b.WriteByte(',')
		}
		b.WriteByte('\n')
	}
	b.WriteString("}\n")
	return b.Bytes(), nil
}

// Clone returns a deep copy of c.
func (c *Config) Clone() *Config {
	d := *c
	if c.RopeScaling != nil {
		rs := *c.RopeScaling
		d.RopeScaling = &rs
	}
	d.EOS = slices.Clone(c.EOS)
	if c.MoE != nil {
		moe := *c.MoE
		moe.DenseLayers = slices.Clone(c.MoE.DenseLayers)
		if c.MoE.Synthetic != nil {
			syn := *c.MoE.Synthetic
			moe.Synthetic = &syn
		}
		d.MoE = &moe
	}
	return &d
}

// jsonFloat marshals as a JSON number that Python reads back as a float
// (10000.0, not 10000).
type jsonFloat float64

func (f jsonFloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil, cfgErr("%v is not a JSON number", v)
	}
	s := strconv.FormatFloat(v, 'g', -1, 64)
	if !strings.ContainsAny(s, ".eE") {
		s += ".0"
	}
	return []byte(s), nil
}

// ErrConfig is wrapped by every error about a config: malformed, or
// describing a model strata cannot run.
var ErrConfig = errors.New("bad config")

// ConfigError is a problem with a config. It wraps ErrConfig; a reader of
// config.json reports Msg with the file's path in place of "config".
type ConfigError struct{ Msg string }

func (e *ConfigError) Error() string { return "arch: config: " + e.Msg }

// Unwrap returns ErrConfig.
func (e *ConfigError) Unwrap() error { return ErrConfig }

func cfgErr(format string, args ...any) error {
	return &ConfigError{Msg: fmt.Sprintf(format, args...)}
}
