package paging

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// Strategy says how the planner trades device memory for streaming.
type Strategy string

// The offload strategies.
const (
	// StrategyNone keeps every layer resident; a budget too small for that
	// fails at plan time.
	StrategyNone Strategy = "none"
	// StrategyMinimal fills the budget with resident weights and streams the
	// rest through a ring of one layer, without prefetch: the fewest bytes
	// moved per token.
	StrategyMinimal Strategy = "minimal"
	// StrategyBalanced reserves the KV cache for the full context and the
	// activations, streams what does not fit with prefetch (depth chosen
	// from the budget) and keeps the rest resident.
	StrategyBalanced Strategy = "balanced"
	// StrategyAggressive keeps no weights resident: only the ring is on the
	// device, streamed from host RAM or straight from disk, with no host
	// cache: the smallest footprint on both.
	StrategyAggressive Strategy = "aggressive"
	// StrategyHybrid computes some of the layers that do not stay on the
	// device on the CPU in decode, and streams the others, the split
	// chosen from measured rates (PlanHybrid, HybridAuto or
	// HybridForced).
	StrategyHybrid Strategy = "hybrid"
	// StrategyCPU computes every layer that does not stay on the device
	// on the CPU in decode, and streams none (PlanHybrid, HybridAllCPU).
	StrategyCPU Strategy = "cpu"
)

// ParseStrategy accepts the strategy names ("none", "minimal", "balanced",
// "aggressive", "hybrid", "cpu"), case-insensitive. Plan takes the first
// four; the last two need measured rates and plan with PlanHybrid.
func ParseStrategy(s string) (Strategy, error) {
	switch st := Strategy(strings.ToLower(strings.TrimSpace(s))); st {
	case StrategyNone, StrategyMinimal, StrategyBalanced, StrategyAggressive, StrategyHybrid, StrategyCPU:
		return st, nil
	}
	return "", fmt.Errorf("paging: unknown offload strategy %q (want none, minimal, balanced, aggressive, hybrid or cpu)", s)
}

// ErrBudgetTooSmall is wrapped by Plan when no plan of the strategy fits.
var ErrBudgetTooSmall = errors.New("budget too small")

// BudgetError is the error Plan returns when the budget is too small; it
// wraps ErrBudgetTooSmall and says the smallest budget that would work.
type BudgetError struct {
	Strategy Strategy
	Budget   int64 // what was asked for
	Needed   int64 // the smallest budget that plans
	Detail   string
}

func (e *BudgetError) Error() string {
	return fmt.Sprintf("paging: plan %s: %v: budget %s (%d bytes), need at least %s (%d bytes): %s",
		e.Strategy, ErrBudgetTooSmall, FormatSize(e.Budget), e.Budget, FormatSize(e.Needed), e.Needed, e.Detail)
}

// Unwrap returns ErrBudgetTooSmall.
func (e *BudgetError) Unwrap() error { return ErrBudgetTooSmall }

// LayerInfo describes one paging unit (a layer as nn numbers them) to the
// planner. Tensors may be empty, in which case the layer is planned whole
// from Bytes.
type LayerInfo struct {
	Bytes   int64        `json:"bytes"`
	Tensors []TensorSpec `json:"tensors,omitempty"`
	// Experts names the tensors of each of the layer's experts and
	// Routing the tensors that choose them (ExpertSource). Planned
	// WithExpertCache, the experts go to the expert cache and the routing
	// stays resident; otherwise they are tensors of the layer like any.
	Experts [][]string `json:"experts,omitempty"`
	Routing []string   `json:"routing,omitempty"`
}

// ModelInfo is what the planner needs to know about a model: its layers,
// and what its user allocates beside them.
type ModelInfo struct {
	// Layers are the paging units in nn's numbering: embedding, blocks,
	// final norm and head. DescribeSource fills them from a Source.
	Layers []LayerInfo
	// NumLayers is the number of decoder blocks (num_hidden_layers):
	// Layers holds them between the embedding and the final layer, and a
	// Buffer PerBlock is allocated for each.
	NumLayers int
	// Reserve is the memory the weights' user allocates from the budget
	// (nn.Reserve computes nn's).
	Reserve Reserve
	// NoEmbedding says that Layers[0] is not the embedding (a later
	// device's share, Stage): PlanHybrid counts a token's read of the
	// embedding as one row.
	NoEmbedding bool
}

// Reserve is the device memory that the weights' user allocates from the
// budget beside the weights, buffer by buffer, so that Plan can scale it to
// its context length, prefill chunk and batch, ModelInfo.Stage to one
// device's share, and WithDevice to the blocks the device's allocator
// takes for each tensor. The user describes its own buffers
// (nn.Reserve, nn.TrainReserve): paging knows none of them.
type Reserve []Buffer

// Buffer is Count tensors of one size that the weights' user allocates
// from the budget, charged to Category.
type Buffer struct {
	Category Category `json:"category"`
	// Bytes is one tensor's size for each position of the context
	// (PerPosition), each token of a chunk (PerToken), each sequence
	// (PerSequence), or in all (Once).
	Bytes int64 `json:"bytes"`
	Per   Per   `json:"per"`
	// Count is the number of such tensors for each sequence of the batch
	// (in all for Once), and for each decoder block on the device when
	// PerBlock (a KV cache).
	Count    int  `json:"count"`
	PerBlock bool `json:"per_block,omitempty"`
	// LastLayer marks tensors that only the device holding the model's
	// last layer allocates (the logits of the LM head).
	LastLayer bool `json:"last_layer,omitempty"`
}

// Per says what a Buffer's size grows with.
type Per int

// What a buffer's size grows with.
const (
	Once        Per = iota // a fixed size, once per device
	PerPosition            // the context length, for each sequence
	PerToken               // the prefill chunk, for each sequence
	PerSequence            // a fixed size, for each sequence
)

// Bytes returns the bytes the reserve's buffers of cat take for contextLen
// positions, chunks of chunk tokens and batch sequences on a device
// holding blocks decoder blocks, each tensor counted as size says the
// device's allocator takes it (nil: its bytes).
func (r Reserve) Bytes(cat Category, blocks, contextLen, chunk, batch int, size func(int64) int64) int64 {
	var total int64
	for _, b := range r {
		if b.Category != cat {
			continue
		}
		n, count := b.Bytes, int64(b.Count)
		switch b.Per {
		case PerPosition:
			n, count = n*int64(contextLen), count*int64(batch)
		case PerToken:
			n, count = n*int64(chunk), count*int64(batch)
		case PerSequence:
			count *= int64(batch)
		}
		if b.PerBlock {
			count *= int64(blocks)
		}
		if size != nil && n > 0 {
			n = size(n)
		}
		total += n * count
	}
	return total
}

