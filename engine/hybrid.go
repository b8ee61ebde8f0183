package engine

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// DefaultTwinMinTokens is the chunk size from which a hybrid placement runs
// its CPU layers on the GPU, streaming their weights (Options.TwinMinTokens):
// a prompt's chunk of this many tokens is compute-bound enough that the
// CPU, which decodes at the speed of its memory, would take longer than the
// copies.
const DefaultTwinMinTokens = 32

// Hybrid is the part of an engine that computes layers on the CPU beside
// one GPU or several: the plans, the rates they were made from, and the
// CPU backend.
type Hybrid struct {
	// Plan is the GPU's plan on one GPU; nil on several, whose plans are
	// in GPUs.
	Plan *paging.HybridPlan `json:"plan,omitempty"`
	// GPUs are, on several GPUs, each GPU's share of the model (its
	// contiguous blocks, placed in proportion to the budgets) and the
	// plan of that share within its budget: its layers in the share's
	// numbering from 0 (CPULayers says which in the model's).
	GPUs  []HybridGPU  `json:"gpus,omitempty"`
	Rates paging.Rates `json:"rates"`
	// Probe is what Open's probe of decode measured and did (one GPU, the
	// planner's split; Options.ProbeSteps); the rates are those it
	// corrected.
	Probe *HybridProbe `json:"probe,omitempty"`
	// CPU is the CPU device's name and threads.
	CPU     string `json:"cpu"`
	Threads int    `json:"threads"`
}

// HybridGPU is one GPU's part of a hybrid placement over several.
type HybridGPU struct {
	Device    string             `json:"device"`
	Placement paging.Placement   `json:"placement"`
	Plan      *paging.HybridPlan `json:"plan"`
}

// Plans are the GPUs' plans, one per GPU, in pipeline order.
func (h *Hybrid) Plans() []*paging.HybridPlan {
	if h.Plan != nil {
		return []*paging.HybridPlan{h.Plan}
	}
	var ps []*paging.HybridPlan
	for _, g := range h.GPUs {
		ps = append(ps, g.Plan)
	}
	return ps
}

// CPULayers are the layers the CPU computes in decode, in the model's
// numbering, over every GPU's plan.
func (h *Hybrid) CPULayers() []int {
	if h.Plan != nil {
		return slices.Clone(h.Plan.CPULayers)
	}
	var ls []int
	for _, g := range h.GPUs {
		ls = append(ls, h.gpuCPULayers(g)...)
	}
	return ls
}

// gpuCPULayers are g's CPU layers in the model's numbering.
func (h *Hybrid) gpuCPULayers(g HybridGPU) []int {
	var ls []int
	for _, l := range g.Plan.CPULayers {
		ls = append(ls, g.Placement.Layers[l])
	}
	return ls
}

// HybridTotals add up the GPUs' plans: per token, the bytes resident,
// streamed and read by the CPU, the host memory of the CPU's layers, and
// the predicted time of a token, the stages running one after the other.
type HybridTotals struct {
	ResidentBytes  int64         `json:"resident_bytes"`
	StreamedBytes  int64         `json:"streamed_bytes"`
	CPUBytes       int64         `json:"cpu_bytes"`
	HostLayerBytes int64         `json:"host_layer_bytes"`
	Predicted      time.Duration `json:"predicted_ns"`
	PredictedTokS  float64       `json:"predicted_tok_s"`
}

// Totals adds up the plans (Plans).
func (h *Hybrid) Totals() HybridTotals {
	var t HybridTotals
	for _, p := range h.Plans() {
		t.ResidentBytes += p.ResidentBytes
		t.StreamedBytes += p.StreamedBytes
		t.CPUBytes += p.CPUBytes
		t.HostLayerBytes += p.HostLayerBytes
		t.Predicted += p.Predicted
	}
	if t.Predicted > 0 {
		t.PredictedTokS = float64(time.Second) / float64(t.Predicted)
	}
	return t
}

// isHybrid reports whether a strategy places layers on the CPU.
func isHybrid(s paging.Strategy) bool {
	return s == paging.StrategyHybrid || s == paging.StrategyCPU
}

