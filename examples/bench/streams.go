package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/nn"
)

// StreamsResult is a run's batched decode: Streams requests through one
// engine.Batcher at once, each a prompt of streamPrompt tokens and
// warm-up plus decode new tokens.
type StreamsResult struct {
	Streams int `json:"streams"`
	// DecodeTokS is the aggregate rate: the tokens all the streams
	// generated while every one of them was past its warm-up and not yet
	// done, over that window.
	DecodeTokS float64 `json:"decode_tok_s"`
	// InterTokenMs are the percentiles of the gaps between a stream's
	// consecutive tokens (after its first), TTFTMs those of the time from
	// Submit to a stream's first token, in milliseconds.
	InterTokenP50Ms float64 `json:"inter_token_p50_ms"`
	InterTokenP99Ms float64 `json:"inter_token_p99_ms"`
	TTFTP50Ms       float64 `json:"ttft_p50_ms"`
	TTFTP99Ms       float64 `json:"ttft_p99_ms"`
	MeanBatch       float64 `json:"mean_batch"`
	// StepsS is the batched steps a second, over the steps' own time;
	// RowsPerStep the mean tokens a step ran (decode rows and prompt
	// chunks).
	StepsS      float64 `json:"steps_s"`
	RowsPerStep float64 `json:"rows_per_step"`
	// Step is where a step's time went, averaged over the steps
	// (engine.StepSplit); absent for Hugging Face's batches.
	Step      *StepSplitMs `json:"step,omitempty"`
	KVBlocks  int          `json:"kv_blocks"`
	BlockSize int          `json:"block_size"`
	// Error is why this count of a sweep failed (the others are kept).
	Error string `json:"error,omitempty"`
}

// StepSplitMs is a batched step's mean time by part, in milliseconds
// (engine.StepSplit over Steps): on the host, choosing the rows
// (Schedule), checking them and building the step's tables (Prepare),
// running the forward up to the logits (Launch: the uploads and every
// layer's operations, which a GPU queues and the CPU computes), waiting
// for the device to finish it (Wait), copying the logits (Download), and
// sampling and sending the tokens (Sample); they add up to StepMs. Device
// is the device's own time for the forward (events on its compute queue;
// on the CPU, over several devices or in a step without logits, Launch),
// which ran during Launch and Wait: a Device well under Launch is a step
// bound by the host's launches, LaunchesPerStep of them.
type StepSplitMs struct {
	StepMs          float64 `json:"step_ms"`
	ScheduleMs      float64 `json:"schedule_ms"`
	PrepareMs       float64 `json:"prepare_ms"`
	LaunchMs        float64 `json:"launch_ms"`
	WaitMs          float64 `json:"wait_ms"`
	DownloadMs      float64 `json:"download_ms"`
	SampleMs        float64 `json:"sample_ms"`
	DeviceMs        float64 `json:"device_ms"`
	LaunchesPerStep float64 `json:"launches_per_step"`
}

// stepSplit is st's mean step by part; nil without steps.
func stepSplit(st engine.BatchStats) *StepSplitMs {
	if st.Steps == 0 {
		return nil
	}
	n := float64(st.Steps)
	per := func(d time.Duration) float64 { return ms(d) / n }
	sp := st.StepSplit
	return &StepSplitMs{StepMs: per(st.StepTimeSum), ScheduleMs: per(sp.Schedule), PrepareMs: per(sp.Prepare), LaunchMs: per(sp.Launch),
		WaitMs: per(sp.Wait), DownloadMs: per(sp.Download), SampleMs: per(sp.Sample), DeviceMs: per(sp.Device), LaunchesPerStep: float64(sp.Launches) / n}
}

// String is the split as the batched table and the output show it.
func (s *StepSplitMs) String() string {
	if s == nil {
		return "-"
	}
	launches := ""
	if s.LaunchesPerStep > 0 {
		launches = fmt.Sprintf(", %.0f launches", s.LaunchesPerStep)
	}
	return fmt.Sprintf("%.2f = host %.2f + launch %.2f + wait %.2f + download %.2f + sample %.2f; device %.2f%s",
		s.StepMs, s.ScheduleMs+s.PrepareMs, s.LaunchMs, s.WaitMs, s.DownloadMs, s.SampleMs, s.DeviceMs, launches)
}

// streamPrompt is the prompt length of each stream of -streams.
const streamPrompt = 16

