package paging

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"
)

// Stats are a pager's counters, for the CLI's -json report and the memory
// summary. Byte counts are totals since NewPager.
type Stats struct {
	Pager    int      `json:"pager"`
	Device   string   `json:"device"`
	Strategy Strategy `json:"strategy"`
	Layers   int      `json:"layers"`

	Acquires  int64 `json:"acquires"`
	Hits      int64 `json:"hits"`   // Acquires that found the layer on the device
	Misses    int64 `json:"misses"` // Acquires that waited for a load
	Loads     int64 `json:"loads"`
	Evictions int64 `json:"evictions"`
	// Prefetches started, and those not started because as many as the
	// prefetch depth were already running.
	Prefetches      int64 `json:"prefetches"`
	PrefetchSkipped int64 `json:"prefetch_skipped"`
	// PrefetchStale counts prefetches dropped because, by the time they
	// ran, the layer was no longer among the next ones to be used, or its
	// place in the ring had gone to a demand load.
	PrefetchStale int64 `json:"prefetch_stale"`
	// PrefetchNoRoom counts prefetches dropped because the ring had no
	// room for them without evicting the layers about to be used;
	// OutsideRing counts streamed parts loaded outside the ring, in
	// allocations of their own, because every ring part in their way was
	// pinned (several users of one pager). A cyclic walk has neither.
	PrefetchNoRoom int64 `json:"prefetch_no_room"`
	OutsideRing    int64 `json:"outside_ring"`

	BytesDiskToHost   int64 `json:"bytes_disk_to_host"`   // read from the source
	BytesHostToDevice int64 `json:"bytes_host_to_device"` // uploaded to the device
	HostCacheHits     int64 `json:"host_cache_hits"`
	HostCacheMisses   int64 `json:"host_cache_misses"`
	HostCacheBytes    int64 `json:"host_cache_bytes"`
	HostCacheLimit    int64 `json:"host_cache_limit"`
	PinnedHostBytes   int64 `json:"pinned_host_bytes"`
	// PinnedFallbacks counts the host copies made in pageable memory
	// because the backend, which pins memory, refused to pin them
	// (PinnedFallbackBytes in all; PinnedFallbackError is the first
	// refusal): their uploads run at pageable speed, synchronously.
	PinnedFallbacks     int64  `json:"pinned_fallbacks,omitempty"`
	PinnedFallbackBytes int64  `json:"pinned_fallback_bytes,omitempty"`
	PinnedFallbackError string `json:"pinned_fallback_error,omitempty"`
	// HostLayerBytes is the host memory held by the layers the CPU
	// computes (HostLayer), counted in HostCacheBytes; HostLayerLoads
	// counts the host layers HostLayer read from the source.
	HostLayerBytes int64 `json:"host_layer_bytes"`
	HostLayerLoads int64 `json:"host_layer_loads"`
	// The staging ring (Options.StagingSlots): StagingSlots pinned buffers
	// of StagingBytes in all, host memory beside the host cache's and
	// within its limit (HostCacheLimit). BytesStaged are the bytes read
	// into them and copied out; StagingWait is the time loads waited for
	// a free buffer (all of them holding copies not yet landed).
	// StagingReaders is the goroutines reading into the ring;
	// StagingReadTime the time during which at least one of them was
	// reading, so that BytesStaged / StagingReadTime is the rate the
	// staged reads ran at (StagedReadGBps), copies to the device going on
	// beside them.
	StagingSlots    int           `json:"staging_slots,omitempty"`
	StagingBytes    int64         `json:"staging_bytes,omitempty"`
	BytesStaged     int64         `json:"bytes_staged,omitempty"`
	StagingWait     time.Duration `json:"staging_wait_ns,omitempty"`
	StagingReaders  int           `json:"staging_readers,omitempty"`
	StagingReadTime time.Duration `json:"staging_read_ns,omitempty"`
	// MappedBytes is the host memory of a MappedSource the pager
	// page-locked (its mapped weight files: the page cache's pages, not
	// allocated); BytesMapped the bytes copied to the device straight from
	// it, not read (and not in BytesStaged or BytesDiskToHost).
	MappedBytes int64 `json:"mapped_bytes,omitempty"`
	BytesMapped int64 `json:"bytes_mapped,omitempty"`

	// PrefetchWait is the time Acquire spent waiting for loads already
	// under way (prefetches that had not finished); DemandWait the time
	// it spent on loads it started.
	PrefetchWait time.Duration `json:"prefetch_wait_ns"`
	DemandWait   time.Duration `json:"demand_wait_ns"`

	// Steps counts MarkStep calls. The first closes the warm-up (loading
	// the resident layers, prefill); BytesPerStep is the mean of the
	// bytes moved to the device in each step after it, MaxStepBytes
	// their largest, LastStepBytes the latest step's.
	Steps         int64   `json:"steps"`
	BytesPerStep  float64 `json:"bytes_per_step"`
	MaxStepBytes  int64   `json:"max_step_bytes"`
	LastStepBytes int64   `json:"last_step_bytes"`

	// The expert cache (a plan WithExpertCache): ExpertSlots experts of
	// ExpertsTotal fit in its ExpertCacheBytes; ExpertsCached are in it
	// now, ExpertsPinned acquired and not released. ExpertAcquires counts
	// the experts AcquireExperts returned: ExpertHits found in the cache
	// (or on their way into it), ExpertMisses loaded for it.
	// ExpertPrefetches counts the experts PrefetchExperts started loading
	// and ExpertPrefetchHits those of them acquired at their layer's next
	// visit, the one they were prefetched for (PrefetchAccuracy); ExpertPrefetchNoRoom the prefetches that
	// found no slot, ExpertPrefetchSkipped the calls dropped because as
	// many prefetches were under way as allowed. ExpertBytesMoved are the
	// bytes uploaded for experts; ExpertBytesPerStep and
	// ExpertMissesPerStep their mean and the misses' per step after the
	// first (MarkStep).
	ExpertPolicy          ExpertPolicy `json:"expert_policy,omitempty"`
	ExpertSlots           int          `json:"expert_slots,omitempty"`
	ExpertsTotal          int          `json:"experts,omitempty"`
	ExpertCacheBytes      int64        `json:"expert_cache_bytes,omitempty"`
	ExpertsCached         int          `json:"experts_cached,omitempty"`
	ExpertsPinned         int          `json:"experts_pinned,omitempty"`
	ExpertAcquires        int64        `json:"expert_acquires,omitempty"`
	ExpertHits            int64        `json:"expert_hits,omitempty"`
	ExpertMisses          int64        `json:"expert_misses,omitempty"`
	ExpertEvictions       int64        `json:"expert_evictions,omitempty"`
	ExpertPrefetches      int64        `json:"expert_prefetches,omitempty"`
	ExpertPrefetchHits    int64        `json:"expert_prefetch_hits,omitempty"`
	ExpertPrefetchNoRoom  int64        `json:"expert_prefetch_no_room,omitempty"`
	ExpertPrefetchSkipped int64        `json:"expert_prefetch_skipped,omitempty"`
	ExpertBytesMoved      int64        `json:"expert_bytes_moved,omitempty"`
	ExpertBytesPerStep    float64      `json:"expert_bytes_per_step,omitempty"`
	ExpertMissesPerStep   float64      `json:"expert_misses_per_step,omitempty"`
	// ExpertsPrepared counts the acquires whose slots came from
	// PrepareExperts' choice, without a scan of the cache.
	ExpertsPrepared int64 `json:"experts_prepared,omitempty"`
	// ExpertsOnCPU counts the missing experts computed on the CPU from
	// host memory instead (HostExpert), for ExpertCPUTokens tokens
	// together, their weights ExpertCPUBytes read there.
	ExpertsOnCPU    int64 `json:"experts_on_cpu,omitempty"`
	ExpertCPUTokens int64 `json:"expert_cpu_tokens,omitempty"`
	ExpertCPUBytes  int64 `json:"expert_cpu_bytes,omitempty"`

	ResidentWeightBytes int64 `json:"resident_weight_bytes"` // resident parts on the device now
	StreamedWeightBytes int64 `json:"streamed_weight_bytes"` // streamed parts on the device now
	RingBytes           int64 `json:"ring_bytes"`
	PeakDeviceBytes     int64 `json:"peak_device_bytes"` // the budget's peak
	PinnedLayers        int   `json:"pinned_layers"`     // layers acquired and not released
	BadReleases         int64 `json:"bad_releases,omitempty"`
}

