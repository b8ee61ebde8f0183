package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"runtime"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/strata-llm/strata/arch"
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
	model, data, eval, save, log string
	prompt, device, gpuLimit     string
	steps, batch, seqLen         int
	warmup, segments, threads    int
	evalEvery, evalTokens        int
	saveEvery, logEvery          int
	sampleTokens, scaleInterval  int
	lr, minLR, weightDecay       float64
	beta2, maxGradNorm           float64
	lossScale                    float64
	seed                         uint64
	quiet                        bool
	duration                     time.Duration
	shardBytes                   int64
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("train", flag.ContinueOnError)
	fs.StringVar(&o.model, "model", "", "initial model `directory` (examples/synth writes one), with its tokenizer (required)")
	fs.StringVar(&o.data, "data", "", "training documents: a .jsonl `file` ({\"text\": ...} a line) or a text file (required)")
	fs.StringVar(&o.eval, "eval", "", "held-out documents (same forms as -data) for the perplexity")
	fs.IntVar(&o.steps, "steps", 1000, "optimizer steps at most")
	fs.DurationVar(&o.duration, "duration", 0, "stop after this much training time (0: at -steps); the learning rate's cosine follows the time or the steps, whichever is further on")
	fs.IntVar(&o.batch, "batch", 8, "windows whose gradients one step adds up")
	fs.IntVar(&o.seqLen, "seq-len", 256, "positions per window")
	fs.Float64Var(&o.lr, "lr", 2e-3, "peak learning rate, after the warm-up")
	fs.Float64Var(&o.minLR, "min-lr", 2e-4, "learning rate at the end of the cosine")
	fs.IntVar(&o.warmup, "warmup", 100, "steps of linear warm-up")
	fs.Float64Var(&o.weightDecay, "weight-decay", 0.1, "AdamW's decoupled weight decay, in [0, 1]")
	fs.Float64Var(&o.beta2, "beta2", 0.95, "AdamW's second-moment decay, in [0, 1)")
	fs.Float64Var(&o.maxGradNorm, "max-grad-norm", 1, "clip the gradients to this norm; 0 does not clip")
	fs.IntVar(&o.segments, "checkpoint-segments", 0, "recompute checkpoints: split the blocks into K segments (0 or 1: none)")
	fs.Float64Var(&o.lossScale, "loss-scale", 0, "initial dynamic loss scale (default 65536 for F16 weights, 1 otherwise)")
	fs.IntVar(&o.scaleInterval, "loss-scale-interval", 200, "good steps before the loss scale doubles (0: never)")
	fs.IntVar(&o.evalEvery, "eval-every", 100, "steps between held-out evaluations (0: at the end only)")
	fs.IntVar(&o.evalTokens, "eval-tokens", 0, "held-out tokens evaluated at most (0: all)")
	fs.StringVar(&o.prompt, "prompt", "Hello, world!", "text whose sampled continuation is printed at each evaluation (empty: none)")
	fs.IntVar(&o.sampleTokens, "sample-tokens", 48, "tokens sampled after -prompt")
	fs.StringVar(&o.save, "save", "", "write the model as a Hugging Face checkpoint into this `directory`")
	fs.IntVar(&o.saveEvery, "save-every", 0, "steps between checkpoints in -save (0: at the end only)")
	fs.Int64Var(&o.shardBytes, "shard-bytes", 4<<30, "largest safetensors file -save writes; larger models are sharded")
	fs.StringVar(&o.log, "log", "", "loss log `file`: a JSON object a line, one per step and one per evaluation, rewritten as training goes")
	fs.IntVar(&o.logEvery, "log-every", 10, "steps between loss lines on stdout and in -log")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the window order and the samples")
	fs.StringVar(&o.device, "device", "auto", "cpu, cuda, cuda:N or auto (cuda when compiled in and a device exists)")
	fs.StringVar(&o.gpuLimit, "gpu-memory-limit", "", "memory budget `size` for weights and activations (a bare number is GiB): weights page under it")
	fs.IntVar(&o.threads, "threads", 0, "CPU threads; 0 is all cores")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress bar")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return nil, err
	}
	bad := func(ok bool, format string, a ...any) error {
		if ok {
			return nil
		}
		return cli.Usagef(format, a...)
	}
	for _, err := range []error{
		bad(o.model != "" && o.data != "", "give -model DIR and -data FILE"),
		bad(o.steps >= 1, "-steps %d must be >= 1", o.steps),
		bad(o.batch >= 1, "-batch %d must be >= 1", o.batch),
		bad(o.seqLen >= 1, "-seq-len %d must be >= 1", o.seqLen),
		bad(o.warmup >= 0, "-warmup %d must be >= 0", o.warmup),
		bad(o.minLR >= 0 && o.minLR <= o.lr, "-min-lr %v must be in [0, -lr]", o.minLR),
		bad(o.segments >= 0, "-checkpoint-segments %d must be >= 0", o.segments),
		bad(o.evalEvery >= 0, "-eval-every %d must be >= 0", o.evalEvery),
		bad(o.evalTokens >= 0, "-eval-tokens %d must be >= 0", o.evalTokens),
		bad(o.saveEvery >= 0, "-save-every %d must be >= 0", o.saveEvery),
		bad(o.logEvery >= 1, "-log-every %d must be >= 1", o.logEvery),
		bad(o.duration >= 0, "-duration %v must be >= 0", o.duration),
		bad(o.shardBytes >= 1, "-shard-bytes %d must be >= 1", o.shardBytes),
		bad(o.sampleTokens >= 0, "-sample-tokens %d must be >= 0", o.sampleTokens),
		bad(o.threads >= 0, "-threads %d must be >= 0", o.threads),
		bad(o.saveEvery == 0 || o.save != "", "-save-every needs -save"),
	} {
		if err != nil {
			return nil, err
		}
	}
	if _, _, err := o.hyperparameters(1); err != nil {
		return nil, err
	}
	if err := cli.CheckDevice(o.device); err != nil {
		return nil, err
	}
	return o, nil
}

