package engine

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// expertsCPU returns the policy and rates for the pager of device b, whose
// plan is plan over the stage info: for a plan whose experts page
// (an expert cache of fewer slots than experts) and a policy other than
// never, it opens the CPU the experts are computed on and, for auto on a
// device with a copy engine and no rates given, measures the rates over
// one expert's matrices. Otherwise the policy is never.
func (e *Engine) expertsCPU(ctx context.Context, b tensor.Backend, plan *paging.PlanResult, info paging.ModelInfo) (paging.ExpertCPUPolicy, *paging.Rates, error) {
	policy, err := paging.ParseExpertCPUPolicy(string(e.opts.Memory.ExpertsCPU))
	if err != nil {
		return "", nil, fmt.Errorf("engine: %w", err)
	}
	if policy == paging.ExpertCPUNever || plan.Experts == 0 || plan.ExpertSlots >= plan.Experts {
		return paging.ExpertCPUNever, nil, nil
	}
	if err := e.openCPU(); err != nil {
		return "", nil, err
	}
	e.expertCPU = true
	rates := e.opts.Rates
	if rates == nil {
		rates = e.kvRates
	}
	if rates == nil {
		rates = e.expertRates // measured for another device of the same host
	}
	if _, async := tensor.AsyncUpload(b); rates == nil && policy == paging.ExpertCPUAuto && async {
		// The first expert's matrices, as the CPU computes them; a
		// quantized one is measured as F16 of its shape (MeasureRates
		// takes float matrices), its blocks read at about that rate.
		var one []paging.TensorSpec
		for _, li := range info.Layers {
			if len(li.Experts) == 0 {
				continue
			}
			for _, name := range li.Experts[0] {
				for _, t := range li.Tensors {
					if t.Name == name {
						if !t.DType.IsFloat() {
							t.DType, t.Bytes = tensor.F16, 2*t.Shape.NumElements()
						}
						one = append(one, t)
					}
				}
			}
			break
		}
		dt := tensor.F16
		if len(one) > 0 {
			dt = one[0].DType
		}
		r, err := MeasureRates(ctx, b, e.cpu, dt, e.cfg.HiddenSize, one)
		if err != nil {
			return "", nil, err
		}
		rates = &r
	}
	if rates != nil && policy == paging.ExpertCPUAuto {
		e.expertRates = rates // the report's, and another device's of the same host
	}
	return policy, rates, nil
}

// ExpertReport is what a run of a mixture of experts whose experts are
// paged one by one reports about them (generate's and bench's -json): the
// cache, the counters since Open (or over a window, Since), and the rates
// derived from them.
type ExpertReport struct {
	// Routing is "router", or "synthetic routing (skew S, locality L)"
	// for a synthetic model, whose experts are drawn, not chosen by its
	// router (arch.SyntheticRouting).
	Routing string              `json:"routing"`
	Policy  paging.ExpertPolicy `json:"policy"`
	// Slots of the Experts fit in the caches of CacheBytes, all devices
	// together; ExpertBytes is one expert's weight bytes (the mean), and
	// WeightBytes every expert's.
	Experts     int   `json:"experts"`
	Slots       int   `json:"slots"`
	CacheBytes  int64 `json:"cache_bytes"`
	ExpertBytes int64 `json:"expert_bytes"`
	WeightBytes int64 `json:"expert_weight_bytes"`

	Acquires     int64 `json:"acquires"`
	Hits         int64 `json:"hits"`
	Misses       int64 `json:"misses"`
	Prefetches   int64 `json:"prefetches"`
	PrefetchHits int64 `json:"prefetch_hits"`
	BytesMoved   int64 `json:"bytes_moved"`
	// Guessed experts of the next sparse block in decode steps, of which
	// GuessedRight were chosen.
	Guessed      int64 `json:"guessed"`
	GuessedRight int64 `json:"guessed_right"`
	// OnCPU counts the missing experts computed on the CPU instead of
	// uploaded (Memory.ExpertsCPU), for CPUTokens tokens, CPUBytes of
	// their weights read from host memory.
	OnCPU     int64 `json:"on_cpu"`
	CPUTokens int64 `json:"cpu_tokens"`
	CPUBytes  int64 `json:"cpu_bytes"`
	// SparseBlocks counts the sparse blocks the forward passes ran; the
	// host waited RouterWait for their routers' scores and spent
	// SparseHost on the rest of them (nn.SparseTimes: where the link
	// bounds decode, SparseHost is what it may idle for).
	SparseBlocks int64         `json:"sparse_blocks"`
	RouterWait   time.Duration `json:"router_wait_ns"`
	SparseHost   time.Duration `json:"sparse_host_ns"`
	// Rates are those -experts-cpu auto splits the misses between the
	// CPU and the link with (measured at Open, or given); nil for the
	// other policies.
	Rates *paging.Rates `json:"rates,omitempty"`

	// Tokens is the decode steps of the window (Since), 0 for the totals.
	Tokens           int     `json:"tokens,omitempty"`
	HitRate          float64 `json:"hit_rate"`
	PrefetchAccuracy float64 `json:"prefetch_accuracy"`
	GuessAccuracy    float64 `json:"guess_accuracy"`
	// Per decode step of the window.
	MissesPerToken   float64 `json:"misses_per_token,omitempty"`
	OnCPUPerToken    float64 `json:"on_cpu_per_token,omitempty"`
	AcquiresPerToken float64 `json:"acquires_per_token,omitempty"`
	BytesPerToken    float64 `json:"bytes_per_token,omitempty"`
	// The host's time in sparse blocks per decode step, milliseconds.
	RouterWaitMsPerToken float64 `json:"router_wait_ms_per_token,omitempty"`
	SparseHostMsPerToken float64 `json:"sparse_host_ms_per_token,omitempty"`

	// Devices is each device's part when the model runs on several: its
	// cache and counters, with the rates of the same window (their
	// Guessed counts are the engine's, not split by device); nil on one.
	Devices []DeviceExperts `json:"devices,omitempty"`
}

