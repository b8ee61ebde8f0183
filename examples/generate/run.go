package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// options are the parsed flags.
type options struct {
	model        string
	prompt       string
	ids          string
	maxNew       int
	temperature  float64
	topK         int
	topP         float64
	seed         uint64
	device       string
	jsonOut      bool
	logitsOut    string
	chunk        int
	threads      int
	quiet        bool
	promptIsSet  bool
	defaultModel bool

	// Memory: flags, merged over the -config file.
	mem      cli.MemoryFlags
	devices  string
	noPeer   bool
	summary  bool
	snapshot string
	set      map[string]bool // flags given on the command line
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("generate", flag.ContinueOnError)
	fs.StringVar(&o.model, "model", "", "Hugging Face model `directory` or GGUF file (default: the embedded model, examples/internal/defaultmodel)")
	fs.StringVar(&o.prompt, "prompt", "", "prompt `text` (needs the model's tokenizer: tokenizer.json, or a GGUF file's own)")
	fs.StringVar(&o.ids, "ids", "", "prompt as comma-separated token `ids` (overrides -prompt and the tokenizer)")
	fs.IntVar(&o.maxNew, "max-new-tokens", 32, "tokens to generate; 0 only runs the prompt")
	fs.Float64Var(&o.temperature, "temperature", 0, "sampling temperature; 0 is greedy")
	fs.IntVar(&o.topK, "top-k", 0, "sample among the k most likely tokens; 0 is all")
	fs.Float64Var(&o.topP, "top-p", 1, "sample from the smallest set of most likely tokens whose probability reaches p (as Hugging Face's top_p: 1 keeps every token, 0 only the most likely)")
	fs.Uint64Var(&o.seed, "seed", 0, "random seed for sampling")
	fs.StringVar(&o.device, "device", "auto", "cpu, cuda, cuda:N or auto (cuda when compiled in and a device exists)")
	fs.BoolVar(&o.jsonOut, "json", false, "print one JSON report at the end instead of streaming text")
	fs.StringVar(&o.logitsOut, "logits-out", "", "write the prompt's logits [prompt length, vocab] F32 to this safetensors `file`")
	fs.IntVar(&o.chunk, "prefill-chunk", 0, "prompt tokens processed per forward step (default 512; under a budget, the largest power of two up to 4096 whose activations take at most an eighth of it, so that a long prompt streams the weights fewer times)")
	fs.IntVar(&o.threads, "threads", 0, "CPU threads; 0 is all cores")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress bar")
	o.mem.Register(fs)
	fs.StringVar(&o.devices, "devices", "", "spread the layers over these `devices` of -device's driver: 0,1 or all (with -device cpu, CPU backends stand in for devices)")
	fs.BoolVar(&o.noPeer, "no-peer-copies", false, "with -devices, hand the hidden state between GPUs through host memory even where they can copy to each other directly")
	fs.BoolVar(&o.summary, "memory-summary", false, "print a memory summary table on stderr at exit")
	fs.StringVar(&o.snapshot, "memory-snapshot", "", "record every allocation and paging event to this JSON `file` (draw it with examples/memviz)")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return nil, err
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	o.promptIsSet = o.set["prompt"]
	switch {
	case o.maxNew < 0:
		return nil, cli.Usagef("-max-new-tokens %d must be >= 0", o.maxNew)
	case o.chunk < 0:
		return nil, cli.Usagef("-prefill-chunk %d must be >= 0 (0: the engine's choice)", o.chunk)
	case o.threads < 0:
		return nil, cli.Usagef("-threads %d must be >= 0", o.threads)
	}
	if err := cli.CheckDevice(o.device); err != nil {
		return nil, err
	}
	if o.topP == 0 {
		o.topP = nn.TopPMostLikely // Hugging Face's top_p = 0
	}
	if err := (nn.SamplerConfig{Temperature: o.temperature, TopK: o.topK, TopP: o.topP}).Validate(); err != nil {
		return nil, cli.UsageError{Err: err}
	}
	return o, nil
}

// parseIDs reads "1,2,3".
func parseIDs(s string) ([]int32, error) {
	var ids []int32
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		v, err := strconv.ParseInt(f, 10, 32)
		if err != nil {
			return nil, cli.Usagef("-ids: %q is not a token id", f)
		}
		ids = append(ids, int32(v))
	}
	if len(ids) == 0 {
		return nil, cli.Usagef("-ids: no token ids in %q", s)
	}
	return ids, nil
}

