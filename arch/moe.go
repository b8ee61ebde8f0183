package arch

import (
	"encoding/json"
	"slices"
	"strconv"

	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/tensor"
)

// SyntheticRouting is the routing of a synthetic model, which synth
// writes into config.json as strata_synthetic_routing (transformers ignores
// it) so that benchmarks of expert paging can choose how experts are used,
// and label their reports synthetic routing. Each block draws each token's
// experts, in place of the router's top-k, from a popularity of Zipf
// exponent Skew over an order of the experts of its own (0: uniform), and
// keeps each of its k choices from the previous position with probability
// Locality (0: each token draws anew). The chosen experts' weights are
// still the router's softmax, renormalised when NormTopK. The draw for a
// position depends only on Seed, the block and the position.
type SyntheticRouting struct {
	Skew     float64
	Locality float64
	Seed     uint64
}

// experts is how a family lays out and configures its mixture of experts;
// nil for a dense family.
type experts = *expertLayout

type expertLayout struct {
	// prefix is the block's MLP module holding the router ("<prefix>.gate")
	// and the experts ("<prefix>.experts.E.<gate|up|down>").
	prefix         string
	gate, up, down string // an expert's projections
	// shared: a shared expert ("<prefix>.shared_expert.*") with a sigmoid
	// gate ("<prefix>.shared_expert_gate", [1, hidden]).
	shared bool
	// qwen: decoder_sparse_step, mlp_only_layers and norm_topk_prob apply,
	// and moe_intermediate_size sizes the experts. Otherwise (Mixtral)
	// every block is sparse, the experts have intermediate_size and the
	// chosen weights are always renormalised.
	qwen bool
	// The defaults of the family's transformers config class.
	defExperts, defPerToken, defExpertSize, defSharedSize int
}

var (
	mixtralExperts = &expertLayout{prefix: "block_sparse_moe", gate: "w1", up: "w3", down: "w2",
		defExperts: 8, defPerToken: 2}
	qwen2MoEExperts = &expertLayout{prefix: "mlp", gate: "gate_proj", up: "up_proj", down: "down_proj", shared: true, qwen: true,
		defExperts: 60, defPerToken: 4, defExpertSize: 1408, defSharedSize: 5632}
	qwen3MoEExperts = &expertLayout{prefix: "mlp", gate: "gate_proj", up: "up_proj", down: "down_proj", qwen: true,
		defExperts: 128, defPerToken: 8, defExpertSize: 768}
)

// Sparse reports whether decoder block i has a mixture of experts (a
// router and experts) rather than a dense MLP.
func (c *Config) Sparse(i int) bool {
	m := c.MoE
	if m == nil || i < 0 || i >= c.NumLayers || m.SparseStep <= 0 {
		return false
	}
	_, dense := slices.BinarySearch(m.DenseLayers, i)
	return (i+1)%m.SparseStep == 0 && !dense
}

// IsExpert reports whether r is a projection of one routed expert
// (ExpertGate, ExpertUp, ExpertDown): a block holds one tensor of the role
// per expert, told apart by Spec.Expert.
func (r Role) IsExpert() bool { return r == ExpertGate || r == ExpertUp || r == ExpertDown }

// ExpertTensors lists the tensors of routed expert e of decoder block i:
// its gate, up and down projections, each with Spec.Expert e. It returns
// nil when the block is dense or e is not one of its experts.
func (c *Config) ExpertTensors(i, e int) []Spec {
	q, _ := c.Family.quirks()
	if !c.Sparse(i) || q.experts == nil || e < 0 || e >= c.MoE.Experts {
		return nil
	}
	x, h, in := q.experts, c.HiddenSize, c.MoE.ExpertSize
	name := func(proj string) string {
		return BlockTensorName(i, x.prefix+".experts."+strconv.Itoa(e)+"."+proj+".weight")
	}
	return []Spec{
		{Name: name(x.gate), Role: ExpertGate, Shape: tensor.Shape{in, h}, Expert: e},
		{Name: name(x.up), Role: ExpertUp, Shape: tensor.Shape{in, h}, Expert: e},
		{Name: name(x.down), Role: ExpertDown, Shape: tensor.Shape{h, in}, Expert: e},
	}
}