func (r Reserve) check() error {
	for i, b := range r {
		if b.Bytes < 0 || b.Count < 0 || b.Per < Once || b.Per > PerSequence || b.Category < KVCache || b.Category >= Cached {
			return fmt.Errorf("paging: plan: reserve buffer %d %+v: want bytes and count >= 0, a known Per and a category of nn's buffers", i, b)
		}
	}
	return nil
}

// DescribeSource lists a source's layers for ModelInfo.Layers.
func DescribeSource(src Source) ([]LayerInfo, error) {
	n := src.NumLayers()
	if n <= 0 {
		return nil, fmt.Errorf("paging: source has %d layers", n)
	}
	out := make([]LayerInfo, n)
	for l := range n {
		specs := src.LayerTensors(l)
		if err := checkSpecs(l, specs); err != nil {
			return nil, err
		}
		out[l].Tensors = slices.Clone(specs)
		for _, s := range specs {
			out[l].Bytes += s.Bytes
		}
		if es, ok := src.(ExpertSource); ok {
			experts, routing := es.LayerExperts(l), es.LayerRouting(l)
			if err := checkExperts(l, specs, experts, routing); err != nil {
				return nil, err
			}
			out[l].Experts, out[l].Routing = cloneNames(experts), slices.Clone(routing)
		}
	}
	return out, nil
}

// DefaultChunkTokens is the prefill chunk the planner sizes activations for
// unless the context is shorter or WithChunkTokens says otherwise.
const DefaultChunkTokens = 512

// PlanOption adjusts Plan.
type PlanOption func(*planOptions)

type planOptions struct {
	chunk       int
	maxPrefetch int
	allocSize   func(int64) int64 // nil: a tensor takes its bytes
	deviceFixed int64
	whole       []int // layers streamed whole (WithStreamedWhole)
	sequence    []int // another cyclic order the ring serves (WithSequence)
	// depth is the prefetch depth to plan for, or -1 for the strategy's
	// choice (PlanHybrid compares depths).
	depth int
	// expertMin > 0 puts the layers' experts in an expert cache of at
	// least that many (WithExpertCache).
	expertMin int
	// extraFixed is device memory the planner of the layers leaves for
	// the expert cache and the routing tensors (planExperts).
	extraFixed int64
	// kv places the KV cache (WithKVPlacement), kvRates predicts its
	// auto placement (WithKVRates); hostKV is the count of decoder blocks
	// whose KV cache is in host memory in the plan being made (the last
	// ones).
	kv      KVPlacement
	kvRates *Rates
	hostKV  int
	// kvPositions > 0 sizes the device KV cache for that many positions
	// in all, instead of contextLen for each of batch sequences
	// (WithKVPositions).
	kvPositions int
	// attend > 0 is the positions a decoded token attends over in
	// PlanHybrid's prediction (WithAttendPositions).
	attend int
}

// WithChunkTokens sets the number of tokens nn processes per step (the
// prefill chunk), which sizes the activations.
func WithChunkTokens(n int) PlanOption { return func(o *planOptions) { o.chunk = n } }

// WithKVPositions sizes the KV cache the plan keeps room for by n
// positions in all, shared by the sequences (a pool of KV blocks that a
// batch of sequences of different lengths shares out), instead of the
// context length for each sequence of the batch; n <= 0 changes nothing.
func WithKVPositions(n int) PlanOption { return func(o *planOptions) { o.kvPositions = n } }

// WithAttendPositions sets the positions a decoded token attends over in
// PlanHybrid's prediction (the prompt and the tokens decoded after it),
// which its KV cache reads grow with; n <= 0, the default, takes the
// context length.
func WithAttendPositions(n int) PlanOption { return func(o *planOptions) { o.attend = n } }

// WithMaxPrefetch bounds the prefetch depth the planner may choose
// (default 2).
func WithMaxPrefetch(n int) PlanOption { return func(o *planOptions) { o.maxPrefetch = n } }

// WithStreamedWhole makes the planner stream the given layers whole: none
// of their bytes stays resident, and the rest of the budget goes to the
// other layers. PlanHybrid gives it the layers the CPU computes in decode,
// which only pass through the ring (in prefill). StrategyNone refuses it.
func WithStreamedWhole(layers []int) PlanOption {
	return func(o *planOptions) { o.whole = slices.Clone(layers) }
}

// WithSequence sizes the ring for a walk over the layers in this cyclic
// order too (Pager.SetSequence): any PrefetchDepth+1 consecutive layers of
// it fit, as any of 0..n-1 do. The sequence lists each layer at most once.
func WithSequence(layers []int) PlanOption {
	return func(o *planOptions) { o.sequence = slices.Clone(layers) }
}

// WithDevice plans for b's memory as a Budget over b charges it: when b's
// allocator caches blocks (tensor.CachingAllocator), each resident tensor,
// the ring and each tensor of the reserve count the block the allocator
// takes for them, and the memory b holds outside allocations (library
// workspace) is reserved as workspace. Other backends change nothing.
func WithDevice(b tensor.Memory) PlanOption {
	return func(o *planOptions) {
		if ca, ok := tensor.Caching(b); ok {
			o.allocSize = func(n int64) int64 { return max(ca.AllocSize(n), n) }
			o.deviceFixed = ca.Fixed()
		}
	}
}

// WithExpertCache plans the layers' experts (LayerInfo.Experts) as units
// of their own: the planner places the other weights of every layer
// first, the tensors that choose the experts (LayerInfo.Routing) resident,
// as the strategy places layers, then gives the rest of the budget to an
// expert cache holding whole experts, at least perStep of them (the
// experts of one layer a step uses at once) and at most every expert.
// StrategyNone needs room for every expert; StrategyAggressive keeps only
// perStep. Layers without experts are planned as without the option.
func WithExpertCache(perStep int) PlanOption {
	return func(o *planOptions) { o.expertMin = max(perStep, 1) }
}

