package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// unlimited stands for "no budget": larger than any device.
const unlimited = math.MaxInt64 / 4

// memory is the resolved memory settings.
type memory struct {
	budget    int64   // 0: none given (one device)
	budgets   []int64 // per device, when several; 0 entries: none given
	hostLimit int64   // 0: the plan's choice; < 0: no host cache
	strategy  paging.Strategy
	mode      paging.MemoryMode
}

// resolveMemory merges the -config file under the flags and parses sizes:
// one budget for one device, or one for each of several devices (a single
// value applies to each; "0=3GiB,1=5GiB" gives each its own, by device
// number).
func resolveMemory(o *options, backends []tensor.Backend, ordinals []int) (*memory, error) {
	var fc paging.MemoryConfig
	if o.configFile != "" {
		if _, err := infile.Check(o.configFile); err != nil { // a named pipe would block the read
			return nil, cli.Usagef("-config: %v", err)
		}
		f, err := paging.LoadConfigFile(o.configFile)
		if err != nil {
			return nil, cli.UsageError{Err: err}
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
	fraction := pick("gpu-memory-fraction", o.gpuFraction, fc.GPUMemoryFraction)
	if o.set["gpu-memory-fraction"] && o.set["gpu-memory-limit"] {
		return nil, cli.Usagef("give -gpu-memory-limit or -gpu-memory-fraction, not both")
	}
	if o.set["gpu-memory-fraction"] {
		gpuLimit = ""
	} else if gpuLimit != "" {
		fraction = ""
	}

	m := &memory{budgets: make([]int64, len(backends))}
	for d, b := range backends {
		var err error
		switch {
		case gpuLimit != "":
			v, perr := paging.PerDevice(gpuLimit, ordinals[d])
			if perr != nil {
				return nil, cli.Usagef("-gpu-memory-limit: %v", perr)
			}
			if m.budgets[d], err = paging.ParseSize(v); err != nil {
				return nil, cli.Usagef("-gpu-memory-limit: %v", err)
			}
			if m.budgets[d] <= 0 {
				return nil, cli.Usagef("-gpu-memory-limit %q must be positive", v)
			}
		case fraction != "":
			v, perr := paging.PerDevice(fraction, ordinals[d])
			if perr != nil {
				return nil, cli.Usagef("-gpu-memory-fraction: %v", perr)
			}
			f, ferr := paging.ParseFraction(v)
			if ferr != nil {
				return nil, cli.Usagef("-gpu-memory-fraction: %v", ferr)
			}
			if m.budgets[d], err = paging.DeviceFraction(b, f); err != nil {
				return nil, cli.Usagef("-gpu-memory-fraction: %v", err)
			}
		}
	}
	m.budget = m.budgets[0]
	var err error
	if hostLimit != "" {
		if m.hostLimit, err = paging.ParseSize(hostLimit); err != nil {
			return nil, cli.Usagef("-host-memory-limit: %v", err)
		}
		if m.hostLimit == 0 {
			m.hostLimit = -1 // no host cache at all
		}
	}
	switch {
	case offload != "":
		if m.strategy, err = paging.ParseStrategy(offload); err != nil {
			return nil, cli.Usagef("-offload: %v", err)
		}
	case slices.ContainsFunc(m.budgets, func(b int64) bool { return b > 0 }):
		m.strategy = paging.StrategyBalanced
	default:
		m.strategy = paging.StrategyNone
	}
	m.mode = paging.ModeExplicit
	if mode != "" {
		if m.mode, err = paging.ParseMemoryMode(mode); err != nil {
			return nil, cli.Usagef("-memory-mode: %v", err)
		}
	}
	if _, ok := tensor.Managed(backends[0]); m.mode != paging.ModeExplicit && !ok {
		return nil, cli.Usagef("-memory-mode %s needs a device with unified memory, such as -device cuda (running on %s)", m.mode, backends[0].Name())
	}
	return m, nil
}

// engine is the model under the memory settings, on one device or spread
// over several.
type engine struct {
	backends  []tensor.Backend
	budgets   []*paging.Budget
	servers   []paging.Server
	plans     []*paging.PlanResult
	placement []paging.Placement // nil on one device
	sess      interface {
		Forward(ctx context.Context, ids []int32, all bool, hook nn.Hook) ([]float32, error)
		Close()
	}
}

// openEngine plans the model on the backends (placing contiguous layer
// ranges on each in proportion to their budgets when there are several),
// opens a server per device, loads the resident layers drawing progress,
// and opens a session.
func openEngine(ctx context.Context, lm *loader.Model, cfg *arch.Config, backends []tensor.Backend, mem *memory,
	contextLen, chunk int, snapshot bool, bar *progress) (*engine, error) {
	info, err := nn.ModelInfo(lm, cfg)
	if err != nil {
		return nil, err
	}
	e := &engine{backends: backends}
	limits := make([]int64, len(backends))
	for d, b := range backends {
		limits[d] = mem.budget
		if len(backends) > 1 {
			limits[d] = mem.budgets[d]
		}
		if limits[d] == 0 {
			limits[d] = unlimited
			if mi, ok := b.(tensor.MemoryInfo); ok { // the device's free memory bounds "no budget"
				if free, _, err := mi.MemInfo(); err == nil && free > 0 {
					limits[d] = free
				}
			}
		}
	}
	// Each device's layers, in the model's numbering.
	parts := []paging.Placement{{FirstBlock: 0, EndBlock: cfg.NumLayers, Budget: limits[0]}}
	for l := range lm.Layers() {
		parts[0].Layers = append(parts[0].Layers, l)
	}
	if len(backends) > 1 {
		if parts, err = paging.PlaceLayers(info, limits); err != nil {
			return nil, err
		}
		e.placement = parts
	}
	var stages []nn.Stage
	for d, p := range parts {
		b := backends[d]
		plan, err := paging.Plan(info.Stage(p), limits[d], mem.strategy, contextLen, 1, paging.WithChunkTokens(chunk), paging.WithDevice(b))
		if err != nil {
			e.close()
			if len(backends) > 1 {
				return nil, fmt.Errorf("device %d (%s, layers %d..%d): %w", d, b.Name(), p.Layers[0], p.Layers[len(p.Layers)-1], err)
			}
			return nil, err
		}
		bud, err := paging.NewBudget(b, limits[d], b.Name())
		if err != nil {
			e.close()
			return nil, err
		}
		if snapshot {
			bud.RecordHistory(1 << 20)
		}
		e.plans, e.budgets = append(e.plans, plan), append(e.budgets, bud)
		srv, err := paging.NewServer(ctx, mem.mode, nn.StageSource(nn.Source(lm), p.Layers), bud, plan, paging.Options{HostCacheBytes: mem.hostLimit})
		if err != nil {
			e.close()
			return nil, err
		}
		e.servers = append(e.servers, srv)
		stages = append(stages, nn.Stage{Backend: b, Alloc: bud, Weights: nn.StageWeights(srv, p.Layers), FirstBlock: p.FirstBlock, EndBlock: p.EndBlock})
	}
	// Warm up: every layer once, in order, so the resident set is loaded
	// before the clock starts on the prompt.
	layers := lm.Layers()
	done, total := int64(0), lm.WeightBytes()
	for d, p := range parts {
		for i, l := range p.Layers {
			if _, err := e.servers[d].Acquire(ctx, i); err != nil {
				e.close()
				return nil, err
			}
			e.servers[d].Release(i)
			done += layers[l].Bytes
			bar.update(min(done, total), total)
		}
	}
	// The session is stored only once it exists: a nil *nn.Session in the
	// interface would not compare equal to nil in close.
	if len(stages) == 1 {
		m, err := nn.New(cfg, stages[0].Backend, stages[0].Alloc, stages[0].Weights)
		if err != nil {
			e.close()
			return nil, err
		}
		s, err := m.NewSession(contextLen, chunk)
		if err != nil {
			e.close()
			return nil, err
		}
		e.sess = s
	} else {
		pl, err := nn.NewPipeline(cfg, stages)
		if err != nil {
			e.close()
			return nil, err
		}
		s, err := pl.NewSession(contextLen, chunk)
		if err != nil {
			e.close()
			return nil, err
		}
		e.sess = s
	}
	return e, nil
}

// markStep marks a decoded token on every device.
func (e *engine) markStep() {
	for _, s := range e.servers {
		s.MarkStep()
	}
}

// stats adds up the devices' paging statistics; the peak is the largest
// device's.
func (e *engine) stats() paging.Stats {
	var t paging.Stats
	for i, s := range e.servers {
		st := s.Stats()
		if i == 0 {
			t = st
			continue
		}
		t.Layers += st.Layers
		t.Acquires += st.Acquires
		t.Hits += st.Hits
		t.Misses += st.Misses
		t.Loads += st.Loads
		t.Evictions += st.Evictions
		t.BytesDiskToHost += st.BytesDiskToHost
		t.BytesHostToDevice += st.BytesHostToDevice
		t.BytesPerStep += st.BytesPerStep
		t.ResidentWeightBytes += st.ResidentWeightBytes
		t.StreamedWeightBytes += st.StreamedWeightBytes
		t.PinnedHostBytes += st.PinnedHostBytes
		t.PeakDeviceBytes = max(t.PeakDeviceBytes, st.PeakDeviceBytes)
	}
	return t
}

func (e *engine) summary() string { return paging.Summary(e.budgets...) }

// close frees what openEngine built, which may be only a part when it
// failed; it is safe on a nil engine.
func (e *engine) close() error {
	if e == nil {
		return nil
	}
	if e.sess != nil {
		e.sess.Close()
	}
	var errs []error
	for _, s := range e.servers {
		errs = append(errs, s.Close())
	}
	for _, b := range e.budgets {
		errs = append(errs, b.Close())
	}
	return errors.Join(errs...)
}

func writeSnapshot(path string, bud *paging.Budget) error {
	if err := atomicfile.Write(path, bud.WriteSnapshot); err != nil {
		return fmt.Errorf("-memory-snapshot: %w", err)
	}
	return nil
}
