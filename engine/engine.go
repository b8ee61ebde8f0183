package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Memory says how much device and host memory the engine may use, and how.
type Memory struct {
	// Budgets are the device budgets in bytes, one per device, or one
	// for every device. A budget of 0 (or none given) takes the default
	// policy (see the package comment).
	Budgets []int64
	// Fractions, instead of Budgets: each device's budget as a fraction
	// of its total memory, in (0, 1]; one value for every device, or one
	// per device.
	Fractions []float64
	// HostCache bounds the host RAM that keeps streamed layers between
	// uses: 0 takes the plan's choice, < 0 keeps none.
	HostCache int64
	// Strategy is the offload strategy; "" is none when no budget was
	// given and balanced when one was.
	Strategy paging.Strategy
	// Mode is how weights reach a device; "" is explicit copies.
	Mode paging.MemoryMode
	// KVDType is the stored dtype of the sessions' KV cache (F32, F16,
	// BF16 or Q8_0; nn.SessionOptions.KVDType); Invalid, the zero value,
	// is F32. The plans count its stored bytes.
	KVDType tensor.DType
	// CPULayers, with the hybrid strategy, is how many layers the CPU
	// computes: 0 lets the planner choose from the measured rates, < 0
	// none.
	CPULayers int
	// ExpertPolicy is the expert cache's eviction policy for a mixture
	// of experts; "" is paging.DefaultExpertPolicy.
	ExpertPolicy paging.ExpertPolicy
	// ExpertsCPU says when an expert missing from a device's expert
	// cache is computed on the CPU from host memory instead of uploaded:
	// "" or paging.ExpertCPUAuto when the rates (Options.Rates, or
	// measured at Open on a GPU whose experts page) predict the CPU
	// first, as in decode; ExpertCPUNever; ExpertCPUAlways.
	ExpertsCPU paging.ExpertCPUPolicy
	// KVCache places the KV cache: "" or paging.KVDevice keeps it all on
	// the device; KVHost keeps every block's in host memory; KVAuto lets
	// the planner choose per block (see paging.KVAuto): with the rates
	// (Options.Rates, or measured at Open on a GPU) it picks the count
	// of host blocks with the least predicted decode time. On several
	// devices each device's plan places the caches of its own blocks, and
	// their host parts share the host memory limit (HostCache).
	KVCache paging.KVPlacement
	// StagingReaders, StagingPiece and StagingSlots tune the pagers'
	// staging ring, which the aggressive strategy streams through on a
	// GPU: paging.Options' fields of the same names (0 takes their
	// defaults; StagingSlots < 0 turns the ring off).
	StagingReaders int
	StagingPiece   int64
	StagingSlots   int
	// NoMappedUploads makes the staging ring read every tensor, where it
	// would copy the tensors of mapped weight files in place from their
	// page-locked mapping (paging.Options.NoMappedUploads).
	NoMappedUploads bool
}