// LayerPlan is one layer's part of a plan.
type LayerPlan struct {
	Layer         int   `json:"layer"`
	Bytes         int64 `json:"bytes"`
	ResidentBytes int64 `json:"resident_bytes"`
	StreamedBytes int64 `json:"streamed_bytes"`
	// ExpertBytes are the layer's experts, which the expert cache holds
	// (WithExpertCache): Bytes = ResidentBytes + StreamedBytes +
	// ExpertBytes. Experts is how many.
	ExpertBytes int64 `json:"expert_bytes,omitempty"`
	Experts     int   `json:"experts,omitempty"`
	// Streamed names the tensors that pass through the ring; the others
	// stay resident. Empty when the layer is wholly resident (or planned
	// from Bytes alone).
	Streamed []string `json:"streamed,omitempty"`
	// Shared are the layer's tensors that the layer before it holds
	// (tied embeddings: the embedding table, which the head holds). They
	// are planned once, as the other layer's: resident there, or streamed
	// with it, its device copy serving both Acquires, since the two are
	// adjacent in the walk (the head ends a token, the embedding starts
	// the next). Bytes = ResidentBytes + StreamedBytes + ExpertBytes +
	// Shared.Bytes.
	Shared *SharedTensors `json:"shared,omitempty"`
}

// SharedTensors are tensors a layer shares with the layer before it in
// the cyclic order of layers (From), under the same names.
type SharedTensors struct {
	From  int      `json:"from"`
	Names []string `json:"names"`
	Bytes int64    `json:"bytes"`
}

// sharedTensors finds, for each layer, the tensors the layer before it in
// the cyclic order also lists, with the same name, dtype and shape: the
// embedding table of a model with tied embeddings, which the head (the
// last layer) lists too. A layer that lends tensors borrows none, so that
// a borrowed tensor is always its lender's own.
func sharedTensors(layers []LayerInfo) []*SharedTensors {
	n := len(layers)
	out := make([]*SharedTensors, n)
	lends := make([]bool, n)
	for l := 0; l < n && n > 1; l++ {
		a := (l - 1 + n) % n
		if out[a] != nil || lends[l] {
			continue
		}
		have := map[string]TensorSpec{}
		for _, t := range layers[a].Tensors {
			have[t.Name] = t
		}
		for _, t := range layers[l].Tensors {
			if o, ok := have[t.Name]; ok && o.DType == t.DType && o.Shape.Equal(t.Shape) && o.Bytes == t.Bytes {
				if out[l] == nil {
					out[l] = &SharedTensors{From: a}
				}
				out[l].Names = append(out[l].Names, t.Name)
				out[l].Bytes += t.Bytes
			}
		}
		if out[l] != nil {
			slices.Sort(out[l].Names)
			lends[a] = true
		}
	}
	return out
}

// withoutShared returns li without the tensors sh names.
func withoutShared(li LayerInfo, sh *SharedTensors) LayerInfo {
	if sh == nil {
		return li
	}
	out := li
	out.Tensors = nil
	for _, t := range li.Tensors {
		if !slices.Contains(sh.Names, t.Name) {
			out.Tensors = append(out.Tensors, t)
		}
	}
	if out.Bytes != 0 { // 0: the tensors' sum
		out.Bytes -= sh.Bytes
	}
	return out
}

// PlanResult is what the planner decides before anything is loaded.
type PlanResult struct {
	Strategy    Strategy `json:"strategy"`
	Budget      int64    `json:"budget_bytes"`
	ContextLen  int      `json:"context_len"`
	Batch       int      `json:"batch"`
	ChunkTokens int      `json:"chunk_tokens"`
	WeightBytes int64    `json:"weight_bytes"`
	// The reserve for what nn allocates (ModelInfo.Reserve) for ContextLen
	// positions, chunks of ChunkTokens and Batch sequences, each tensor as
	// the device's allocator takes it (WithDevice); WorkspaceBytes
	// includes gradients and the memory the device holds outside
	// allocations.
	KVCacheBytes int64 `json:"kv_cache_bytes"`
	// KVPlacement says where the KV cache is: device (every block's),
	// host (every block's) or auto (some of each). KVHostBlocks are the
	// decoder blocks whose KV cache is in host memory, KVHostBytes what
	// they hold there; KVCacheBytes (device memory) counts the others'
	// and KVScratchBytes, the device copies a prefill chunk attends over
	// (KVScratchBuffers blocks' worth at most). KVPredicted is KVAuto's
	// predicted decode time for a token at a full context (WithKVRates;
	// 0 without rates).
	KVPlacement     KVPlacement   `json:"kv_placement"`
	KVHostBlocks    []int         `json:"kv_host_blocks"`
	KVHostBytes     int64         `json:"kv_host_bytes"`
	KVScratchBytes  int64         `json:"kv_scratch_bytes,omitempty"`
	KVPredicted     time.Duration `json:"kv_predicted_ns,omitempty"`
	ActivationBytes int64         `json:"activation_bytes"`
	WorkspaceBytes  int64         `json:"workspace_bytes"`
	// ResidentBytes stay on the device once loaded; StreamedBytes pass
	// through the ring on every sweep over the layers.
	ResidentBytes  int64 `json:"resident_bytes"`
	StreamedBytes  int64 `json:"streamed_bytes"`
	ResidentLayers []int `json:"resident_layers"`
	StreamedLayers []int `json:"streamed_layers"`
	// The ring holds the streamed parts of RingSlots consecutive layers
	// (the one computing and PrefetchDepth ahead); SlotBytes is the
	// largest part. The ring is one allocation that the parts are laid out
	// in one after the other, each tensor at a 256-byte aligned offset,
	// wrapping around its end (Pager). RingBytes is what any RingSlots
	// consecutive layers stream, with their tensors so aligned, plus, with
	// prefetch, room for the bytes a tensor skips when it does not fit
	// before the end: at most the window's largest tensor. RingSlackBytes
	// is what alignment and that room add to the most any RingSlots
	// consecutive layers stream.
	RingSlots      int   `json:"ring_slots"`
	SlotBytes      int64 `json:"slot_bytes"`
	RingBytes      int64 `json:"ring_bytes"`
	RingSlackBytes int64 `json:"ring_slack_bytes"`
	PrefetchDepth  int   `json:"prefetch_depth"`
	// SharedBytes are the bytes of the tensors two layers share (tied
	// embeddings, LayerPlan.Shared), planned once: WeightBytes,
	// ResidentBytes and StreamedBytes count them once.
	SharedBytes int64 `json:"shared_bytes,omitempty"`
	// HostCacheBytes is the host RAM worth keeping streamed parts in: what
	// they take in the pager's host copies, each tensor padded to 64 bytes.
	HostCacheBytes int64 `json:"host_cache_bytes"`
	// StagingBytes is the pinned host memory a Pager reads streamed parts
	// into on their way to the device when it keeps no host copy of them
	// (the staging ring, Options.StagingSlots): the aggressive strategy's,
	// a buffer of the largest streamed part for each load that runs at
	// once (the prefetch depth plus one, at most three). The other
	// strategies' host cache keeps every streamed part: none.
	StagingBytes int64 `json:"staging_bytes,omitempty"`
	// The expert cache (WithExpertCache): ExpertSlots of the model's
	// Experts fit in it, each slot of ExpertSlotBytes (the largest expert,
	// each of its tensors 256-byte aligned), in one allocation of
	// ExpertCacheBytes. ExpertBytes are the weight bytes of every expert,
	// in WeightBytes but neither resident nor streamed.
	Experts          int   `json:"experts,omitempty"`
	ExpertSlots      int   `json:"expert_slots,omitempty"`
	ExpertSlotBytes  int64 `json:"expert_slot_bytes,omitempty"`
	ExpertCacheBytes int64 `json:"expert_cache_bytes,omitempty"`
	ExpertBytes      int64 `json:"expert_bytes,omitempty"`
	// DeviceOverheadBytes is what the device's allocator adds to the
	// resident tensors, the ring and the expert cache (its block sizes,
	// WithDevice).
	DeviceOverheadBytes int64 `json:"device_overhead_bytes,omitempty"`
	// PredictedPeakBytes = resident + ring + expert cache + device
	// overhead + KV cache + activations + workspace: what the budget holds
	// once every resident layer is loaded and nn has allocated its
	// reserve.
	PredictedPeakBytes int64 `json:"predicted_peak_bytes"`
	// MinBudgetBytes is the smallest budget any streaming strategy plans
	// with: a ring for the largest layer, the KV cache, activations and
	// workspace.
	MinBudgetBytes int64       `json:"min_budget_bytes"`
	Layers         []LayerPlan `json:"layers"`
}