// HitRate is Hits / Acquires, or 0 before any Acquire.
func (s Stats) HitRate() float64 {
	if s.Acquires == 0 {
		return 0
	}
	return float64(s.Hits) / float64(s.Acquires)
}

// ExpertHitRate is ExpertHits / ExpertAcquires, or 0 before any.
func (s Stats) ExpertHitRate() float64 {
	if s.ExpertAcquires == 0 {
		return 0
	}
	return float64(s.ExpertHits) / float64(s.ExpertAcquires)
}

// PrefetchAccuracy is ExpertPrefetchHits / ExpertPrefetches, or 0 before
// any prefetch.
func (s Stats) PrefetchAccuracy() float64 {
	if s.ExpertPrefetches == 0 {
		return 0
	}
	return float64(s.ExpertPrefetchHits) / float64(s.ExpertPrefetches)
}

// steps turns the bytes moved to the device into per-step figures: the
// first step (warm-up, prefill) is counted but left out of the mean.
type steps struct {
	lastMark, sum, count int64
}

// mark closes a step in st and returns the bytes moved during it.
func (k *steps) mark(st *Stats) int64 {
	d := st.BytesHostToDevice - k.lastMark
	k.lastMark = st.BytesHostToDevice
	st.Steps++
	st.LastStepBytes = d
	if st.Steps > 1 {
		k.sum += d
		k.count++
		st.MaxStepBytes = max(st.MaxStepBytes, d)
	}
	return d
}

