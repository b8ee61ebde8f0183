package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// The model config of a GGUF file, read from and written to its metadata
// ({arch}.* keys, GGUFConfigKeys) the way llama.cpp reads and writes it.

// GGUFArchitectures lists the general.architecture values a GGUF model
// may have: "llama" (Llama, and Mistral: a sliding window makes the file
// a Mistral; and Mixtral: experts make it a Mixtral), "qwen2", "qwen3" and
// "qwen3moe".
func GGUFArchitectures() []string { return []string{"llama", "qwen2", "qwen3", "qwen3moe"} }

// GGUFRopeFreqsName is the tensor of llama3 rope scaling factors: llama.cpp
// divides the frequency of rotary pair i by element i.
const GGUFRopeFreqsName = "rope_freqs.weight"

// GGUFConfig returns the config the metadata and tensors of g describe,
// validated (arch.Config.Validate). Every size comes from the metadata
// except the vocabulary, the token embedding's rows; tied embeddings are
// a file without output.weight; a llama or qwen3 file has q/k/v biases
// when block 0 has attn_q.bias, an o_proj bias when it has
// attn_output.bias; a qwen3 head size that block 0's attn_q_norm
// contradicts is an error naming attention.key_length; llama3
// rope scaling is recovered from rope_freqs.weight; BOS and EOS (with the
// end-of-turn and end-of-message tokens) are those of the tokenizer; the
// dtype is the float type holding the most bytes; a mixture of experts
// (qwen3moe, or llama with {arch}.expert_count) is as ggufMoE reads it. An
// architecture strata does not run is an error naming it.
func GGUFConfig(ctx context.Context, g *GGUFFile) (*arch.Config, error) {
	c, err := ggufConfig(ctx, g)
	if err != nil {
		var ce *arch.ConfigError
		var fe *fileError
		switch {
		case errors.As(err, &ce):
			return nil, &fileError{file: g.Path, kind: ErrConfig, msg: ce.Msg}
		case errors.As(err, &fe):
			return nil, err
		}
		return nil, &fileError{file: g.Path, kind: ErrConfig, msg: err.Error()}
	}
	return c, nil
}

