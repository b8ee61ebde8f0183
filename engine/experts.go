package engine

import (
	"fmt"
	"slices"

	"github.com/strata-llm/strata/paging"
)

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

	// Tokens is the decode steps of the window (Since), 0 for the totals.
	Tokens           int     `json:"tokens,omitempty"`
	HitRate          float64 `json:"hit_rate"`
	PrefetchAccuracy float64 `json:"prefetch_accuracy"`
	GuessAccuracy    float64 `json:"guess_accuracy"`
	// Per decode step of the window.
	MissesPerToken   float64 `json:"misses_per_token,omitempty"`
	AcquiresPerToken float64 `json:"acquires_per_token,omitempty"`
	BytesPerToken    float64 `json:"bytes_per_token,omitempty"`

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
	r.MissesPerToken, r.AcquiresPerToken, r.BytesPerToken = 0, 0, 0
	if n := int64(r.Tokens); n > 0 {
		r.MissesPerToken = ratio(r.Misses, n)
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
