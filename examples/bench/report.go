package main

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/paging"
)

// Row is one line of the comparison table.
type Row struct {
	Result
	// BoundTokS is the streaming bound (pinned GB/s over the bytes that must
	// cross the link per token) or, with nothing streamed, the device-memory
	// bound (device GB/s over the weight bytes). A mixture of experts whose
	// experts are paged has the experts bound: the time of the bytes its
	// measured misses and the other weights' streaming move over the link
	// (pinned GB/s), plus that of the bytes a token reads from device
	// memory (device GB/s): the weights other than the experts and the
	// experts it acquired. When the CPU computes experts, the missing
	// experts' bytes (uploaded and read by the CPU) count at the link's
	// and the CPU's rates together (shared, as they run side by side),
	// which no split of them beats: Bound then names the two rates.
	BoundTokS float64 `json:"bound_tok_s"`
	// "stream", "cpu", "hybrid", "device", "experts", or "experts: link
	// L + CPU C GB/s".
	Bound string `json:"bound"`
	// CPUBoundTokS and HybridBoundTokS are the same run's bytes that are
	// not resident on the device over the CPU's read rate, and over the
	// CPU's and the link's rates together (measured at the same time): the
	// bounds of computing them on the CPU, and of the hybrid split.
	CPUBoundTokS    float64 `json:"cpu_bound_tok_s,omitempty"`
	HybridBoundTokS float64 `json:"hybrid_bound_tok_s,omitempty"`
	OfBound         float64 `json:"of_bound"`
	// StagingBoundTokS is a staged run's own bound: the bytes it streams
	// per token at the slower of the pinned copy rate and the rate its
	// staging ring's reads ran at (Result.StagedReadGBps), the reads from
	// the page cache into pinned memory being the part the stream bound
	// leaves out; OfStagingBound the run's share of it.
	StagingBoundTokS float64 `json:"staging_bound_tok_s,omitempty"`
	OfStagingBound   float64 `json:"of_staging_bound,omitempty"`
	VsBaseline       float64 `json:"vs_baseline"` // decode tok/s over the baseline's
	BaselineRun      string  `json:"baseline"`    // which: accelerate at the same budget, else transformers resident (compiled when it ran)
	// StreamsVsBaseline is a batched run's aggregate tok/s over Hugging
	// Face's at the same model, budget and batch size (hf_baseline
	// -batch), StreamsBaseline which run that was.
	StreamsVsBaseline float64 `json:"streams_vs_baseline,omitempty"`
	StreamsBaseline   string  `json:"streams_baseline,omitempty"`
}