// measureStreams submits n requests at once to a batcher over e and times
// their tokens; the KV pool holds all of them.
func measureStreams(ctx context.Context, e *engine.Engine, n int, o options) (*StreamsResult, error) {
	gen := o.warmup + o.decode
	bs := nn.DefaultBlockSize
	// Four rows a stream a step: the prompts start over a few steps, and
	// the batch's buffers stay small beside the pool.
	b, err := e.NewBatcher(engine.BatchOptions{MaxSequences: n, MaxQueue: n, KVBlocks: streamsPositions(o, n) / bs, BlockSize: bs, StepTokens: 4 * n, Pipeline: o.pipeline})
	if err != nil {
		return nil, err
	}
	defer b.Close(context.Background())
	rng := rand.New(rand.NewPCG(3, uint64(n)))
	vocab := e.Config().VocabSize
	times := make([][]time.Time, n) // each stream's token times
	starts := make([]time.Time, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		prompt := make([]int32, streamPrompt)
		for j := range prompt {
			prompt[j] = int32(rng.IntN(vocab))
		}
		starts[i] = time.Now()
		ch, err := b.Submit(ctx, engine.Request{Prompt: prompt, MaxTokens: gen, IgnoreEOS: true})
		if err != nil {
			return nil, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for tok := range ch {
				if tok.Emitted {
					times[i] = append(times[i], time.Now())
				}
				if tok.Done {
					errs[i] = tok.Err
				}
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("stream %d: %w", i, err)
		}
		if len(times[i]) != gen {
			return nil, fmt.Errorf("stream %d: %d tokens, want %d", i, len(times[i]), gen)
		}
	}
	st := b.Stats()
	r := &StreamsResult{Streams: n, KVBlocks: st.KVBlocks, BlockSize: st.BlockSize}
	if st.Steps > 0 {
		r.MeanBatch = float64(st.BatchSizeSum) / float64(st.Steps)
		r.RowsPerStep = float64(st.StepRowsSum) / float64(st.Steps)
	}
	if st.StepTimeSum > 0 {
		r.StepsS = float64(st.Steps) / st.StepTimeSum.Seconds()
	}
	r.Step = stepSplit(st)
	// The window: from the last stream's end of warm-up to the first
	// stream's last token.
	from, to := times[0][o.warmup], times[0][gen-1]
	for _, ts := range times {
		if ts[o.warmup].After(from) {
			from = ts[o.warmup]
		}
		if ts[gen-1].Before(to) {
			to = ts[gen-1]
		}
	}
	var gaps, ttft []float64
	tokens := 0
	for i, ts := range times {
		ttft = append(ttft, ms(ts[0].Sub(starts[i])))
		for j := 1; j < len(ts); j++ {
			gaps = append(gaps, ms(ts[j].Sub(ts[j-1])))
			if ts[j].After(from) && !ts[j].After(to) {
				tokens++
			}
		}
	}
	if w := to.Sub(from); w > 0 && tokens > 0 {
		r.DecodeTokS = float64(tokens) / w.Seconds()
	} else {
		// The streams did not overlap past their warm-up (a batch of
		// one, or streams that ran one after the other): every token
		// over the whole run.
		first, last := starts[0], times[0][gen-1]
		for _, ts := range times {
			last = maxTime(last, ts[gen-1])
		}
		r.DecodeTokS = float64(n*gen) / last.Sub(first).Seconds()
	}
	r.InterTokenP50Ms, r.InterTokenP99Ms = percentile(gaps, 0.50), percentile(gaps, 0.99)
	r.TTFTP50Ms, r.TTFTP99Ms = percentile(ttft, 0.50), percentile(ttft, 0.99)
	return r, nil
}

// streamsPositions is the KV positions of the pool of n streams: each
// stream's prompt and tokens in whole blocks; 0 for none.
func streamsPositions(o options, n int) int {
	bs := nn.DefaultBlockSize
	return n * ((streamPrompt + o.warmup + o.decode + bs - 1) / bs * bs)
}

// parseStreams reads -streams: stream counts, comma-separated; "" or "0"
// is none.
func parseStreams(s string) ([]int, error) {
	if s = strings.TrimSpace(s); s == "" || s == "0" {
		return nil, nil
	}
	var counts []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-streams %s: want stream counts of at least 1, such as 1,8,32,64", s)
		}
		if slices.Contains(counts, n) {
			return nil, fmt.Errorf("-streams %s: %d is given twice", s, n)
		}
		counts = append(counts, n)
	}
	return counts, nil
}

// sweepStreams measures each count of -streams in turn over e, each with
// its own batcher (and KV pool, freed before the next), into r: Streams
// for one count, StreamsSweep for several. A count that fails, or whose
// pool no plan could keep room for (noRoom), is kept with its error and
// the sweep goes on (a pool of 64 that does not fit loses none of the
// smaller counts); the run fails when every count failed.
func sweepStreams(ctx context.Context, e *engine.Engine, r *Result, o options, noRoom map[int]error) error {
	var runs []*StreamsResult
	var last error
	for _, n := range o.streams {
		if err := ctx.Err(); err != nil {
			return err
		}
		var sr *StreamsResult
		err := noRoom[n]
		if err == nil {
			sr, err = measureStreams(ctx, e, n, o)
		}
		if err != nil {
			last = fmt.Errorf("-streams %d: %w", n, err)
			if noRoom[n] == nil { // told when the plan failed
				fmt.Fprintf(os.Stderr, "bench: %s %s: %v\n", r.Model, r.Run, last)
			}
			sr = &StreamsResult{Streams: n, Error: last.Error()}
		}
		runs = append(runs, sr)
	}
	if !slices.ContainsFunc(runs, func(sr *StreamsResult) bool { return sr.Error == "" }) {
		return last
	}
	if len(runs) == 1 {
		r.Streams = runs[0]
	} else {
		r.StreamsSweep = runs
	}
	return nil
}

// streamRuns is r's batched decodes: its sweep, or its one count.
func (r *Result) streamRuns() []*StreamsResult {
	switch {
	case len(r.StreamsSweep) > 0:
		return r.StreamsSweep
	case r.Streams != nil:
		return []*StreamsResult{r.Streams}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// percentile is the q-th quantile of v (nearest rank); 0 for none.
func percentile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func (r *StreamsResult) String() string {
	return fmt.Sprintf("%d streams: decode %.2f tok/s aggregate, inter-token p50 %.1f ms p99 %.1f ms, first token p50 %.1f ms p99 %.1f ms, mean batch %.2f, %.2f steps/s of %.1f rows, ms a step %s",
		r.Streams, r.DecodeTokS, r.InterTokenP50Ms, r.InterTokenP99Ms, r.TTFTP50Ms, r.TTFTP99Ms, r.MeanBatch, r.StepsS, r.RowsPerStep, r.Step)
}