// String summarises the plan on one line.
func (p *PlanResult) String() string {
	extra := ""
	if p.Experts > 0 {
		extra = fmt.Sprintf(", expert cache %s (%d of %d experts, %.1f%%)",
			FormatSize(p.ExpertCacheBytes), p.ExpertSlots, p.Experts, 100*float64(p.ExpertSlots)/float64(p.Experts))
	}
	if p.StagingBytes > 0 {
		extra += fmt.Sprintf(", host staging %s", FormatSize(p.StagingBytes))
	}
	for _, lp := range p.Layers {
		if lp.Shared != nil {
			extra += fmt.Sprintf(", layer %d shares %s with layer %d (planned once)", lp.Layer, FormatSize(lp.Shared.Bytes), lp.Shared.From)
		}
	}
	kv := FormatSize(p.KVCacheBytes)
	if n := len(p.KVHostBlocks); n > 0 {
		kv = fmt.Sprintf("%s on the device (%s of it scratch), %s in host memory for %d blocks (%d..%d)",
			kv, FormatSize(p.KVScratchBytes), FormatSize(p.KVHostBytes), n, p.KVHostBlocks[0], p.KVHostBlocks[n-1])
	}
	return fmt.Sprintf("%s plan for %s budget: %s resident (%d of %d layers whole), %s streamed per pass through a ring of %d (%s), prefetch %d%s, KV cache %s, activations %s, predicted peak %s",
		p.Strategy, FormatSize(p.Budget), FormatSize(p.ResidentBytes), len(p.ResidentLayers), len(p.Layers),
		FormatSize(p.StreamedBytes), p.RingSlots, FormatSize(p.RingBytes), p.PrefetchDepth, extra,
		kv, FormatSize(p.ActivationBytes), FormatSize(p.PredictedPeakBytes))
}

// Plan decides, before anything is loaded, which weights stay on the device
// and which stream, the ring and prefetch depth, and the KV cache and
// activation reserve, for a budget of budget bytes, contextLen positions and
// batch sequences. It fails with a *BudgetError (wrapping
// ErrBudgetTooSmall) that names the smallest budget that would work.
//
// Residency is decided per tensor: a layer may keep some tensors resident
// and stream the others, which lets the resident set fill the budget to
// within one small tensor and spreads the streamed bytes so that the ring,
// sized for the largest window of consecutive streamed parts, stays small.
func Plan(model ModelInfo, budget int64, strategy Strategy, contextLen, batch int, opts ...PlanOption) (*PlanResult, error) {
	if _, err := ParseStrategy(string(strategy)); err != nil {
		return nil, err
	}
	if strategy == StrategyHybrid || strategy == StrategyCPU {
		return nil, fmt.Errorf("paging: plan %s: the split between the CPU and the device needs measured rates: plan with PlanHybrid", strategy)
	}
	o := planOptions{chunk: min(DefaultChunkTokens, contextLen), maxPrefetch: 2, depth: -1}
	for _, f := range opts {
		f(&o)
	}
	return planKV(model, budget, strategy, contextLen, batch, o, func(o planOptions) (*PlanResult, error) {
		if o.expertMin > 0 && hasExperts(model) {
			return planExperts(model, budget, strategy, contextLen, batch, o)
		}
		return plan(model, budget, strategy, contextLen, batch, o)
	})
}

// errNoPlanAtDepth is plan's answer when no plan at the depth asked for
// (planOptions.depth) fits the budget.
var errNoPlanAtDepth = errors.New("paging: plan: no plan at that prefetch depth fits")