func report(files []string, mdPath, jsonPath string, stdout io.Writer) error {
	var ceil *Ceilings
	var results []Result
	for _, path := range files {
		f, err := infile.Open(path)
		if err != nil {
			return err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for n := 1; sc.Scan(); n++ {
			line := sc.Bytes()
			if len(strings.TrimSpace(string(line))) == 0 {
				continue
			}
			var kind struct{ Kind string }
			if err := json.Unmarshal(line, &kind); err != nil {
				f.Close()
				return fmt.Errorf("%s:%d: %w", path, n, err)
			}
			if kind.Kind == "ceilings" {
				ceil = new(Ceilings)
				if err := json.Unmarshal(line, ceil); err != nil {
					f.Close()
					return fmt.Errorf("%s:%d: %w", path, n, err)
				}
				continue
			}
			var r Result
			if err := json.Unmarshal(line, &r); err != nil {
				f.Close()
				return fmt.Errorf("%s:%d: %w", path, n, err)
			}
			results = append(results, r)
		}
		f.Close()
		if err := sc.Err(); err != nil {
			return err
		}
	}
	rows := make([]Row, 0, len(results))
	for _, r := range results {
		row := Row{Result: r}
		if r.Error == "" {
			bounds(&row, ceil)
		}
		if base := baseline(results, r); base != nil && base.DecodeTokS > 0 {
			row.VsBaseline, row.BaselineRun = r.DecodeTokS/base.DecodeTokS, base.Kind+" "+base.Run
		}
		if base, sr := streamsBaseline(results, r, r.Streams); base != nil {
			row.StreamsVsBaseline, row.StreamsBaseline = r.Streams.DecodeTokS/sr.DecodeTokS, base.Kind+" "+base.Run
		}
		rows = append(rows, row)
	}
	batched := batchedRows(results)
	md := markdown(ceil, rows) + batchedMarkdown(batched) + cpuBandwidthMarkdown(rows)
	fmt.Fprint(stdout, md)
	if mdPath != "" {
		if err := atomicfile.WriteFile(mdPath, []byte(md)); err != nil {
			return fmt.Errorf("-md: %w", err)
		}
	}
	if jsonPath != "" {
		b, err := json.MarshalIndent(struct {
			Ceilings *Ceilings    `json:"ceilings"`
			Rows     []Row        `json:"rows"`
			Batched  []BatchedRow `json:"batched,omitempty"`
		}{ceil, rows, batched}, "", "  ")
		if err != nil {
			return err
		}
		if err := atomicfile.WriteFile(jsonPath, b); err != nil {
			return fmt.Errorf("-json: %w", err)
		}
	}
	return nil
}

// bounds fills a row's bounds. A run's non-resident bytes per token are
// what it streams, plus what its CPU reads of its layers' weights in a
// CPU+GPU run; the rates are the run's own (a CPU+GPU run measures them
// at Open: engine.MeasureRates' H2D and CPU rates, alone and shared) or
// the ceilings'. The bounds are the bandwidths' alone: the calibrated
// costs the prediction adds (Rates.CPULayer and CPULayerShared,
// DeviceStage, the KV reads at Rates.CPUAttention) stay out of them.
// The row is judged against the bound of what it does: the hybrid bound for
// the hybrid strategy, the CPU bound for cpu, the stream bound when it
// streams, else the device-memory bound; with a KV cache in host memory,
// the bound with its reads counted.
//
// The link's rate is the faster of the ceilings' pinned rate and the rate
// the run's own copies ran at (h2d_GBps): the ceilings are one moment of a
// host shared with others, and a bound below what the run did is no bound
// (on the H200 a call's ceilings once read 43.6 GB/s where its runs copied
// at 54.9).
func bounds(row *Row, c *Ceilings) {
	r := row.Result
	if c != nil && r.H2DGBps > c.PinnedGBps && c.PinnedGBps > 0 {
		run := *c
		run.PinnedGBps = r.H2DGBps
		c = &run
	}
	if x := r.Experts; x != nil {
		if c != nil && c.PinnedGBps > 0 && c.DeviceGBps > 0 {
			pinned := c.PinnedGBps * 1e9
			hbm := float64(r.WeightBytes-x.WeightBytes) + x.AcquiresPerToken*float64(x.ExpertBytes)
			t := (float64(r.StreamedBytes)+x.MissesPerToken*float64(x.ExpertBytes))/pinned + hbm/(c.DeviceGBps*1e9)
			row.Bound = "experts"
			if x.OnCPUPerToken > 0 && c.CPUGBps > 0 {
				// Experts on the CPU: the missing experts' bytes, those
				// uploaded and those the CPU read, at the link's and the
				// CPU's rates together (each as it runs beside the
				// other), the best any split of them can do.
				link, cpu := c.H2DSharedGBps*1e9, c.CPUSharedGBps*1e9
				if link <= 0 || cpu <= 0 {
					link, cpu = pinned, c.CPUGBps*1e9
				}
				missing := (x.MissesPerToken + x.OnCPUPerToken) * float64(x.ExpertBytes)
				t = float64(r.StreamedBytes)/pinned + missing/(link+cpu) + hbm/(c.DeviceGBps*1e9)
				row.Bound = fmt.Sprintf("experts: link %.0f + CPU %.0f GB/s", link/1e9, cpu/1e9)
			}
			row.BoundTokS = 1 / t
			row.OfBound = r.DecodeTokS / row.BoundTokS
		}
		return
	}
	nonResident := r.StreamedBytes
	var rates paging.Rates
	if h := r.Hybrid; h != nil {
		nonResident = h.StreamedBytes + h.CPUBytes
		rates = h.Rates
	} else if c != nil {
		rates = paging.Rates{H2D: c.PinnedGBps * 1e9, CPU: c.CPUGBps * 1e9, H2DShared: c.H2DSharedGBps * 1e9, CPUShared: c.CPUSharedGBps * 1e9}
	}
	if nonResident > 0 {
		b := rates.Bounds(nonResident)
		if c != nil && c.PinnedGBps > 0 && r.Hybrid == nil {
			b.Stream = c.PinnedGBps * 1e9 / float64(nonResident)
		}
		row.CPUBoundTokS, row.HybridBoundTokS = b.CPU, b.Hybrid
		switch r.Strategy {
		case string(paging.StrategyHybrid):
			row.Bound, row.BoundTokS = "hybrid", b.Hybrid
		case string(paging.StrategyCPU):
			row.Bound, row.BoundTokS = "cpu", b.CPU
		default:
			row.Bound, row.BoundTokS = "stream", b.Stream
		}
	} else if c != nil && c.DeviceGBps > 0 && r.WeightBytes > 0 {
		row.Bound, row.BoundTokS = "device", c.DeviceGBps*1e9/float64(r.WeightBytes)
	}
	// A KV cache in host memory: the CPU reads it each step besides what
	// streams (KVResult's bound, from the engine's rates).
	if k := r.KV; k != nil && k.KVReport != nil && len(k.HostBlocks) > 0 && k.DecodeBoundTokS > 0 {
		row.Bound, row.BoundTokS = cmp.Or(row.Bound, "stream")+"+host KV", k.DecodeBoundTokS
	}
	if row.BoundTokS > 0 {
		row.OfBound = r.DecodeTokS / row.BoundTokS
	}
	if c != nil && c.PinnedGBps > 0 && r.StagedReadGBps > 0 && r.StreamedBytes > 0 {
		row.StagingBoundTokS = min(c.PinnedGBps, r.StagedReadGBps) * 1e9 / float64(r.StreamedBytes)
		row.OfStagingBound = r.DecodeTokS / row.StagingBoundTokS
	}
}

// baseline is accelerate at the same model and budget, else transformers
// with everything resident.
func baseline(all []Result, r Result) *Result {
	var resident *Result
	for i := range all {
		b := &all[i]
		// A batched line of hf_baseline (-batch) has no single-stream
		// rate: it is the baseline of the streams column only.
		if b.Model != r.Model || b.Error != "" || b.DecodeTokS <= 0 {
			continue
		}
		if b.Kind == "accelerate" && b.BudgetBytes == r.BudgetBytes && r.BudgetBytes > 0 {
			return b
		}
		// The compiled run (static cache, torch.compile) is the stronger
		// resident baseline, when it ran.
		if b.BudgetBytes == 0 && (b.Kind == "transformers-compiled" || b.Kind == "transformers" && (resident == nil || resident.Kind != "transformers-compiled")) {
			resident = b
		}
	}
	if r.BudgetBytes == 0 {
		return resident
	}
	return nil
}

// streamsBaseline is Hugging Face's batched run (hf_baseline -batch) of
// r's model, budget and batch size, for sr, a batched decode of a strata
// run: the compiled resident run when it ran, else the eager one; the
// run and its batched decode of that size.
func streamsBaseline(all []Result, r Result, sr *StreamsResult) (*Result, *StreamsResult) {
	if r.Kind != "strata" || sr == nil || sr.Error != "" || sr.DecodeTokS <= 0 {
		return nil, nil
	}
	var found *Result
	var foundSR *StreamsResult
	for i := range all {
		b := &all[i]
		if b.Kind == "strata" || b.Model != r.Model || b.Error != "" || b.BudgetBytes != r.BudgetBytes {
			continue
		}
		for _, bs := range b.streamRuns() {
			if bs.Streams != sr.Streams || bs.Error != "" || bs.DecodeTokS <= 0 {
				continue
			}
			if found == nil || b.Kind == "transformers-compiled" {
				found, foundSR = b, bs
			}
		}
	}
	return found, foundSR
}

// BatchedRow is one line of the batched table: a batched decode of a run
// (strata's -streams, Hugging Face's --batch) and, for strata's, its
// aggregate rate over Hugging Face's of the same model, budget and batch
// size.
type BatchedRow struct {
	Model       string `json:"model"`
	Kind        string `json:"kind"`
	Run         string `json:"run"`
	BudgetBytes int64  `json:"budget_bytes"`
	*StreamsResult
	VsBaseline float64 `json:"vs_baseline,omitempty"`
	Baseline   string  `json:"baseline,omitempty"`
}

// batchedRows is every batched decode of the results, by model, budget
// and stream count, strata's first: Hugging Face's batch of a size sits
// beside strata's streams of that count.
func batchedRows(results []Result) []BatchedRow {
	var rows []BatchedRow
	for _, r := range results {
		if r.Error != "" {
			continue
		}
		for _, sr := range r.streamRuns() {
			row := BatchedRow{Model: r.Model, Kind: r.Kind, Run: r.Run, BudgetBytes: r.BudgetBytes, StreamsResult: sr}
			if base, bs := streamsBaseline(results, r, sr); base != nil {
				row.VsBaseline, row.Baseline = sr.DecodeTokS/bs.DecodeTokS, base.Kind+" "+base.Run
			}
			rows = append(rows, row)
		}
	}
	strataFirst := func(kind string) int {
		if kind == "strata" {
			return 0
		}
		return 1
	}
	slices.SortStableFunc(rows, func(a, b BatchedRow) int {
		return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.BudgetBytes, b.BudgetBytes), cmp.Compare(a.Streams, b.Streams),
			cmp.Compare(strataFirst(a.Kind), strataFirst(b.Kind)))
	})
	return rows
}