// openHybrid assembles the model on the GPUs and the CPU: it measures the
// rates (unless given: MeasureCalibratedRates, on the first GPU, the
// others alike), places the
// blocks over the GPUs in contiguous shares in proportion to their budgets
// (one GPU takes them all), and for each GPU plans which layers of its
// share stay on it, stream to it or run on the CPU, within its budget, and
// makes its budget and pager; then it builds the stages: runs of GPU
// layers computed from their GPU's pager, runs of CPU layers computed from
// that pager's host copies (pinned, so that the copy engine streams them
// to the GPU when a large prompt chunk runs them there).
func (e *Engine) openHybrid(ctx context.Context, info paging.ModelInfo, limits []int64, kv paging.KVPlacement, rates *paging.Rates) error {
	o := e.opts
	for _, gpu := range e.backends {
		if _, ok := tensor.AsyncUpload(gpu); !ok {
			return fmt.Errorf("engine: the %s strategy needs a GPU beside the CPU (%s has no copy engine)", e.strategy, gpu.Name())
		}
	}
	if e.mode != paging.ModeExplicit {
		return fmt.Errorf("engine: the %s strategy copies weights explicitly; memory mode %s is not supported with it", e.strategy, e.mode)
	}
	if len(e.backends) > 1 && kv != paging.KVDevice {
		return fmt.Errorf("engine: the %s strategy keeps the KV cache in host memory on one GPU (%d given): keep it on the devices", e.strategy, len(e.backends))
	}
	if err := e.openCPU(); err != nil {
		return err
	}
	cpu := e.cpu

	if rates == nil {
		block := info.Layers[e.cfg.BlockLayer(0)].Tensors
		dt := tensor.F16
		if len(block) > 0 {
			dt = block[len(block)-1].DType
		}
		// With what a block on the CPU costs beyond its bytes at r.CPU,
		// and its attention's reads of the KV cache, on a block of the
		// model's shape: the planner's prediction counts both.
		r, err := MeasureCalibratedRates(ctx, e.backends[0], cpu, dt, e.cfg, e.kvDType(), e.context, block)
		if err != nil {
			return err
		}
		rates = &r
	}
	e.hybrid = &Hybrid{Rates: *rates, CPU: cpu.Name(), Threads: cpuThreads(cpu)}
	e.kvRates = rates
	L := e.cfg.NumLayers
	all := make([]int, e.cfg.LayerCount())
	for l := range all {
		all[l] = l
	}
	parts := []paging.Placement{{FirstBlock: 0, EndBlock: L, Layers: all, Budget: limits[0]}}
	if len(e.backends) > 1 {
		var err error
		if parts, err = paging.PlaceLayers(info, limits); err != nil {
			return err
		}
	}
	hostLimit, err := e.hybridHostLimit(kv)
	if err != nil {
		return err
	}
	kvAll := nn.KVCacheBytes(e.cfg, e.context, e.kvDType())
	if e.hostAlloc == nil {
		e.hostAlloc = pinnedAllocator(e.backends[0], cpu)
	}
	var pagers []*paging.Pager
	var plans []*paging.HybridPlan
	var stages []nn.Stage
	var twinSeqs [][]int // per GPU, its pager's sequence while the twins run
	var total, cum int64
	for _, p := range parts {
		total += p.Bytes
	}
	forced, forcedSoFar := max(o.Memory.CPULayers, 0), 0
	for d, p := range parts {
		gpu, limit := e.backends[d], limits[d]
		stageInfo, src := info, nn.Source(e.lm)
		gpuHostLimit, cpuLayers := hostLimit, forced
		if len(parts) > 1 {
			stageInfo, src = info.Stage(p), nn.StageSource(nn.Source(e.lm), p.Layers)
			// Each GPU's share of the host memory limit and of a forced
			// count of CPU layers: in proportion to its share of the
			// weights.
			cum += p.Bytes
			if hostLimit > 0 {
				gpuHostLimit = max(int64(float64(hostLimit)*float64(p.Bytes)/float64(total)), 1)
			}
			upTo := int(math.Round(float64(forced) * float64(cum) / float64(total)))
			cpuLayers, forcedSoFar = min(upTo-forcedSoFar, len(p.Layers)), upTo
		}
		hp, err := e.planHybrid(stageInfo, limit, kv, *rates, gpu, gpuHostLimit, cpuLayers)
		if err != nil {
			if len(parts) > 1 {
				return fmt.Errorf("device %d (%s, layers %d..%d): %w", d, gpu.Name(), p.Layers[0], p.Layers[len(p.Layers)-1], err)
			}
			return err
		}
		plans = append(plans, hp)
		if _, _, err := e.placeKV(gpu, hp.GPU, 0); err != nil {
			return err
		}
		hostCache := gpuHostLimit
		if e.kv != nil && kv == paging.KVAuto && hostCache > 0 {
			if kvAll+hp.HostLayerBytes > hostCache {
				return kvOverLimit(kvAll+hp.HostLayerBytes, hostCache)
			}
			hostCache -= kvAll
		}

		bud, err := paging.NewBudget(gpu, limit, gpu.Name())
		if err != nil {
			return err
		}
		e.budgets = append(e.budgets, bud)
		if o.Record {
			bud.RecordHistory(1 << 20)
		}
		// The pager fills its ring ahead along the sequence, so that the
		// copies go on while the CPU computes its layers, as the plan's
		// prediction assumes.
		opts := paging.Options{HostCacheBytes: hostCache, HostLayers: hp.CPULayers, PrefetchFill: true}
		if len(parts) == 1 {
			// One GPU: its pager pins through the engine's pool, which
			// keeps the pages when the probe builds the placement again.
			if e.pinnedPool == nil {
				if pa, ok := tensor.Pinned(gpu); ok {
					e.pinnedPool = &pinnedPool{pa: pa}
				}
			}
			if e.pinnedPool != nil {
				opts.Pinned = e.pinnedPool
			}
		}
		pager, err := paging.NewPager(src, bud, hp.GPU, opts)
		if err != nil {
			return err
		}
		e.servers = append(e.servers, pager)
		pagers = append(pagers, pager)
		if err := pager.SetSequence(hp.Sequence); err != nil {
			return err
		}
		st, twinSeq := e.hybridStages(d, p, len(parts), hp, pager, bud)
		stages, twinSeqs = append(stages, st...), append(twinSeqs, twinSeq)
		e.devices = append(e.devices, Device{Name: gpu.Name(), Placement: p, Plan: hp.GPU, BudgetBytes: limit})
	}
	if len(plans) == 1 {
		e.hybrid.Plan = plans[0]
	} else {
		for d, p := range parts {
			e.hybrid.GPUs = append(e.hybrid.GPUs, HybridGPU{Device: e.backends[d].Name(), Placement: p, Plan: plans[d]})
		}
	}
	e.stages = stages
	twinMin := o.TwinMinTokens
	if twinMin == 0 {
		twinMin = DefaultTwinMinTokens
	}
	e.pipeOpts = nn.PipelineOptions{TwinMinTokens: twinMin, NoPeerCopies: o.NoPeerCopies, OnTwins: func(twins bool) {
		for d, pager := range pagers {
			seq := plans[d].Sequence
			if twins {
				seq = twinSeqs[d]
			}
			_ = pager.SetSequence(seq) // both are valid: checked above, and a subset of the pager's layers
		}
	}}
	// Warm up: the GPUs' layers load through their pagers (the resident
	// sets stay), the CPU's into the pagers' host copies.
	done, total := int64(0), e.lm.WeightBytes()
	layers := e.lm.Layers()
	for d, p := range parts {
		onCPU := map[int]bool{}
		for _, i := range plans[d].CPULayers {
			onCPU[i] = true
		}
		for i, l := range p.Layers {
			if onCPU[i] {
				if _, err := pagers[d].HostLayer(ctx, i); err != nil {
					return err
				}
			} else {
				if _, err := pagers[d].Acquire(ctx, i); err != nil {
					return err
				}
				pagers[d].Release(i)
			}
			done += layers[l].Bytes
			if o.Progress != nil {
				o.Progress(min(done, total), total)
			}
		}
	}
	return nil
}