// Options say where and how the engine runs a model.
type Options struct {
	// Devices are device specs for tensor.OpenDevice ("cpu", "cuda",
	// "cuda:1", "auto"); the model's blocks are spread over them in
	// contiguous ranges in proportion to their budgets. Empty means
	// "auto".
	Devices []string
	// Backends, instead of Devices: backends the caller opened and
	// closes; the engine does not close them.
	Backends []tensor.Backend
	// Threads is the CPU threads of CPU devices; 0 is every core.
	Threads int
	Memory  Memory
	// Context is the positions a session holds; 0 is the model's context
	// length. Chunk is the prompt tokens one forward step processes; 0
	// is DefaultChunk, or AutoChunk's choice under a budget given to a
	// strategy that streams (either one no longer than the context).
	Context, Chunk int
	// KVPositions is the KV cache positions the plans keep room for on
	// each device, all the sequences' together: 0 is one Context, a
	// session's. A Batcher's KV pool takes this room: to batch many
	// sequences under a budget, give the positions of the pool
	// (BatchOptions.KVBlocks times BlockSize) here, so that the plan
	// streams more of the weights instead of the pool taking the room of
	// the resident ones.
	KVPositions int
	// Record keeps every allocation and paging event, for WriteSnapshot.
	Record bool
	// Rates, when set, are the rates the hybrid planner plans with instead
	// of those MeasureRates measures at Open.
	Rates *paging.Rates
	// ProbeSteps is the decode steps Open times through a hybrid
	// placement whose split the planner chose, to correct the rates and
	// plan again (HybridProbe): 0 is DefaultProbeSteps when the rates
	// are measured at Open and none when Rates are given, < 0 none.
	ProbeSteps int
	// TwinMinTokens is the prompt chunk from which a hybrid placement
	// computes its CPU layers on the GPU; 0 is DefaultTwinMinTokens.
	TwinMinTokens int
	// Progress, when set, is told how many weight bytes are loaded so
	// far while Open loads the resident layers.
	Progress func(done, total int64)
	// NoGraphs runs decode steps eagerly, launch by launch, on a backend
	// that could capture them as graphs (nn.Model.SetGraphs).
	NoGraphs bool
	// NoPeerCopies hands the hidden state between two GPUs through host
	// memory even when they can copy to each other directly
	// (nn.PipelineOptions.NoPeerCopies), to compare the two.
	NoPeerCopies bool
}

// DefaultChunk is the prefill chunk when Options.Chunk is 0 and every
// layer stays on the device.
const DefaultChunk = 512

// MaxAutoChunk bounds AutoChunk.
const MaxAutoChunk = 4096

// AutoChunk is the prefill chunk when Options.Chunk is 0 under a strategy
// that may stream (any but none): the largest power of two from
// DefaultChunk up to MaxAutoChunk whose activations (nn.ActivationBytes)
// take at most an eighth of budget, the smallest device's. Each chunk
// streams the weights that do not stay on the device once, so a long
// prompt streams them prompt/chunk times, and a larger chunk amortises
// them (the 7B shape at 4 GiB streams about 10 GiB a pass: an 8,000-token
// prompt in chunks of 512 spends 16 passes, over 3 s at 55 GB/s, on
// copies alone); the eighth bounds what the activations, held for the
// whole session, take from the weights that decode keeps resident (1,024
// tokens for the 7B shape at 4 GiB, 2,048 at 8 GiB).
func AutoChunk(cfg *arch.Config, budget int64) int {
	c := DefaultChunk
	for c*2 <= MaxAutoChunk && nn.ActivationBytes(cfg, c*2) <= budget/8 {
		c *= 2
	}
	return c
}

// Device is one device's part of an engine.
type Device struct {
	Name      string             `json:"device"`
	Placement paging.Placement   `json:"placement"`
	Plan      *paging.PlanResult `json:"plan"`
	// BudgetBytes is the device's budget, given or from the default
	// policy (DefaultBudget).
	BudgetBytes     int64 `json:"budget_bytes"`
	DefaultBudget   bool  `json:"default_budget,omitempty"`
	PeakDeviceBytes int64 `json:"peak_device_bytes"`
	// UsedBytes is what the budget holds charged when Devices is called:
	// the weights in place, the sessions' KV caches and buffers.
	UsedBytes int64 `json:"used_bytes"`
}