// hyperparameters builds the optimizer and the loss scaler, checked by
// their Validate methods; a bad value is a usage error naming its flag.
func (o *options) hyperparameters(defaultScale float32) (*nn.AdamW, *nn.LossScaler, error) {
	a := nn.NewAdamW(o.lr)
	a.WeightDecay, a.Beta2 = o.weightDecay, o.beta2
	scale := defaultScale
	if o.lossScale != 0 {
		scale = float32(o.lossScale)
	}
	s := nn.NewLossScaler(scale, o.scaleInterval)
	t := nn.TrainOptions{Segments: o.segments, MaxGradNorm: o.maxGradNorm}
	flags := map[string]string{"LR": "lr", "WeightDecay": "weight-decay", "Beta2": "beta2", "MaxGradNorm": "max-grad-norm",
		"Segments": "checkpoint-segments", "Scale": "loss-scale", "GrowthInterval": "loss-scale-interval"}
	for _, v := range []interface{ Validate() error }{a, t, s} {
		err := v.Validate()
		if err == nil {
			continue
		}
		var oe *nn.OptionError
		if errors.As(err, &oe) {
			if name, ok := flags[oe.Option]; ok {
				return nil, nil, cli.Usagef("-%s %v must be %s", name, oe.Value, oe.Range)
			}
		}
		return nil, nil, cli.UsageError{Err: err}
	}
	return a, s, nil
}

// schedule is the learning rate of step (from 1) after elapsed training
// time: linear warm-up to lr, then a cosine from lr to minLR at the last
// step or at -duration, whichever the run is further towards.
func (o *options) schedule(step int, elapsed time.Duration) float64 {
	if step <= o.warmup {
		return o.lr * float64(step) / float64(o.warmup)
	}
	var p float64
	if span := o.steps - o.warmup; span > 0 {
		p = float64(step-o.warmup) / float64(span)
	}
	if o.duration > 0 {
		p = max(p, elapsed.Seconds()/o.duration.Seconds())
	}
	p = min(p, 1)
	return o.minLR + (o.lr-o.minLR)*0.5*(1+math.Cos(math.Pi*p))
}

