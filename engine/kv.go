package engine

import (
	"context"
	"fmt"
	"slices"

	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// KVReport says where the KV cache is and what keeping some of it in host
// memory cost so far.
type KVReport struct {
	Placement paging.KVPlacement `json:"placement"`
	// HostBlocks are the decoder blocks whose cache is in host memory;
	// HostBytes what they hold there (pinned where the device copies
	// from it), DeviceBytes the device's part of the cache (ScratchBytes
	// of it the copies a prefill chunk attends over).
	HostBlocks   []int `json:"host_blocks"`
	HostBytes    int64 `json:"host_bytes"`
	DeviceBytes  int64 `json:"device_bytes"`
	ScratchBytes int64 `json:"scratch_bytes"`
	// DeviceMinTokens is the chunk from which a host block attends on
	// the device over the scratch; smaller ones (decode) attend on the CPU.
	DeviceMinTokens int `json:"device_min_tokens"`
	// DeviceMaxPos is the context up to which a decode step uploads a
	// host block's rows and attends on the device instead, where the rates
	// predict that faster (paging.KVUploadMaxPos); 0 never.
	DeviceMaxPos int `json:"device_max_pos"`
	// Rates are the rates measured at Open (or Options.Rates) that auto
	// placed the cache by, and that bound a decode step; nil with the
	// cache on the device.
	Rates *paging.Rates `json:"rates,omitempty"`
	nn.KVStats
}

// String summarises the report on one line.
func (r *KVReport) String() string {
	where := "decode attends on the CPU"
	if r.DeviceMaxPos > 0 {
		where = fmt.Sprintf("decode attends on the device over uploaded rows up to %d positions, then on the CPU", r.DeviceMaxPos)
	}
	return fmt.Sprintf("KV cache %s: %s on the device (%s scratch), %s in host memory for %d blocks; %s; CPU attention %v in %d block steps, %s uploaded, %s downloaded",
		r.Placement, paging.FormatSize(r.DeviceBytes), paging.FormatSize(r.ScratchBytes), paging.FormatSize(r.HostBytes), len(r.HostBlocks),
		where, r.CPUAttention, r.CPUAttentions, paging.FormatSize(r.UploadBytes), paging.FormatSize(r.DownloadBytes))
}

// kvPlacement checks the KV cache placement against the devices and
// strategy.
func (e *Engine) kvPlacement() (paging.KVPlacement, error) {
	kv := e.opts.Memory.KVCache
	if kv == "" || kv == paging.KVDevice {
		return paging.KVDevice, nil
	}
	if _, err := paging.ParseKVPlacement(string(kv)); err != nil {
		return "", fmt.Errorf("engine: %w", err)
	}
	for _, b := range e.backends {
		if _, ok := tensor.AsyncUpload(b); !ok {
			if kv == paging.KVHost {
				return "", fmt.Errorf("engine: KV cache placed host: %s has no memory of its own to keep it out of", b.Name())
			}
			return paging.KVDevice, nil // auto on the CPU: it is in host memory
		}
	}
	return kv, nil
}

// kvPlanOptions are the planner's options for placement kv: with auto, the
// rates to predict with (Options.Rates, or measured now; host measures
// them too, for KVReport.Rates).
func (e *Engine) kvPlanOptions(ctx context.Context, kv paging.KVPlacement, info paging.ModelInfo) ([]paging.PlanOption, error) {
	if kv == paging.KVDevice {
		return nil, nil
	}
	opts := []paging.PlanOption{paging.WithKVPlacement(kv)}
	// The rates are measured for host too, for the report's decode bound.
	if err := e.openCPU(); err != nil {
		return nil, err
	}
	rates := e.opts.Rates
	if rates == nil {
		rates = e.kvRates // measured for an earlier device (they are alike)
	}
	if rates == nil {
		block := info.Layers[e.cfg.BlockLayer(0)].Tensors
		dt := tensor.F16
		if len(block) > 0 {
			dt = block[len(block)-1].DType
		}
		// The CPU's attention over host KV reads slower than its
		// products: KVAuto predicts with its rate (CalibrateCPU).
		r, err := MeasureCalibratedRates(ctx, e.backends[0], e.cpu, dt, e.cfg, e.kvDType(), e.context, block)
		if err != nil {
			return nil, err
		}
		rates = &r
	}
	e.kvRates = rates
	if kv == paging.KVAuto {
		opts = append(opts, paging.WithKVRates(*rates))
	}
	return opts, nil
}

// openCPU opens the CPU backend that attends over host KV caches, once.
func (e *Engine) openCPU() error {
	if e.cpu != nil {
		return nil
	}
	cpu, err := tensor.OpenDevice("cpu", tensor.DeviceOptions{Threads: e.opts.Threads})
	if err != nil {
		return err
	}
	e.owned = append(e.owned, cpu)
	e.cpu = cpu
	return nil
}

// placeKV prepares the host side of a plan that keeps some blocks' KV
// cache in host memory: the CPU that attends over it and the pinned
// allocator, within the host memory limit (Memory.HostCache) that the
// host KV caches of every device share, whose rest goes to the host cache
// of streamed layers. firstBlock is the device's first block (its plan
// numbers its blocks from 0). It returns that cache's bound for the pager,
// and the stage's HostKV (its blocks in the model's numbering), nil when
// it keeps every block's cache on the device.
func (e *Engine) placeKV(dev tensor.Backend, plan *paging.PlanResult, firstBlock int) (int64, *nn.HostKV, error) {
	limit := e.opts.Memory.HostCache
	if len(plan.KVHostBlocks) == 0 {
		return limit, nil, nil
	}
	held := plan.KVHostBytes
	if e.kv != nil {
		held += e.kv.HostBytes // earlier devices'
	}
	if limit != 0 && held > max(limit, 0) {
		return 0, nil, kvOverLimit(held, limit)
	}
	if limit > 0 {
		limit -= held
		if limit == 0 {
			limit = -1 // nothing left for streamed layers
		}
	}
	if err := e.openCPU(); err != nil {
		return 0, nil, err
	}
	if e.hostAlloc == nil {
		// Pinned memory is portable: every device copies from it at
		// full speed, whichever allocated it.
		e.hostAlloc = pinnedAllocator(dev, e.cpu)
	}
	minTokens := e.opts.TwinMinTokens
	if minTokens == 0 {
		minTokens = DefaultTwinMinTokens
	}
	maxPos := 0
	if e.kvRates != nil && plan.ContextLen > 0 {
		row := plan.KVHostBytes / int64(len(plan.KVHostBlocks)) / int64(plan.ContextLen)
		maxPos = min(paging.KVUploadMaxPos(*e.kvRates, row), plan.ContextLen)
	}
	blocks := make([]int, len(plan.KVHostBlocks))
	for i, b := range plan.KVHostBlocks {
		blocks[i] = firstBlock + b
	}
	if e.kv == nil {
		e.kv = &KVReport{Placement: plan.KVPlacement, DeviceMinTokens: minTokens, DeviceMaxPos: maxPos, Rates: e.kvRates}
	}
	e.kv.HostBlocks = append(e.kv.HostBlocks, blocks...)
	e.kv.HostBytes += plan.KVHostBytes
	e.kv.DeviceBytes += plan.KVCacheBytes
	e.kv.ScratchBytes += plan.KVScratchBytes
	e.kv.DeviceMaxPos = min(e.kv.DeviceMaxPos, maxPos)
	return limit, &nn.HostKV{Blocks: blocks, CPU: e.cpu, Alloc: e.hostAlloc, DeviceMinTokens: minTokens, DeviceMaxPos: maxPos}, nil
}

// kvOverLimit is the error of a KV cache in host memory that, with what
// else the host holds, takes need bytes, over the host memory limit.
func kvOverLimit(need, limit int64) error {
	return fmt.Errorf("engine: the KV cache in host memory needs %s (%d bytes) of host memory, over the host memory limit of %s (-host-memory-limit)",
		paging.FormatSize(need), need, paging.FormatSize(max(limit, 0)))
}

// KV reports where the KV cache is and the work of its host part so far:
// with a host part (Memory.KVCache), its blocks, bytes and counters; with
// the hybrid strategies, the CPU layers' blocks as the host part (their
// caches are where the CPU computes them); otherwise all of it on the
// devices, as planned.
func (e *Engine) KV() *KVReport {
	if e.kv != nil {
		r := *e.kv
		switch {
		case e.model != nil:
			r.KVStats = e.model.KVStats()
		case e.pipeline != nil:
			r.KVStats = e.pipeline.KVStats()
		}
		r.HostBlocks = slices.Clone(r.HostBlocks)
		return &r
	}
	r := &KVReport{Placement: paging.KVDevice, HostBlocks: []int{}}
	for _, d := range e.devices {
		r.DeviceBytes += d.Plan.KVCacheBytes
	}
	if h := e.hybrid; h != nil && e.cfg.NumLayers > 0 {
		perBlock := nn.KVCacheBytes(e.cfg, e.context, e.kvDType()) / int64(e.cfg.NumLayers)
		for _, l := range h.CPULayers() {
			if b := l - e.cfg.BlockLayer(0); b >= 0 && b < e.cfg.NumLayers {
				r.HostBlocks = append(r.HostBlocks, b)
			}
		}
		r.HostBytes = int64(len(r.HostBlocks)) * perBlock
		if len(r.HostBlocks) > 0 {
			r.Placement = paging.KVAuto
		}
	}
	return r
}