// DeviceExperts is one device's expert cache in an ExpertReport.
type DeviceExperts struct {
	Device       string `json:"device"`
	Experts      int    `json:"experts"`
	Slots        int    `json:"slots"`
	CacheBytes   int64  `json:"cache_bytes"`
	Acquires     int64  `json:"acquires"`
	Hits         int64  `json:"hits"`
	Misses       int64  `json:"misses"`
	Prefetches   int64  `json:"prefetches"`
	PrefetchHits int64  `json:"prefetch_hits"`
	BytesMoved   int64  `json:"bytes_moved"`

	HitRate          float64 `json:"hit_rate"`
	PrefetchAccuracy float64 `json:"prefetch_accuracy"`
	MissesPerToken   float64 `json:"misses_per_token,omitempty"`
	BytesPerToken    float64 `json:"bytes_per_token,omitempty"`
}

// Experts reports the expert caches since Open; nil when no device pages
// experts (a dense model, unified memory, the hybrid strategies). It waits
// for the expert prefetches under way to end, so that their bytes count.
func (e *Engine) Experts() *ExpertReport {
	var r ExpertReport
	for _, d := range e.devices {
		if p := d.Plan; p != nil {
			r.Experts += p.Experts
			r.WeightBytes += p.ExpertBytes
		}
	}
	if r.Experts == 0 {
		return nil
	}
	for _, srv := range e.servers {
		if es, ok := srv.(paging.ExpertServer); ok {
			es.SettleExperts()
		}
	}
	r.ExpertBytes = r.WeightBytes / int64(r.Experts)
	r.Routing = "router"
	if m := e.cfg.MoE; m != nil && m.Synthetic != nil {
		r.Routing = fmt.Sprintf("synthetic routing (skew %g, locality %g)", m.Synthetic.Skew, m.Synthetic.Locality)
	}
	st := e.Stats()
	r.Policy, r.Slots, r.CacheBytes = st.ExpertPolicy, st.ExpertSlots, st.ExpertCacheBytes
	r.Acquires, r.Hits, r.Misses = st.ExpertAcquires, st.ExpertHits, st.ExpertMisses
	r.Prefetches, r.PrefetchHits, r.BytesMoved = st.ExpertPrefetches, st.ExpertPrefetchHits, st.ExpertBytesMoved
	r.Guessed, r.GuessedRight = e.ExpertGuesses()
	sp := e.SparseTimes()
	r.SparseBlocks, r.RouterWait, r.SparseHost = sp.Blocks, sp.RouterWait, sp.Host
	r.OnCPU, r.CPUTokens, r.CPUBytes = st.ExpertsOnCPU, st.ExpertCPUTokens, st.ExpertCPUBytes
	r.Rates = e.expertRates
	if len(e.servers) > 1 {
		for d, srv := range e.servers {
			st := srv.Stats()
			r.Devices = append(r.Devices, DeviceExperts{Device: e.devices[d].Name, Experts: st.ExpertsTotal, Slots: st.ExpertSlots, CacheBytes: st.ExpertCacheBytes,
				Acquires: st.ExpertAcquires, Hits: st.ExpertHits, Misses: st.ExpertMisses,
				Prefetches: st.ExpertPrefetches, PrefetchHits: st.ExpertPrefetchHits, BytesMoved: st.ExpertBytesMoved})
		}
	}
	r.rates()
	return &r
}