// mean is the bytes per step after the first.
func (k *steps) mean() float64 {
	if k.count == 0 {
		return 0
	}
	return float64(k.sum) / float64(k.count)
}

// MarkStep marks a step boundary (a decoded token) and returns the bytes
// moved to the device since the previous mark.
func (p *Pager) MarkStep() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := p.steps.mark(&p.st)
	if p.ex != nil {
		p.ex.steps.mark(&p.st)
	}
	return d
}

// Stats returns the pager's counters now.
func (p *Pager) Stats() Stats {
	peak := p.bg.Peak()
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.st
	s.Pager, s.Device, s.Strategy, s.Layers = p.id, p.bg.Device(), p.plan.Strategy, len(p.layers)
	s.PrefetchWait, s.DemandWait = p.prefetchWait, p.demandWait
	s.BytesPerStep = p.steps.mean()
	s.HostCacheBytes, s.HostCacheLimit, s.PinnedHostBytes = p.hostUsed, p.hostCap, p.pinnedBytes
	if p.stage != nil {
		n := p.stage.pinnedBufs() // copied in place, it pins them at the first need
		s.StagingSlots, s.StagingBytes = n, int64(n)*p.stage.size
		s.StagingReaders, s.StagingReadTime = p.stage.nreaders, p.stage.readTime()
		s.MappedBytes = p.stage.mappedBytes
	}
	if p.ex != nil && len(p.ex.unregister) > 0 {
		s.MappedBytes += p.ex.mappedBytes // the expert cache's own registration
	}
	s.StagingWait = p.stagingWait
	s.RingBytes = p.ringCap
	s.PeakDeviceBytes = peak
	for _, e := range p.layers {
		if e.resLoaded {
			s.ResidentWeightBytes += e.resBytes
		}
		if e.strLoaded {
			s.StreamedWeightBytes += e.strBytes
		}
		if e.pins > 0 {
			s.PinnedLayers++
		}
		if e.held && e.host != nil {
			s.HostLayerBytes += int64(len(e.host))
		}
	}
	if x := p.ex; x != nil {
		s.ExpertPolicy, s.ExpertSlots, s.ExpertsTotal = x.policy, len(x.slots), x.total
		s.ExpertCacheBytes = int64(len(x.slots)) * x.slotBytes
		s.ExpertBytesPerStep, s.ExpertMissesPerStep = x.steps.means()
		for _, e := range x.slots {
			if e != nil && e.loaded {
				s.ExpertsCached++
				s.StreamedWeightBytes += e.bytes
			}
			if e != nil && e.pins > 0 {
				s.ExpertsPinned++
			}
		}
	}
	return s
}