func plan(model ModelInfo, budget int64, strategy Strategy, contextLen, batch int, o planOptions) (*PlanResult, error) {
	switch {
	case len(model.Layers) == 0:
		return nil, fmt.Errorf("paging: plan: model has no layers")
	case budget <= 0:
		return nil, fmt.Errorf("paging: plan: budget %d bytes: must be > 0", budget)
	case contextLen <= 0 || batch <= 0:
		return nil, fmt.Errorf("paging: plan: context length %d and batch %d must be > 0", contextLen, batch)
	case o.chunk <= 0 || o.maxPrefetch < 0:
		return nil, fmt.Errorf("paging: plan: chunk %d, max prefetch %d: must be positive", o.chunk, o.maxPrefetch)
	case model.NumLayers < 0:
		return nil, fmt.Errorf("paging: plan: %d decoder blocks", model.NumLayers)
	}
	if err := model.Reserve.check(); err != nil {
		return nil, err
	}
	n := len(model.Layers)
	forced := make([]bool, n)
	if err := checkLayerList("layer to stream whole", o.whole, n, forced); err != nil {
		return nil, err
	}
	if err := checkLayerList("layer of the sequence", o.sequence, n, make([]bool, n)); err != nil {
		return nil, err
	}
	if strategy == StrategyNone && len(o.whole) > 0 {
		return nil, fmt.Errorf("paging: plan none: streams nothing, yet layers %v are to stream whole", o.whole)
	}
	size := o.allocSize
	if size == nil {
		size = func(n int64) int64 { return n }
	}
	// Tensors two adjacent layers share are planned once, as the earlier
	// layer's; not when the walk follows another sequence or some layers
	// stream whole (PlanHybrid: the CPU may compute one of the two).
	var shared []*SharedTensors
	if o.whole == nil && o.sequence == nil {
		shared = sharedTensors(model.Layers)
	} else {
		shared = make([]*SharedTensors, n)
	}
	borrows := make([]bool, n)
	units := make([][]unit, n)
	var W, Wc, lmax int64 // weight bytes, what they take on the device, the largest layer
	for l, li := range model.Layers {
		borrows[l] = shared[l] != nil
		us, bytes, err := layerUnits(l, withoutShared(li, shared[l]), size)
		if err != nil {
			return nil, err
		}
		units[l] = us
		W += bytes
		for _, u := range us {
			Wc += u.cost
		}
		lmax = max(lmax, bytes)
	}
	if o.hostKV < 0 || o.hostKV > model.NumLayers {
		return nil, fmt.Errorf("paging: plan: KV cache of %d blocks in host memory, the model has %d", o.hostKV, model.NumLayers)
	}
	reserve := func(cat Category) int64 {
		blocks := model.NumLayers
		if cat == KVCache {
			blocks = kvDeviceBlocks(model.NumLayers, o.hostKV)
			if o.kvPositions > 0 {
				return model.Reserve.Bytes(cat, blocks, o.kvPositions, o.chunk, 1, o.allocSize)
			}
		}
		return model.Reserve.Bytes(cat, blocks, contextLen, o.chunk, batch, o.allocSize)
	}
	p := &PlanResult{
		Strategy:        strategy,
		Budget:          budget,
		ContextLen:      contextLen,
		Batch:           batch,
		ChunkTokens:     o.chunk,
		WeightBytes:     W,
		KVCacheBytes:    reserve(KVCache),
		ActivationBytes: reserve(Activations),
		WorkspaceBytes:  reserve(Workspace) + reserve(Gradients) + o.deviceFixed,
		KVPlacement:     KVDevice,
		KVHostBlocks:    hostKVBlocks(model.NumLayers, o.hostKV),
	}
	if o.hostKV > 0 {
		p.KVPlacement = KVHost
		p.KVHostBytes = model.Reserve.Bytes(KVCache, o.hostKV, contextLen, o.chunk, batch, nil)
		p.KVScratchBytes = model.Reserve.Bytes(KVCache, min(o.hostKV, KVScratchBuffers), contextLen, o.chunk, batch, o.allocSize)
		if o.hostKV < model.NumLayers {
			p.KVPlacement = KVAuto
		}
	}
	fixed := p.KVCacheBytes + p.ActivationBytes + p.WorkspaceBytes + o.extraFixed
	opt := make([]layerOptions, n)
	for l := range units {
		opt[l] = subsetSums(units[l])
	}
	full := make([]int, n) // option index of the whole layer
	var forcedSum, forcedMoved int64
	for l := range opt {
		full[l] = len(opt[l].sums) - 1
		if forced[l] { // the whole layer is its only option
			opt[l] = opt[l].only(full[l])
			full[l] = 0
			forcedSum += opt[l].sums[0]
			forcedMoved += opt[l].moved[0]
		}
	}
	ringCost := func(choice []int, d int) int64 {
		if rb := ringBytesOver(ringParts(opt, choice), d, o.sequence, borrows); rb > 0 {
			return size(rb)
		}
		return 0
	}
	// The smallest streaming plan streams everything through a ring for
	// the largest layer, without prefetch.
	lring := ringCost(full, 0)
	p.MinBudgetBytes = fixed + lring
	kvPos, kvSeqs := contextLen, batch
	if o.kvPositions > 0 { // a pool shared by the batch (WithKVPositions)
		kvPos, kvSeqs = o.kvPositions, 1
	}
	detail := fmt.Sprintf("weights %s (largest layer %s), KV cache %s for %d positions x %d, activations %s for %d tokens, workspace %s",
		FormatSize(W), FormatSize(lmax), FormatSize(p.KVCacheBytes), kvPos, kvSeqs, FormatSize(p.ActivationBytes), o.chunk*batch, FormatSize(p.WorkspaceBytes))
	if o.hostKV > 0 {
		detail += fmt.Sprintf(" (KV cache of %d blocks in host memory, %s of device scratch)", o.hostKV, FormatSize(p.KVScratchBytes))
	} else if o.kv == "" || o.kv == KVDevice {
		detail += " (every block's KV cache on the device; placed auto or host, -kv-cache, it moves to host memory)"
	}
	if strategy == StrategyNone && budget < fixed+Wc {
		return nil, &BudgetError{Strategy: strategy, Budget: budget, Needed: fixed + Wc, Detail: "every layer resident: " + detail}
	}
	if budget < p.MinBudgetBytes {
		return nil, &BudgetError{Strategy: strategy, Budget: budget, Needed: p.MinBudgetBytes, Detail: "the largest layer streamed alone: " + detail}
	}
	avail := budget - fixed
	var choice []int
	depth := 0
	X := Wc - avail
	search := func(d int) ([]int, int64) {
		return chooseStreamed(opt, forced, forcedSum, Wc, X, avail, d, ringCost)
	}
	switch {
	case strategy == StrategyAggressive:
		choice = full
		for d := min(o.maxPrefetch, n-1); d >= 0; d-- {
			if ringCost(full, d) <= avail {
				depth = d
				break
			}
		}
	case X <= 0 && len(o.whole) == 0: // none, or everything fits
		choice = make([]int, n)
	case o.depth >= 0:
		depth = min(o.depth, n-1)
		if choice, _ = search(depth); choice == nil && ringCost(full, depth) <= avail {
			choice = full
		}
		if choice == nil {
			return nil, fmt.Errorf("%w: depth %d, budget %d", errNoPlanAtDepth, depth, budget)
		}
	case strategy == StrategyMinimal:
		choice, _ = search(0)
	case strategy == StrategyBalanced || strategy == StrategyHybrid || strategy == StrategyCPU:
		// Prefetch when it streams at most a twentieth more than the least
		// there is to stream, and a layer.
		bound := max(X, forcedMoved) + max(X, 0)/20 + lring
		choice, _ = search(0)
		for d := min(o.maxPrefetch, n-1); d >= 1; d-- {
			if c, moved := search(d); c != nil && moved <= bound {
				choice, depth = c, d
				break
			}
		}
	}
	if choice == nil {
		// The searches are heuristics over part-size caps and can miss the
		// one plan that fits at the smallest budgets; streaming every layer
		// through a one-layer ring always fits once budget >=
		// MinBudgetBytes, which was checked above.
		choice, depth = full, 0
	}
	parts := make([]int64, n)
	var residentCost, hostBytes, partHost int64
	for l := range n {
		c := choice[l]
		lp := LayerPlan{Layer: l, Bytes: model.Layers[l].Bytes, StreamedBytes: opt[l].moved[c], Shared: shared[l]}
		lp.ResidentBytes = lp.Bytes - lp.StreamedBytes
		if lp.Shared != nil {
			lp.ResidentBytes -= lp.Shared.Bytes
			p.SharedBytes += lp.Shared.Bytes
		}
		residentCost += opt[l].sums[full[l]] - opt[l].sums[c]
		mask := opt[l].masks[c]
		var host int64
		for ui, u := range units[l] {
			if mask&(1<<ui) != 0 {
				lp.Streamed = append(lp.Streamed, u.names...)
				host += u.host
			}
		}
		hostBytes += host
		partHost = max(partHost, host)
		slices.Sort(lp.Streamed)
		if lp.Streamed != nil && lp.Streamed[0] == "" { // planned from Bytes alone
			lp.Streamed = nil
		}
		p.Layers = append(p.Layers, lp)
		parts[l] = lp.StreamedBytes
		p.ResidentBytes += lp.ResidentBytes
		p.StreamedBytes += lp.StreamedBytes
		p.SlotBytes = max(p.SlotBytes, lp.StreamedBytes)
		if lp.StreamedBytes == 0 {
			p.ResidentLayers = append(p.ResidentLayers, l)
		} else {
			p.StreamedLayers = append(p.StreamedLayers, l)
		}
	}
	if p.ResidentLayers == nil {
		p.ResidentLayers = []int{}
	}
	if p.StreamedLayers == nil {
		p.StreamedLayers = []int{}
	}
	var ringCharge int64
	if p.StreamedBytes > 0 {
		p.PrefetchDepth = depth
		p.RingSlots = depth + 1
		p.RingBytes = ringBytesOver(ringParts(opt, choice), depth, o.sequence, borrows)
		p.RingSlackBytes = p.RingBytes - windowMax(parts, depth, borrows)
		if o.sequence != nil {
			p.RingSlackBytes = p.RingBytes - max(windowMax(parts, depth, borrows), windowMax(pick(parts, o.sequence), depth, nil))
		}
		ringCharge = ringCost(choice, depth)
	}
	if strategy != StrategyAggressive {
		p.HostCacheBytes = hostBytes
	} else {
		p.StagingBytes = int64(stagingSlots(p.PrefetchDepth)) * partHost
	}
	p.DeviceOverheadBytes = residentCost - p.ResidentBytes + ringCharge - p.RingBytes
	p.PredictedPeakBytes = p.ResidentBytes + p.RingBytes + p.DeviceOverheadBytes + fixed
	if p.PredictedPeakBytes > budget { // a planner bug, not bad input
		return nil, fmt.Errorf("paging: plan %s: internal error: predicted peak %d exceeds budget %d", strategy, p.PredictedPeakBytes, budget)
	}
	return p, nil
}