// LayerExperts returns the name table of each routed expert of layer
// `layer`, indexed by expert: ExpertGate, ExpertUp and ExpertDown are set.
// It returns nil for a layer without experts.
func (c *Config) LayerExperts(layer int) []Names {
	kind, block, ok := c.LayerKind(layer)
	if !ok || kind != Block || !c.Sparse(block) {
		return nil
	}
	out := make([]Names, c.MoE.Experts)
	for e := range out {
		for _, s := range c.ExpertTensors(block, e) {
			out[e][s.Role] = s.Name
		}
	}
	return out
}

// mlpTensors lists the MLP's tensors of decoder block i: a dense MLP of
// IntermediateSize, or the router, the shared expert and its gate, and the
// routed experts one after the other.
func (c *Config) mlpTensors(i int) []Spec {
	h := c.HiddenSize
	s := func(suffix string, r Role, shape ...int) Spec {
		return Spec{Name: BlockTensorName(i, suffix), Role: r, Shape: tensor.Shape(shape)}
	}
	q, _ := c.Family.quirks()
	if !c.Sparse(i) || q.experts == nil {
		in := c.IntermediateSize
		return []Spec{
			s("mlp.gate_proj.weight", Gate, in, h),
			s("mlp.up_proj.weight", Up, in, h),
			s("mlp.down_proj.weight", Down, h, in),
		}
	}
	x, m := q.experts, c.MoE
	specs := []Spec{s(x.prefix+".gate.weight", Router, m.Experts, h)}
	if m.SharedExperts > 0 {
		in := m.SharedSize
		specs = append(specs,
			s(x.prefix+".shared_expert.gate_proj.weight", SharedGate, in, h),
			s(x.prefix+".shared_expert.up_proj.weight", SharedUp, in, h),
			s(x.prefix+".shared_expert.down_proj.weight", SharedDown, h, in),
			s(x.prefix+".shared_expert_gate.weight", SharedScale, 1, h),
		)
	}
	for e := range m.Experts {
		specs = append(specs, c.ExpertTensors(i, e)...)
	}
	return specs
}

// MLPSize is the widest intermediate activation of the model's MLPs: the
// dense MLP's (when a block has one), a routed expert's and the shared
// expert's.
func (c *Config) MLPSize() int {
	n := 0
	for i := range c.NumLayers {
		if !c.Sparse(i) {
			n = c.IntermediateSize
			break
		}
	}
	if m := c.MoE; m != nil {
		n = max(n, m.ExpertSize, m.SharedSize)
	}
	return n
}

// setExperts makes c's mixture of experts fit the layout x: nil for a
// dense family, the transformers defaults when c has none, and otherwise
// c's own changed only where x rules it (fit).
func (c *Config) setExperts(x experts) {
	if x == nil {
		c.MoE = nil
		return
	}
	if c.MoE == nil {
		c.MoE = &MoE{Experts: x.defExperts, ExpertsPerToken: x.defPerToken, ExpertSize: x.defExpertSize, SparseStep: 1}
		if x.shared {
			c.MoE.SharedExperts, c.MoE.SharedSize = 1, x.defSharedSize
		}
	}
	c.MoE.fit(x, c.IntermediateSize)
}

// fit changes m where the layout x rules it: Mixtral's experts have the
// intermediate size inter, every block sparse and their weights always
// renormalised; only Qwen2-MoE has a shared expert.
func (m *MoE) fit(x experts, inter int) {
	if !x.qwen {
		m.ExpertSize, m.SparseStep, m.DenseLayers, m.NormTopK = inter, 1, nil, true
	}
	switch {
	case !x.shared:
		m.SharedExperts, m.SharedSize = 0, 0
	case m.SharedExperts == 0:
		m.SharedExperts, m.SharedSize = 1, x.defSharedSize
	}
}