// Since returns the report of the window from before to r, over tokens
// decode steps: the counters' changes, with the rates of the window.
func (r *ExpertReport) Since(before *ExpertReport, tokens int) *ExpertReport {
	w := *r
	if before != nil {
		w.Acquires -= before.Acquires
		w.Hits -= before.Hits
		w.Misses -= before.Misses
		w.Prefetches -= before.Prefetches
		w.PrefetchHits -= before.PrefetchHits
		w.BytesMoved -= before.BytesMoved
		w.Guessed -= before.Guessed
		w.GuessedRight -= before.GuessedRight
		w.OnCPU -= before.OnCPU
		w.CPUTokens -= before.CPUTokens
		w.CPUBytes -= before.CPUBytes
		w.SparseBlocks -= before.SparseBlocks
		w.RouterWait -= before.RouterWait
		w.SparseHost -= before.SparseHost
	}
	w.Devices = slices.Clone(r.Devices)
	if before != nil && len(before.Devices) == len(w.Devices) {
		for d := range w.Devices {
			w.Devices[d].Acquires -= before.Devices[d].Acquires
			w.Devices[d].Hits -= before.Devices[d].Hits
			w.Devices[d].Misses -= before.Devices[d].Misses
			w.Devices[d].Prefetches -= before.Devices[d].Prefetches
			w.Devices[d].PrefetchHits -= before.Devices[d].PrefetchHits
			w.Devices[d].BytesMoved -= before.Devices[d].BytesMoved
		}
	}
	w.Tokens = tokens
	w.rates()
	return &w
}

func (r *ExpertReport) rates() {
	ratio := func(a, b int64) float64 {
		if b == 0 {
			return 0
		}
		return float64(a) / float64(b)
	}
	r.HitRate = ratio(r.Hits, r.Acquires)
	r.PrefetchAccuracy = ratio(r.PrefetchHits, r.Prefetches)
	r.GuessAccuracy = ratio(r.GuessedRight, r.Guessed)
	r.MissesPerToken, r.AcquiresPerToken, r.BytesPerToken, r.OnCPUPerToken = 0, 0, 0, 0
	r.RouterWaitMsPerToken, r.SparseHostMsPerToken = 0, 0
	if n := int64(r.Tokens); n > 0 {
		r.RouterWaitMsPerToken = float64(r.RouterWait) / 1e6 / float64(n)
		r.SparseHostMsPerToken = float64(r.SparseHost) / 1e6 / float64(n)
		r.MissesPerToken = ratio(r.Misses, n)
		r.OnCPUPerToken = ratio(r.OnCPU, n)
		r.AcquiresPerToken = ratio(r.Acquires, n)
		r.BytesPerToken = ratio(r.BytesMoved, n)
	}
	for d := range r.Devices {
		x := &r.Devices[d]
		x.HitRate = ratio(x.Hits, x.Acquires)
		x.PrefetchAccuracy = ratio(x.PrefetchHits, x.Prefetches)
		x.MissesPerToken, x.BytesPerToken = 0, 0
		if n := int64(r.Tokens); n > 0 {
			x.MissesPerToken = ratio(x.Misses, n)
			x.BytesPerToken = ratio(x.BytesMoved, n)
		}
	}
}

// String is the report on one line.
func (r *ExpertReport) String() string {
	s := fmt.Sprintf("experts [%s]: cache of %d of %d (%.1f%%, %s, %s): hit rate %.1f%%, prefetch accuracy %.1f%%, guesses right %.1f%%",
		r.Routing, r.Slots, r.Experts, 100*float64(r.Slots)/float64(max(r.Experts, 1)), paging.FormatSize(r.CacheBytes), r.Policy,
		100*r.HitRate, 100*r.PrefetchAccuracy, 100*r.GuessAccuracy)
	if r.Tokens > 0 {
		s += fmt.Sprintf("; per token over %d: %.2f misses, %s moved", r.Tokens, r.MissesPerToken, paging.FormatSize(int64(r.BytesPerToken)))
		if r.OnCPU > 0 {
			s += fmt.Sprintf(", %.2f experts on the CPU", r.OnCPUPerToken)
		}
		if r.SparseBlocks > 0 {
			s += fmt.Sprintf("; the host in sparse blocks %.2f ms waiting for routers, %.2f ms after", r.RouterWaitMsPerToken, r.SparseHostMsPerToken)
		}
	} else if r.OnCPU > 0 {
		s += fmt.Sprintf("; %d experts on the CPU (%d tokens)", r.OnCPU, r.CPUTokens)
	}
	if x := r.Rates; x != nil {
		s += fmt.Sprintf("; split by link %.1f GB/s, CPU %.1f GB/s (%.1f over a chunk's rows, %.1f two at once), hand-over %v", x.H2D/1e9, x.CPU/1e9, x.CPURows/1e9, x.CPUExperts/1e9, x.Handoff)
	}
	for d, x := range r.Devices {
		s += fmt.Sprintf("\n  device %d (%s): cache of %d of %d (%s): hit rate %.1f%%, prefetch accuracy %.1f%%", d, x.Device, x.Slots, x.Experts,
			paging.FormatSize(x.CacheBytes), 100*x.HitRate, 100*x.PrefetchAccuracy)
		if r.Tokens > 0 {
			s += fmt.Sprintf("; per token: %.2f misses, %s moved", x.MissesPerToken, paging.FormatSize(int64(x.BytesPerToken)))
		}
	}
	return s
}