// checkLayerList checks that list names layers of n, each once, marking
// them in seen.
func checkLayerList(what string, list []int, n int, seen []bool) error {
	for _, l := range list {
		if l < 0 || l >= n {
			return fmt.Errorf("paging: plan: %s %d: have layers 0..%d", what, l, n-1)
		}
		if seen[l] {
			return fmt.Errorf("paging: plan: %s %d listed twice", what, l)
		}
		seen[l] = true
	}
	return nil
}

// pick returns the elements of xs at the indices in idx, in that order.
func pick[T any](xs []T, idx []int) []T {
	out := make([]T, len(idx))
	for i, j := range idx {
		out[i] = xs[j]
	}
	return out
}

// A unit is a group of tensors the planner places together; layers with
// more than maxUnits tensors have their smallest ones grouped.
type unit struct {
	names []string
	bytes int64   // the tensors' bytes: what streaming the unit moves
	host  int64   // what a host copy of them takes, each tensor padded (alignHost)
	cost  int64   // what the device's allocator takes for them when resident
	sizes []int64 // their sizes in the ring, each aligned
}

const maxUnits = 8

func layerUnits(l int, li LayerInfo, size func(int64) int64) ([]unit, int64, error) {
	if li.Bytes < 0 {
		return nil, 0, fmt.Errorf("paging: plan: layer %d has %d bytes", l, li.Bytes)
	}
	if len(li.Tensors) == 0 {
		if li.Bytes == 0 {
			return nil, 0, nil
		}
		return []unit{{names: []string{""}, bytes: li.Bytes, host: alignHost(li.Bytes), cost: size(li.Bytes), sizes: []int64{alignUp(li.Bytes)}}}, li.Bytes, nil
	}
	if err := checkSpecs(l, li.Tensors); err != nil {
		return nil, 0, err
	}
	var us []unit
	var sum int64
	for _, t := range li.Tensors {
		us = append(us, unit{names: []string{t.Name}, bytes: t.Bytes, host: alignHost(t.Bytes), cost: size(t.Bytes), sizes: []int64{alignUp(t.Bytes)}})
		sum += t.Bytes
	}
	if li.Bytes != 0 && li.Bytes != sum {
		return nil, 0, fmt.Errorf("paging: plan: layer %d: Bytes %d but its tensors add up to %d", l, li.Bytes, sum)
	}
	for len(us) > maxUnits { // merge the two smallest
		slices.SortFunc(us, func(a, b unit) int { return cmp.Compare(b.bytes, a.bytes) })
		a, b := us[len(us)-2], us[len(us)-1]
		us = append(us[:len(us)-2], unit{names: append(slices.Clone(a.names), b.names...),
			bytes: a.bytes + b.bytes, host: a.host + b.host, cost: a.cost + b.cost, sizes: append(slices.Clone(a.sizes), b.sizes...)})
	}
	return us, sum, nil
}