func ggufConfig(ctx context.Context, g *GGUFFile) (*arch.Config, error) {
	md := g.Metadata
	name, err := md.String("general.architecture")
	if err != nil {
		return nil, err
	}
	c := &arch.Config{BOS: -1}
	switch name {
	case "llama":
		c.SetFamily(arch.Llama)
	case "qwen2":
		c.SetFamily(arch.Qwen2)
	case "qwen3":
		c.SetFamily(arch.Qwen3)
	case "qwen3moe":
		c.SetFamily(arch.Qwen3MoE)
	case "qwen2moe":
		return nil, fmt.Errorf("GGUF architecture %q (a mixture of experts with a shared expert) is not supported yet (supported: %s)", name, strings.Join(GGUFArchitectures(), ", "))
	default:
		return nil, fmt.Errorf("GGUF architecture %q is not supported yet (supported: %s)", name, strings.Join(GGUFArchitectures(), ", "))
	}
	key := func(k string) string { return name + "." + k }
	if n, err := optUint(md, key("expert_count")); err != nil {
		return nil, err
	} else if n > 0 && name == "llama" {
		c.SetFamily(arch.Mixtral)
	}

	sizes := []struct {
		key      string
		dst      *int
		required bool
	}{
		{"block_count", &c.NumLayers, true},
		{"embedding_length", &c.HiddenSize, true},
		{"feed_forward_length", &c.IntermediateSize, true},
		{"attention.head_count", &c.NumHeads, true},
		{"attention.head_count_kv", &c.NumKVHeads, false},
		{"context_length", &c.MaxPositions, true},
	}
	for _, s := range sizes {
		v, err := md.Uint(key(s.key))
		switch {
		case errors.Is(err, ErrNoKey) && !s.required:
			continue
		case err != nil:
			return nil, err
		case v > 1<<24:
			return nil, fmt.Errorf("metadata %s is %d, implausibly large", key(s.key), v)
		}
		*s.dst = int(v)
	}
	if _, ok := md.Get(key("attention.head_count_kv")); !ok {
		c.NumKVHeads = c.NumHeads
	}
	if c.NumHeads > 0 {
		c.HeadDim = c.HiddenSize / c.NumHeads
	}
	var kl, vl uint64
	if kl, err = optUint(md, key("attention.key_length")); err != nil {
		return nil, err
	}
	if vl, err = optUint(md, key("attention.value_length")); err != nil {
		return nil, err
	}
	switch {
	case kl != 0 && vl != 0 && kl != vl:
		return nil, fmt.Errorf("metadata %s %d differs from %s %d: strata needs one head size", key("attention.key_length"), kl, key("attention.value_length"), vl)
	case kl > 1<<24:
		return nil, fmt.Errorf("metadata %s is %d, implausibly large", key("attention.key_length"), kl)
	case kl != 0:
		c.HeadDim = int(kl)
	case vl != 0 && vl <= 1<<24:
		c.HeadDim = int(vl)
	}
	if c.QKNorm {
		if err := ggufCheckQKNorm(g, c, key, kl, vl); err != nil {
			return nil, err
		}
	}
	if rd, err := optUint(md, key("rope.dimension_count")); err != nil {
		return nil, err
	} else if rd != 0 && rd != uint64(c.HeadDim) {
		return nil, fmt.Errorf("metadata %s is %d, the head size %d: a partial rotary embedding is not supported", key("rope.dimension_count"), rd, c.HeadDim)
	}
	if c.RMSNormEps, err = ggufFloat(md, key("attention.layer_norm_rms_epsilon")); err != nil {
		return nil, err
	}
	c.RopeTheta = 10000
	if v, err := ggufFloat(md, key("rope.freq_base")); err == nil {
		c.RopeTheta = v
	} else if !errors.Is(err, ErrNoKey) {
		return nil, err
	}
	if typ, err := md.String(key("rope.scaling.type")); err == nil && typ != "none" {
		return nil, fmt.Errorf("metadata %s is %q: rope scaling other than llama3's (rope_freqs.weight) is not supported", key("rope.scaling.type"), typ)
	} else if err != nil && !errors.Is(err, ErrNoKey) {
		return nil, err
	}
	if name == "llama" {
		if w, err := optUint(md, key("attention.sliding_window")); err != nil {
			return nil, err
		} else if w > 0 {
			if c.Family == arch.Llama {
				c.SetFamily(arch.Mistral)
			}
			c.SlidingWindow = int(min(w, 1<<30))
		}
	}
	if err := ggufMoE(g, c, name, key); err != nil {
		return nil, err
	}
	if name == "llama" || name == "qwen3" || name == "qwen3moe" { // attention_bias: the tensors say
		_, c.QKVBias = g.Tensor("blk.0.attn_q.bias")
		_, c.OutBias = g.Tensor("blk.0.attn_output.bias")
	}

	// The vocabulary is the embedding's rows.
	if t, ok := g.Tensor(GGUFEmbedName); ok && len(t.Dims) == 2 && t.Dims[1] <= 1<<24 {
		c.VocabSize = int(t.Dims[1])
	} else if v, err := md.Uint(key("vocab_size")); err == nil && v <= 1<<24 {
		c.VocabSize = int(v)
	}
	_, hasOutput := g.Tensor(GGUFOutputName)
	c.TieEmbeddings = !hasOutput

	if err := ggufSpecialIDs(md, c); err != nil {
		return nil, err
	}
	if t, ok := g.Tensor(GGUFRopeFreqsName); ok {
		if c.RopeScaling, err = ropeScalingOf(ctx, g, t, c); err != nil {
			return nil, err
		}
	}
	c.DType = ggufFloatDType(g)
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// ggufMoE sets the mixture of experts of c, whose family the architecture
// name and {arch}.expert_count chose, from the metadata: expert_count,
// expert_used_count (top-k) and, for qwen3moe, expert_feed_forward_length
// (Mixtral's experts have feed_forward_length); every block is sparse, as
// llama.cpp runs these architectures; the chosen experts' weights are
// renormalised unless {arch}.expert_weights_norm is false. A dense family
// with stacked expert tensors is an error naming expert_count.
func ggufMoE(g *GGUFFile, c *arch.Config, name string, key func(string) string) error {
	md := g.Metadata
	if c.MoE == nil {
		if n, _ := optUint(md, key("expert_count")); n > 0 {
			return fmt.Errorf("a %s model with %d experts (a mixture of experts) is not supported yet", name, n)
		}
		for _, t := range g.Tensors() {
			if isGGUFStackedExperts(t.Name) {
				return fmt.Errorf("tensor %s holds experts, but metadata %s is missing or 0", t.Name, key("expert_count"))
			}
		}
		return nil
	}
	need := func(k string, lo, hi uint64) (int, error) {
		v, err := md.Uint(key(k))
		switch {
		case errors.Is(err, ErrNoKey):
			return 0, fmt.Errorf("metadata %s is missing: a %s model needs it", key(k), name)
		case err != nil:
			return 0, err
		case v < lo || v > hi:
			return 0, fmt.Errorf("metadata %s is %d, want %d..%d", key(k), v, lo, hi)
		}
		return int(v), nil
	}
	experts, err := need("expert_count", 1, 1<<16)
	if err != nil {
		return err
	}
	perToken, err := need("expert_used_count", 1, uint64(experts))
	if err != nil {
		if v, uerr := md.Uint(key("expert_used_count")); uerr == nil && v > uint64(experts) {
			return fmt.Errorf("metadata %s is %d, more than the %d experts of %s", key("expert_used_count"), v, experts, key("expert_count"))
		}
		return err
	}
	size := c.IntermediateSize
	if c.Family == arch.Qwen3MoE {
		if size, err = need("expert_feed_forward_length", 1, 1<<24); err != nil {
			return err
		}
	}
	norm := true
	if v, ok := md.Get(key("expert_weights_norm")); ok {
		b, isBool := v.(bool)
		if !isBool {
			return fmt.Errorf("metadata %s is a %T, want a bool", key("expert_weights_norm"), v)
		}
		norm = b
	}
	c.MoE = &arch.MoE{Experts: experts, ExpertsPerToken: perToken, ExpertSize: size, SparseStep: 1, NormTopK: norm}
	syn, err := ggufSyntheticRouting(md)
	if err != nil {
		return err
	}
	c.MoE.Synthetic = syn
	return nil
}

// The metadata of a synthetic model's routing (arch.SyntheticRouting),
// which strata writes for synth and llama.cpp ignores: all three or none.
const (
	GGUFSyntheticSkew     = "strata.synthetic_routing.skew"     // float64
	GGUFSyntheticLocality = "strata.synthetic_routing.locality" // float64
	GGUFSyntheticSeed     = "strata.synthetic_routing.seed"     // uint64
)

// ggufSyntheticRouting reads the synthetic routing of md, nil when md has
// none of its keys; some but not all of them is an error naming the first
// missing.
func ggufSyntheticRouting(md *GGUFMetadata) (*arch.SyntheticRouting, error) {
	keys := []string{GGUFSyntheticSkew, GGUFSyntheticLocality, GGUFSyntheticSeed}
	n := 0
	for _, k := range keys {
		if _, ok := md.Get(k); ok {
			n++
		}
	}
	if n == 0 {
		return nil, nil
	}
	for _, k := range keys {
		if _, ok := md.Get(k); !ok {
			return nil, fmt.Errorf("metadata %s is missing: synthetic routing needs %s", k, strings.Join(keys, ", "))
		}
	}
	skew, err := md.Float(GGUFSyntheticSkew)
	if err != nil {
		return nil, err
	}
	loc, err := md.Float(GGUFSyntheticLocality)
	if err != nil {
		return nil, err
	}
	seed, err := md.Uint(GGUFSyntheticSeed)
	if err != nil {
		return nil, err
	}
	return &arch.SyntheticRouting{Skew: skew, Locality: loc, Seed: seed}, nil
}

// ggufCheckQKNorm checks the head size against the per-head query norm of
// block 0, so that a missing or wrong key_length (kl, vl: 0 when missing)
// is named as such rather than as a tensor of the wrong shape.
func ggufCheckQKNorm(g *GGUFFile, c *arch.Config, key func(string) string, kl, vl uint64) error {
	t, ok := g.Tensor("blk.0.attn_q_norm.weight")
	if !ok || len(t.Dims) != 1 || t.Dims[0] == int64(c.HeadDim) {
		return nil // the tensor checks report what else is wrong
	}
	switch {
	case kl != 0:
		return fmt.Errorf("metadata %s is %d, but %s holds %d values (the head size)", key("attention.key_length"), kl, t.Name, t.Dims[0])
	case vl != 0:
		return fmt.Errorf("metadata %s is %d, but %s holds %d values (the head size)", key("attention.value_length"), vl, t.Name, t.Dims[0])
	}
	return fmt.Errorf("metadata %s is missing and the head size hidden/heads = %d, but %s holds %d values (the head size)", key("attention.key_length"), c.HeadDim, t.Name, t.Dims[0])
}

// optUint is md.Uint with 0 for a missing key.
func optUint(md *GGUFMetadata, key string) (uint64, error) {
	v, err := md.Uint(key)
	if errors.Is(err, ErrNoKey) {
		return 0, nil
	}
	return v, err
}

// ggufFloat reads a float key. A float32 is read as the shortest decimal
// that rounds to it, which is what was written into it (1e-05, not
// 9.999999747378752e-06).
func ggufFloat(md *GGUFMetadata, key string) (float64, error) {
	v, err := md.Float(key)
	if err != nil {
		return 0, err
	}
	raw, _ := md.Get(key)
	if f, ok := raw.(float32); ok {
		if d, err := strconv.ParseFloat(strconv.FormatFloat(float64(f), 'g', -1, 32), 64); err == nil {
			return d, nil
		}
	}
	return v, nil
}

// ggufSpecialIDs sets c's BOS and EOS: the tokenizer's when the file has
// one, else the ids the metadata names; the end-of-turn and
// end-of-message tokens end generation too.
func ggufSpecialIDs(md *GGUFMetadata, c *arch.Config) error {
	v, ok, err := ggufVocab(md)
	if err != nil {
		return err
	}
	if ok {
		c.BOS = v.BOS
		if v.EOS >= 0 {
			c.EOS = append(c.EOS, v.EOS)
		}
	} else {
		if id, err := md.Uint("tokenizer.ggml.bos_token_id"); err == nil {
			c.BOS = int(min(id, math.MaxInt32))
		}
		if id, err := md.Uint("tokenizer.ggml.eos_token_id"); err == nil {
			c.EOS = append(c.EOS, int(min(id, math.MaxInt32)))
		}
	}
	for _, k := range []string{"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"} {
		if id, err := md.Uint(k); err == nil && !slices.Contains(c.EOS, int(min(id, math.MaxInt32))) {
			c.EOS = append(c.EOS, int(min(id, math.MaxInt32)))
		}
	}
	return nil
}

// ggufFloatDType is the float dtype of the tensors of g holding the most
// bytes, F32 when there are none.
func ggufFloatDType(g *GGUFFile) tensor.DType {
	bytes := map[tensor.DType]int64{}
	for _, t := range g.Tensors() {
		if dt, ok := tensor.FromQuant(t.Type); ok && dt.IsFloat() {
			bytes[dt] += t.Size
		}
	}
	best := tensor.F32
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		if bytes[dt] > bytes[best] {
			best = dt
		}
	}
	return best
}