// batchedMarkdown is the batched table, empty without batched decodes.
func batchedMarkdown(rows []BatchedRow) string {
	if len(rows) == 0 {
		return ""
	}
	var sb strings.Builder
	sb.WriteString("\nBatched decode (strata -streams N beside Hugging Face generate with a batch of N at the same budget: aggregate tok/s over the streams, latencies in ms; a strata run's counts share one plan, which keeps room for the largest pool the budget holds):\n\n")
	sb.WriteString("| model | budget | streams | system | run | aggregate tok/s | inter-token p50 | inter-token p99 | first token p50 | first token p99 | mean batch | vs baseline | steps/s of rows | ms a step (host: schedule and tables; launch: the forward queued, or computed on the CPU; wait for the device; download; sample; the device's own time) |\n")
	sb.WriteString("| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |\n")
	for _, r := range rows {
		budget := budgetCell(r.BudgetBytes)
		if r.Error != "" {
			fmt.Fprintf(&sb, "| %s | %s | %d | %s | %s | error: %s |||||||||\n", r.Model, budget, r.Streams, r.Kind, r.Run, strings.ReplaceAll(r.Error, "|", "/"))
			continue
		}
		vs := "-"
		if r.VsBaseline > 0 {
			vs = fmt.Sprintf("%.2fx %s", r.VsBaseline, r.Baseline)
		}
		steps := "-"
		if r.StepsS > 0 {
			steps = fmt.Sprintf("%.1f of %.1f", r.StepsS, r.RowsPerStep)
		}
		fmt.Fprintf(&sb, "| %s | %s | %d | %s | %s | %.1f | %.1f | %.1f | %.0f | %.0f | %.2f | %s | %s | %s |\n",
			r.Model, budget, r.Streams, r.Kind, r.Run, r.DecodeTokS, r.InterTokenP50Ms, r.InterTokenP99Ms, r.TTFTP50Ms, r.TTFTP99Ms, r.MeanBatch, vs, steps, r.Step)
	}
	return sb.String()
}