// layerOptions are the distinct ways a layer can stream part of itself,
// by the device memory they free (subset sums of its units' costs) and
// their largest tensor: ascending by the memory freed, each with one
// subset that achieves it, the bytes it moves and its footprint in the
// ring.
type layerOptions struct {
	sums  []int64
	masks []uint32
	moved []int64
	parts []ringPart
}

func subsetSums(us []unit) layerOptions {
	type option struct {
		sum  int64
		mask uint32
		part ringPart
	}
	seen := map[[2]int64]bool{}
	var opts []option
	for mask := uint32(0); mask < 1<<len(us); mask++ {
		var sum int64
		var sizes []int64
		for i, u := range us {
			if mask&(1<<i) != 0 {
				sum += u.cost
				sizes = append(sizes, u.sizes...)
			}
		}
		rp := newRingPart(sizes)
		if k := [2]int64{sum, rp.anyGap}; !seen[k] {
			seen[k] = true
			opts = append(opts, option{sum, mask, rp})
		}
	}
	slices.SortFunc(opts, func(a, b option) int {
		return cmp.Or(cmp.Compare(a.sum, b.sum), cmp.Compare(a.part.anyGap, b.part.anyGap))
	})
	var o layerOptions
	for _, op := range opts {
		var moved int64
		for i, u := range us {
			if op.mask&(1<<i) != 0 {
				moved += u.bytes
			}
		}
		o.sums = append(o.sums, op.sum)
		o.masks = append(o.masks, op.mask)
		o.moved = append(o.moved, moved)
		o.parts = append(o.parts, op.part)
	}
	return o
}

// only returns the options reduced to option i.
func (o *layerOptions) only(i int) layerOptions {
	return layerOptions{sums: []int64{o.sums[i]}, masks: []uint32{o.masks[i]}, moved: []int64{o.moved[i]}, parts: []ringPart{o.parts[i]}}
}

func ringParts(opt []layerOptions, choice []int) []ringPart {
	out := make([]ringPart, len(choice))
	for l, c := range choice {
		out[l] = opt[l].parts[c]
	}
	return out
}

// windowMax is the largest sum of d+1 cyclically consecutive parts, a
// window starting at a layer that borrows (borrows[i]) taking the part
// before it too.
func windowMax(parts []int64, d int, borrows []bool) int64 {
	n := len(parts)
	d = min(d, n-1)
	var best int64
	for i := range n {
		var s int64
		for j := windowStart(i, d, borrows); j <= d; j++ {
			s += parts[(i+j+n)%n]
		}
		best = max(best, s)
	}
	return best
}

// windowStart is where the window of d+1 layers starting at layer i
// begins, relative to i: -1 when i borrows tensors from the layer before
// it (LayerPlan.Shared), which stays on the device while i is in use.
func windowStart(i, d int, borrows []bool) int {
	if borrows != nil && borrows[i] && d+1 < len(borrows) {
		return -1
	}
	return 0
}

// ringPart is a layer's streamed part as the ring holds it.
type ringPart struct {
	slab int64 // its tensors' bytes, each rounded up to ringAlign
	// The most bytes the part can leave unused before the ring's end
	// when it wraps (wrapGaps): anyGap in general, firstGap when it is the
	// first part of a window.
	anyGap, firstGap int64
}

func newRingPart(sizes []int64) ringPart {
	rp := ringPart{}
	for _, a := range sizes {
		rp.slab += a
	}
	rp.anyGap, rp.firstGap = wrapGaps(sizes)
	return rp
}

// maxGapCombos bounds the subset sums wrapGaps examines; beyond it, it
// assumes the worst, a gap of the largest tensor.
const maxGapCombos = 1 << 12

// wrapGaps returns the most bytes that the Pager's layout of a part whose
// tensors take sizes (aligned) in the ring leaves unused before the ring's
// end when the part does not fit before it (Pager.layout): the largest
// tensors that fit go before the end, the others start again at offset 0.
// A tensor left out is larger than the room that remains, so the gap is
// below the smallest tensor left out. anyGap is the most over every room
// smaller than the part; firstGap the most when at least one tensor goes
// before the end (otherwise the part starts at offset 0 and the gap lies
// before it, outside a window that the part begins).
//
// What is placed changes only when the room reaches a sum of some of the
// sizes, and the gap grows with the room in between, so the most is found
// just below one of those sums.
func wrapGaps(sizes []int64) (anyGap, firstGap int64) {
	if len(sizes) == 0 {
		return 0, 0
	}
	desc := slices.Clone(sizes)
	slices.SortFunc(desc, func(a, b int64) int { return cmp.Compare(b, a) })
	var distinct []int64
	var counts []int
	combos := 1
	for i, a := range desc {
		if i > 0 && a == desc[i-1] {
			counts[len(counts)-1]++
			continue
		}
		distinct, counts = append(distinct, a), append(counts, 1)
	}
	for _, c := range counts {
		if combos *= c + 1; combos > maxGapCombos {
			g := desc[0] - ringAlign
			return g, g
		}
	}
	var slab int64
	for _, a := range desc {
		slab += a
	}
	var visit func(i int, v int64)
	visit = func(i int, v int64) {
		if i == len(distinct) {
			if v == 0 || v > slab {
				return
			}
			room := v - ringAlign
			placed := placeBeforeEnd(desc, room)
			anyGap = max(anyGap, room-placed)
			if placed > 0 {
				firstGap = max(firstGap, room-placed)
			}
			return
		}
		for c := 0; c <= counts[i]; c++ {
			visit(i+1, v+int64(c)*distinct[i])
		}
	}
	visit(0, 0)
	return anyGap, firstGap
}

// placeBeforeEnd returns the bytes of the tensors (sizes, descending) that
// the layout puts in room bytes before the ring's end: each that fits, the
// largest first.
func placeBeforeEnd(desc []int64, room int64) int64 {
	var placed int64
	for _, a := range desc {
		if placed+a <= room {
			placed += a
		}
	}
	return placed
}