// Engine is a model assembled on its devices under its budgets. It is safe
// for concurrent use; each session is not.
type Engine struct {
	lm       *loader.Model
	cfg      *arch.Config
	opts     Options
	context  int
	chunk    int
	strategy paging.Strategy
	mode     paging.MemoryMode

	backends  []tensor.Backend
	owned     []tensor.Backend // opened here, closed by Close
	devices   []Device
	budgets   []*paging.Budget
	servers   []paging.Server
	stages    []nn.Stage
	model     *nn.Model    // one device
	pipeline  *nn.Pipeline // several, or a GPU and the CPU
	pipeOpts  nn.PipelineOptions
	cpu       tensor.Backend // the hybrid strategy's CPU
	hybrid    *Hybrid
	hostAlloc *pinnedHost
	kv        *KVReport     // the KV cache's placement, nil when all on the devices
	kvRates   *paging.Rates // the rates KVAuto planned with
	// pinnedPool is the hybrid pager's page-locked host memory on one
	// GPU (probe.go), kept through the probe's rebuild.
	pinnedPool *pinnedPool
	expertCPU  bool // a pager may hand missing experts to e.cpu
	// expertRates are the rates that decide where missing experts are
	// computed (Memory.ExpertsCPU auto): given, or measured at Open when
	// nothing else measured them.
	expertRates *paging.Rates

	mu       sync.Mutex
	sessions map[Session]bool
	closed   bool
	closeErr error
}

// Session is one sequence through the engine's model: nn.Session on one
// device, nn.PipelineSession on several.
type Session interface {
	// Forward runs ids at the session's next positions and returns the
	// logits of the last position, or of every position when all is set.
	Forward(ctx context.Context, ids []int32, all bool, hook nn.Hook) ([]float32, error)
	// Greedy runs ids as Forward does and returns the most likely next
	// token, found where the logits are when the device can (greedy
	// decoding copies an id a step instead of the logits).
	Greedy(ctx context.Context, ids []int32) (int32, error)
	Pos() int
	Reset()
	Close()
}

