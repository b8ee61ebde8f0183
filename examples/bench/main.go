// Command bench measures strata on a model directory (decode and prefill
// tokens/s, bytes moved per token, copy rate, overlap, peak device bytes)
// for a list of budgets, memory modes and offload strategies, measures the
// machine's own ceilings, and joins its results with the Hugging Face
// baseline's (hf_baseline.py) into one table.
//
//	bench -ceilings -device cuda -out results.jsonl
//	bench -model DIR -name llama2-7b -device cuda -runs none,4GiB:balanced,4GiB:balanced:unified -out results.jsonl
//	bench -report results.jsonl,hf.jsonl [-md table.md] [-json table.json]
//	bench -model DIR -device cuda -runs none,4GiB -streams 1,8,32,64 -out results.jsonl
//
// A run is BUDGET[:STRATEGY[:MODE[:POLICY]]]: BUDGET is "none" or a size
// (4GiB), STRATEGY one of none, minimal, balanced, aggressive, hybrid
// (hybrid=N puts N layers on the CPU), cpu (default balanced with a
// budget), MODE explicit, unified or unified-noprefetch, POLICY the expert
// cache's of a mixture of experts, lru or lfu. Each run appends one JSON
// object to -out. A mixture of experts' run reports its experts (hit rate,
// misses and bytes per token, prefetch accuracy, guesses right, and
// whether its routing is synthetic), and the report judges it against the
// bound of its measured misses: their bytes over the link plus the
// weights a token reads from device memory. -router-skew S (with
// -router-locality P) runs a mixture of experts with synthetic routing of
// that skew and locality in place of its own (as synth's flags write it),
// so that one large file, a GGUF one above all, is measured under both
// uniform and skewed routing; -experts-cpu (auto, never, always) says when
// a missing expert is computed on the CPU instead of uploaded. run-gpu.sh drives a whole
// comparison on a GPU machine. With -streams N a run also decodes N
// requests at once through the engine's batcher and reports their
// aggregate tok/s, the p50 and p99 of the inter-token latency and of the
// time to first token; -streams 1,8,32,64 sweeps the counts over the one
// engine the run opened (its plan keeps room for the largest pool), and
// the report's batched table sets each count beside Hugging Face's batch
// of that size (hf_baseline.py --batch). With -cpuprofile FILE each run
// writes a CPU profile of its timed decode steps (the hybrid strategy's
// CPU stage, say) beside FILE, the run's name in its own.
package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/strata-llm/strata/arch"
	_ "github.com/strata-llm/strata/cuda" // the "cuda" device driver, built with -tags cuda
	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

func main() {
	cli.Main("bench", func(ctx context.Context, args []string, stdout, _ io.Writer) error {
		return run(ctx, args, stdout)
	})
}