// ringBytes is the ring that holds any d+1 cyclically consecutive streamed
// parts (the one computing and the d prefetched after it) as the Pager lays
// them out: one after the other in the order they load, wrapping around
// the ring's end (Pager.layout), each tensor at a ringAlign-aligned offset.
//
// A window of parts that fits the ring wraps at most once, and the wrap
// leaves at most one part's gap unused (wrapGaps): the ring needs the
// window's aligned bytes plus the largest gap of its parts (for its first
// part, the gap it leaves when it begins before the end), whatever offset
// the walk has reached. That gap is the slack the slab costs over separate
// allocations: below the smallest tensor a part leaves for after the end.
// Without prefetch (d = 0) no other part is held when a part loads, and a
// part that would run into itself starts at offset 0 instead: the largest
// part is enough (but for a borrower's window, which holds its lender's).
//
// A window starting at a layer that borrows tensors from the layer before
// it (borrows, LayerPlan.Shared) holds that layer's part too: the Pager
// keeps the lender acquired while the borrower is.
func ringBytes(parts []ringPart, d int, borrows []bool) int64 {
	n := len(parts)
	d = min(d, n-1)
	var best int64
	for i := range n {
		var sum, gap int64
		first := true
		start := windowStart(i, d, borrows)
		for j := start; j <= d; j++ {
			rp := parts[(i+j+n)%n]
			if rp.slab == 0 {
				continue
			}
			sum += rp.slab
			if first {
				gap, first = rp.firstGap, false
			} else {
				gap = max(gap, rp.anyGap)
			}
		}
		if d > 0 || start < 0 { // more than one part held: one may wrap
			sum += gap
		}
		best = max(best, sum)
	}
	return best
}

// ringBytesOver is ringBytes for a walk over the layers in their order and,
// when seq is not nil, over seq's (plans with a sequence share nothing).
func ringBytesOver(parts []ringPart, d int, seq []int, borrows []bool) int64 {
	rb := ringBytes(parts, d, borrows)
	if seq != nil {
		rb = max(rb, ringBytes(pick(parts, seq), d, nil))
	}
	return rb
}

// chooseStreamed picks per-layer streamed parts for prefetch depth d that
// free at least X bytes net of the ring (sum - ring >= X) with the fewest
// streamed bytes. The forced layers have one option, which frees
// forcedSum in all; the search chooses among the others. It tries every cap c on the part size and b on the gap a
// part may leave at the ring's end (ringBytes): with parts <= c the ring is
// about (d+1)c, plus b with prefetch, so it first streams that much more
// than X, then moves the target to X plus the ring it actually got.
func chooseStreamed(opt []layerOptions, forced []bool, forcedSum, W, X, avail int64, d int, ring func([]int, int) int64) ([]int, int64) {
	n := len(opt)
	seenSum, seenGap := map[int64]bool{}, map[int64]bool{}
	var caps, gaps []int64
	for _, o := range opt {
		for i, s := range o.sums {
			if s > 0 && s <= avail && !seenSum[s] {
				seenSum[s] = true
				caps = append(caps, s)
			}
			if g := o.parts[i].anyGap; !seenGap[g] {
				seenGap[g] = true
				gaps = append(gaps, g)
			}
		}
	}
	slices.Sort(caps)
	slices.Sort(gaps)
	if d == 0 { // no slack without prefetch: no need to bound it
		gaps = gaps[len(gaps)-1:]
	}
	stride := min(d+1, n)
	order := make([]int, 0, n)
	for r := range stride {
		for l := r; l < n; l += stride {
			if !forced[l] {
				order = append(order, l)
			}
		}
	}
	var best []int
	bestSum := int64(math.MaxInt64)
	if forcedSum > 0 { // the forced layers alone may free enough: the fewest bytes there are
		ch := make([]int, n)
		if W-forcedSum+ring(ch, d) <= avail {
			return ch, forcedSum
		}
	}
	for _, b := range gaps {
		for _, c := range caps {
			target := X + int64(d+1)*c
			if d > 0 {
				target += b
			}
			for range 4 {
				ch, sum := greedyParts(opt, order, c, b, target, forcedSum)
				if ch == nil {
					break
				}
				ws := ring(ch, d)
				if W-sum+ws <= avail && sum < bestSum {
					best, bestSum = ch, sum
				}
				if X+ws == target {
					break
				}
				target = X + ws // tighter, or wider when the ring came out larger
			}
		}
	}
	return best, bestSum
}

// greedyParts streams the largest part <= c whose gap at the ring's end is
// at most b of each layer in order until the next would reach target, then
// picks, among the layers left, the part that reaches target with the
// least overshoot. The layers outside order keep option 0, which frees
// base in all.
func greedyParts(opt []layerOptions, order []int, c, b, target, base int64) ([]int, int64) {
	ch := make([]int, len(opt))
	sum := base
	if sum >= target {
		return ch, sum
	}
	for k, l := range order {
		bi := opt[l].bestAtMost(c, b)
		if sum+opt[l].sums[bi] < target {
			ch[l] = bi
			sum += opt[l].sums[bi]
			continue
		}
		need := target - sum
		bl, bi, bv := -1, 0, int64(math.MaxInt64)
		for _, m := range order[k:] {
			if i, ok := opt[m].leastFrom(need, c, b); ok && opt[m].sums[i] < bv {
				bl, bi, bv = m, i, opt[m].sums[i]
			}
		}
		if bl < 0 {
			return nil, 0
		}
		for _, m := range order[k:] {
			ch[m] = 0
		}
		ch[bl] = bi
		return ch, sum + bv
	}
	return nil, 0
}

// bestAtMost returns the index of the largest sum <= c among the options
// whose gap is at most b (option 0, streaming nothing, always is).
func (o *layerOptions) bestAtMost(c, b int64) int {
	i, _ := slices.BinarySearch(o.sums, c+1)
	for i--; i > 0; i-- {
		if o.parts[i].anyGap <= b {
			return i
		}
	}
	return 0
}

// leastFrom returns the index of the smallest sum in [need, c] among the
// options whose gap is at most b.
func (o *layerOptions) leastFrom(need, c, b int64) (int, bool) {
	i, _ := slices.BinarySearch(o.sums, need)
	for ; i < len(o.sums) && o.sums[i] <= c; i++ {
		if o.parts[i].anyGap <= b {
			return i, true
		}
	}
	return 0, false
}