// Open assembles lm on the devices of o: it opens them, sets their
// budgets, places the layers, plans each device, makes the budgets and
// servers and loads every layer once, so that the resident set is in place
// before the first token. The engine does not own lm: close it after the
// engine.
func Open(ctx context.Context, lm *loader.Model, o Options) (e *Engine, err error) {
	cfg := lm.Config
	e = &Engine{lm: lm, cfg: cfg, opts: o, sessions: map[Session]bool{}}
	defer func() {
		if err != nil {
			e.Close()
			e = nil
		}
	}()
	maxPos := cfg.ContextLength()
	e.context = o.Context
	switch {
	case e.context < 0:
		return nil, fmt.Errorf("engine: context of %d positions", e.context)
	case e.context == 0:
		e.context = maxPos
	case e.context > maxPos:
		return nil, fmt.Errorf("engine: %w: %d positions asked, the model's context is %d", nn.ErrContextTooLong, e.context, maxPos)
	}
	if err := e.openDevices(); err != nil {
		return nil, err
	}
	limits, given, err := e.limits()
	if err != nil {
		return nil, err
	}
	e.strategy = o.Memory.Strategy
	if e.strategy == "" {
		e.strategy = paging.StrategyNone
		if slices.Contains(given, true) {
			e.strategy = paging.StrategyBalanced
		}
	}
	e.chunk = o.Chunk
	if e.chunk <= 0 {
		e.chunk = DefaultChunk
		if e.strategy != paging.StrategyNone && slices.Contains(given, true) {
			e.chunk = AutoChunk(cfg, slices.Min(limits))
		}
	}
	e.chunk = min(e.chunk, e.context)
	if o.KVPositions < 0 {
		return nil, fmt.Errorf("engine: KV cache room of %d positions", o.KVPositions)
	}
	e.mode = o.Memory.Mode
	if e.mode == "" {
		e.mode = paging.ModeExplicit
	}
	if e.mode != paging.ModeExplicit {
		for _, b := range e.backends {
			if _, ok := tensor.Managed(b); !ok {
				return nil, fmt.Errorf("engine: memory mode %s needs a device with unified memory, such as cuda (%s has none)", e.mode, b.Name())
			}
		}
	}

	info, err := nn.ModelInfoKV(lm, cfg, e.kvDType())
	if err != nil {
		return nil, fmt.Errorf("engine: %w", err)
	}
	kv, err := e.kvPlacement()
	if err != nil {
		return nil, err
	}
	if isHybrid(e.strategy) {
		if err := e.buildHybrid(ctx, info, limits, kv, o.Rates); err != nil {
			return nil, err
		}
		if steps := e.probeSteps(); steps > 0 {
			if err := e.probeHybrid(ctx, steps, info, limits, kv); err != nil {
				return nil, err
			}
		}
		return e, nil
	}
	parts := []paging.Placement{{FirstBlock: 0, EndBlock: cfg.NumLayers, Budget: limits[0]}}
	for l := range lm.Layers() {
		parts[0].Layers = append(parts[0].Layers, l)
	}
	if len(e.backends) > 1 {
		if parts, err = paging.PlaceLayers(info, limits); err != nil {
			return nil, err
		}
	}
	for d, p := range parts {
		b := e.backends[d]
		opts := []paging.PlanOption{paging.WithChunkTokens(e.chunk), paging.WithDevice(b), paging.WithKVPositions(e.kvPositions())}
		if cfg.MoE != nil && e.mode == paging.ModeExplicit {
			// Each expert is a unit of its own, in an expert cache.
			opts = append(opts, paging.WithExpertCache(cfg.MoE.ExpertsPerToken))
		}
		kvOpts, err := e.kvPlanOptions(ctx, kv, info)
		if err != nil {
			return nil, err
		}
		plan, err := paging.Plan(info.Stage(p), limits[d], e.strategy, e.context, 1, append(opts, kvOpts...)...)
		if err != nil {
			if len(parts) > 1 {
				return nil, fmt.Errorf("device %d (%s, layers %d..%d): %w", d, b.Name(), p.Layers[0], p.Layers[len(p.Layers)-1], err)
			}
			return nil, err
		}
		bud, err := paging.NewBudget(b, limits[d], b.Name())
		if err != nil {
			return nil, err
		}
		e.budgets = append(e.budgets, bud)
		if o.Record {
			bud.RecordHistory(1 << 20)
		}
		hostCache, hostKV, err := e.placeKV(b, plan, p.FirstBlock)
		if err != nil {
			return nil, err
		}
		popts := paging.Options{HostCacheBytes: hostCache, ExpertPolicy: o.Memory.ExpertPolicy,
			StagingReaders: o.Memory.StagingReaders, StagingPiece: o.Memory.StagingPiece, StagingSlots: o.Memory.StagingSlots,
			NoMappedUploads: o.Memory.NoMappedUploads}
		if popts.ExpertsCPU, popts.Rates, err = e.expertsCPU(ctx, b, plan, info.Stage(p)); err != nil {
			return nil, err
		}
		srv, err := paging.NewServer(ctx, e.mode, nn.StageSource(nn.Source(lm), p.Layers), bud, plan, popts)
		if err != nil {
			return nil, err
		}
		e.servers = append(e.servers, srv)
		e.devices = append(e.devices, Device{Name: b.Name(), Placement: p, Plan: plan, BudgetBytes: limits[d], DefaultBudget: !given[d]})
		e.stages = append(e.stages, nn.Stage{Backend: b, Alloc: bud, Weights: nn.StageWeights(srv, p.Layers), FirstBlock: p.FirstBlock, EndBlock: p.EndBlock, HostKV: hostKV})
	}
	if e.kv != nil {
		// The device part of the cache: every device's, those that keep
		// it all too.
		e.kv.DeviceBytes = 0
		for _, d := range e.devices {
			e.kv.DeviceBytes += d.Plan.KVCacheBytes
		}
	}
	if err := e.warmUp(ctx); err != nil {
		return nil, err
	}
	if len(e.stages) == 1 {
		st := e.stages[0]
		if e.model, err = nn.New(cfg, st.Backend, st.Alloc, st.Weights); err == nil && e.kv != nil {
			err = e.model.SetHostKV(nn.HostKV{Blocks: e.kv.HostBlocks, CPU: e.cpu, Alloc: e.hostAlloc, DeviceMinTokens: e.kv.DeviceMinTokens, DeviceMaxPos: e.kv.DeviceMaxPos})
		}
		if err == nil && e.expertCPU {
			e.model.SetExpertCPU(e.cpu)
		}
		if err == nil {
			e.model.SetGraphs(!o.NoGraphs)
		}
	} else if e.pipeline, err = nn.NewPipeline(cfg, e.stages, nn.PipelineOptions{NoPeerCopies: o.NoPeerCopies}); err == nil {
		e.pipeline.SetGraphs(!o.NoGraphs)
		if e.expertCPU {
			e.pipeline.SetExpertCPU(e.cpu)
		}
	}
	if err != nil {
		return nil, err
	}
	return e, nil
}