// encodeDocs encodes each document as BOS, text, EOS (the tokens the
// tokenizer has of these) and joins them, on every core.
func encodeDocs(ctx context.Context, tok *tokenizer.Tokenizer, docs []string, vocab int) ([]int32, error) {
	parts := make([][]int32, len(docs))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(runtime.GOMAXPROCS(0))
	const per = 256
	for lo := 0; lo < len(docs); lo += per {
		g.Go(func() error {
			for i := lo; i < min(lo+per, len(docs)); i++ {
				if err := gctx.Err(); err != nil {
					return err
				}
				ids, err := tok.Encode(docs[i], true)
				if err != nil {
					return fmt.Errorf("document %d: %w", i+1, err)
				}
				if eos := tok.EOS(); eos >= 0 {
					ids = append(ids, eos)
				}
				p := make([]int32, len(ids))
				for j, id := range ids {
					if id >= vocab {
						return fmt.Errorf("document %d: token id %d is outside the model's vocabulary of %d", i+1, id, vocab)
					}
					p[j] = int32(id)
				}
				parts[i] = p
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	var n int
	for _, p := range parts {
		n += len(p)
	}
	stream := make([]int32, 0, n)
	for _, p := range parts {
		stream = append(stream, p...)
	}
	return stream, nil
}

// windowStarts are the starts of the windows of n+1 tokens that cover the
// stream, each sharing its first token with the last of the one before;
// the last window ends at the stream's end.
func windowStarts(tokens, n int) []int {
	if tokens < 2 {
		return nil
	}
	n = min(n, tokens-1)
	var s []int
	for start := 0; start+n+1 <= tokens; start += n {
		s = append(s, start)
	}
	if last := tokens - n - 1; s[len(s)-1] != last {
		s = append(s, last)
	}
	return s
}

// readStream reads and encodes a document file.
func readStream(ctx context.Context, flagName, path string, tok *tokenizer.Tokenizer, vocab int) ([]int32, int, error) {
	docs, err := cli.ReadDocs(ctx, path)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", flagName, err)
	}
	s, err := encodeDocs(ctx, tok, docs, vocab)
	if err != nil {
		return nil, 0, fmt.Errorf("%s %s: %w", flagName, path, err)
	}
	if len(s) < 2 {
		return nil, 0, fmt.Errorf("%s %s encodes to %d tokens; at least 2 are needed", flagName, path, len(s))
	}
	return s, len(docs), nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) (retErr error) {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	lm, err := cli.OpenModel(o.model)
	if err != nil {
		return err
	}
	defer lm.Close()
	if err := checkOutputs(o, lm); err != nil {
		return err
	}
	cfg := lm.Config
	if o.segments > cfg.NumLayers {
		return cli.Usagef("-checkpoint-segments %d: the model has %d blocks", o.segments, cfg.NumLayers)
	}
	if maxPos := cfg.ContextLength(); o.seqLen > maxPos {
		return cli.Usagef("-seq-len %d is longer than %s", o.seqLen, cli.Context(cfg))
	}
	tok, err := cli.LoadTokenizer(lm)
	if err != nil {
		return err
	}
	if tok == nil {
		return cli.Usagef("%s has no tokenizer.json to encode -data with", lm.Dir)
	}
	train, ndocs, err := readStream(ctx, "-data", o.data, tok, cfg.VocabSize)
	if err != nil {
		return err
	}
	var held []int32
	if o.eval != "" {
		if held, _, err = readStream(ctx, "-eval", o.eval, tok, cfg.VocabSize); err != nil {
			return err
		}
		if o.evalTokens > 0 && len(held) > o.evalTokens+1 {
			held = held[:o.evalTokens+1]
		}
	}
	params, err := nn.LoadParams(ctx, lm)
	if err != nil {
		return err
	}
	defaultScale := float32(1)
	if params.Tensor(cfg.LayerNames(cfg.EmbedLayer())[arch.Embed]).DType() == tensor.F16 {
		defaultScale = 65536
	}
	opt, scaler, err := o.hyperparameters(defaultScale)
	if err != nil {
		return err
	}
	eo := engine.Options{Devices: []string{o.device}, Threads: o.threads}
	if o.gpuLimit != "" {
		limit, err := paging.ParseSize(o.gpuLimit)
		if err != nil {
			return cli.Usagef("-gpu-memory-limit: %v", err)
		}
		if limit <= 0 {
			return cli.Usagef("-gpu-memory-limit %q must be positive", o.gpuLimit)
		}
		eo.Memory.Budgets = []int64{limit}
	}
	seqLen := min(o.seqLen, len(train)-1)
	r, err := engine.OpenTraining(ctx, params, eo, nn.TrainOptions{Segments: o.segments}, seqLen)
	if err != nil {
		return err
	}
	defer func() {
		if err := r.Close(); err != nil && retErr == nil {
			retErr = err
		}
	}()
	limit := fmt.Sprintf("at most %.2f epochs: %d steps", float64(o.steps*o.batch*seqLen)/float64(len(train)), o.steps)
	if o.duration > 0 {
		limit = fmt.Sprintf("for %v or %d steps, whichever comes first", o.duration, o.steps)
	}
	fmt.Fprintf(stdout, "train: %s: %.3g M parameters, vocabulary %d, on %s; %d documents, %d tokens (%s of %d windows x %d positions)\n",
		o.model, float64(cfg.NumParams())/1e6, cfg.VocabSize, r.Backend().Name(), ndocs, len(train),
		limit, o.batch, seqLen)
	t := &trainer{o: o, r: r, params: params, lm: lm, tok: tok, opt: opt, scaler: scaler, train: train, held: held,
		seqLen: seqLen, stdout: stdout, stderr: stderr}
	for _, id := range []int{tok.BOS(), tok.ID("<pad>"), tok.ID("<unk>")} {
		if id >= 0 && id < cfg.VocabSize && id != tok.EOS() {
			t.never = append(t.never, id)
		}
	}
	return t.loop(ctx)
}

// checkOutputs checks every output before any work.
func checkOutputs(o *options, lm *loader.Model) error {
	inputs := cli.InputsOf(lm, o.data, o.eval)
	if err := cli.CheckOutputs([][2]string{{"-log", o.log}}, inputs); err != nil {
		return err
	}
	if o.save == "" {
		return nil
	}
	if err := atomicfile.CheckNotInput("-save", o.save, inputs...); err != nil {
		return cli.UsageError{Err: err}
	}
	if err := nn.CheckSaveDir(o.save, lm); err != nil {
		return cli.UsageError{Err: fmt.Errorf("-save: %w", err)}
	}
	if o.log != "" && atomicfile.CheckNotInput("-log", o.log, o.save) != nil {
		return cli.Usagef("-log %s is inside -save %s, which is replaced as a whole", o.log, o.save)
	}
	return nil
}

// trainer is the state of one training run.
type trainer struct {
	o              *options
	r              *engine.Training
	params         *nn.Params
	lm             *loader.Model
	tok            *tokenizer.Tokenizer
	opt            *nn.AdamW
	scaler         *nn.LossScaler
	train, held    []int32
	seqLen         int
	stdout, stderr io.Writer
	grads          nn.Grads
	log            []byte // the loss log's lines
	never          []int  // ids never sampled: BOS and padding
}

// window returns the inputs and targets of the window at start.
func (t *trainer) window(start int) (inputs, targets []int32) {
	return nn.NextToken(t.train[start : start+t.seqLen+1])
}

func (t *trainer) loop(ctx context.Context) error {
	o := t.o
	starts := windowStarts(len(t.train), t.seqLen)
	order := make([]int, len(starts))
	epoch, next := 0, len(order)
	nextWindow := func() int {
		if next == len(order) {
			rng := rand.New(rand.NewPCG(o.seed, uint64(epoch)))
			for i, p := range rng.Perm(len(starts)) {
				order[i] = starts[p]
			}
			epoch, next = epoch+1, 0
		}
		next++
		return order[next-1]
	}
	t.grads = nn.Grads{}
	bar := cli.NewProgress(t.stderr, "training", o.quiet)
	start := time.Now()
	var tokens int64
	var sumLoss float64
	var sumN int
	var first, last float64
	steps := 0
	for step := 1; step <= o.steps; step++ {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("step %d: %w", step, err)
		}
		t.opt.LR = o.schedule(step, time.Since(start))
		loss, norm, skipped, err := t.step(ctx, nextWindow)
		if err != nil {
			return fmt.Errorf("step %d: %w", step, err)
		}
		steps = step
		tokens += int64(o.batch * t.seqLen)
		final := step == o.steps || (o.duration > 0 && time.Since(start) >= o.duration)
		t.logLine(logLine{Step: step, Tokens: tokens, Seconds: time.Since(start).Seconds(), LR: t.opt.LR, Loss: &loss,
			Scale: t.scaler.Scale, GradNorm: norm, Skipped: skipped})
		if step == 1 {
			first = loss
		}
		last = loss
		sumLoss += loss
		sumN++
		if o.duration > 0 { // the clock ends the run sooner than -steps
			bar.Update(int64(time.Since(start)), int64(o.duration), fmt.Sprintf("step %d loss %.4f", step, loss))
		} else {
			bar.Update(int64(step), int64(o.steps), fmt.Sprintf("%d/%d loss %.4f", step, o.steps, loss))
		}
		if step%o.logEvery == 0 || final || skipped {
			note := ""
			if skipped {
				note = " skipped (overflow)"
			}
			el := time.Since(start).Seconds()
			bar.Clear()
			fmt.Fprintf(t.stdout, "step %d/%d loss %.4f (mean %.4f) lr %.3g scale %g grad-norm %.3g %.0f tok/s%s\n",
				step, o.steps, loss, sumLoss/float64(sumN), t.opt.LR, t.scaler.Scale, norm, float64(tokens)/el, note)
			sumLoss, sumN = 0, 0
		}
		evalNow := final || (o.evalEvery > 0 && step%o.evalEvery == 0)
		if evalNow {
			bar.Clear()
			if err := t.evaluate(ctx, step, tokens, time.Since(start)); err != nil {
				return err
			}
		}
		if o.save != "" && (final || (o.saveEvery > 0 && step%o.saveEvery == 0)) {
			bar.Clear()
			if err := t.params.Save(ctx, o.save, t.lm, o.shardBytes); err != nil {
				return err
			}
			fmt.Fprintf(t.stdout, "step %d: saved %s\n", step, o.save)
		}
		if evalNow || step%o.logEvery == 0 {
			if err := t.writeLog(); err != nil {
				return err
			}
		}
		if final {
			break
		}
	}
	bar.Clear()
	el := time.Since(start)
	fmt.Fprintf(t.stdout, "train: %d steps (%d skipped), %d tokens in %s (%.0f tok/s): loss %.4f -> %.4f\n",
		steps, t.scaler.Skipped(), tokens, el.Round(time.Second), float64(tokens)/el.Seconds(), first, last)
	return nil
}

// step runs one optimizer step over o.batch windows.
func (t *trainer) step(ctx context.Context, nextWindow func() int) (loss, norm float64, skipped bool, err error) {
	o := t.o
	t.grads.Zero()
	scale := t.scaler.Scale
	err = t.r.With(func(tr *nn.Trainer) error {
		for range o.batch {
			in, tg := t.window(nextWindow())
			st, err := tr.LossAndGrads(ctx, in, tg, t.grads, scale/float32(o.batch))
			if err != nil {
				return err
			}
			loss += st.Loss / float64(o.batch)
		}
		return nil
	})
	if err != nil {
		return 0, 0, false, err
	}
	// The gradients are of scale times the mean loss of the windows.
	if !t.scaler.Unscale(t.grads) {
		return loss, 0, true, nil
	}
	norm = t.grads.ClipNorm(o.maxGradNorm)
	if err := t.opt.Step(t.params, t.grads); err != nil {
		return loss, norm, false, err
	}
	return loss, norm, false, nil
}

// evaluate prints the held-out loss and perplexity and a sample.
func (t *trainer) evaluate(ctx context.Context, step int, tokens int64, el time.Duration) error {
	o := t.o
	vocab := t.params.Config().VocabSize
	return t.r.With(func(tr *nn.Trainer) error {
		s, err := tr.Model().NewSession(t.seqLen, t.seqLen)
		if err != nil {
			return err
		}
		defer s.Close()
		if len(t.held) >= 2 {
			var sum float64
			var n int
			for _, start := range windowStarts(len(t.held), t.seqLen) {
				in, tg := nn.NextToken(t.held[start : start+min(t.seqLen, len(t.held)-1)+1])
				s.Reset()
				logits, err := s.Forward(ctx, in, true, nil)
				if err != nil {
					return fmt.Errorf("evaluation: %w", err)
				}
				// The last window may overlap the one before: only its
				// targets past n are new.
				skip := max(0, n-start)
				for i := skip; i < len(tg); i++ {
					sum += crossEntropy(logits[i*vocab:(i+1)*vocab], int(tg[i]))
				}
				n = start + len(tg)
			}
			mean := sum / float64(n)
			fmt.Fprintf(t.stdout, "step %d: held-out loss %.4f, perplexity %.1f over %d tokens (uniform: %d)\n",
				step, mean, math.Exp(mean), n, vocab)
			ppl := math.Exp(mean)
			t.logLine(logLine{Step: step, Tokens: tokens, Seconds: el.Seconds(), LR: t.opt.LR, Scale: t.scaler.Scale,
				HeldoutLoss: &mean, HeldoutPPL: &ppl, HeldoutTokens: n})
		}
		if o.prompt == "" || o.sampleTokens == 0 {
			return nil
		}
		text, err := t.sample(ctx, s)
		if err != nil {
			return err
		}
		fmt.Fprintf(t.stdout, "step %d: sample: %q\n", step, o.prompt+text)
		return nil
	})
}

// crossEntropy is -log softmax(logits)[y], in float64.
func crossEntropy(logits []float32, y int) float64 {
	m := math.Inf(-1)
	for _, v := range logits {
		m = max(m, float64(v))
	}
	var z float64
	for _, v := range logits {
		z += math.Exp(float64(v) - m)
	}
	return m + math.Log(z) - float64(logits[y])
}

// sample continues o.prompt by o.sampleTokens tokens (temperature 0.8, the
// 40 most likely, never BOS nor padding), stopping at EOS or at the
// session's end.
func (t *trainer) sample(ctx context.Context, s *nn.Session) (string, error) {
	ids, err := t.tok.Encode(t.o.prompt, true)
	if err != nil {
		return "", err
	}
	in := make([]int32, len(ids))
	for i, id := range ids {
		in[i] = int32(id)
	}
	if len(in) >= s.MaxPos() {
		return "", nil
	}
	sm, err := nn.NewSampler(nn.SamplerConfig{Temperature: 0.8, TopK: 40, Seed: t.o.seed})
	if err != nil {
		return "", err
	}
	s.Reset()
	var out []int
	for len(out) < t.o.sampleTokens && s.Pos()+len(in) <= s.MaxPos() {
		logits, err := s.Forward(ctx, in, false, nil)
		if err != nil {
			return "", err
		}
		for _, id := range t.never {
			logits[id] = float32(math.Inf(-1))
		}
		id := sm.Sample(logits)
		if id == t.tok.EOS() {
			break
		}
		out = append(out, id)
		in = []int32{int32(id)}
	}
	return t.tok.Decode(out)
}

// logLine is one line of the loss log: a step's loss, or a held-out
// evaluation (the fields of the other kind left out).
type logLine struct {
	Step          int      `json:"step"`
	Tokens        int64    `json:"tokens"`
	Seconds       float64  `json:"seconds"`
	LR            float64  `json:"lr"`
	Loss          *float64 `json:"loss,omitempty"`
	Scale         float32  `json:"scale"`
	GradNorm      float64  `json:"grad_norm,omitempty"`
	Skipped       bool     `json:"skipped,omitempty"`
	HeldoutLoss   *float64 `json:"heldout_loss,omitempty"`
	HeldoutPPL    *float64 `json:"heldout_ppl,omitempty"`
	HeldoutTokens int      `json:"heldout_tokens,omitempty"`
}

// logLine adds l to the loss log.
func (t *trainer) logLine(l logLine) {
	b, err := json.Marshal(l)
	if err != nil { // only finite numbers reach the log
		b, _ = json.Marshal(logLine{Step: l.Step, Tokens: l.Tokens, Seconds: l.Seconds, Skipped: true})
	}
	t.log = append(append(t.log, b...), '\n')
}

// writeLog rewrites the loss log.
func (t *trainer) writeLog() error {
	if t.o.log == "" {
		return nil
	}
	if err := atomicfile.WriteFile(t.o.log, t.log); err != nil {
		return fmt.Errorf("-log: %w", err)
	}
	return nil
}