// hybridReport is the -json report of a CPU+GPU placement.
type hybridReport struct {
	*engine.Hybrid
	// MeasuredMsPerToken is the wall time per decoded token spent on each
	// device's stages (the GPU's includes waiting for its copies), by
	// device name.
	MeasuredMsPerToken map[string]float64 `json:"measured_ms_per_token"`
	// HostLayerBytes is the host memory the CPU's layers hold;
	// HostBufferBytes the CPU stages' activations and KV cache.
	HostLayerBytes  int64 `json:"host_layer_bytes"`
	HostBufferBytes int64 `json:"host_buffer_bytes"`
}

// report is the -json output.
type report struct {
	Model         string  `json:"model"`
	Device        string  `json:"device"`
	PromptIDs     []int32 `json:"prompt_ids"`
	IDs           []int32 `json:"ids"`
	Text          *string `json:"text,omitempty"`
	PrefillTokS   float64 `json:"prefill_tok_s"`
	DecodeTokS    float64 `json:"decode_tok_s"`
	LoadSeconds   float64 `json:"load_s"`
	PeakHostBytes int64   `json:"peak_host_bytes"`
	WeightBytes   int64   `json:"weight_bytes"`
	StopReason    string  `json:"stop_reason"`

	BudgetBytes           int64              `json:"budget_bytes"`
	DefaultBudget         bool               `json:"default_budget,omitempty"` // no budget given: the engine's policy
	PeakDeviceBytes       int64              `json:"peak_device_bytes"`
	ResidentWeightBytes   int64              `json:"resident_weight_bytes"`
	StreamedBytesPerToken float64            `json:"streamed_bytes_per_token"`
	LayerHits             int64              `json:"layer_hits"`
	LayerMisses           int64              `json:"layer_misses"`
	Strategy              paging.Strategy    `json:"strategy"`
	MemoryMode            paging.MemoryMode  `json:"memory_mode"`
	KVDType               string             `json:"kv_dtype"` // the KV cache's stored dtype; the plan has its bytes
	Plan                  *paging.PlanResult `json:"plan"`
	Paging                paging.Stats       `json:"paging"`
	Devices               []engine.Device    `json:"devices,omitempty"`
	H2DBytesPerToken      float64            `json:"h2d_bytes_per_token"`
	H2DGBps               float64            `json:"h2d_GBps"`
	Overlap               float64            `json:"overlap"`
	// Hybrid is the CPU+GPU placement (-offload hybrid or cpu): the plan
	// with its predicted per-token time of each path, the rates measured
	// at start, and what each device took per decoded token.
	Hybrid *hybridReport `json:"hybrid,omitempty"`
	// Experts is a mixture of experts' expert cache over the decode steps
	// (the prefill's first token excluded): hit rate, misses and bytes per
	// token, prefetch accuracy, guesses right, and the routing (router or
	// synthetic).
	Experts *engine.ExpertReport `json:"experts,omitempty"`
	// KV is where the KV cache is (bytes on the device and in host
	// memory, by block) and, for a part in host memory, the time the CPU
	// spent attending over it and the rows moved (engine.KVReport).
	KV *engine.KVReport `json:"kv"`
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) (retErr error) {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	var ids []int32
	if o.ids != "" {
		if ids, err = parseIDs(o.ids); err != nil {
			return err
		}
	}

	o.defaultModel = o.model == ""
	lm, err := cli.OpenModel(o.model)
	if err != nil {
		return err
	}
	defer lm.Close()
	dir := lm.Dir
	if err := cli.CheckOutputs([][2]string{{"-logits-out", o.logitsOut}, {"-memory-snapshot", o.snapshot}},
		cli.InputsOf(lm, o.mem.ConfigFile)); err != nil {
		return err
	}
	cfg := lm.Config

	tok, err := cli.LoadTokenizer(lm)
	if err != nil {
		return err
	}
	// The context is checked before anything is allocated: a prompt longer
	// than the model's context is refused, -max-new-tokens is clamped to
	// what fits after the prompt.
	maxPos := cfg.ContextLength()
	if ids == nil {
		switch {
		case tok == nil:
			return cli.Usagef("%s has no tokenizer.json: give the prompt as -ids", dir)
		case !o.promptIsSet && !o.defaultModel:
			return cli.Usagef("give a -prompt or -ids")
		}
		prompt := o.prompt
		if !o.promptIsSet {
			prompt = "Hello, world!"
		}
		// Refused without encoding when even the longest tokens would
		// overflow the context.
		if n := tok.MaxTokenBytes(); n > 0 && len(prompt) > maxPos*n {
			return cli.Usagef("-prompt of %d bytes cannot fit in %s: no token of the tokenizer stands for more than %d bytes", len(prompt), cli.Context(cfg), n)
		}
		enc, err := tok.Encode(prompt, true)
		if err != nil {
			return err
		}
		for _, id := range enc {
			ids = append(ids, int32(id))
		}
		if len(ids) == 0 {
			return cli.Usagef("-prompt %q encodes to no tokens", prompt)
		}
		if len(ids) > maxPos {
			return cli.Usagef("-prompt of %d tokens is longer than %s", len(ids), cli.Context(cfg))
		}
	} else if len(ids) > maxPos {
		return cli.Usagef("-ids: a prompt of %d tokens is longer than %s", len(ids), cli.Context(cfg))
	}
	for i, id := range ids {
		if id < 0 || int(id) >= cfg.VocabSize {
			return cli.Usagef("token id %d (prompt position %d) is outside the vocabulary of %d", id, i, cfg.VocabSize)
		}
	}
	clamped := false
	if room := maxPos - len(ids); o.maxNew > room {
		fmt.Fprintf(stderr, "generate: -max-new-tokens %d clamped to %d: the prompt's %d tokens and %d new ones would not fit in %s\n",
			o.maxNew, room, len(ids), o.maxNew, cli.Context(cfg))
		o.maxNew, clamped = room, true
	}

	specs, ordinals, err := cli.DeviceSpecs(o.device, o.devices)
	if err != nil {
		return err
	}
	mem, err := o.mem.Resolve(o.set, ordinals)
	if err != nil {
		return err
	}
	if !o.set["threads"] && o.mem.Threads > 0 {
		o.threads = o.mem.Threads // the -config file's cpu_threads
	}
	if err := cli.CheckPlacement(mem, specs); err != nil {
		return err
	}
	if o.snapshot != "" && len(specs) > 1 {
		return cli.Usagef("-memory-snapshot records one device; drop -devices or -memory-snapshot")
	}
	// The last new token is sampled, never run: len(ids)+maxNew-1 positions
	// are used, within maxPos.
	contextLen := min(len(ids)+max(o.maxNew, 1), maxPos)
	start := time.Now()
	bar := cli.NewProgress(stderr, "loading "+filepath.Base(dir), o.quiet || o.jsonOut)
	eng, err := engine.Open(ctx, lm, engine.Options{
		Devices: specs, Threads: o.threads, Memory: mem,
		Context: contextLen, Chunk: o.chunk, Record: o.snapshot != "", Progress: bar.Bytes, NoPeerCopies: o.noPeer,
	})
	bar.Done()
	if err != nil {
		return err
	}
	defer func() {
		if o.summary {
			fmt.Fprint(stderr, eng.Summary())
		}
		if err := eng.Close(); err != nil && retErr == nil {
			retErr = err
		}
		// After Close, so that the snapshot records what Close found.
		if o.snapshot != "" {
			if err := atomicfile.Write(o.snapshot, eng.WriteSnapshot); err != nil && retErr == nil {
				retErr = fmt.Errorf("-memory-snapshot: %w", err)
			}
		}
	}()
	loadTime := time.Since(start)
	backend := eng.Backends()[0]
	sess, err := eng.NewSession()
	if err != nil {
		return err
	}
	defer sess.Close()
	sampler, err := nn.NewSampler(nn.SamplerConfig{Temperature: o.temperature, TopK: o.topK, TopP: o.topP, Seed: o.seed})
	if err != nil {
		return err
	}

	// Prefill.
	t0 := time.Now()
	logits, err := sess.Forward(ctx, ids, o.logitsOut != "", nil)
	if err != nil {
		return forwardError(err, len(ids))
	}
	prefill := time.Since(t0)
	eng.MarkStep() // closes the warm-up and the prefill
	if o.logitsOut != "" {
		if err := writeLogits(o.logitsOut, logits, len(ids), cfg.VocabSize); err != nil {
			return err
		}
		logits = logits[(len(ids)-1)*cfg.VocabSize:]
	}

	// Decode, streaming text (or ids) to stdout.
	var stream *tokenizer.Stream
	if tok != nil {
		stream = tok.NewStream()
	}
	emit := func(id int32) error {
		if o.jsonOut {
			return nil
		}
		if stream == nil {
			_, err := fmt.Fprintf(stdout, "%d ", id)
			return err
		}
		text, err := stream.Add(int(id))
		if err == nil {
			_, err = io.WriteString(stdout, text)
		}
		return err
	}
	eos := map[int]bool{}
	for _, e := range cfg.EOS {
		eos[e] = true
	}
	var out []int32
	stop := "max_new_tokens"
	cw := paging.StartCopyWindow(backend)
	busy0 := busyOf(sess)
	experts0 := eng.Experts()
	t1 := time.Now()
	next := int32(sampler.Sample(logits))
	for len(out) < o.maxNew {
		if err := ctx.Err(); err != nil {
			return err
		}
		id := next
		out = append(out, id)
		if eos[int(id)] {
			stop = "eos" // the end-of-sequence token ends the text; it is not printed
			break
		}
		if err := emit(id); err != nil {
			return err
		}
		if len(out) == o.maxNew {
			break
		}
		// Greedy decoding takes the argmax where the logits are
		// (Session.Greedy); sampling needs them here.
		if o.temperature == 0 {
			next, err = sess.Greedy(ctx, []int32{id})
		} else if logits, err = sess.Forward(ctx, []int32{id}, false, nil); err == nil {
			next = int32(sampler.Sample(logits))
		}
		if err != nil {
			return forwardError(err, len(ids))
		}
		eng.MarkStep()
	}
	decode := time.Since(t1)
	h2dGBps, overlap := cw.End(backend)
	switch {
	case clamped && stop == "max_new_tokens":
		stop = "context_full" // the generation ran to the end of the context
	case o.maxNew == 0:
		stop = "prompt_only"
	}
	if !o.jsonOut {
		if stream != nil {
			io.WriteString(stdout, stream.Flush())
		}
		fmt.Fprintln(stdout)
	}

	if o.jsonOut {
		devs := eng.Devices()
		r := report{
			Model: dir, Device: backend.Name(), PromptIDs: ids, IDs: out,
			PrefillTokS: float64(len(ids)) / prefill.Seconds(),
			LoadSeconds: loadTime.Seconds(), PeakHostBytes: peakHostBytes(),
			WeightBytes: lm.WeightBytes(), StopReason: stop,
			BudgetBytes: devs[0].BudgetBytes, DefaultBudget: devs[0].DefaultBudget,
			Strategy: eng.Strategy(), MemoryMode: eng.Mode(), KVDType: eng.KVDType().String(), Plan: devs[0].Plan,
		}
		if len(devs) > 1 {
			r.Plan, r.BudgetBytes, r.Devices = nil, 0, devs
			for _, d := range devs {
				r.BudgetBytes += d.BudgetBytes
			}
		}
		st := eng.Stats()
		if h := eng.Hybrid(); h != nil {
			hr := &hybridReport{Hybrid: h, MeasuredMsPerToken: map[string]float64{},
				HostLayerBytes: st.HostLayerBytes, HostBufferBytes: eng.HostHeldBytes()}
			if steps := len(out) - 1; steps > 0 {
				for dev, d := range busyOf(sess) {
					hr.MeasuredMsPerToken[dev] = float64(d-busy0[dev]) / 1e6 / float64(steps)
				}
			}
			r.Hybrid = hr
		}
		if x := eng.Experts(); x != nil {
			r.Experts = x.Since(experts0, max(len(out)-1, 0))
		}
		r.Paging = st
		r.KV = eng.KV()
		r.PeakDeviceBytes = st.PeakDeviceBytes
		r.ResidentWeightBytes = st.ResidentWeightBytes
		r.StreamedBytesPerToken = st.BytesPerStep
		r.LayerHits, r.LayerMisses = st.Hits, st.Misses
		r.H2DBytesPerToken, r.H2DGBps, r.Overlap = st.BytesPerStep, h2dGBps, overlap
		if r.IDs == nil {
			r.IDs = []int32{}
		}
		// The first generated token comes from the prefill; each later one
		// is a decode step.
		if steps := len(out) - 1; steps > 0 {
			r.DecodeTokS = float64(steps) / decode.Seconds()
		}
		if tok != nil {
			var all []int
			for _, id := range out {
				all = append(all, int(id))
			}
			text, err := tok.Decode(all)
			if err != nil {
				return err
			}
			r.Text = &text
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	return nil
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

func writeLogits(path string, logits []float32, rows, vocab int) error {
	t, err := tensor.FromF32(tensor.Shape{rows, vocab}, logits)
	if err != nil {
		return err
	}
	if err := loader.WriteSafetensors(path, []loader.NamedTensor{{Name: "logits", T: t}}, nil); err != nil {
		return fmt.Errorf("-logits-out: %w", err)
	}
	return nil
}