// Llama 3's rope scaling, the one llama.cpp stores as factors.
const (
	llama3LowFreqFactor  = 1
	llama3HighFreqFactor = 4
	llama3OriginalCtx    = 8192
)

// ropeScalingOf recovers the llama3 rope scaling whose factors t holds:
// the largest factor is the scaling factor; the others must be those of
// Llama 3.1's low and high frequency factors (1 and 4) and original
// context (8192, or {arch}.rope.scaling.original_context_length).
func ropeScalingOf(ctx context.Context, g *GGUFFile, t *GGUFTensor, c *arch.Config) (*arch.RopeScaling, error) {
	half := c.HeadDim / 2
	if t.Type != quant.F32 || len(t.Dims) != 1 || t.Dims[0] != int64(half) {
		return nil, fmt.Errorf("tensor %s is %v %v, want F32 [%d] (the head size / 2)", t.Name, t.Type, t.Dims, half)
	}
	raw := make([]byte, t.Size)
	if err := g.ReadTensorBytes(ctx, t.Name, raw); err != nil {
		return nil, err
	}
	factors := make([]float64, half)
	var top float64
	for i := range factors {
		f := float64(math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:])))
		if !(f > 0) || math.IsInf(f, 0) {
			return nil, fmt.Errorf("tensor %s: factor %d is %v", t.Name, i, f)
		}
		factors[i] = f
		top = max(top, f)
	}
	orig := uint64(llama3OriginalCtx)
	if v, err := g.Metadata.Uint(g.arch() + ".rope.scaling.original_context_length"); err == nil {
		orig = v
	}
	rs := &arch.RopeScaling{Type: "llama3", Factor: top, LowFreqFactor: llama3LowFreqFactor,
		HighFreqFactor: llama3HighFreqFactor, OriginalMaxPositions: int(min(orig, 1<<30))}
	want := llama3Factors(c.HeadDim, c.RopeTheta, rs)
	for i, f := range factors {
		if math.Abs(f-want[i]) > 1e-5*want[i] {
			return nil, fmt.Errorf("tensor %s: factor %d is %v where llama3 scaling by %v (low and high frequency factors %v and %v, original context %d) gives %v; other scalings are not supported",
				t.Name, i, f, top, rs.LowFreqFactor, rs.HighFreqFactor, rs.OriginalMaxPositions, want[i])
		}
	}
	return rs, nil
}