// Summary returns the memory summary of the budget's device: per category
// the bytes allocated and reserved now and at their peak and the allocation
// counts, then the statistics of every pager using the budget.
func (bg *Budget) Summary() string {
	var sb strings.Builder
	bg.writeSummary(&sb)
	return sb.String()
}

// Summary returns the summaries of several devices' budgets, one after the
// other.
func Summary(budgets ...*Budget) string {
	var sb strings.Builder
	for i, bg := range budgets {
		if i > 0 {
			sb.WriteString("\n")
		}
		bg.writeSummary(&sb)
	}
	return sb.String()
}

func (bg *Budget) writeSummary(sb *strings.Builder) {
	s := bg.Snapshot()
	rule := strings.Repeat("=", 86)
	fmt.Fprintf(sb, "%s\n", rule)
	pct := 0.0
	if s.Limit > 0 {
		pct = 100 * float64(s.Peak) / float64(s.Limit)
	}
	fmt.Fprintf(sb, " memory summary, device %s: budget %s, in use %s, peak %s (%.1f%% of budget)\n",
		s.Device, FormatSize(s.Limit), FormatSize(s.Used), FormatSize(s.Peak), pct)
	fmt.Fprintf(sb, "%s\n", rule)
	tw := tabwriter.NewWriter(sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "category\tallocated\tpeak alloc\treserved\tpeak reserved\tallocs\tfrees\t")
	var tot CategoryStats
	for _, c := range s.Categories {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t\n", c.Category, FormatSize(c.Allocated), FormatSize(c.PeakAllocated),
			FormatSize(c.Reserved), FormatSize(c.PeakReserved), c.Allocs, c.Frees)
		tot.Allocated += c.Allocated
		tot.Reserved += c.Reserved
		tot.Allocs += c.Allocs
		tot.Frees += c.Frees
	}
	fmt.Fprintf(tw, "total\t%s\t\t%s\t%s\t%d\t%d\t\n", FormatSize(tot.Allocated), FormatSize(tot.Reserved), FormatSize(s.Peak), tot.Allocs, tot.Frees)
	tw.Flush()
	for _, ps := range s.Pagers {
		fmt.Fprintf(sb, "%s\n", strings.Repeat("-", 86))
		fmt.Fprintf(sb, " pager %d (%s, %d layers): resident %s, streamed on device %s, ring %s, %d pinned\n",
			ps.Pager, ps.Strategy, ps.Layers, FormatSize(ps.ResidentWeightBytes), FormatSize(ps.StreamedWeightBytes), FormatSize(ps.RingBytes), ps.PinnedLayers)
		fmt.Fprintf(sb, "   acquires %d: hits %d, misses %d (hit rate %.1f%%); loads %d, evictions %d, prefetches %d (%d skipped, %d stale, %d without room); %d parts outside the ring\n",
			ps.Acquires, ps.Hits, ps.Misses, 100*ps.HitRate(), ps.Loads, ps.Evictions, ps.Prefetches, ps.PrefetchSkipped, ps.PrefetchStale, ps.PrefetchNoRoom, ps.OutsideRing)
		fmt.Fprintf(sb, "   moved: disk->host %s, host->device %s; host cache %s of %s (hits %d, misses %d), pinned %s, held by CPU layers %s\n",
			FormatSize(ps.BytesDiskToHost), FormatSize(ps.BytesHostToDevice), FormatSize(ps.HostCacheBytes), FormatSize(ps.HostCacheLimit),
			ps.HostCacheHits, ps.HostCacheMisses, FormatSize(ps.PinnedHostBytes), FormatSize(ps.HostLayerBytes))
		if ps.PinnedFallbacks > 0 {
			fmt.Fprintf(sb, "   pinned host memory refused %d times: %s of host copies in pageable memory, uploaded at pageable speed (first refusal: %s)\n",
				ps.PinnedFallbacks, FormatSize(ps.PinnedFallbackBytes), ps.PinnedFallbackError)
		}
		if ps.StagingSlots > 0 {
			fmt.Fprintf(sb, "   staging ring %s pinned (%d buffers of %s) within the host limit: %s staged, waited %v for a free buffer; %d readers, reading for %v (%.1f GB/s)\n",
				FormatSize(ps.StagingBytes), ps.StagingSlots, FormatSize(ps.StagingBytes/int64(ps.StagingSlots)), FormatSize(ps.BytesStaged), ps.StagingWait.Round(time.Microsecond),
				ps.StagingReaders, ps.StagingReadTime.Round(time.Microsecond), ps.StagedReadGBps())
		}
		if ps.MappedBytes > 0 {
			fmt.Fprintf(sb, "   mapped weight files page-locked: %s; %s copied from them in place (staging buffers pinned: %d)\n",
				FormatSize(ps.MappedBytes), FormatSize(ps.BytesMapped), ps.StagingSlots)
		}
		fmt.Fprintf(sb, "   steps %d: %s per step after the first (max %s); waited %v on prefetches, %v on demand loads\n",
			ps.Steps, FormatSize(int64(ps.BytesPerStep)), FormatSize(ps.MaxStepBytes), ps.PrefetchWait.Round(time.Microsecond), ps.DemandWait.Round(time.Microsecond))
		if ps.ExpertSlots > 0 {
			fmt.Fprintf(sb, "   experts: cache %s holds %d of %d (%s), %d cached, %d pinned; acquires %d: hits %d, misses %d (hit rate %.1f%%), evictions %d\n",
				FormatSize(ps.ExpertCacheBytes), ps.ExpertSlots, ps.ExpertsTotal, ps.ExpertPolicy, ps.ExpertsCached, ps.ExpertsPinned,
				ps.ExpertAcquires, ps.ExpertHits, ps.ExpertMisses, 100*ps.ExpertHitRate(), ps.ExpertEvictions)
			fmt.Fprintf(sb, "   expert prefetches %d: %d used (accuracy %.1f%%), %d without room, %d skipped; per step after the first: %.2f misses, %s moved\n",
				ps.ExpertPrefetches, ps.ExpertPrefetchHits, 100*ps.PrefetchAccuracy(), ps.ExpertPrefetchNoRoom, ps.ExpertPrefetchSkipped,
				ps.ExpertMissesPerStep, FormatSize(int64(ps.ExpertBytesPerStep)))
			if ps.ExpertsOnCPU > 0 {
				fmt.Fprintf(sb, "   experts computed on the CPU instead of uploaded: %d, for %d tokens, %s read from host memory\n",
					ps.ExpertsOnCPU, ps.ExpertCPUTokens, FormatSize(ps.ExpertCPUBytes))
			}
		}
	}
	fmt.Fprintf(sb, "%s\n", rule)
}

// StagedReadGBps is the rate, in GB/s, the staging ring's reads ran at:
// the bytes staged over the time at least one read was under way; 0
// before any.
func (s Stats) StagedReadGBps() float64 {
	if s.StagingReadTime <= 0 {
		return 0
	}
	return float64(s.BytesStaged) / s.StagingReadTime.Seconds() / 1e9
}
