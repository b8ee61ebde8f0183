package main

import (
	"context"
	"fmt"
	"math"
	"os"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// unlimited stands for "no budget": larger than any device.
const unlimited = math.MaxInt64 / 4

// memory is the resolved memory settings.
type memory struct {
	budget    int64 // 0: none given
	hostLimit int64 // 0: the plan's choice; < 0: no host cache
	strategy  paging.Strategy
	mode      paging.MemoryMode
}

// resolveMemory merges the -config file under the flags and parses sizes.
func resolveMemory(o *options, b tensor.Backend) (*memory, error) {
	var fc paging.MemoryConfig
	if o.configFile != "" {
		f, err := paging.LoadConfigFile(o.configFile)
		if err != nil {
			return nil, usageError{err}
		}
		fc = f.Memory
	}
	pick := func(flagName, flagVal, fileVal string) string {
		if o.set[flagName] {
			return flagVal
		}
		return fileVal
	}
	gpuLimit := pick("gpu-memory-limit", o.gpuLimit, fc.MaxGPUMemory)
	hostLimit := pick("host-memory-limit", o.hostLimit, fc.MaxHostMemory)
	offload := pick("offload", o.offload, fc.OffloadStrategy)
	mode := pick("memory-mode", o.memMode, fc.MemoryMode)
	fraction := fc.GPUMemoryFraction
	if o.set["gpu-memory-fraction"] {
		fraction = o.gpuFraction
	}

	m := &memory{}
	var err error
	if gpuLimit != "" && o.set["gpu-memory-fraction"] && o.set["gpu-memory-limit"] {
		return nil, usagef("give -gpu-memory-limit or -gpu-memory-fraction, not both")
	}
	switch {
	case gpuLimit != "" && !o.set["gpu-memory-fraction"]:
		if m.budget, err = paging.ParseSize(gpuLimit); err != nil {
			return nil, usagef("-gpu-memory-limit: %v", err)
		}
		if m.budget <= 0 {
			return nil, usagef("-gpu-memory-limit %q must be positive", gpuLimit)
		}
	case fraction != 0:
		if m.budget, err = paging.DeviceFraction(b, fraction); err != nil {
			return nil, usagef("-gpu-memory-fraction: %v", err)
		}
	}
	if hostLimit != "" {
		if m.hostLimit, err = paging.ParseSize(hostLimit); err != nil {
			return nil, usagef("-host-memory-limit: %v", err)
		}
		if m.hostLimit == 0 {
			m.hostLimit = -1 // no host cache at all
		}
	}
	switch {
	case offload != "":
		if m.strategy, err = paging.ParseStrategy(offload); err != nil {
			return nil, usagef("-offload: %v", err)
		}
	case m.budget > 0:
		m.strategy = paging.StrategyBalanced
	default:
		m.strategy = paging.StrategyNone
	}
	m.mode = paging.ModeExplicit
	if mode != "" {
		if m.mode, err = paging.ParseMemoryMode(mode); err != nil {
			return nil, usagef("-memory-mode: %v", err)
		}
	}
	if m.mode != paging.ModeExplicit && !isCUDA(b) {
		return nil, usagef("-memory-mode %s needs the cuda device (running on %s)", m.mode, b.Name())
	}
	return m, nil
}

// served adapts a paging.Server to nn.Weights.
type served struct{ paging.Server }

func (s served) Acquire(ctx context.Context, layer int) (nn.LayerWeights, error) {
	return s.Server.Acquire(ctx, layer)
}

// paged is a model's weights under a budget.
type paged struct {
	plan   *paging.PlanResult
	budget *paging.Budget
	pager  paging.Server
}

// openPaged plans the model under the memory settings and loads the
// resident layers, drawing progress.
func openPaged(ctx context.Context, lm *loader.Model, cfg nn.Config, b tensor.Backend, mem *memory,
	contextLen, chunk int, snapshot bool, bar *progress) (*paged, error) {
	info, err := nn.ModelInfo(lm, cfg)
	if err != nil {
		return nil, err
	}
	limit := mem.budget
	if limit == 0 {
		limit = unlimited
		if mi, ok := b.(tensor.MemoryInfo); ok { // the device's free memory bounds "no budget"
			if free, _, err := mi.MemInfo(); err == nil && free > 0 {
				limit = free
			}
		}
	}
	plan, err := paging.Plan(info, limit, mem.strategy, contextLen, 1, paging.WithChunkTokens(chunk))
	if err != nil {
		return nil, err
	}
	p := &paged{plan: plan, budget: paging.NewBudget(b, limit, b.Name())}
	if snapshot {
		p.budget.RecordHistory(1 << 20)
	}
	p.pager, err = paging.NewServer(ctx, mem.mode, nn.Source(lm), p.budget, plan, paging.Options{HostCacheBytes: mem.hostLimit})
	if err != nil {
		p.budget.Close()
		return nil, err
	}
	// Warm up: every layer once, in order, so the resident set is loaded
	// before the clock starts on the prompt.
	layers := lm.Layers()
	done, total := int64(0), lm.WeightBytes()
	for l := 0; l < len(layers); l++ {
		if _, err := p.pager.Acquire(ctx, l); err != nil {
			p.close()
			return nil, err
		}
		p.pager.Release(l)
		done += layers[l].Bytes
		bar.update(min(done, total), total)
	}
	return p, nil
}

func (p *paged) close() error {
	err := p.pager.Close()
	if e := p.budget.Close(); err == nil {
		err = e
	}
	return err
}

func writeSnapshot(path string, bud *paging.Budget) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("-memory-snapshot: %w", err)
	}
	if err := bud.WriteSnapshot(f); err != nil {
		f.Close()
		return fmt.Errorf("-memory-snapshot: %w", err)
	}
	return f.Close()
}

func isCUDA(b tensor.Backend) bool { return len(b.Name()) >= 4 && b.Name()[:4] == "cuda" }