// streamsCell is a batched run in the table: its streams, aggregate rate,
// inter-token and first-token latency percentiles, and the ratio to
// Hugging Face's at the same batch size.
func streamsCell(r *Row) string {
	if len(r.StreamsSweep) > 0 {
		var counts, rates []string
		for _, s := range r.StreamsSweep {
			counts = append(counts, strconv.Itoa(s.Streams))
			rate := "error"
			if s.Error == "" {
				rate = fmt.Sprintf("%.1f", s.DecodeTokS)
			}
			rates = append(rates, rate)
		}
		return strings.Join(counts, ", ") + ": " + strings.Join(rates, ", ") + " tok/s (the batched table)"
	}
	s := r.Streams
	if s == nil {
		return "-"
	}
	c := fmt.Sprintf("%d: %.1f tok/s, inter-token p50 %.1f p99 %.1f ms, first token p50 %.0f p99 %.0f ms",
		s.Streams, s.DecodeTokS, s.InterTokenP50Ms, s.InterTokenP99Ms, s.TTFTP50Ms, s.TTFTP99Ms)
	if r.StreamsVsBaseline > 0 {
		c += fmt.Sprintf(", %.2fx %s", r.StreamsVsBaseline, r.StreamsBaseline)
	}
	return c
}

func markdown(c *Ceilings, rows []Row) string {
	var sb strings.Builder
	if c != nil {
		fmt.Fprintf(&sb, "Ceilings on %s: host-to-device %.1f GB/s pinned, %.1f GB/s pageable (%s copies); device memory %.0f GB/s (read + write).\n\n",
			c.Device, c.PinnedGBps, c.PageableGBps, paging.FormatSize(c.CopyBytes), c.DeviceGBps)
	}
	sb.WriteString("| model | system | budget | strategy | mode | decode tok/s | launches/token | prefill 128 | prefill 512 | moved/token | CPU reads/token | H2D GB/s | overlap | peak device | host staging | CPU bound | hybrid bound | bound tok/s | of bound | predicted | experts | vs baseline | streams |\n")
	hybrid := false
	sb.WriteString("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |\n")
	for _, r := range rows {
		budget := budgetCell(r.BudgetBytes)
		if r.Error != "" {
			fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | error: %s ||||||||||||||||||\n", r.Model, r.Kind, budget, r.Strategy, r.Mode, strings.ReplaceAll(r.Error, "|", "/"))
			continue
		}
		vs := "-"
		if r.VsBaseline > 0 {
			vs = fmt.Sprintf("%.2fx %s", r.VsBaseline, r.BaselineRun)
		}
		bound := "-"
		if r.BoundTokS > 0 {
			bound = fmt.Sprintf("%.1f (%s)", r.BoundTokS, r.Bound)
		}
		of := "-"
		if r.OfBound > 0 {
			of = fmt.Sprintf("%.0f%%", 100*r.OfBound)
		}
		cpuReads, predicted := "-", "-"
		if h := r.Hybrid; h != nil {
			cpuReads = fmt.Sprintf("%s (%d layers)", paging.FormatSize(h.CPUBytes), len(h.CPULayers))
			predicted = fmt.Sprintf("%.2f", h.PredictedTokS)
		}
		opt := func(v float64) string {
			if v <= 0 {
				return "-"
			}
			return fmt.Sprintf("%.1f", v)
		}
		staging := "-"
		if r.StagingSlots > 0 || r.MappedPerToken > 0 {
			staging = fmt.Sprintf("%s pinned (%d buffers), %s/token", paging.FormatSize(r.StagingBytes), r.StagingSlots, paging.FormatSize(int64(r.StagedPerToken)))
			if r.MappedPerToken > 0 {
				staging += fmt.Sprintf(", %s/token in place from %s page-locked", paging.FormatSize(int64(r.MappedPerToken)), paging.FormatSize(r.MappedBytes))
			}
			if r.StagedReadGBps > 0 {
				staging += fmt.Sprintf(", reads %.1f GB/s", r.StagedReadGBps)
			}
			if r.StagingBoundTokS > 0 {
				staging += fmt.Sprintf("; own bound %.2f tok/s (%.0f%%)", r.StagingBoundTokS, 100*r.OfStagingBound)
			}
		}
		decode := "-" // a batched line of hf_baseline has no single-stream rate
		if r.DecodeTokS > 0 {
			decode = fmt.Sprintf("%.2f", r.DecodeTokS)
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | %s | %s | %.0f | %.0f | %s | %s | %.1f | %.2f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			r.Model, r.Kind, budget, r.Strategy, r.Mode, decode, launchCell(&r.Result), r.PrefillTokS["128"], r.PrefillTokS["512"],
			paging.FormatSize(int64(r.BytesPerToken)), cpuReads, r.H2DGBps, r.Overlap, paging.FormatSize(r.PeakDeviceBytes), staging,
			opt(r.CPUBoundTokS), opt(r.HybridBoundTokS), bound, of, predicted, expertCell(r.Experts), vs, streamsCell(&r))
		if h := r.Hybrid; h != nil {
			hybrid = true
		}
	}
	if hybrid {
		sb.WriteString("\nCPU and hybrid bounds: the weights' bytes a token reads outside device memory over the run's own rates, measured at Open (engine.MeasureRates: the CPU's products alone, and beside copies with the link for the hybrid bound). predicted: the planner's decode time at the positions the timed steps attend over, with the calibrated cost of a CPU block and the KV cache's reads.\n")
	}
	return sb.String()
}