// validateMoE checks c.MoE against the family's layout x.
func (c *Config) validateMoE(x experts) error {
	m, f := c.MoE, c.Family
	switch {
	case m.Experts <= 0 || m.Experts > 1<<16:
		return cfgErr("num_experts %d must be in 1..65536", m.Experts)
	case m.ExpertsPerToken <= 0 || m.ExpertsPerToken > m.Experts:
		return cfgErr("num_experts_per_tok %d must be in 1..num_experts %d", m.ExpertsPerToken, m.Experts)
	case m.ExpertSize <= 0 || m.ExpertSize > 1<<24:
		return cfgErr("moe_intermediate_size %d must be in 1..%d", m.ExpertSize, 1<<24)
	case m.SparseStep <= 0:
		return cfgErr("decoder_sparse_step %d must be positive", m.SparseStep)
	case m.SharedExperts < 0 || m.SharedExperts > 1:
		return cfgErr("%d shared experts: strata runs none or one", m.SharedExperts)
	case m.SharedExperts == 0 && m.SharedSize != 0:
		return cfgErr("shared_expert_intermediate_size %d without a shared expert", m.SharedSize)
	case m.SharedExperts == 1 && (m.SharedSize <= 0 || m.SharedSize > 1<<24):
		return cfgErr("shared_expert_intermediate_size %d must be in 1..%d", m.SharedSize, 1<<24)
	case !x.qwen && m.ExpertSize != c.IntermediateSize:
		return cfgErr("%v experts have intermediate_size %d (ExpertSize is %d)", f, c.IntermediateSize, m.ExpertSize)
	case !x.qwen && !m.NormTopK:
		return cfgErr("%v always renormalises the chosen experts' weights (NormTopK must be true)", f)
	case !x.qwen && (m.SparseStep != 1 || len(m.DenseLayers) > 0):
		return cfgErr("%v has experts in every block (decoder_sparse_step %d, mlp_only_layers %v)", f, m.SparseStep, m.DenseLayers)
	case x.shared && m.SharedExperts == 0:
		return cfgErr("%v always has a shared expert", f)
	case !x.shared && m.SharedExperts > 0:
		return cfgErr("%v has no shared expert", f)
	case m.Synthetic != nil && !(m.Synthetic.Skew >= 0 && m.Synthetic.Skew <= 100):
		return cfgErr("strata_synthetic_routing skew %v must be in 0..100", m.Synthetic.Skew)
	case m.Synthetic != nil && !(m.Synthetic.Locality >= 0 && m.Synthetic.Locality < 1):
		return cfgErr("strata_synthetic_routing locality %v must be in [0, 1)", m.Synthetic.Locality)
	case c.HiddenSize%2 != 0:
		// The forward weights the experts' rows with a rotation of pairs
		// of columns (a rotary embedding of head size 2).
		return cfgErr("hidden_size %d must be even for a mixture of experts", c.HiddenSize)
	}
	for k, l := range m.DenseLayers {
		if l < 0 || l >= c.NumLayers {
			return cfgErr("mlp_only_layers entry %d outside the %d blocks", l, c.NumLayers)
		}
		if k > 0 && l <= m.DenseLayers[k-1] {
			return cfgErr("mlp_only_layers %v is not ascending without repeats", m.DenseLayers)
		}
	}
	return nil
}

// familyJSON is what MarshalJSON writes for the families with q/k norms
// or experts: the fields of their transformers config classes.
func (c *Config) familyJSON() []jsonField {
	var out []jsonField
	add := func(k string, v any) { out = append(out, jsonField{k, v}) }
	q, _ := c.Family.quirks()
	if q.qkvBias == biasQKV {
		add("qkv_bias", c.QKVBias)
	} else if q.qkvBias == biasFlag {
		add("attention_bias", c.QKVBias)
	}
	switch q.window {
	case windowAlways:
		var sw any
		if c.SlidingWindow > 0 {
			sw = c.SlidingWindow
		}
		add("sliding_window", sw)
	case windowFlag:
		add("use_sliding_window", false)
		add("sliding_window", nil)
		add("max_window_layers", c.NumLayers)
		types := make([]string, c.NumLayers)
		for i := range types {
			types[i] = "full_attention"
		}
		add("layer_types", types)
	}
	m, x := c.MoE, q.experts
	if m == nil || x == nil {
		return out
	}
	if syn := m.Synthetic; syn != nil {
		add(syntheticRoutingField, map[string]any{"skew": jsonFloat(syn.Skew), "locality": jsonFloat(syn.Locality), "seed": syn.Seed})
	}
	if !x.qwen {
		add("num_local_experts", m.Experts)
		add("num_experts_per_tok", m.ExpertsPerToken)
		add("router_jitter_noise", jsonFloat(0))
		return out
	}
	dense := m.DenseLayers
	if dense == nil {
		dense = []int{}
	}
	// num_experts: transformers 5 maps it to num_local_experts where that
	// is the attribute's name, and transformers 4 reads only it.
	add("num_experts", m.Experts)
	add("num_experts_per_tok", m.ExpertsPerToken)
	add("moe_intermediate_size", m.ExpertSize)
	add("decoder_sparse_step", m.SparseStep)
	add("mlp_only_layers", dense)
	add("norm_topk_prob", m.NormTopK)
	if x.shared {
		add("shared_expert_intermediate_size", m.SharedSize)
	}
	return out
}

