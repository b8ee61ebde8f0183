package engine

import (
	"context"
	"fmt"
	"sync"

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

// Hybrid is the part of an engine that computes layers on the CPU beside a
// GPU: the plan, the rates it was made from, and the CPU backend.
type Hybrid struct {
	Plan  *paging.HybridPlan `json:"plan"`
	Rates paging.Rates       `json:"rates"`
	// CPU is the CPU device's name and threads.
	CPU     string `json:"cpu"`
	Threads int    `json:"threads"`
}

// isHybrid reports whether a strategy places layers on the CPU.
func isHybrid(s paging.Strategy) bool {
	return s == paging.StrategyHybrid || s == paging.StrategyCPU
}

// openHybrid assembles the model on one GPU and the CPU: it measures the
// rates (unless given: MeasureCalibratedRates), plans which layers stay on the GPU, stream to it or
// run on the CPU, makes the GPU's budget and pager, and builds the stages:
// runs of GPU layers computed from the pager, runs of CPU layers computed
// from the pager's host copies (pinned, so that the copy engine streams
// them to the GPU when a large prompt chunk runs them there).
func (e *Engine) openHybrid(ctx context.Context, info paging.ModelInfo, limit int64, kv paging.KVPlacement) error {
	o := e.opts
	if len(e.backends) != 1 {
		return fmt.Errorf("engine: the %s strategy runs on one GPU and the CPU (%d devices given)", e.strategy, len(e.backends))
	}
	gpu := e.backends[0]
	if _, ok := tensor.AsyncUpload(gpu); !ok {
		return fmt.Errorf("engine: the %s strategy needs a GPU beside the CPU (%s has no copy engine)", e.strategy, gpu.Name())
	}
	if e.mode != paging.ModeExplicit {
		return fmt.Errorf("engine: the %s strategy copies weights explicitly; memory mode %s is not supported with it", e.strategy, e.mode)
	}
	if err := e.openCPU(); err != nil {
		return err
	}
	cpu := e.cpu

	rates := o.Rates
	if rates == nil {
		block := info.Layers[e.cfg.BlockLayer(0)].Tensors
		dt := tensor.F16
		if len(block) > 0 {
			dt = block[len(block)-1].DType
		}
		// With what a block on the CPU costs beyond its bytes at r.CPU,
		// and its attention's reads of the KV cache, on a block of the
		// model's shape: the planner's prediction counts both.
		r, err := MeasureCalibratedRates(ctx, gpu, cpu, dt, e.cfg, e.kvDType(), e.context, block)
		if err != nil {
			return err
		}
		rates = &r
	}
	// With the KV cache in host memory, every block's is there (the
	// CPU's blocks' and the GPU's): the host memory limit holds it and
	// the CPU's layers.
	hostLimit, kvAll := o.Memory.HostCache, nn.KVCacheBytes(e.cfg, e.context, e.kvDType())
	if kv == paging.KVHost && hostLimit != 0 {
		if kvAll >= max(hostLimit, 0) {
			return kvOverLimit(kvAll, hostLimit)
		}
		hostLimit -= kvAll
	}
	ho := paging.HybridOptions{Mode: paging.HybridAuto, HostBytes: hostLimit}
	switch {
	case e.strategy == paging.StrategyCPU:
		ho.Mode = paging.HybridAllCPU
	case o.Memory.CPULayers != 0:
		ho.Mode, ho.CPULayers = paging.HybridForced, max(o.Memory.CPULayers, 0)
	}
	hp, err := paging.PlanHybrid(info, limit, e.context, 1, *rates, ho, paging.WithChunkTokens(e.chunk), paging.WithDevice(gpu), paging.WithKVPlacement(kv), paging.WithKVPositions(e.kvPositions()))
	if err != nil {
		return err
	}
	e.hybrid = &Hybrid{Plan: hp, Rates: *rates, CPU: cpu.Name(), Threads: cpuThreads(cpu)}
	e.kvRates = rates
	if _, err := e.placeKV(gpu, hp.GPU); err != nil {
		return err
	}
	if e.kv != nil && kv == paging.KVAuto && hostLimit > 0 {
		if kvAll+hp.HostLayerBytes > hostLimit {
			return kvOverLimit(kvAll+hp.HostLayerBytes, hostLimit)
		}
		hostLimit -= kvAll
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
	pager, err := paging.NewPager(nn.Source(e.lm), bud, hp.GPU, paging.Options{HostCacheBytes: hostLimit, HostLayers: hp.CPULayers, PrefetchFill: true})
	if err != nil {
		return err
	}
	e.servers = append(e.servers, pager)
	if err := pager.SetSequence(hp.Sequence); err != nil {
		return err
	}
	all := make([]int, e.cfg.LayerCount())
	for l := range all {
		all[l] = l
	}

	onCPU := map[int]bool{}
	for _, l := range hp.CPULayers {
		onCPU[l] = true
	}
	if e.hostAlloc == nil {
		e.hostAlloc = pinnedAllocator(gpu, cpu)
	}
	hostAlloc := e.hostAlloc
	host := hostLayers{pager}
	// With the KV cache in host memory, the GPU's blocks keep theirs there
	// too (the CPU's are there already).
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
		hostKV = &nn.HostKV{Blocks: gpuBlocks, CPU: cpu, Alloc: hostAlloc, DeviceMinTokens: e.kv.DeviceMinTokens, DeviceMaxPos: e.kv.DeviceMaxPos}
	}
	// Stages: maximal runs of layers on one side. The embedding (layer 0)
	// and the head (layer L+1) belong to the first and last stage; a run
	// of CPU layers starting at the embedding or ending at the head makes
	// a stage of its own when the blocks next to it are on the GPU.
	L := e.cfg.NumLayers
	side := func(layer int) bool { return onCPU[layer] }
	var stages []nn.Stage
	addStage := func(cpuSide bool, lo, hi int) {
		st := nn.Stage{Backend: gpu, Alloc: bud, Weights: pager, FirstBlock: lo, EndBlock: hi, HostKV: hostKV}
		if cpuSide {
			st.Backend, st.Alloc, st.Weights, st.HostKV = cpu, hostAlloc, host, nil
			if hi > lo {
				st.Twin = &nn.Twin{Backend: gpu, Alloc: bud, Weights: pager}
			}
		}
		stages = append(stages, st)
	}
	// The embedding's side: a stage of its own when it differs from block
	// 0's.
	next := 0
	if side(0) != side(1) {
		addStage(side(0), 0, 0)
	}
	for next < L {
		s := side(next + 1)
		end := next
		for end < L && side(end+1) == s {
			end++
		}
		addStage(s, next, end)
		next = end
	}
	if side(L+1) != side(L) {
		addStage(side(L+1), L, L)
	}
	e.devices = append(e.devices, Device{Name: gpu.Name(), Placement: paging.Placement{FirstBlock: 0, EndBlock: L, Layers: all, Budget: limit},
		Plan: hp.GPU, BudgetBytes: limit})
	e.stages = stages
	twinMin := o.TwinMinTokens
	if twinMin == 0 {
		twinMin = DefaultTwinMinTokens
	}
	e.pipeOpts = nn.PipelineOptions{TwinMinTokens: twinMin, OnTwins: func(twins bool) {
		seq := hp.Sequence
		if twins {
			seq = all
		}
		_ = pager.SetSequence(seq) // checked above: both are valid
	}}
	// Warm up: the GPU's layers load through the pager (the resident set
	// stays), the CPU's into the pager's host copies.
	done, total := int64(0), e.lm.WeightBytes()
	layers := e.lm.Layers()
	for l := range all {
		if onCPU[l] {
			if _, err := pager.HostLayer(ctx, l); err != nil {
				return err
			}
		} else {
			if _, err := pager.Acquire(ctx, l); err != nil {
				return err
			}
			pager.Release(l)
		}
		done += layers[l].Bytes
		if o.Progress != nil {
			o.Progress(min(done, total), total)
		}
	}
	return nil
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
// compute from.
type hostLayers struct{ p *paging.Pager }

func (h hostLayers) Acquire(ctx context.Context, layer int) (nn.LayerWeights, error) {
	return h.p.HostLayer(ctx, layer)
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