// hybridHostLimit is the host memory the CPU's layers of every GPU may
// hold (Memory.HostCache; 0 sets no bound): with the KV cache in host
// memory (one GPU), what every block's cache leaves of it.
func (e *Engine) hybridHostLimit(kv paging.KVPlacement) (int64, error) {
	limit, kvAll := e.opts.Memory.HostCache, nn.KVCacheBytes(e.cfg, e.context, e.kvDType())
	if kv == paging.KVHost && limit != 0 {
		if kvAll >= max(limit, 0) {
			return 0, kvOverLimit(kvAll, limit)
		}
		limit -= kvAll
	}
	return limit, nil
}

// planHybrid plans one GPU's share (info) within its budget limit at
// rates: the split of the strategy (cpu: as llama.cpp; hybrid with
// Memory.CPULayers: cpuLayers forced; else the planner's choice), the
// CPU's layers within hostLimit.
func (e *Engine) planHybrid(info paging.ModelInfo, limit int64, kv paging.KVPlacement, rates paging.Rates, gpu tensor.Backend, hostLimit int64, cpuLayers int) (*paging.HybridPlan, error) {
	ho := paging.HybridOptions{Mode: paging.HybridAuto, HostBytes: hostLimit}
	switch {
	case e.strategy == paging.StrategyCPU:
		ho.Mode = paging.HybridAllCPU
	case e.opts.Memory.CPULayers != 0:
		ho.Mode, ho.CPULayers = paging.HybridForced, cpuLayers
	}
	return paging.PlanHybrid(info, limit, e.context, 1, rates, ho, paging.WithChunkTokens(e.chunk), paging.WithDevice(gpu), paging.WithKVPlacement(kv), paging.WithKVPositions(e.kvPositions()))
}