// arch returns the file's general.architecture, "" when it has none.
func (g *GGUFFile) arch() string {
	s, _ := g.Metadata.String("general.architecture")
	return s
}

// llama3Factors are the factors llama.cpp's converter writes as
// rope_freqs.weight for llama3 scaling: the rotary frequencies of a head
// of size headDim are divided by them.
func llama3Factors(headDim int, theta float64, s *arch.RopeScaling) []float64 {
	lowWavelen := float64(s.OriginalMaxPositions) / s.LowFreqFactor
	highWavelen := float64(s.OriginalMaxPositions) / s.HighFreqFactor
	out := make([]float64, headDim/2)
	for i := range out {
		freq := 1 / math.Pow(theta, float64(2*i)/float64(headDim))
		wavelen := 2 * math.Pi / freq
		switch {
		case wavelen < highWavelen:
			out[i] = 1
		case wavelen > lowWavelen:
			out[i] = s.Factor
		default:
			smooth := (float64(s.OriginalMaxPositions)/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
			out[i] = 1 / ((1-smooth)/s.Factor + smooth)
		}
	}
	return out
}

// GGUFArchitecture is the general.architecture llama.cpp names c's family
// by: "llama" for Llama, Mistral and Mixtral, "qwen2", "qwen3",
// "qwen3moe". A Qwen3-MoE with dense blocks (decoder_sparse_step,
// mlp_only_layers) has none: llama.cpp's qwen3moe has experts in every
// block. A mixture of experts with synthetic routing has its family's,
// the routing in strata's own keys (GGUFSyntheticSkew and the others),
// which llama.cpp ignores: it would route with the random router.
func GGUFArchitecture(c *arch.Config) (string, error) {
	switch c.Family {
	case arch.Llama, arch.Mistral:
		return "llama", nil
	case arch.Qwen2:
		return "qwen2", nil
	case arch.Qwen3:
		return "qwen3", nil
	case arch.Qwen3MoE, arch.Mixtral:
		if c.Family == arch.Mixtral {
			return "llama", nil
		}
		if c.MoE != nil && (c.MoE.SparseStep != 1 || len(c.MoE.DenseLayers) > 0) {
			return "", fmt.Errorf("loader: a Qwen3-MoE with dense blocks (decoder_sparse_step %d, mlp_only_layers %v) has no GGUF architecture: llama.cpp's qwen3moe has experts in every block",
				c.MoE.SparseStep, c.MoE.DenseLayers)
		}
		return "qwen3moe", nil
	}
	return "", fmt.Errorf("loader: the %v family has no GGUF architecture strata writes", c.Family)
}

// GGUFConfigKVs returns the metadata that describes c to llama.cpp (and
// GGUFConfig): general.architecture and the {arch}.* sizes as llama.cpp's
// converter types them (uint32 counts, float32 epsilon and rotary base),
// the head size when it is not hidden/heads (always for qwen3 and
// qwen3moe, as llama.cpp's converter writes a config's head_dim), the
// experts (expert_count, expert_used_count, qwen3moe's
// expert_feed_forward_length, expert_weights_norm only when false, and
// strata's keys of synthetic routing), Mistral's and Mixtral's sliding window,
// and BOS and EOS (up to three EOS: the end-of-turn and end-of-message
// ids hold the second and third). A llama3 rope scaling is no metadata
// but the tensor GGUFRopeFreqs returns.
func GGUFConfigKVs(c *arch.Config) ([]GGUFKV, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	a, err := GGUFArchitecture(c)
	if err != nil {
		return nil, err
	}
	u := func(v int) uint32 { return uint32(v) }
	kvs := []GGUFKV{
		{"general.architecture", a},
		{a + ".context_length", u(c.MaxPositions)},
		{a + ".embedding_length", u(c.HiddenSize)},
		{a + ".block_count", u(c.NumLayers)},
		{a + ".feed_forward_length", u(c.IntermediateSize)},
		{a + ".attention.head_count", u(c.NumHeads)},
		{a + ".attention.head_count_kv", u(c.NumKVHeads)},
		{a + ".attention.layer_norm_rms_epsilon", float32(c.RMSNormEps)},
		{a + ".rope.freq_base", float32(c.RopeTheta)},
		{a + ".rope.dimension_count", u(c.HeadDim)},
	}
	if m := c.MoE; m != nil {
		kvs = append(kvs, GGUFKV{a + ".expert_count", u(m.Experts)}, GGUFKV{a + ".expert_used_count", u(m.ExpertsPerToken)})
		if c.Family == arch.Qwen3MoE {
			kvs = append(kvs, GGUFKV{a + ".expert_feed_forward_length", u(m.ExpertSize)})
		}
		if !m.NormTopK {
			kvs = append(kvs, GGUFKV{a + ".expert_weights_norm", false})
		}
		if syn := m.Synthetic; syn != nil {
			kvs = append(kvs, GGUFKV{GGUFSyntheticSkew, syn.Skew}, GGUFKV{GGUFSyntheticLocality, syn.Locality}, GGUFKV{GGUFSyntheticSeed, syn.Seed})
		}
	}
	if c.HeadDim*c.NumHeads != c.HiddenSize || c.QKNorm { // llama.cpp writes qwen3's head_dim always
		kvs = append(kvs, GGUFKV{a + ".attention.key_length", u(c.HeadDim)}, GGUFKV{a + ".attention.value_length", u(c.HeadDim)})
	}
	if c.SlidingWindow > 0 {
		kvs = append(kvs, GGUFKV{a + ".attention.sliding_window", u(c.SlidingWindow)})
	}
	kvs = append(kvs, GGUFKV{a + ".vocab_size", u(c.VocabSize)})
	if c.BOS >= 0 {
		kvs = append(kvs, GGUFKV{"tokenizer.ggml.bos_token_id", u(c.BOS)})
	}
	for i, k := range []string{"eos", "eot", "eom"} {
		if i < len(c.EOS) {
			kvs = append(kvs, GGUFKV{"tokenizer.ggml." + k + "_token_id", u(c.EOS[i])})
		}
	}
	return kvs, nil
}

// GGUFRopeFreqs returns the rope_freqs.weight factors of c's llama3 rope
// scaling, nil when it has none.
func GGUFRopeFreqs(c *arch.Config) []float32 {
	if c.RopeScaling == nil {
		return nil
	}
	f := llama3Factors(c.HeadDim, c.RopeTheta, c.RopeScaling)
	out := make([]float32, len(f))
	for i, v := range f {
		out[i] = float32(v)
	}
	return out
}