// kvPositions is the KV positions the plans keep room for beyond one
// context (Options.KVPositions), or 0 for one context.
func (e *Engine) kvPositions() int {
	if e.opts.KVPositions <= e.context {
		return 0
	}
	return e.opts.KVPositions
}

// openDevices opens the devices of the options, or takes the caller's
// backends.
func (e *Engine) openDevices() error {
	o := e.opts
	if len(o.Backends) > 0 {
		if len(o.Devices) > 0 {
			return errors.New("engine: give Devices or Backends, not both")
		}
		e.backends = slices.Clone(o.Backends)
		return nil
	}
	specs := o.Devices
	if len(specs) == 0 {
		specs = []string{"auto"}
	}
	for _, spec := range specs {
		b, err := tensor.OpenDevice(spec, tensor.DeviceOptions{Threads: o.Threads})
		if err != nil {
			return err
		}
		e.backends = append(e.backends, b)
		e.owned = append(e.owned, b)
	}
	for i, b := range e.backends {
		for _, c := range e.backends[:i] {
			if c.Name() == b.Name() && b.Name() != "cpu" {
				return fmt.Errorf("engine: device %s given twice", b.Name())
			}
		}
	}
	return nil
}

// unlimited is the budget of a device with no memory of its own to bound
// it (the CPU) when none is given.
const unlimited = math.MaxInt64 / 4

// limits returns each device's budget and whether it was given.
func (e *Engine) limits() ([]int64, []bool, error) {
	m := e.opts.Memory
	n := len(e.backends)
	if len(m.Budgets) > 0 && len(m.Fractions) > 0 {
		return nil, nil, errors.New("engine: give budgets or fractions, not both")
	}
	pick := func(vals int, d int) (int, error) {
		switch vals {
		case 1:
			return 0, nil
		case n:
			return d, nil
		}
		return 0, fmt.Errorf("engine: %d budgets for %d devices: give one, or one per device", vals, n)
	}
	limits, given := make([]int64, n), make([]bool, n)
	for d, b := range e.backends {
		switch {
		case len(m.Budgets) > 0:
			i, err := pick(len(m.Budgets), d)
			if err != nil {
				return nil, nil, err
			}
			if m.Budgets[i] < 0 {
				return nil, nil, fmt.Errorf("engine: budget %d bytes for %s", m.Budgets[i], b.Name())
			}
			limits[d], given[d] = m.Budgets[i], m.Budgets[i] > 0
		case len(m.Fractions) > 0:
			i, err := pick(len(m.Fractions), d)
			if err != nil {
				return nil, nil, err
			}
			v, err := paging.DeviceFraction(b, m.Fractions[i])
			if err != nil {
				return nil, nil, err
			}
			limits[d], given[d] = v, true
		}
		if !given[d] {
			limits[d] = DefaultBudget(b)
		}
	}
	return limits, given, nil
}

// DefaultBudget is the budget of a device when none is given: its free
// memory less 1/32 of it (at least 256 MiB) for the driver, other
// libraries and fragmentation; no limit for a device that cannot report
// its memory (the CPU).
func DefaultBudget(b tensor.Memory) int64 {
	free, _, err := tensor.FreeMemory(b)
	if err != nil || free <= 0 {
		return unlimited
	}
	return max(0, free-max(free/32, 256<<20))
}