// buildHybrid is openHybrid, then the pipeline over its stages.
func (e *Engine) buildHybrid(ctx context.Context, info paging.ModelInfo, limits []int64, kv paging.KVPlacement, rates *paging.Rates) error {
	if err := e.openHybrid(ctx, info, limits, kv, rates); err != nil {
		return err
	}
	p, err := nn.NewPipeline(e.cfg, e.stages, e.pipeOpts)
	if err != nil {
		return err
	}
	p.SetGraphs(!e.opts.NoGraphs)
	e.pipeline = p
	return nil
}

// hybridStages are the stages of GPU d's share p (of n shares) under its
// hybrid plan: maximal runs of its layers on one side. The embedding
// (layer 0) and the head (layer L+1) belong to the first and last stage; a
// run of CPU layers starting at the embedding or ending at the head makes
// a stage of its own when the blocks next to it are on the GPU. The pager
// numbers the share's layers from 0 (the model's on one GPU).
//
// twinSeq is the pager's sequence while the twins run (a large chunk): its
// layers but those the CPU computes from their host copies then too: the
// embedding on the CPU's side (nn embeds a twin's chunk on the CPU), and
// the head alone in a CPU stage (which has no twin). The pager's prefetch
// would upload them for nothing, the embedding each time a chunk's head
// wraps the walk around, taking the link and the ring's room from the
// next chunk's first layers.
func (e *Engine) hybridStages(d int, p paging.Placement, n int, hp *paging.HybridPlan, pager *paging.Pager, bud *paging.Budget) (stages []nn.Stage, twinSeq []int) {
	gpu, cpu := e.backends[d], e.cpu
	var weights nn.Weights = pager
	var host nn.Weights = hostLayers{p: pager}
	if n > 1 {
		weights, host = nn.StageWeights(pager, p.Layers), hostLayers{p: pager, first: p.Layers[0]}
	}
	onCPU := map[int]bool{}
	for _, i := range hp.CPULayers {
		onCPU[p.Layers[i]] = true
	}
	// With the KV cache in host memory (one GPU), the GPU's blocks keep
	// theirs there too (the CPU's are there already).
	var hostKV *nn.HostKV
	if e.kv != nil {
		var gpuBlocks []int
		for b := range e.cfg.NumLayers {
			if !onCPU[e.cfg.BlockLayer(b)] {
				gpuBlocks = append(gpuBlocks, b)
			}
		}
		e.kv.HostBlocks = make([]int, e.cfg.NumLayers)
		for b := range e.kv.HostBlocks {
			e.kv.HostBlocks[b] = b
		}
		e.kv.HostBytes = nn.KVCacheBytes(e.cfg, e.context, e.kvDType())
		e.kv.Placement = paging.KVHost
		hostKV = &nn.HostKV{Blocks: gpuBlocks, CPU: cpu, Alloc: e.hostAlloc, DeviceMinTokens: e.kv.DeviceMinTokens, DeviceMaxPos: e.kv.DeviceMaxPos}
	}
	L := e.cfg.NumLayers
	side := func(layer int) bool { return onCPU[layer] }
	hostOnly := map[int]bool{} // model layers the CPU computes whatever the chunk
	addStage := func(cpuSide bool, lo, hi int) {
		st := nn.Stage{Backend: gpu, Alloc: bud, Weights: weights, FirstBlock: lo, EndBlock: hi, HostKV: hostKV}
		if cpuSide {
			st.Backend, st.Alloc, st.Weights, st.HostKV = cpu, e.hostAlloc, host, nil
			if lo == 0 && len(stages) == 0 {
				hostOnly[0] = true
			}
			if hi > lo {
				st.Twin = &nn.Twin{Backend: gpu, Alloc: bud, Weights: weights}
			} else if lo == L {
				hostOnly[L+1] = true
			}
		}
		stages = append(stages, st)
	}
	next := p.FirstBlock
	// The embedding's side: a stage of its own when it differs from block
	// 0's.
	if next == 0 && side(0) != side(1) {
		addStage(side(0), 0, 0)
	}
	for next < p.EndBlock {
		s := side(next + 1)
		end := next
		for end < p.EndBlock && side(end+1) == s {
			end++
		}
		addStage(s, next, end)
		next = end
	}
	if p.EndBlock == L && side(L+1) != side(L) {
		addStage(side(L+1), L, L)
	}
	for i, l := range p.Layers {
		if !hostOnly[l] {
			twinSeq = append(twinSeq, i)
		}
	}
	return stages, twinSeq
}