// jsonField is one field MarshalJSON writes, in order.
type jsonField struct {
	k string
	v any
}

// familyFieldsJSON is the part of config.json that only some families
// read: the mixture of experts, Qwen2-MoE's qkv_bias, the layer types.
type familyFieldsJSON struct {
	NumExperts                   *int     `json:"num_experts"`
	NumLocalExperts              *int     `json:"num_local_experts"`
	NumExpertsPerTok             *int     `json:"num_experts_per_tok"`
	MoEIntermediateSize          *int     `json:"moe_intermediate_size"`
	SharedExpertIntermediateSize *int     `json:"shared_expert_intermediate_size"`
	DecoderSparseStep            *int     `json:"decoder_sparse_step"`
	MLPOnlyLayers                []int    `json:"mlp_only_layers"`
	NormTopKProb                 *bool    `json:"norm_topk_prob"`
	QKVBias                      *bool    `json:"qkv_bias"`
	LayerTypes                   []string `json:"layer_types"`
	SyntheticRouting             *struct {
		Skew     *float64 `json:"skew"`
		Locality *float64 `json:"locality"`
		Seed     *uint64  `json:"seed"`
	} `json:"strata_synthetic_routing"`
}

// syntheticRoutingField is the config field of SyntheticRouting.
const syntheticRoutingField = "strata_synthetic_routing"

// unsupportedFields are config fields of other mixtures of experts that
// change what the model computes, with the values that change nothing
// (null always does). A config that gives one another value is refused
// rather than run as if it had not.
var unsupportedFields = []struct {
	name    string
	neutral []any
}{
	{"scoring_func", []any{"softmax"}},
	{"topk_method", []any{"greedy"}},
	{"moe_layer_freq", []any{1.0}},
	{"first_k_dense_replace", []any{0.0}},
	{"n_group", []any{1.0}},
	{"topk_group", []any{1.0}},
	{"routed_scaling_factor", []any{1.0}},
	{"n_shared_experts", []any{0.0}},
	{"num_shared_experts", []any{0.0}},
}