// warmUp acquires every layer once, in order, so the resident set is
// loaded before the clock starts on a prompt, telling Progress; and every
// expert, when the expert cache holds them all.
func (e *Engine) warmUp(ctx context.Context) error {
	layers := e.lm.Layers()
	done, total := int64(0), e.lm.WeightBytes()
	for d, dev := range e.devices {
		for i, l := range dev.Placement.Layers {
			if _, err := e.servers[d].Acquire(ctx, i); err != nil {
				return err
			}
			e.servers[d].Release(i)
			if err := warmExperts(ctx, e.servers[d], dev.Plan, i); err != nil {
				return err
			}
			done += layers[l].Bytes
			if e.opts.Progress != nil {
				e.opts.Progress(min(done, total), total)
			}
		}
	}
	return nil
}

// warmExperts loads the experts of a server's layer when its expert cache
// holds every expert, so that none waits for the first token that
// chooses it; a cache that holds fewer fills as tokens choose.
func warmExperts(ctx context.Context, srv paging.Server, plan *paging.PlanResult, layer int) error {
	es, ok := srv.(paging.ExpertServer)
	if !ok || plan.Experts == 0 || plan.ExpertSlots < plan.Experts || !es.PagesExperts(layer) {
		return nil
	}
	n := plan.Layers[layer].Experts
	for lo := 0; lo < n; lo += plan.ExpertSlots {
		var group []int
		for x := lo; x < min(lo+plan.ExpertSlots, n); x++ {
			group = append(group, x)
		}
		if _, err := es.AcquireExperts(ctx, layer, group); err != nil {
			return err
		}
		es.ReleaseExperts(layer, group)
	}
	return nil
}

// SparseTimes returns the host's time in the sparse blocks of the forward
// passes so far: waiting for their routers, and the rest
// (nn.Model.SparseTimes).
func (e *Engine) SparseTimes() nn.SparseTimes {
	if e.model != nil {
		return e.model.SparseTimes()
	}
	if e.pipeline != nil {
		return e.pipeline.SparseTimes()
	}
	return nn.SparseTimes{}
}

// ExpertGuesses returns how many experts the forward passes guessed ahead
// for the next sparse block in decode steps, to prefetch them, and how many
// of those the block chose (nn.Model.ExpertGuesses).
func (e *Engine) ExpertGuesses() (guessed, right int64) {
	if e.model != nil {
		return e.model.ExpertGuesses()
	}
	if e.pipeline != nil {
		return e.pipeline.ExpertGuesses()
	}
	return 0, 0
}

// Config returns the model's configuration.
func (e *Engine) Config() *arch.Config { return e.cfg }

// Model returns the loaded model the engine runs.
func (e *Engine) Model() *loader.Model { return e.lm }

// Context is the positions a session holds; Chunk the prompt tokens one
// forward step processes.
func (e *Engine) Context() int { return e.context }

// Chunk is the prompt tokens one forward step processes.
func (e *Engine) Chunk() int { return e.chunk }

// Strategy and Mode are the offload strategy and memory mode in force.
func (e *Engine) Strategy() paging.Strategy { return e.strategy }

// Mode is the memory mode in force.
func (e *Engine) Mode() paging.MemoryMode { return e.mode }

// Devices describes each device's part: its layers, plan, budget, peak
// and the bytes it holds now.
func (e *Engine) Devices() []Device {
	out := slices.Clone(e.devices)
	for d := range out {
		out[d].PeakDeviceBytes = e.budgets[d].Peak()
		out[d].UsedBytes = e.budgets[d].Used()
	}
	return out
}

// Backends returns the engine's backends, one per device.
func (e *Engine) Backends() []tensor.Backend { return slices.Clone(e.backends) }

// kvDType is the sessions' KV cache dtype (Memory.KVDType, F32 when unset).
func (e *Engine) kvDType() tensor.DType {
	if e.opts.Memory.KVDType == tensor.Invalid {
		return tensor.F32
	}
	return e.opts.Memory.KVDType
}