type options struct {
	model, name, device, runs, out, report, md, jsonOut string
	prefill, hostLimit, kvCache, kvDType, streamsFlag   string
	expertsCPU                                          string
	cpuProfile, stagingPieceS                           string
	stagingReaders, stagingBuffers                      int
	stagingPiece                                        int64 // stagingPieceS parsed
	stagingMapped                                       bool
	decode, warmup, threads, chunk, promptTokens        int
	bwPiece                                             int
	streams                                             []int        // streamsFlag parsed
	kv                                                  tensor.DType // kvDType parsed
	ceilings, graphs                                    bool
	routerSkew, routerLocality                          float64
	synthetic                                           bool // -router-skew given
	devices                                             string
	pipeline                                            bool
	more                                                []tensor.Backend // -devices after the first
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	o := options{}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.StringVar(&o.model, "model", "", "model `directory`")
	fs.StringVar(&o.name, "name", "", "model label in the results (default: the directory's base name)")
	fs.StringVar(&o.device, "device", "cpu", "cpu, cuda, cuda:N or auto")
	fs.StringVar(&o.devices, "devices", "", "spread the layers over these `devices` of -device's driver: 0,1 or all (each run's budget is each device's; launches and copy rates are the first device's)")
	fs.BoolVar(&o.pipeline, "pipeline", false, "with -devices and -streams, run the batcher's steps as a pipeline over the devices")
	fs.StringVar(&o.runs, "runs", "none", "comma-separated runs BUDGET[:STRATEGY[:MODE]]")
	fs.StringVar(&o.prefill, "prefill", "128,512", "prompt lengths to time")
	fs.IntVar(&o.decode, "decode", 64, "decode steps to time")
	fs.IntVar(&o.warmup, "warmup", 4, "decode steps before timing")
	fs.IntVar(&o.bwPiece, "bw-piece", 8, "on the cpu device: time the decode in pieces of this many `steps`, the read bandwidth measured around each (0: no bandwidth measures)")
	fs.StringVar(&o.streamsFlag, "streams", "", "also decode `N[,N...]` requests at once through the engine's batcher, each count in turn over the same engine: aggregate tok/s, inter-token latency and time to first token")
	fs.IntVar(&o.promptTokens, "prompt-tokens", 16, "prompt `tokens` before the decode steps (their prefill is timed too): the context the timed steps attend over")
	fs.StringVar(&o.kvCache, "kv-cache", "", "where the KV cache lives: device (default), host or auto (see generate -help)")
	fs.IntVar(&o.chunk, "chunk", 0, "prefill chunk (0: the engine's choice, 512 or larger under a budget: engine.AutoChunk)")
	fs.IntVar(&o.threads, "threads", 0, "CPU threads (the cpu device, and the CPU layers of the hybrid and cpu strategies; 0 is every core)")
	fs.StringVar(&o.hostLimit, "host-memory-limit", "", "host RAM `size` for caching streamed layers and experts (default: the plan's, all it streams)")
	fs.StringVar(&o.kvDType, "kv-dtype", "", "the KV cache's stored `dtype`: f32 (the default), f16, bf16, q8_b8 or q8_0")
	fs.IntVar(&o.stagingReaders, "staging-readers", 0, "goroutines reading streamed parts into the staging ring (the aggressive strategy on a GPU; 0: one per core, at least 8)")
	fs.StringVar(&o.stagingPieceS, "staging-piece", "", "`size` of the pieces large tensors are read and copied in through the staging ring (default 16MiB)")
	fs.IntVar(&o.stagingBuffers, "staging-buffers", 0, "the staging ring's pinned buffers (0: one per load at once, at most 3; -1: no ring)")
	fs.BoolVar(&o.stagingMapped, "staging-mapped", true, "let the staging ring copy the tensors of mapped weight files in place from their page-locked mapping (false: read every tensor into the ring, to compare)")
	fs.BoolVar(&o.ceilings, "ceilings", false, "measure host-to-device (pinned, pageable) and device memory GB/s")
	fs.BoolVar(&o.graphs, "graphs", true, "decode with captured graphs where the device has them (false: launch by launch, to compare)")
	fs.StringVar(&o.expertsCPU, "experts-cpu", "", "a mixture of experts: when a missing expert is computed on the CPU instead of uploaded: auto (the default), never or always")
	fs.Float64Var(&o.routerSkew, "router-skew", 0, "a mixture of experts: route with synthetic routing of this Zipf skew (0 uniform) in place of the model's own routing")
	fs.Float64Var(&o.routerLocality, "router-locality", 0, "with -router-skew: the chance a token keeps each expert of the previous token")
	fs.StringVar(&o.out, "out", "", "append results as JSON lines to this `file`")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of each run's timed decode steps to this `file`, the run's name inserted before its extension (decode.pprof: decode-4GiB-hybrid-explicit.pprof); on the cpu device it holds -bw-piece's bandwidth measures too (main.sumWords)")
	fs.StringVar(&o.report, "report", "", "comma-separated JSONL `files` to join into a table (no measuring)")
	fs.StringVar(&o.md, "md", "", "with -report: also write the markdown table to this file")
	fs.StringVar(&o.jsonOut, "json", "", "with -report: write the table rows as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	fs.Visit(func(f *flag.Flag) { o.synthetic = o.synthetic || f.Name == "router-skew" })
	if o.routerLocality != 0 && !o.synthetic {
		return errors.New("-router-locality needs -router-skew")
	}
	if o.report != "" {
		files := strings.Split(o.report, ",")
		if err := cli.CheckOutputs([][2]string{{"-md", o.md}, {"-json", o.jsonOut}}, files); err != nil {
			return err
		}
		return report(files, o.md, o.jsonOut, stdout)
	}
	if err := cli.CheckOutputs([][2]string{{"-out", o.out}, {"-cpuprofile", o.cpuProfile}}, nil); err != nil {
		return err
	}
	switch {
	case o.decode < 1:
		return fmt.Errorf("-decode %d must be >= 1", o.decode)
	case o.warmup < 0:
		return fmt.Errorf("-warmup %d must be >= 0", o.warmup)
	case o.chunk < 0:
		return fmt.Errorf("-chunk %d must be >= 0", o.chunk)
	case o.threads < 0:
		return fmt.Errorf("-threads %d must be >= 0", o.threads)
	case o.bwPiece < 0:
		return fmt.Errorf("-bw-piece %d must be >= 0", o.bwPiece)
	case o.promptTokens < 1:
		return fmt.Errorf("-prompt-tokens %d must be >= 1", o.promptTokens)
	case o.stagingReaders < 0:
		return fmt.Errorf("-staging-readers %d must be >= 0", o.stagingReaders)
	case o.stagingBuffers < -1:
		return fmt.Errorf("-staging-buffers %d must be >= -1", o.stagingBuffers)
	}
	if o.stagingPieceS != "" {
		n, err := paging.ParseSize(o.stagingPieceS)
		if err != nil {
			return fmt.Errorf("-staging-piece: %w", err)
		}
		if n <= 0 {
			return fmt.Errorf("-staging-piece %s must be more than 0 bytes", o.stagingPieceS)
		}
		o.stagingPiece = n
	}
	streams, err := parseStreams(o.streamsFlag)
	if err != nil {
		return err
	}
	o.streams = streams
	kvPlace, err := paging.ParseKVPlacement(o.kvCache)
	if err != nil {
		return fmt.Errorf("-kv-cache: %w", err)
	}
	if _, err := paging.ParseExpertCPUPolicy(o.expertsCPU); err != nil {
		return fmt.Errorf("-experts-cpu: %v", strings.TrimPrefix(err.Error(), "paging: "))
	}
	kv, err := tensor.ParseCacheDType(o.kvDType)
	if err != nil {
		return fmt.Errorf("-kv-dtype: %v", strings.TrimPrefix(err.Error(), "tensor: "))
	}
	o.kv = kv
	var hostCache int64
	if o.hostLimit != "" {
		n, err := paging.ParseSize(o.hostLimit)
		if err != nil {
			return fmt.Errorf("-host-memory-limit: %w", err)
		}
		hostCache = n
		if n == 0 {
			hostCache = -1 // none at all
		}
	}
	specs, _, err := cli.DeviceSpecs(o.device, o.devices)
	if err != nil {
		return err
	}
	b, err := cli.OpenBackend(specs[0], o.threads)
	if err != nil {
		return err
	}
	defer cli.CloseBackend(b)
	for _, spec := range specs[1:] {
		m, err := cli.OpenBackend(spec, o.threads)
		if err != nil {
			return err
		}
		defer cli.CloseBackend(m)
		o.more = append(o.more, m)
	}
	var results []any
	if o.ceilings {
		c, err := measureCeilings(b, o.threads)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "ceilings on %s: pinned H2D %.1f GB/s, pageable %.1f GB/s, device %.0f GB/s; CPU %.1f GB/s (%d threads), with copies: CPU %.1f + H2D %.1f GB/s\n",
			b.Name(), c.PinnedGBps, c.PageableGBps, c.DeviceGBps, c.CPUGBps, c.Threads, c.CPUSharedGBps, c.H2DSharedGBps)
		results = append(results, c)
	}
	if o.model != "" {
		specs, err := parseRuns(o.runs)
		if err != nil {
			return err
		}
		prefill, err := parseInts(o.prefill)
		if err != nil {
			return err
		}
		lm, err := loader.Open(o.model)
		if err != nil {
			return err
		}
		defer lm.Close()
		cfg := lm.Config
		if o.synthetic {
			if err := syntheticRouting(cfg, o); err != nil {
				return err
			}
		}
		if err := checkContext(cfg, prefill, o); err != nil {
			return err
		}
		if err := cli.CheckOutputs([][2]string{{"-out", o.out}}, cli.InputsOf(lm)); err != nil {
			return err
		}
		name := o.name
		if name == "" {
			name = lm.Dir
		}
		for _, s := range specs {
			if err := ctx.Err(); err != nil {
				return err // nothing is appended for an interrupted comparison
			}
			r, err := measure(ctx, b, lm, name, s, prefill, hostCache, kvPlace, o)
			if err != nil {
				r = &Result{Kind: "strata", Model: name, Device: b.Name(), Run: s.String(), BudgetBytes: s.budget,
					Strategy: string(s.strategy), Mode: string(s.mode), Error: err.Error()}
				fmt.Fprintf(os.Stderr, "bench: %s %s: %v\n", name, s, err)
			} else {
				fmt.Fprintf(stdout, "%-12s %-36s decode %8.2f tok/s  prefill %v tok/s  %s/token  %.1f GB/s  overlap %.2f  peak %s  %s\n",
					name, s, r.DecodeTokS, fmtRates(r.PrefillTokS), paging.FormatSize(int64(r.BytesPerToken)), r.H2DGBps, r.Overlap, paging.FormatSize(r.PeakDeviceBytes), launchCell(r))
				if r.CPUBandwidth != nil {
					fmt.Fprintf(stdout, "%-12s %-36s %s\n", name, s, r.CPUBandwidth)
				}
				if r.Experts != nil {
					fmt.Fprintf(stdout, "%-12s %-36s %s\n", name, s, r.Experts)
				}
				for _, sr := range r.streamRuns() {
					if sr.Error == "" {
						fmt.Fprintf(stdout, "%-12s %-36s %s\n", name, s, sr)
					}
				}
				if k := r.KV; k != nil && len(k.HostBlocks) > 0 {
					fmt.Fprintf(stdout, "%-12s %-36s %s; at %d prompt tokens: host KV read %s/token, CPU attention %.2f ms/token, decode bound %.2f tok/s (%.2f without KV reads)\n",
						name, s, k.KVReport, k.PromptTokens, paging.FormatSize(int64(k.HostKVReadPerToken)), k.CPUAttentionMsPerToken, k.DecodeBoundTokS, k.DecodeBoundNoKVReadTokS)
				}
			}
			results = append(results, r)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if o.out != "" {
		return appendResults(o.out, results)
	}
	return nil
}

// appendResults appends results as JSON lines to path: the earlier lines
// and the new ones are written to a fresh file that replaces path, so a
// failed write leaves the earlier results whole.
func appendResults(path string, results []any) error {
	earlier, err := infile.ReadFile(context.Background(), path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("-out: %w", err)
	}
	if len(earlier) > 0 && earlier[len(earlier)-1] != '\n' {
		earlier = append(earlier, '\n')
	}
	err = atomicfile.Write(path, func(w io.Writer) error {
		if _, err := w.Write(earlier); err != nil {
			return err
		}
		enc := json.NewEncoder(w)
		for _, r := range results {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("-out: %w", err)
	}
	return nil
}

func fmtRates(m map[string]float64) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, fmt.Sprintf("%s:%.0f", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := strconv.Atoi(f)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("bad length %q", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// contextLen returns the longest prompt a run times and the positions its
// session holds: that prompt, the warm-up and the timed decode steps.
func contextLen(prefill []int, o options) (maxPrompt, positions int) {
	maxPrompt = max(16, o.promptTokens)
	for _, p := range prefill {
		maxPrompt = max(maxPrompt, p)
	}
	return maxPrompt, maxPrompt + o.warmup + o.decode + 1
}

// checkContext refuses runs whose session would hold more positions than
// the model's context, before anything is measured.
func checkContext(cfg *arch.Config, prefill []int, o options) error {
	limit := cfg.ContextLength()
	maxPrompt, n := contextLen(prefill, o)
	// Each part first: with one of them past the limit the sum may overflow.
	if maxPrompt > limit || o.warmup > limit || o.decode > limit || n > limit {
		return fmt.Errorf("-prefill and -prompt-tokens up to %d, -warmup %d and -decode %d need more positions than %s", maxPrompt, o.warmup, o.decode, cli.Context(cfg))
	}
	return nil
}

// runSpec is one measured configuration.
type runSpec struct {
	budget    int64 // 0: none
	label     string
	strategy  paging.Strategy
	mode      paging.MemoryMode
	cpuLayers int                 // hybrid=N: N layers on the CPU (engine.Memory.CPULayers)
	policy    paging.ExpertPolicy // the expert cache's; "" for the default
}

func (s runSpec) String() string {
	st := string(s.strategy)
	if s.cpuLayers != 0 {
		st = fmt.Sprintf("%s=%d", st, max(s.cpuLayers, 0))
	}
	if s.policy != "" {
		return fmt.Sprintf("%s:%s:%s:%s", s.label, st, s.mode, s.policy)
	}
	return fmt.Sprintf("%s:%s:%s", s.label, st, s.mode)
}

// profilePath is the -cpuprofile file of run s: the run's name, its
// colons and other separators made dashes, before the extension.
func profilePath(path string, s runSpec) string {
	ext := filepath.Ext(path)
	label := strings.Map(func(r rune) rune {
		if r == ':' || r == '=' || r == '/' || r == os.PathSeparator {
			return '-'
		}
		return r
	}, s.String())
	return strings.TrimSuffix(path, ext) + "-" + label + ext
}

func parseRuns(s string) ([]runSpec, error) {
	var out []runSpec
	for _, r := range strings.Split(s, ",") {
		if r = strings.TrimSpace(r); r == "" {
			continue
		}
		parts := strings.Split(r, ":")
		spec := runSpec{label: parts[0], strategy: paging.StrategyNone, mode: paging.ModeExplicit}
		if parts[0] != "none" {
			n, err := paging.ParseSize(parts[0])
			if err != nil {
				return nil, fmt.Errorf("run %q: %w", r, err)
			}
			spec.budget, spec.strategy = n, paging.StrategyBalanced
		}
		if len(parts) > 1 {
			name, n, forced := strings.Cut(parts[1], "=")
			st, err := paging.ParseStrategy(name)
			if err != nil {
				return nil, fmt.Errorf("run %q: %w", r, err)
			}
			spec.strategy = st
			if forced {
				if st != paging.StrategyHybrid {
					return nil, fmt.Errorf("run %q: a count of CPU layers needs the hybrid strategy", r)
				}
				if spec.cpuLayers, err = paging.ParseCPULayers(n); err != nil {
					return nil, fmt.Errorf("run %q: %w", r, err)
				}
			}
		}
		if len(parts) > 2 {
			m, err := paging.ParseMemoryMode(parts[2])
			if err != nil {
				return nil, fmt.Errorf("run %q: %w", r, err)
			}
			spec.mode = m
		}
		if len(parts) > 3 {
			p, err := paging.ParseExpertPolicy(parts[3])
			if err != nil || parts[3] == "" {
				return nil, fmt.Errorf("run %q: expert policy %q: want lru or lfu", r, parts[3])
			}
			spec.policy = p
		}
		if len(parts) > 4 {
			return nil, fmt.Errorf("run %q: want BUDGET[:STRATEGY[:MODE[:POLICY]]]", r)
		}
		out = append(out, spec)
	}
	return out, nil
}

// HybridResult is a CPU+GPU run's placement and its measured times.
type HybridResult struct {
	CPULayers     []int `json:"cpu_layers"`
	ResidentBytes int64 `json:"resident_bytes"`
	StreamedBytes int64 `json:"streamed_bytes"` // per token, over the link
	CPUBytes      int64 `json:"cpu_bytes"`      // per token, read by the CPU
	HostBytes     int64 `json:"host_layer_bytes"`
	// PredictedTokS is the plan's prediction at the positions the timed
	// steps attend over on average (PredictedPositions: the prompt, the
	// warm-up and half the timed steps; HybridPlan.PredictAt), and
	// PlannedTokS the plan's own, at the context it planned for.
	PredictedTokS      float64 `json:"predicted_tok_s"`
	PredictedPositions int     `json:"predicted_positions"`
	PlannedTokS        float64 `json:"planned_tok_s"`
	// Predicted is the prediction's time of each path per token (at
	// PredictedPositions), to set against MeasuredMs.
	Predicted paging.Breakdown `json:"predicted_breakdown"`
	// HostKVBytes are the KV cache bytes the CPU reads for a token at
	// PredictedPositions (its blocks', and those of the GPU's blocks
	// with a KV cache in host memory).
	HostKVBytes int64         `json:"host_kv_bytes"`
	Rates       paging.Rates  `json:"rates"`
	Bounds      paging.Bounds `json:"bounds"`
	// MeasuredMs is the wall time per decoded token on each device's
	// stages, by device name.
	MeasuredMs map[string]float64 `json:"measured_ms_per_token"`
	Threads    int                `json:"threads"`
	// Probe is what Open's probe of decode measured and whether it
	// planned again (engine.HybridProbe); Rates are the rates it
	// corrected.
	Probe *engine.HybridProbe `json:"probe,omitempty"`
	// PinnedHostBytes of HostCacheBytes, the pager's host copies, are in
	// pinned memory (the others upload synchronously, at pageable speed).
	PinnedHostBytes int64 `json:"pinned_host_bytes"`
	HostCacheBytes  int64 `json:"host_cache_bytes"`
	// Prefill is what the pager did in each timed prefill, by prompt
	// length: a prefetch that found no room, or a part that went outside
	// the ring, costs a prompt its overlap.
	Prefill map[string]PagerCounts `json:"prefill_pager,omitempty"`
}

// PagerCounts are the pager's counters over one prefill.
type PagerCounts struct {
	Misses         int64 `json:"misses"`
	PrefetchNoRoom int64 `json:"prefetch_no_room"`
	OutsideRing    int64 `json:"outside_ring"`
	Evictions      int64 `json:"evictions"`
}

// Result is one strata run (Kind "strata") or one baseline run from
// hf_baseline.py (Kind "transformers" or "accelerate").
type Result struct {
	Kind            string             `json:"kind"`
	Model           string             `json:"model"`
	Device          string             `json:"device"`
	Run             string             `json:"run"`
	BudgetBytes     int64              `json:"budget_bytes"`
	Strategy        string             `json:"strategy,omitempty"`
	Mode            string             `json:"mode,omitempty"`
	KVDType         string             `json:"kv_dtype,omitempty"`
	WeightBytes     int64              `json:"weight_bytes"`
	StreamedBytes   int64              `json:"streamed_bytes"` // bytes that must cross the link per token
	PrefillTokS     map[string]float64 `json:"prefill_tok_s"`
	DecodeTokS      float64            `json:"decode_tok_s"`
	DecodeTokens    int                `json:"decode_tokens"`
	BytesPerToken   float64            `json:"bytes_per_token"`
	H2DGBps         float64            `json:"h2d_GBps"`
	Overlap         float64            `json:"overlap"`
	PeakDeviceBytes int64              `json:"peak_device_bytes"`
	// StagingBytes is the pinned host memory of the pager's staging ring
	// (the aggressive strategy's), in StagingSlots buffers, beside the
	// host cache's PinnedHostBytes; StagedPerToken the bytes per decoded
	// token that went through it.
	// StagedReadGBps is the rate the ring's reads ran at over the timed
	// decode, while they ran (paging.Stats.StagedReadGBps): with the
	// pinned rate, the aggressive strategy's own bound (Row).
	StagingBytes   int64   `json:"staging_bytes,omitempty"`
	StagingSlots   int     `json:"staging_slots,omitempty"`
	StagedPerToken float64 `json:"staged_per_token,omitempty"`
	StagedReadGBps float64 `json:"staged_read_GBps,omitempty"`
	StagingReaders int     `json:"staging_readers,omitempty"`
	// MappedPerToken is the bytes per decoded token copied in place from
	// the page-locked mapping of the weight files, MappedBytes that
	// mapping's size (paging.Stats.BytesMapped, MappedBytes).
	MappedPerToken  float64 `json:"mapped_per_token,omitempty"`
	MappedBytes     int64   `json:"mapped_bytes,omitempty"`
	StagingPiece    int64   `json:"staging_piece,omitempty"` // -staging-piece; 0 is the default
	PinnedHostBytes int64   `json:"pinned_host_bytes,omitempty"`
	// PageableHostBytes are the pager's host copies made in pageable
	// memory because pinning them was refused (Stats.PinnedFallbacks),
	// and PinnedRefusal the first refusal: such copies upload slowly.
	PageableHostBytes int64   `json:"pageable_host_bytes,omitempty"`
	PinnedRefusal     string  `json:"pinned_refusal,omitempty"`
	LoadSeconds       float64 `json:"load_s"`
	Chunk             int     `json:"chunk"` // the prefill chunk
	// Hybrid is set for the CPU+GPU strategies (hybrid, cpu): the plan's
	// split and prediction, the rates measured at start, the bounds from
	// them, and the measured time per token on each side.
	Hybrid *HybridResult `json:"hybrid,omitempty"`
	// Experts is a mixture of experts' expert cache over the timed decode
	// steps; StreamedBytes are then the other weights' streamed bytes.
	Experts *engine.ExpertReport `json:"experts,omitempty"`
	// Streams is the batched decode of -streams N; StreamsSweep those of
	// -streams with several counts, in their order (streamRuns).
	Streams      *StreamsResult   `json:"streams,omitempty"`
	StreamsSweep []*StreamsResult `json:"streams_sweep,omitempty"`
	// StreamsPlanPositions is the KV pool's room the run's plan kept: the
	// largest count's that the budget could hold. Every count ran in that
	// plan.
	StreamsPlanPositions int `json:"streams_plan_positions,omitempty"`
	// KV is where the KV cache was and what reading it cost over the
	// timed decode steps.
	KV *KVResult `json:"kv,omitempty"`
	// Graphs says the decode steps could run as captured graphs (the
	// device has them and -graphs was on); Launches are the device's
	// launches over the timed decode steps (kernels, copies, cuBLAS calls,
	// graph replays) and LaunchesPerToken their total per step, on a
	// device that counts them.
	Graphs           bool             `json:"graphs,omitempty"`
	Launches         *tensor.Launches `json:"launches,omitempty"`
	LaunchesPerToken float64          `json:"launches_per_token,omitempty"`
	// CPUBandwidth is a run on the CPU device against the read bandwidth
	// measured between pieces of its timed decode (-bw-piece).
	CPUBandwidth *CPUBandwidth `json:"cpu_bandwidth,omitempty"`
	Error        string        `json:"error,omitempty"`
}

// KVResult is the KV cache's part of a run: its placement (bytes on the
// device and in host memory), the context the timed steps attended over,
// the KV bytes a step read on each side, the CPU's attention time per
// step, and the decode bound with those reads counted: per token the
// slowest of the streamed weights over the H2D rate and the host KV bytes
// over the CPU rate, which overlap (the engine's measured rates; 0
// without them).
type KVResult struct {
	*engine.KVReport
	PromptTokens            int     `json:"prompt_tokens"`
	HostKVReadPerToken      float64 `json:"host_kv_read_bytes_per_token"`
	DeviceKVReadPerToken    float64 `json:"device_kv_read_bytes_per_token"`
	CPUAttentionMsPerToken  float64 `json:"cpu_attention_ms_per_token"`
	DecodeBoundTokS         float64 `json:"decode_bound_tok_s"`
	DecodeBoundNoKVReadTokS float64 `json:"decode_bound_without_kv_reads_tok_s"`
}

// kvResult is a run's KVResult from the engine's reports before (kv0) and
// after the timed decode steps. With the hybrid strategies the CPU reads
// its layers and the host KV while the link streams, and the bound is the
// slower of the two (at their shared rates).
func kvResult(kv, kv0 *engine.KVReport, res *Result, cfg *arch.Config, o options) *KVResult {
	if kv == nil {
		return nil
	}
	r := &KVResult{KVReport: kv, PromptTokens: o.promptTokens}
	// The steps attend over the prompt, the warm-up and half the timed
	// steps on average: 2 (keys, values) x 4 bytes x KVDim per position.
	pos := float64(o.promptTokens+o.warmup) + float64(o.decode)/2
	perBlock := 8 * float64(cfg.KVDim()) * pos
	nHost := float64(len(kv.HostBlocks))
	r.HostKVReadPerToken = nHost * perBlock
	r.DeviceKVReadPerToken = (float64(cfg.NumLayers) - nHost) * perBlock
	r.CPUAttentionMsPerToken = float64(kv.CPUAttention-kv0.CPUAttention) / 1e6 / float64(o.decode)
	if rt := kv.Rates; rt != nil && rt.H2D > 0 && rt.CPU > 0 {
		if h := res.Hybrid; h != nil {
			h2d, cpu := cmp.Or(rt.H2DShared, rt.H2D), cmp.Or(rt.CPUShared, rt.CPU)
			link := float64(h.StreamedBytes) / h2d
			if t := max(link, float64(h.CPUBytes)/cpu); t > 0 {
				r.DecodeBoundNoKVReadTokS = 1 / t
			}
			if t := max(link, (float64(h.CPUBytes)+r.HostKVReadPerToken)/cpu); t > 0 {
				r.DecodeBoundTokS = 1 / t
			}
			return r
		}
		link := float64(res.StreamedBytes) / rt.H2D
		dev := 0.0
		if rt.Device > 0 {
			dev = r.DeviceKVReadPerToken / rt.Device
		}
		r.DecodeBoundNoKVReadTokS = 1 / link
		if link == 0 {
			r.DecodeBoundNoKVReadTokS = 0
		}
		// The CPU attends over the host KV while the copy engine streams
		// the next layers and the GPU reads its own KV: the three overlap,
		// so the bound is the slowest of them (the CPU at its rate beside
		// copies when there are any).
		cpu := rt.CPU
		if link > 0 {
			cpu = cmp.Or(rt.CPUShared, rt.CPU)
		}
		if t := max(link, r.HostKVReadPerToken/cpu, dev); t > 0 {
			r.DecodeBoundTokS = 1 / t
		}
	}
	return r
}

// warmupLengths returns the prompt lengths of the untimed passes before
// the timed ones: 8 tokens (a decode-sized pass: the GEMV kernels), then
// the first chunk of each timed prompt longer than that (chunk 0: the
// whole prompt), each length once, shortest first. A timed prefill must
// not be the first pass of its shape: a quantized model's 8-token pass
// runs the integer GEMV (up to 8 rows), not cuBLAS, and cuBLAS sets up
// and loads a GEMM's kernels on its first use (lazily, as CUDA 12 loads
// modules): the likely cause of the H200's 7B Q4_K resident prefill of
// 512 at 4,677 tok/s, the first spec of its process, against 8,577 at 2
// GiB later in the same run (8,488 when the 8-token pass still reached
// cuBLAS).
func warmupLengths(prefill []int, chunk int) []int {
	ls := []int{8}
	for _, p := range prefill {
		if chunk > 0 {
			p = min(p, chunk)
		}
		if p > 8 && !slices.Contains(ls, p) {
			ls = append(ls, p)
		}
	}
	slices.Sort(ls)
	return ls
}

func measure(ctx context.Context, b tensor.Backend, lm *loader.Model, name string, s runSpec, prefill []int, hostCache int64, kv paging.KVPlacement, o options) (*Result, error) {
	cfg := lm.Config
	maxPrompt, ctxLen := contextLen(prefill, o)
	mem := engine.Memory{Strategy: s.strategy, Mode: s.mode, CPULayers: s.cpuLayers, ExpertPolicy: s.policy, ExpertsCPU: paging.ExpertCPUPolicy(o.expertsCPU), HostCache: hostCache, KVCache: kv, KVDType: o.kv,
		StagingReaders: o.stagingReaders, StagingPiece: o.stagingPiece, StagingSlots: o.stagingBuffers, NoMappedUploads: !o.stagingMapped}
	if s.budget > 0 {
		mem.Budgets = []int64{s.budget}
	}
	start := time.Now()
	// With -streams the plan keeps room for the batcher's KV pool (the
	// largest count's), so that the pool does not take the place of
	// resident weights. A count whose pool the budget cannot hold at all
	// fails on its own: the plan is made again for the smaller counts.
	counts := slices.Clone(o.streams)
	slices.Sort(counts)
	noRoom := map[int]error{}
	var e *engine.Engine
	for {
		room := 0
		if len(counts) > 0 {
			room = streamsPositions(o, counts[len(counts)-1])
		}
		var err error
		e, err = engine.Open(ctx, lm, engine.Options{Backends: append([]tensor.Backend{b}, o.more...), Memory: mem, Context: ctxLen, Chunk: o.chunk, Threads: o.threads,
			KVPositions: room, NoGraphs: !o.graphs})
		if err == nil {
			break
		}
		var be *paging.BudgetError
		if len(counts) <= 1 || !errors.As(err, &be) {
			return nil, err // not the pool's room: every count would fail so
		}
		n := counts[len(counts)-1]
		noRoom[n] = fmt.Errorf("a plan with room for the pool of %d streams (%d positions): %w", n, room, err)
		fmt.Fprintf(os.Stderr, "bench: %s %s: -streams %d: %v\n", name, s, n, noRoom[n])
		counts = counts[:len(counts)-1]
	}
	defer e.Close()
	var streamed int64
	var names []string
	for _, d := range e.Devices() {
		streamed += d.Plan.StreamedBytes
		names = append(names, d.Name)
	}
	r := &Result{Kind: "strata", Model: name, Device: strings.Join(names, "+"), Run: s.String(), BudgetBytes: s.budget,
		Strategy: string(e.Strategy()), Mode: string(e.Mode()), WeightBytes: lm.WeightBytes(),
		StreamedBytes: streamed, PrefillTokS: map[string]float64{}, DecodeTokens: o.decode, Chunk: e.Chunk(), KVDType: e.KVDType().String()}
	if _, ok := tensor.Graphs(b); ok && o.graphs {
		r.Graphs = true
	}
	sess, err := e.NewSession()
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	if h := e.Hybrid(); h != nil {
		// On several GPUs the totals of their plans; the bounds and the
		// prediction at the timed steps' positions are one GPU's only.
		t := h.Totals()
		r.StreamedBytes = t.StreamedBytes
		r.Hybrid = &HybridResult{CPULayers: h.CPULayers(), ResidentBytes: t.ResidentBytes, StreamedBytes: t.StreamedBytes,
			CPUBytes: t.CPUBytes, HostBytes: t.HostLayerBytes, PredictedTokS: t.PredictedTokS, PlannedTokS: t.PredictedTokS,
			Rates: h.Rates, MeasuredMs: map[string]float64{}, Threads: h.Threads, Probe: h.Probe}
		for _, p := range h.Plans() {
			fmt.Fprintf(os.Stderr, "bench: %s %s: %s\n", name, s, p)
		}
		if h.Probe != nil {
			fmt.Fprintf(os.Stderr, "bench: %s %s: %s\n", name, s, h.Probe)
		}
		if p := h.Plan; p != nil {
			r.Hybrid.Bounds, r.Hybrid.PredictedPositions = p.Bounds, p.Positions
			if p.Positions > 0 {
				r.Hybrid.HostKVBytes = p.HostKVBytes
			}
			// The timed steps attend over the prompt, the warm-up and half
			// of themselves on average: the prediction at those positions.
			pos := o.promptTokens + o.warmup + o.decode/2
			r.Hybrid.Predicted = p.Breakdown
			if d, br, err := p.PredictAt(pos); err == nil && d > 0 {
				r.Hybrid.PredictedTokS, r.Hybrid.PredictedPositions, r.Hybrid.Predicted = 1e9/float64(d), pos, br
				r.Hybrid.HostKVBytes = int64(float64(p.HostKVBytes) * float64(pos) / float64(p.Positions))
			}
			br := r.Hybrid.Predicted
			fmt.Fprintf(os.Stderr, "bench: %s %s: predicted at the %d positions the timed steps attend over: %.2f tok/s (CPU %.1f ms, GPU %.1f ms, copies %.1f ms, %d hand-overs %.1f ms)\n",
				name, s, r.Hybrid.PredictedPositions, r.Hybrid.PredictedTokS, float64(br.CPU)/1e6, float64(br.GPU)/1e6, float64(br.Copy)/1e6, br.Handoffs, float64(br.Handoff)/1e6)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	prompt := make([]int32, maxPrompt)
	for i := range prompt {
		prompt[i] = int32(rng.IntN(cfg.VocabSize))
	}
	// Warm-up: the engine loaded every layer once; one pass more settles
	// the ring and the caches, and one pass of each timed prompt's first
	// chunk loads the prefill's kernels (warmupLengths).
	for _, n := range warmupLengths(prefill, e.Chunk()) {
		sess.Reset()
		if _, err := sess.Forward(ctx, prompt[:n], false, nil); err != nil {
			return nil, err
		}
	}
	r.LoadSeconds = time.Since(start).Seconds()
	for _, p := range prefill {
		sess.Reset()
		st0 := e.Stats()
		t0 := time.Now()
		if _, err := sess.Forward(ctx, prompt[:p], false, nil); err != nil {
			return nil, err
		}
		r.PrefillTokS[strconv.Itoa(p)] = float64(p) / time.Since(t0).Seconds()
		if r.Hybrid != nil {
			st := e.Stats()
			if r.Hybrid.Prefill == nil {
				r.Hybrid.Prefill = map[string]PagerCounts{}
			}
			r.Hybrid.Prefill[strconv.Itoa(p)] = PagerCounts{Misses: st.Misses - st0.Misses, PrefetchNoRoom: st.PrefetchNoRoom - st0.PrefetchNoRoom,
				OutsideRing: st.OutsideRing - st0.OutsideRing, Evictions: st.Evictions - st0.Evictions}
		}
	}
	sess.Reset()
	t0 := time.Now()
	logits, err := sess.Forward(ctx, prompt[:o.promptTokens], false, nil)
	if err != nil {
		return nil, err
	}
	if key := strconv.Itoa(o.promptTokens); o.promptTokens > 16 && r.PrefillTokS[key] == 0 {
		r.PrefillTokS[key] = float64(o.promptTokens) / time.Since(t0).Seconds()
	}
	// Greedy decoding: each step's id is the last step's argmax, found on
	// the device where it can (Session.Greedy copies the id, not the
	// logits).
	next := int32(nn.Argmax(logits))
	step := func() error {
		next, err = sess.Greedy(ctx, []int32{next})
		e.MarkStep()
		return err
	}
	for range o.warmup {
		if err := step(); err != nil {
			return nil, err
		}
	}
	e.MarkStep()
	st0 := e.Stats()
	before, staged0, mapped0 := st0.BytesHostToDevice, st0.BytesStaged, st0.BytesMapped
	experts0 := e.Experts()
	cw := paging.StartCopyWindow(b)
	busy0 := busyOf(sess)
	kv0 := e.KV()
	l0, counted := tensor.CountLaunches(b)
	meter := newBWMeter(b, lm, o) // its buffer filled before the profile starts
	var prof bytes.Buffer
	if o.cpuProfile != "" {
		if err := pprof.StartCPUProfile(&prof); err != nil {
			return nil, fmt.Errorf("-cpuprofile: %w", err)
		}
	}
	el, err := timeDecode(o.decode, step, meter)
	if err != nil {
		if o.cpuProfile != "" {
			pprof.StopCPUProfile()
		}
		return nil, err
	}
	if meter != nil {
		r.CPUBandwidth = &meter.c
	}
	if o.cpuProfile != "" {
		pprof.StopCPUProfile()
		path := profilePath(o.cpuProfile, s)
		if err := atomicfile.WriteFile(path, prof.Bytes()); err != nil {
			return nil, fmt.Errorf("-cpuprofile: %w", err)
		}
		fmt.Fprintf(os.Stderr, "bench: %s %s: CPU profile of the %d timed decode steps in %s\n", name, s, o.decode, path)
	}
	if l1, ok := tensor.CountLaunches(b); ok && counted {
		l := l1.Sub(l0)
		r.Launches, r.LaunchesPerToken = &l, float64(l.Total())/float64(o.decode)
	}
	r.DecodeTokS = float64(o.decode) / el.Seconds()
	st := e.Stats()
	r.BytesPerToken = float64(st.BytesHostToDevice-before) / float64(o.decode)
	r.StagingBytes, r.StagingSlots, r.PinnedHostBytes = st.StagingBytes, st.StagingSlots, st.PinnedHostBytes
	r.StagedPerToken = float64(st.BytesStaged-staged0) / float64(o.decode)
	r.PageableHostBytes, r.PinnedRefusal = st.PinnedFallbackBytes, st.PinnedFallbackError
	if st.PinnedFallbacks > 0 {
		fmt.Fprintf(os.Stderr, "bench: %s %s: pinned host memory refused %d times, %s of host copies pageable (first refusal: %s)\n",
			name, s, st.PinnedFallbacks, paging.FormatSize(st.PinnedFallbackBytes), st.PinnedFallbackError)
	}
	if r.StagingSlots > 0 {
		r.StagingReaders, r.StagingPiece = st.StagingReaders, o.stagingPiece
	}
	r.MappedPerToken, r.MappedBytes = float64(st.BytesMapped-mapped0)/float64(o.decode), st.MappedBytes
	if rt := st.StagingReadTime - st0.StagingReadTime; rt > 0 {
		r.StagedReadGBps = float64(st.BytesStaged-staged0) / rt.Seconds() / 1e9
	}
	if r.StagingSlots > 0 || r.MappedBytes > 0 {
		fmt.Fprintf(os.Stderr, "bench: %s %s: staging ring %s pinned (%d buffers), %s per token staged, waited %v for a free buffer; %d readers read at %.1f GB/s while reading (%v of %v)\n",
			name, s, paging.FormatSize(r.StagingBytes), r.StagingSlots, paging.FormatSize(int64(r.StagedPerToken)), (st.StagingWait - st0.StagingWait).Round(time.Millisecond),
			st.StagingReaders, r.StagedReadGBps, (st.StagingReadTime - st0.StagingReadTime).Round(time.Millisecond), el.Round(time.Millisecond))
		if r.MappedBytes > 0 {
			fmt.Fprintf(os.Stderr, "bench: %s %s: weight files page-locked in place: %s, %s per token copied from them\n",
				name, s, paging.FormatSize(r.MappedBytes), paging.FormatSize(int64(r.MappedPerToken)))
		}
	}
	r.H2DGBps, r.Overlap = cw.End(b)
	r.PeakDeviceBytes = e.Devices()[0].PeakDeviceBytes
	if x := e.Experts(); x != nil {
		r.Experts = x.Since(experts0, o.decode)
	}
	r.KV = kvResult(e.KV(), kv0, r, cfg, o)
	if r.Hybrid != nil {
		r.Hybrid.PinnedHostBytes, r.Hybrid.HostCacheBytes = st.PinnedHostBytes, st.HostCacheBytes
		for dev, d := range busyOf(sess) {
			r.Hybrid.MeasuredMs[dev] = float64(d-busy0[dev]) / 1e6 / float64(o.decode)
		}
	}
	if len(o.streams) > 0 {
		sess.Close() // its KV cache makes room for the batcher's pool
		r.StreamsPlanPositions = streamsPositions(o, counts[len(counts)-1])
		if err := sweepStreams(ctx, e, r, o, noRoom); err != nil {
			return nil, err
		}
		r.PeakDeviceBytes = e.Devices()[0].PeakDeviceBytes
	}
	return r, nil
}

// busyOf is the session's wall time on each device so far (nil on one
// device).
func busyOf(s engine.Session) map[string]time.Duration {
	if b, ok := s.(interface {
		Busy() map[string]time.Duration
	}); ok {
		return b.Busy()
	}
	return nil
}

// syntheticRouting gives cfg, a mixture of experts, the synthetic routing
// of -router-skew and -router-locality (seed 1, as run-gpu.sh's configs).
func syntheticRouting(cfg *arch.Config, o options) error {
	if cfg.MoE == nil {
		return fmt.Errorf("-router-skew: the %s model %s has no experts", cfg.Family, o.model)
	}
	moe := *cfg.MoE
	moe.Synthetic = &arch.SyntheticRouting{Skew: o.routerSkew, Locality: o.routerLocality, Seed: 1}
	c := *cfg
	c.MoE = &moe
	if err := c.Validate(); err != nil {
		return fmt.Errorf("-router-skew: %s", strings.TrimPrefix(err.Error(), "arch: config: "))
	}
	cfg.MoE = &moe
	return nil
}
