package paging

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
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
)

// ParseStrategy accepts the strategy names ("none", "minimal", "balanced",
// "aggressive"), case-insensitive.
func ParseStrategy(s string) (Strategy, error) {
	switch st := Strategy(strings.ToLower(strings.TrimSpace(s))); st {
	case StrategyNone, StrategyMinimal, StrategyBalanced, StrategyAggressive:
		return st, nil
	}
	return "", fmt.Errorf("paging: unknown offload strategy %q (want none, minimal, balanced or aggressive)", s)
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
	// (nn.Config.Reserve computes nn's).
	Reserve Reserve
}

// Reserve is the device memory that the weights' user allocates from the
// budget beside the weights, buffer by buffer, so that Plan can scale it to
// its context length, prefill chunk and batch, and ModelInfo.Stage to one
// device's share. The user describes its own buffers (nn.Config.Reserve,
// nn.Config.TrainReserve): paging knows none of them.
type Reserve []Buffer

// Buffer is Count tensors of one size that the weights' user allocates
// from the budget, charged to Category.
type Buffer struct {
	Category Category `json:"category"`
	// Bytes is one tensor's size for each position of the context
	// (PerPosition), each token of a chunk (PerToken), or in all (Once).
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
)

// Bytes returns the bytes the reserve's buffers of cat take for contextLen
// positions, chunks of chunk tokens and batch sequences on a device
// holding blocks decoder blocks.
func (r Reserve) Bytes(cat Category, blocks, contextLen, chunk, batch int) int64 {
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
		}
		if b.PerBlock {
			count *= int64(blocks)
		}
		total += n * count
	}
	return total
}