// KVDType is the stored dtype of the sessions' KV cache.
func (e *Engine) KVDType() tensor.DType { return e.kvDType() }

// NewSession makes a session of Context positions, its KV cache and
// buffers charged to the devices' budgets (the plans reserve room for one).
func (e *Engine) NewSession() (Session, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errors.New("engine: closed")
	}
	var s Session
	if e.model != nil {
		ms, err := e.model.NewSessionWith(e.context, e.chunk, nn.SessionOptions{KVDType: e.kvDType()})
		if err != nil {
			return nil, err
		}
		s = ms
	} else {
		ps, err := e.pipeline.NewSessionWith(e.context, e.chunk, nn.SessionOptions{KVDType: e.kvDType()})
		if err != nil {
			return nil, err
		}
		s = ps
	}
	ts := &trackedSession{Session: s, e: e}
	e.sessions[ts] = true
	return ts, nil
}

// trackedSession lets Close close the sessions left open.
type trackedSession struct {
	Session
	e    *Engine
	once sync.Once
}

// Busy is the wall time the session's forward passes spent on each
// device, by name (nn.PipelineSession.Busy); nil on one device.
func (s *trackedSession) Busy() map[string]time.Duration {
	if b, ok := s.Session.(interface {
		Busy() map[string]time.Duration
	}); ok {
		return b.Busy()
	}
	return nil
}

func (s *trackedSession) Close() {
	s.once.Do(func() {
		s.Session.Close()
		s.e.mu.Lock()
		delete(s.e.sessions, s)
		s.e.mu.Unlock()
	})
}

// MarkStep marks a decoded token on every device, for the bytes moved per
// token in Stats.
func (e *Engine) MarkStep() {
	for _, s := range e.servers {
		s.MarkStep()
	}
}

// Stats adds up the devices' paging statistics; the peak is the largest
// device's.
func (e *Engine) Stats() paging.Stats {
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
		t.PinnedFallbacks += st.PinnedFallbacks
		t.PinnedFallbackBytes += st.PinnedFallbackBytes
		t.PinnedFallbackError = cmp.Or(t.PinnedFallbackError, st.PinnedFallbackError)
		t.StagingSlots += st.StagingSlots
		t.StagingBytes += st.StagingBytes
		t.BytesStaged += st.BytesStaged
		t.StagingWait += st.StagingWait
		t.StagingReaders += st.StagingReaders
		t.StagingReadTime += st.StagingReadTime            // devices read one after the other: their times add
		t.MappedBytes = max(t.MappedBytes, st.MappedBytes) // the same files, page-locked by each device's pager
		t.BytesMapped += st.BytesMapped
		t.PeakDeviceBytes = max(t.PeakDeviceBytes, st.PeakDeviceBytes)
		t.ExpertSlots += st.ExpertSlots
		t.ExpertsTotal += st.ExpertsTotal
		t.ExpertCacheBytes += st.ExpertCacheBytes
		t.ExpertsCached += st.ExpertsCached
		t.ExpertsPinned += st.ExpertsPinned
		t.ExpertAcquires += st.ExpertAcquires
		t.ExpertHits += st.ExpertHits
		t.ExpertMisses += st.ExpertMisses
		t.ExpertEvictions += st.ExpertEvictions
		t.ExpertPrefetches += st.ExpertPrefetches
		t.ExpertPrefetchHits += st.ExpertPrefetchHits
		t.ExpertPrefetchNoRoom += st.ExpertPrefetchNoRoom
		t.ExpertPrefetchSkipped += st.ExpertPrefetchSkipped
		t.ExpertBytesMoved += st.ExpertBytesMoved
		t.ExpertBytesPerStep += st.ExpertBytesPerStep
		t.ExpertMissesPerStep += st.ExpertMissesPerStep
		t.ExpertsPrepared += st.ExpertsPrepared
		t.ExpertsOnCPU += st.ExpertsOnCPU
		t.ExpertCPUTokens += st.ExpertCPUTokens
		t.ExpertCPUBytes += st.ExpertCPUBytes
		if t.ExpertPolicy == "" {
			t.ExpertPolicy = st.ExpertPolicy
		}
	}
	return t
}