// Hybrid describes the CPU+GPU placement, or is nil when no layer is
// computed on the CPU's side by design (any strategy but hybrid and cpu).
func (e *Engine) Hybrid() *Hybrid { return e.hybrid }

// HostHeldBytes is the host memory the hybrid placement's CPU stages hold
// for their activations and KV cache (the CPU's layers themselves are in
// the pager's Stats.HostLayerBytes).
func (e *Engine) HostHeldBytes() int64 {
	if e.hostAlloc == nil {
		return 0
	}
	return e.hostAlloc.Held()
}

// hostLayers serves a pager's layers as host tensors, for the CPU to
// compute from; first is the model's layer that is the pager's layer 0 (a
// GPU's share of the model).
type hostLayers struct {
	p     *paging.Pager
	first int
}

func (h hostLayers) Acquire(ctx context.Context, layer int) (nn.LayerWeights, error) {
	return h.p.HostLayer(ctx, layer-h.first)
}

func (h hostLayers) Release(int) {}

// pinnedHost allocates the CPU stages' buffers and KV cache in pinned host
// memory, so that the hidden state and a twin's KV rows cross the link at
// full speed. Without pinned memory it falls back to the CPU's own.
type pinnedHost struct {
	pa  tensor.PinnedAllocator
	cpu tensor.Backend

	mu   sync.Mutex
	live map[*tensor.Tensor][]byte
	held int64
}

func pinnedAllocator(gpu, cpu tensor.Backend) *pinnedHost {
	pa, _ := tensor.Pinned(gpu)
	return &pinnedHost{pa: pa, cpu: cpu, live: map[*tensor.Tensor][]byte{}}
}

func (p *pinnedHost) Alloc(_ paging.Category, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	if p.pa == nil {
		return p.cpu.Alloc(dt, shape)
	}
	n, err := dt.ShapeBytes(shape) // a Q8_0 KV cache's rows are whole blocks
	if err != nil {
		return nil, fmt.Errorf("engine: pinned host tensor: %w", err)
	}
	b, err := p.pa.AllocPinned(max(n, 1))
	if err != nil {
		return nil, err
	}
	t, err := tensor.FromBytes(dt, shape, b[:n])
	if err != nil {
		p.pa.FreePinned(b)
		return nil, err
	}
	p.mu.Lock()
	p.live[t] = b
	p.held += int64(len(b))
	p.mu.Unlock()
	return t, nil
}

func (p *pinnedHost) Free(t *tensor.Tensor) {
	if t == nil {
		return
	}
	if p.pa == nil {
		p.cpu.Free(t)
		return
	}
	p.mu.Lock()
	b, ok := p.live[t]
	delete(p.live, t)
	p.held -= int64(len(b))
	p.mu.Unlock()
	if ok {
		p.pa.FreePinned(b)
	}
}

// Held is the host bytes the CPU stages' buffers and KV cache hold now.
func (p *pinnedHost) Held() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held
}

// cpuThreads is the threads a CPU backend computes with.
func cpuThreads(b tensor.Backend) int {
	if t, ok := b.(interface{ Threads() int }); ok {
		return t.Threads()
	}
	return 0
}