func (r Reserve) check() error {
	for i, b := range r {
		if b.Bytes < 0 || b.Count < 0 || b.Per < Once || b.Per > PerToken || b.Category < KVCache || b.Category >= numCategories {
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
}

// WithChunkTokens sets the number of tokens nn processes per step (the
// prefill chunk), which sizes the activations.
func WithChunkTokens(n int) PlanOption { return func(o *planOptions) { o.chunk = n } }

// WithMaxPrefetch bounds the prefetch depth the planner may choose
// (default 2).
func WithMaxPrefetch(n int) PlanOption { return func(o *planOptions) { o.maxPrefetch = n } }

// LayerPlan is one layer's part of a plan.
type LayerPlan struct {
	Layer         int   `json:"layer"`
	Bytes         int64 `json:"bytes"`
	ResidentBytes int64 `json:"resident_bytes"`
	StreamedBytes int64 `json:"streamed_bytes"`
	// Streamed names the tensors that pass through the ring; the others
	// stay resident. Empty when the layer is wholly resident (or planned
	// from Bytes alone).
	Streamed []string `json:"streamed,omitempty"`
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
	// positions, chunks of ChunkTokens and Batch sequences; WorkspaceBytes
	// includes gradients.
	KVCacheBytes    int64 `json:"kv_cache_bytes"`
	ActivationBytes int64 `json:"activation_bytes"`
	WorkspaceBytes  int64 `json:"workspace_bytes"`
	// ResidentBytes stay on the device once loaded; StreamedBytes pass
	// through the ring on every sweep over the layers.
	ResidentBytes  int64 `json:"resident_bytes"`
	StreamedBytes  int64 `json:"streamed_bytes"`
	ResidentLayers []int `json:"resident_layers"`
	StreamedLayers []int `json:"streamed_layers"`
	// The ring holds the streamed parts of RingSlots consecutive layers
	// (the one computing and PrefetchDepth ahead); RingBytes is the most
	// any RingSlots consecutive layers stream, SlotBytes the largest part.
	RingSlots     int   `json:"ring_slots"`
	SlotBytes     int64 `json:"slot_bytes"`
	RingBytes     int64 `json:"ring_bytes"`
	PrefetchDepth int   `json:"prefetch_depth"`
	// HostCacheBytes is the host RAM worth keeping streamed parts in.
	HostCacheBytes int64 `json:"host_cache_bytes"`
	// PredictedPeakBytes = resident + ring + KV cache + activations +
	// workspace.
	PredictedPeakBytes int64 `json:"predicted_peak_bytes"`
	// MinBudgetBytes is the smallest budget any streaming strategy plans
	// with: the largest layer, the KV cache, activations and workspace.
	MinBudgetBytes int64       `json:"min_budget_bytes"`
	Layers         []LayerPlan `json:"layers"`
}

// String summarises the plan on one line.
func (p *PlanResult) String() string {
	return fmt.Sprintf("%s plan for %s budget: %s resident (%d of %d layers whole), %s streamed per pass through a ring of %d (%s), prefetch %d, KV cache %s, activations %s, predicted peak %s",
		p.Strategy, FormatSize(p.Budget), FormatSize(p.ResidentBytes), len(p.ResidentLayers), len(p.Layers),
		FormatSize(p.StreamedBytes), p.RingSlots, FormatSize(p.RingBytes), p.PrefetchDepth,
		FormatSize(p.KVCacheBytes), FormatSize(p.ActivationBytes), FormatSize(p.PredictedPeakBytes))
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
	o := planOptions{chunk: min(DefaultChunkTokens, contextLen), maxPrefetch: 2}
	for _, f := range opts {
		f(&o)
	}
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
	units := make([][]unit, n)
	var W, lmax int64
	for l, li := range model.Layers {
		us, bytes, err := layerUnits(l, li)
		if err != nil {
			return nil, err
		}
		units[l] = us
		W += bytes
		lmax = max(lmax, bytes)
	}
	reserve := func(cat Category) int64 {
		return model.Reserve.Bytes(cat, model.NumLayers, contextLen, o.chunk, batch)
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
		WorkspaceBytes:  reserve(Workspace) + reserve(Gradients),
	}
	fixed := p.KVCacheBytes + p.ActivationBytes + p.WorkspaceBytes
	p.MinBudgetBytes = fixed + lmax
	detail := fmt.Sprintf("weights %s (largest layer %s), KV cache %s for %d positions x %d, activations %s for %d tokens, workspace %s",
		FormatSize(W), FormatSize(lmax), FormatSize(p.KVCacheBytes), contextLen, batch, FormatSize(p.ActivationBytes), o.chunk*batch, FormatSize(p.WorkspaceBytes))
	if strategy == StrategyNone && budget < fixed+W {
		return nil, &BudgetError{Strategy: strategy, Budget: budget, Needed: fixed + W, Detail: "every layer resident: " + detail}
	}
	if budget < p.MinBudgetBytes {
		return nil, &BudgetError{Strategy: strategy, Budget: budget, Needed: p.MinBudgetBytes, Detail: "the largest layer streamed alone: " + detail}
	}
	avail := budget - fixed
	opt := make([]layerOptions, n)
	for l := range units {
		opt[l] = subsetSums(units[l])
	}
	full := make([]int, n) // option index of the whole layer
	for l := range opt {
		full[l] = len(opt[l].sums) - 1
	}
	var choice []int
	depth := 0
	X := W - avail
	switch {
	case strategy == StrategyAggressive:
		choice = full
		for d := min(o.maxPrefetch, n-1); d >= 0; d-- {
			if windowMax(partBytes(opt, full), d) <= avail {
				depth = d
				break
			}
		}
	case X <= 0: // none, or everything fits
		choice = make([]int, n)
	case strategy == StrategyMinimal:
		choice, _ = chooseStreamed(opt, W, X, avail, 0)
	case strategy == StrategyBalanced:
		bound := X + X/20 + lmax
		choice, _ = chooseStreamed(opt, W, X, avail, 0)
		for d := min(o.maxPrefetch, n-1); d >= 1; d-- {
			if c, moved := chooseStreamed(opt, W, X, avail, d); c != nil && moved <= bound {
				choice, depth = c, d
				break
			}
		}
	}
	if choice == nil { // cannot happen when budget >= MinBudgetBytes: streaming everything fits
		return nil, &BudgetError{Strategy: strategy, Budget: budget, Needed: p.MinBudgetBytes, Detail: detail}
	}
	parts := partBytes(opt, choice)
	for l := range n {
		lp := LayerPlan{Layer: l, Bytes: model.Layers[l].Bytes, StreamedBytes: parts[l]}
		lp.ResidentBytes = lp.Bytes - lp.StreamedBytes
		mask := opt[l].masks[choice[l]]
		for ui, u := range units[l] {
			if mask&(1<<ui) != 0 {
				lp.Streamed = append(lp.Streamed, u.names...)
			}
		}
		slices.Sort(lp.Streamed)
		if lp.Streamed != nil && lp.Streamed[0] == "" { // planned from Bytes alone
			lp.Streamed = nil
		}
		p.Layers = append(p.Layers, lp)
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
	if p.StreamedBytes > 0 {
		p.PrefetchDepth = depth
		p.RingSlots = depth + 1
		p.RingBytes = windowMax(parts, depth)
	}
	if strategy != StrategyAggressive {
		p.HostCacheBytes = p.StreamedBytes
	}
	p.PredictedPeakBytes = p.ResidentBytes + p.RingBytes + fixed
	if p.PredictedPeakBytes > budget { // a planner bug, not bad input
		return nil, fmt.Errorf("paging: plan %s: internal error: predicted peak %d exceeds budget %d", strategy, p.PredictedPeakBytes, budget)
	}
	return p, nil
}

// A unit is a group of tensors the planner places together; layers with
// more than maxUnits tensors have their smallest ones grouped.
type unit struct {
	names []string
	bytes int64
}

const maxUnits = 8

func layerUnits(l int, li LayerInfo) ([]unit, int64, error) {
	if li.Bytes < 0 {
		return nil, 0, fmt.Errorf("paging: plan: layer %d has %d bytes", l, li.Bytes)
	}
	if len(li.Tensors) == 0 {
		if li.Bytes == 0 {
			return nil, 0, nil
		}
		return []unit{{names: []string{""}, bytes: li.Bytes}}, li.Bytes, nil
	}
	if err := checkSpecs(l, li.Tensors); err != nil {
		return nil, 0, err
	}
	var us []unit
	var sum int64
	for _, t := range li.Tensors {
		us = append(us, unit{names: []string{t.Name}, bytes: t.Bytes})
		sum += t.Bytes
	}
	if li.Bytes != 0 && li.Bytes != sum {
		return nil, 0, fmt.Errorf("paging: plan: layer %d: Bytes %d but its tensors add up to %d", l, li.Bytes, sum)
	}
	for len(us) > maxUnits { // merge the two smallest
		slices.SortFunc(us, func(a, b unit) int { return cmp.Compare(b.bytes, a.bytes) })
		a, b := us[len(us)-2], us[len(us)-1]
		us = append(us[:len(us)-2], unit{names: append(slices.Clone(a.names), b.names...), bytes: a.bytes + b.bytes})
	}
	return us, sum, nil
}

// layerOptions are the distinct byte counts a layer can stream (subset sums
// of its units), ascending, each with one subset that achieves it.
type layerOptions struct {
	sums  []int64
	masks []uint32
}

func subsetSums(us []unit) layerOptions {
	seen := map[int64]uint32{}
	for mask := uint32(0); mask < 1<<len(us); mask++ {
		var s int64
		for i := range us {
			if mask&(1<<i) != 0 {
				s += us[i].bytes
			}
		}
		if _, ok := seen[s]; !ok {
			seen[s] = mask
		}
	}
	var o layerOptions
	for s := range seen {
		o.sums = append(o.sums, s)
	}
	slices.Sort(o.sums)
	for _, s := range o.sums {
		o.masks = append(o.masks, seen[s])
	}
	return o
}

func partBytes(opt []layerOptions, choice []int) []int64 {
	out := make([]int64, len(choice))
	for l, c := range choice {
		out[l] = opt[l].sums[c]
	}
	return out
}

// windowMax is the largest sum of d+1 cyclically consecutive parts.
func windowMax(parts []int64, d int) int64 {
	n := len(parts)
	d = min(d, n-1)
	var best int64
	for i := range n {
		var s int64
		for j := 0; j <= d; j++ {
			s += parts[(i+j)%n]
		}
		best = max(best, s)
	}
	return best
}

// chooseStreamed picks per-layer streamed parts for prefetch depth d that
// free at least X bytes net of the ring (sum - ring >= X) with the fewest
// streamed bytes. It tries every cap c on the part size: with parts <= c
// the ring is at most (d+1)c, so streaming X+(d+1)c suffices; it then
// tightens the target to X plus the ring it actually got.
func chooseStreamed(opt []layerOptions, W, X, avail int64, d int) ([]int, int64) {
	n := len(opt)
	seen := map[int64]bool{}
	var caps []int64
	for _, o := range opt {
		for _, s := range o.sums {
			if s > 0 && s <= avail && !seen[s] {
				seen[s] = true
				caps = append(caps, s)
			}
		}
	}
	slices.Sort(caps)
	stride := min(d+1, n)
	order := make([]int, 0, n)
	for r := range stride {
		for l := r; l < n; l += stride {
			order = append(order, l)
		}
	}
	var best []int
	bestSum := int64(math.MaxInt64)
	for _, c := range caps {
		target := X + int64(d+1)*c
		for range 4 {
			ch, sum := greedyParts(opt, order, c, target)
			if ch == nil {
				break
			}
			ws := windowMax(partBytes(opt, ch), d)
			if W-sum+ws <= avail && sum < bestSum {
				best, bestSum = ch, sum
			}
			if X+ws >= target {
				break
			}
			target = X + ws
		}
	}
	return best, bestSum
}

// greedyParts streams the largest part <= c of each layer in order until
// the next would reach target, then picks, among the layers left, the part
// that reaches target with the least overshoot.
func greedyParts(opt []layerOptions, order []int, c, target int64) ([]int, int64) {
	ch := make([]int, len(opt))
	var sum int64
	for k, l := range order {
		bi := bestAtMost(opt[l].sums, c)
		if sum+opt[l].sums[bi] < target {
			ch[l] = bi
			sum += opt[l].sums[bi]
			continue
		}
		need := target - sum
		bl, bv := -1, int64(math.MaxInt64)
		for _, m := range order[k:] {
			i, _ := slices.BinarySearch(opt[m].sums, need)
			if i < len(opt[m].sums) && opt[m].sums[i] <= c && opt[m].sums[i] < bv {
				bl, bv = m, opt[m].sums[i]
				ch[m] = i
			}
		}
		for _, m := range order[k:] {
			if m != bl {
				ch[m] = 0
			}
		}
		return ch, sum + bv
	}
	return nil, 0
}

// bestAtMost returns the index of the largest sum <= c (sums[0] is 0).
func bestAtMost(sums []int64, c int64) int {
	i, ok := slices.BinarySearch(sums, c)
	if ok {
		return i
	}
	return i - 1
}