// expertCell is a mixture of experts' experts in the table: the cache, its
// hit rate, misses per token, prefetch accuracy, guesses right, the
// experts computed on the CPU per token when there are any, and the
// routing when synthetic.
func expertCell(x *engine.ExpertReport) string {
	if x == nil {
		return "-"
	}
	s := fmt.Sprintf("%d of %d cached (%s): hit %.1f%%, %.2f misses/token, prefetch %.0f%%, guesses %.0f%%",
		x.Slots, x.Experts, x.Policy, 100*x.HitRate, x.MissesPerToken, 100*x.PrefetchAccuracy, 100*x.GuessAccuracy)
	if x.OnCPU > 0 {
		s += fmt.Sprintf(", %.2f on the CPU/token", x.OnCPUPerToken)
	}
	if r := x.Rates; r != nil {
		s += fmt.Sprintf(" (split by link %.0f, CPU %.0f GB/s, hand-over %.0f us)", r.H2D/1e9, r.CPU/1e9, float64(r.Handoff)/1e3)
	}
	if x.Routing != "router" {
		s += ", " + x.Routing
	}
	return s
}

// launchCell is a run's launches per decoded token, marked "graphs" when
// its decode steps could run as captured graphs; "-" where the device did
// not count them.
func launchCell(r *Result) string {
	if r.Launches == nil {
		return "-"
	}
	if r.Graphs {
		return fmt.Sprintf("%.1f (graphs: %.1f replays)", r.LaunchesPerToken, float64(r.Launches.Graphs)/float64(max(r.DecodeTokens, 1)))
	}
	return fmt.Sprintf("%.1f", r.LaunchesPerToken)
}

// budgetCell is a run's budget in a table: its size, or none.
func budgetCell(n int64) string {
	if n > 0 {
		return paging.FormatSize(n)
	}
	return "none"
}