// Summary is the memory summary table of every device, with the hybrid
// plan when layers run on the CPU and the experts' report (ExpertReport)
// when experts are paged.
func (e *Engine) Summary() string {
	s := paging.Summary(e.budgets...)
	if r := e.Experts(); r != nil {
		s += r.String() + "\n"
	}
	if e.kv != nil {
		r := e.KV()
		s += r.String() + "\n"
	}
	if h := e.hybrid; h != nil {
		if h.Plan != nil {
			s += h.Plan.String() + "\n"
		}
		for _, g := range h.GPUs {
			s += fmt.Sprintf("%s, layers %d..%d (CPU layers %v): %s\n", g.Device, g.Placement.Layers[0], g.Placement.Layers[len(g.Placement.Layers)-1], h.gpuCPULayers(g), g.Plan)
		}
		if len(h.GPUs) > 1 {
			t := h.Totals()
			s += fmt.Sprintf("hybrid over %d GPUs: per token %s resident, %s streamed, %s read by the CPU in %d layers, predicted %.1f tok/s\n",
				len(h.GPUs), paging.FormatSize(t.ResidentBytes), paging.FormatSize(t.StreamedBytes), paging.FormatSize(t.CPUBytes), len(h.CPULayers()), t.PredictedTokS)
		}
		s += fmt.Sprintf("rates measured: pinned H2D %.1f GB/s alone, %.1f with the CPU; CPU %.1f GB/s alone, %.1f with copies (%d threads), %.2f ms more a block (%.2f with copies), attention %.1f GB/s; device %.0f GB/s, %.2f ms more a stage; hand-over %v\n",
			h.Rates.H2D/1e9, h.Rates.H2DShared/1e9, h.Rates.CPU/1e9, h.Rates.CPUShared/1e9, h.Threads, float64(h.Rates.CPULayer)/1e6, float64(h.Rates.CPULayerShared)/1e6, h.Rates.CPUAttention/1e9, h.Rates.Device/1e9, float64(h.Rates.DeviceStage)/1e6, h.Rates.Handoff)
		if sp := h.Rates.CPULayerSpread; sp.N > 0 {
			s += fmt.Sprintf("CPU block calibration, more than its bytes (min/median/max): %s alone, %s with copies\n", sp, h.Rates.CPULayerSharedSpread)
		}
		if h.Probe != nil {
			s += h.Probe.String() + "\n"
		}
		if sp := h.Rates.DeviceStageSpread; sp.N > 0 {
			s += fmt.Sprintf("device stage calibration, more than its block's bytes and a hand-over (min/median/max): %s\n", sp)
		}
	}
	return s
}

// WriteSnapshot writes the first device's history of allocation and paging
// events (Options.Record) as JSON. Written after Close, it records what
// Close found still allocated.
func (e *Engine) WriteSnapshot(w io.Writer) error {
	if len(e.budgets) == 0 {
		return errors.New("engine: no device to snapshot")
	}
	return e.budgets[0].WriteSnapshot(w)
}

// Close closes the sessions still open, the servers, the budgets (which
// report allocations left behind) and the devices the engine opened, in
// that order. It is safe to call more than once and on a half-built
// engine.
func (e *Engine) Close() error {
	if e == nil {
		return nil
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return e.closeErr
	}
	e.closed = true
	var open []Session
	for s := range e.sessions {
		open = append(open, s)
	}
	e.mu.Unlock()
	for _, s := range open {
		s.Close()
	}
	var errs []error
	for _, s := range e.servers {
		errs = append(errs, s.Close())
	}
	for _, b := range e.budgets {
		errs = append(errs, b.Close())
	}
	for _, b := range e.owned {
		errs = append(errs, b.Close())
	}
	e.closeErr = errors.Join(errs...)
	return e.closeErr
}