// parseFamilyFields reads the fields only some families have into c,
// whose family and sizes ParseConfig has set: the mixture of experts (with
// the defaults of the family's transformers config class), Qwen2-MoE's
// qkv_bias, and the layer types, which must all be full attention. It
// refuses the fields of unsupported routing schemes (unsupportedFields)
// and, for Mixtral, the Qwen fields it does not read.
func parseFamilyFields(data []byte, c *Config, q quirks) error {
	var j familyFieldsJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return cfgErr("bad JSON: %v", err)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return cfgErr("bad JSON: %v", err)
	}
	for _, u := range unsupportedFields {
		r, ok := raw[u.name]
		if !ok {
			continue
		}
		var v any
		if err := json.Unmarshal(r, &v); err != nil {
			return cfgErr("bad JSON: %v", err)
		}
		if v != nil && !slices.Contains(u.neutral, v) {
			return cfgErr("%s %s is not supported (strata routes by a softmax over all experts and a greedy top-k)", u.name, oneline.JSON(r))
		}
	}
	if j.LayerTypes != nil && len(j.LayerTypes) != c.NumLayers {
		return cfgErr("layer_types has %d entries for %d layers", len(j.LayerTypes), c.NumLayers)
	}
	for i, t := range j.LayerTypes {
		if t != "full_attention" {
			return cfgErr("layer_types[%d] %q is not supported (only full_attention)", i, t)
		}
	}
	if q.qkvBias == biasQKV {
		c.QKVBias = j.QKVBias == nil || *j.QKVBias
	}
	x := q.experts
	if x == nil {
		if j.SyntheticRouting != nil {
			return cfgErr("%s: %v has no experts", syntheticRoutingField, c.Family)
		}
		return nil // a dense family: transformers reads none of the rest
	}
	m := &MoE{Experts: x.defExperts, ExpertsPerToken: x.defPerToken, ExpertSize: x.defExpertSize, SparseStep: 1}
	if x.shared {
		m.SharedExperts, m.SharedSize = 1, x.defSharedSize
	}
	if syn := j.SyntheticRouting; syn != nil {
		if syn.Skew == nil || syn.Locality == nil || syn.Seed == nil {
			return cfgErr("%s needs skew, locality and seed", syntheticRoutingField)
		}
		m.Synthetic = &SyntheticRouting{Skew: *syn.Skew, Locality: *syn.Locality, Seed: *syn.Seed}
	}
	switch e, le := j.NumExperts, j.NumLocalExperts; {
	case e != nil && le != nil && *e != *le:
		return cfgErr("num_experts %d and num_local_experts %d disagree", *e, *le)
	case e != nil:
		m.Experts = *e
	case le != nil:
		m.Experts = *le
	}
	if j.NumExpertsPerTok != nil {
		m.ExpertsPerToken = *j.NumExpertsPerTok
	}
	if !x.qwen {
		// Mixtral reads none of the Qwen fields; refuse those that would
		// say something it does not do.
		m.ExpertSize, m.NormTopK = c.IntermediateSize, true
		switch {
		case j.MoEIntermediateSize != nil && *j.MoEIntermediateSize != c.IntermediateSize:
			return cfgErr("%v experts have intermediate_size %d; moe_intermediate_size %d is not supported", c.Family, c.IntermediateSize, *j.MoEIntermediateSize)
		case j.SharedExpertIntermediateSize != nil && *j.SharedExpertIntermediateSize != 0:
			return cfgErr("%v has no shared expert (shared_expert_intermediate_size %d)", c.Family, *j.SharedExpertIntermediateSize)
		case j.DecoderSparseStep != nil && *j.DecoderSparseStep != 1:
			return cfgErr("%v has experts in every block (decoder_sparse_step %d)", c.Family, *j.DecoderSparseStep)
		case len(j.MLPOnlyLayers) > 0:
			return cfgErr("%v has experts in every block (mlp_only_layers %v)", c.Family, j.MLPOnlyLayers)
		case j.NormTopKProb != nil && !*j.NormTopKProb:
			return cfgErr("%v always renormalises the chosen experts' weights (norm_topk_prob false)", c.Family)
		}
		c.MoE = m
		return nil
	}
	if j.MoEIntermediateSize != nil {
		m.ExpertSize = *j.MoEIntermediateSize
	}
	if j.SharedExpertIntermediateSize != nil {
		if !x.shared && *j.SharedExpertIntermediateSize != 0 {
			return cfgErr("%v has no shared expert (shared_expert_intermediate_size %d)", c.Family, *j.SharedExpertIntermediateSize)
		}
		if x.shared {
			m.SharedSize = *j.SharedExpertIntermediateSize
		}
	}
	if j.DecoderSparseStep != nil {
		m.SparseStep = *j.DecoderSparseStep
	}
	if j.NormTopKProb != nil {
		m.NormTopK = *j.NormTopKProb
	}
	if len(j.MLPOnlyLayers) > 0 {
		// transformers asks only whether a block is in the list.
		m.DenseLayers = slices.Compact(slices.Sorted(slices.Values(j.MLPOnlyLayers)))
	}
	c.MoE = m
	return nil
}
