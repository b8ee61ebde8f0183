package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/examples/internal/cli"
	"io"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// options are the parsed flags.
type options struct {
	model, data, save       string
	gradsOut, ids           string
	gpuLimit, optimizer     string
	device                  string
	steps, seqLen, segments int
	threads, scaleInterval  int
	lr, weightDecay         float64
	momentum, maxGradNorm   float64
	lossScale               float64
	quiet                   bool
	cpuProfile              string
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("finetune", flag.ContinueOnError)
	fs.StringVar(&o.model, "model", "", "Hugging Face model `directory` (default: the embedded model, examples/internal/defaultmodel)")
	fs.StringVar(&o.data, "data", "", "training text `file` (UTF-8), encoded with the model's tokenizer")
	fs.IntVar(&o.steps, "steps", 30, "training steps, one window of -seq-len tokens each")
	fs.Float64Var(&o.lr, "lr", 1e-3, "learning rate, in (0, 1]")
	fs.StringVar(&o.optimizer, "optimizer", "adamw", "adamw or sgd")
	fs.Float64Var(&o.weightDecay, "weight-decay", 0, "weight decay in [0, 1] (decoupled for adamw)")
	fs.Float64Var(&o.momentum, "momentum", 0, "sgd momentum, in [0, 1)")
	fs.Float64Var(&o.maxGradNorm, "max-grad-norm", 1, "clip the gradients to this norm; 0 does not clip")
	fs.IntVar(&o.seqLen, "seq-len", 64, "positions per training window")
	fs.IntVar(&o.segments, "checkpoint-segments", 0, "recompute checkpoints: split the blocks into K segments (0 or 1: none)")
	fs.StringVar(&o.gpuLimit, "gpu-memory-limit", "", "memory budget `size` for weights and activations (3.5GiB, 800MiB, 300000B; a bare number is GiB): weights page under it")
	fs.Float64Var(&o.lossScale, "loss-scale", 0, "initial dynamic loss scale (default 65536 for F16 weights, 1 otherwise)")
	fs.IntVar(&o.scaleInterval, "loss-scale-interval", 50, "good steps before the loss scale doubles (0: never)")
	fs.StringVar(&o.gradsOut, "grads-out", "", "write loss and grad.<name> (F32) of one step on -ids at the initial weights to this safetensors `file`")
	fs.StringVar(&o.ids, "ids", "", "comma-separated token `ids` for -grads-out (default: the first window of -data)")
	fs.StringVar(&o.save, "save", "", "write the fine-tuned model as a Hugging Face checkpoint into this `directory`")
	fs.StringVar(&o.device, "device", "auto", "cpu, cuda, cuda:N or auto (cuda when compiled in and a device exists)")
	fs.IntVar(&o.threads, "threads", 0, "CPU threads; 0 is all cores")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress bar")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile (go tool pprof) of the run to this `file`")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, cli.Usagef("unexpected argument %q", fs.Arg(0))
	case o.data == "" && o.gradsOut == "":
		return nil, cli.Usagef("give -data (and/or -grads-out)")
	case o.gradsOut != "" && o.ids == "" && o.data == "":
		return nil, cli.Usagef("-grads-out needs -ids or -data")
	case o.steps < 0:
		return nil, cli.Usagef("-steps %d must be >= 0", o.steps)
	case o.seqLen < 1:
		return nil, cli.Usagef("-seq-len %d must be >= 1", o.seqLen)
	case o.segments < 0:
		return nil, cli.Usagef("-checkpoint-segments %d must be >= 0", o.segments)
	case o.optimizer != "adamw" && o.optimizer != "sgd":
		return nil, cli.Usagef("-optimizer %q: want adamw or sgd", o.optimizer)
	case o.threads < 0:
		return nil, cli.Usagef("-threads %d must be >= 0", o.threads)
	}
	// Every hyperparameter flag, checked before anything is read, by the
	// rules nn applies (the model's dtype picks the default loss scale
	// later; 1 stands in for it here).
	if _, err := o.hyperparameters(1); err != nil {
		return nil, err
	}
	if err := cli.CheckDevice(o.device); err != nil {
		return nil, err
	}
	return o, nil
}

// hyper is what the hyperparameter flags describe.
type hyper struct {
	opt    nn.Optimizer
	train  nn.TrainOptions
	scaler *nn.LossScaler
}

// optionFlags names the flag that sets each nn hyperparameter.
var optionFlags = map[string]string{
	"LR": "lr", "WeightDecay": "weight-decay", "Momentum": "momentum", "MaxGradNorm": "max-grad-norm",
	"Segments": "checkpoint-segments", "Scale": "loss-scale", "GrowthInterval": "loss-scale-interval",
}

// hyperparameters builds the optimizer, the trainer options and the loss
// scaler from the flags, defaultScale being the loss scale of -loss-scale
// 0, and checks them with their Validate methods: every float flag obeys
// the ranges nn documents, NaN and infinities never pass, and a bad value
// is a usage error naming its flag.
func (o *options) hyperparameters(defaultScale float32) (*hyper, error) {
	h := &hyper{train: nn.TrainOptions{Segments: o.segments, MaxGradNorm: o.maxGradNorm}}
	var opt interface{ Validate() error }
	if o.optimizer == "sgd" {
		sgd := &nn.SGD{LR: o.lr, Momentum: o.momentum, WeightDecay: o.weightDecay}
		h.opt, opt = sgd, sgd
	} else {
		if o.momentum != 0 {
			return nil, cli.Usagef("-momentum %v: only -optimizer sgd has momentum", o.momentum)
		}
		a := nn.NewAdamW(o.lr)
		a.WeightDecay = o.weightDecay
		h.opt, opt = a, a
	}
	scale := defaultScale
	if o.lossScale != 0 {
		if scale = float32(o.lossScale); scale == 0 {
			return nil, cli.Usagef("-loss-scale %v is 0 in float32", o.lossScale)
		}
	}
	h.scaler = nn.NewLossScaler(scale, o.scaleInterval)
	for _, v := range []interface{ Validate() error }{opt, h.train, h.scaler} {
		err := v.Validate()
		if err == nil {
			continue
		}
		var oe *nn.OptionError
		if errors.As(err, &oe) {
			if name, ok := optionFlags[oe.Option]; ok {
				value := oe.Value
				if name == "loss-scale" {
					value = o.lossScale // as given, not as a float32
				}
				return nil, cli.Usagef("-%s %v must be %s", name, value, oe.Range)
			}
		}
		return nil, cli.UsageError{Err: err}
	}
	return h, nil
}

// parseIDs reads "1,2,3".
func parseIDs(s string, vocab int) ([]int32, error) {
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
		if v < 0 || int(v) >= vocab {
			return nil, cli.Usagef("-ids: %d is outside the vocabulary of %d", v, vocab)
		}
		ids = append(ids, int32(v))
	}
	if len(ids) < 2 {
		return nil, cli.Usagef("-ids: need at least 2 token ids, got %q", s)
	}
	return ids, nil
}

// windows cuts tokens into windows of n+1 tokens (n predictions each) that
// overlap by one token, the last one ending at the last token.
func windows(tokens []int32, n int) [][]int32 {
	w := min(n+1, len(tokens))
	var out [][]int32
	for start := 0; ; start += w - 1 {
		if start+w >= len(tokens) {
			out = append(out, tokens[len(tokens)-w:])
			return out
		}
		out = append(out, tokens[start:start+w])
	}
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
	if o.cpuProfile != "" {
		f, err := atomicfile.Create(o.cpuProfile)
		if err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		defer f.Abort()
		w := &errWriter{w: f} // pprof drops write errors
		if err := pprof.StartCPUProfile(w); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		// The profile of a run that failed or was interrupted is complete
		// too, and may be what the user is after.
		defer func() {
			pprof.StopCPUProfile()
			err := w.err
			if err == nil {
				err = f.Commit()
			}
			if err != nil && retErr == nil {
				retErr = fmt.Errorf("-cpuprofile: %w", err)
			}
		}()
	}
	cfg := lm.Config
	if o.segments > cfg.NumLayers {
		return cli.Usagef("-checkpoint-segments %d: the model has %d blocks", o.segments, cfg.NumLayers)
	}
	// No window is longer than the model's context: -seq-len is cut to it,
	// -ids past it are refused.
	maxPos := cfg.ContextLength()
	if o.data != "" && o.seqLen > maxPos {
		fmt.Fprintf(stderr, "finetune: -seq-len %d clamped to %d: longer than %s\n", o.seqLen, maxPos, cli.Context(cfg))
		o.seqLen = maxPos
	}

	var tokens []int32
	if o.data != "" {
		text, err := infile.ReadFile(ctx, o.data)
		if err != nil {
			return fmt.Errorf("-data: %w", err)
		}
		tok, err := cli.LoadTokenizer(lm)
		if err != nil {
			return err
		}
		if tok == nil {
			return cli.Usagef("%s has no tokenizer.json to encode -data with", lm.Dir)
		}
		enc, err := encode(ctx, tok, string(text))
		if err != nil {
			return fmt.Errorf("-data %s: %w", o.data, err)
		}
		for _, id := range enc {
			tokens = append(tokens, int32(id))
		}
		if len(tokens) < 2 {
			return fmt.Errorf("-data %s encodes to %d tokens; training needs at least 2", o.data, len(tokens))
		}
	}
	var gradIDs []int32
	if o.gradsOut != "" {
		if o.ids != "" {
			if gradIDs, err = parseIDs(o.ids, cfg.VocabSize); err != nil {
				return err
			}
			if len(gradIDs)-1 > maxPos {
				return cli.Usagef("-ids: %d token ids make a window of %d positions, longer than %s", len(gradIDs), len(gradIDs)-1, cli.Context(cfg))
			}
		} else {
			gradIDs = windows(tokens, o.seqLen)[0]
		}
	}

	params, err := nn.LoadParams(ctx, lm)
	if err != nil {
		return err
	}
	// F16 weights get a loss scale unless -loss-scale sets one.
	defaultScale := float32(1)
	if params.Tensor(cfg.LayerNames(cfg.EmbedLayer())[arch.Embed]).DType() == tensor.F16 {
		defaultScale = 65536
	}
	h, err := o.hyperparameters(defaultScale)
	if err != nil {
		return err
	}
	if err := cli.CheckDevice(o.device); err != nil {
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
	maxT := max(len(gradIDs)-1, min(o.seqLen, len(tokens)-1))
	r, err := engine.OpenTraining(ctx, params, eo, h.train, maxT)
	if err != nil {
		return err
	}
	defer func() {
		if err := r.Close(); err != nil && retErr == nil {
			retErr = err
		}
	}()

	if o.gradsOut != "" {
		inputs, targets := nn.NextToken(gradIDs)
		grads := nn.Grads{}
		var st nn.StepStats
		if err := r.With(func(tr *nn.Trainer) (err error) {
			st, err = tr.LossAndGrads(ctx, inputs, targets, grads, 1)
			return err
		}); err != nil {
			return err
		}
		if err := grads.WriteSafetensors(o.gradsOut, st.Loss); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "wrote the loss (%.6f) and %d gradients to %s\n", st.Loss, len(grads), o.gradsOut)
	}
	if o.data == "" {
		return nil
	}

	if err := train(ctx, o, h, r, params, tokens, stdout, stderr); err != nil {
		return err
	}
	if o.save != "" {
		// Checked before training; the directory may have changed since.
		if err := params.Save(ctx, o.save, lm, 4<<30); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "saved the fine-tuned model to %s\n", o.save)
	}
	return nil
}

// checkOutputs checks every output before any work: each can be written,
// none is an input, and -save is a place for a checkpoint (nn.CheckSaveDir)
// that holds no other output (it is replaced as a whole).
func checkOutputs(o *options, lm *loader.Model) error {
	inputs := cli.InputsOf(lm, o.data)
	files := [][2]string{{"-grads-out", o.gradsOut}, {"-cpuprofile", o.cpuProfile}}
	if err := cli.CheckOutputs(files, inputs); err != nil {
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
	for _, f := range files {
		if f[1] != "" && atomicfile.CheckNotInput(f[0], filepath.Dir(f[1]), o.save) != nil {
			return cli.Usagef("%s %s is inside -save %s, which is replaced as a whole", f[0], f[1], o.save)
		}
	}
	return nil
}

// errWriter keeps the first error of its writer.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	e.err = err
	return n, err
}

// encode encodes text, returning at once when ctx is cancelled: a large
// -data file takes a while, and the tokenizer does not look at ctx (the
// encoding left running ends with the command).
func encode(ctx context.Context, tok *tokenizer.Tokenizer, text string) ([]int, error) {
	type result struct {
		ids []int
		err error
	}
	done := make(chan result, 1)
	go func() {
		ids, err := tok.Encode(text, true)
		done <- result{ids, err}
	}()
	select {
	case r := <-done:
		return r.ids, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// train runs the training loop, printing each step's loss.
func train(ctx context.Context, o *options, h *hyper, r *engine.Training, params *nn.Params, tokens []int32, stdout, stderr io.Writer) error {
	opt, scaler := h.opt, h.scaler
	wins := windows(tokens, o.seqLen)
	bar := cli.NewProgress(stderr, "training", o.quiet)
	var first, last float64
	var peakAct int64
	start := time.Now()
	for step := 1; step <= o.steps; step++ {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("step %d: %w", step, err)
		}
		inputs, targets := nn.NextToken(wins[(step-1)%len(wins)])
		var res nn.StepResult
		t0 := time.Now()
		if err := r.With(func(tr *nn.Trainer) (err error) {
			res, err = tr.Step(ctx, inputs, targets, params, opt, scaler)
			return err
		}); err != nil {
			return fmt.Errorf("step %d: %w", step, err)
		}
		st := res.StepStats
		peakAct = max(peakAct, st.PeakActivationBytes)
		note := ""
		if res.Skipped {
			note = " skipped (overflow)"
		}
		if step == 1 {
			first = st.Loss
		}
		last = st.Loss
		bar.Clear()
		fmt.Fprintf(stdout, "step %d/%d loss %.6f scale %g grad-norm %.4g time %s%s\n",
			step, o.steps, st.Loss, res.Scale, res.GradNorm, time.Since(t0).Round(time.Millisecond), note)
		bar.Update(int64(step), int64(o.steps), fmt.Sprintf("%d/%d loss %.4f", step, o.steps, st.Loss))
	}
	bar.Clear()
	if o.steps > 0 {
		fmt.Fprintf(stderr, "trained %d steps (%d skipped) in %s: loss %.4f -> %.4f; peak activations %s\n",
			o.steps, scaler.Skipped(), time.Since(start).Round(time.Millisecond), first, last, paging.FormatSize(peakAct))
		if bud := r.Budget(); bud != nil {
			fmt.Fprintf(stderr, "budget %s: peak %s, weights moved %s per step\n",
				paging.FormatSize(bud.Limit()), paging.FormatSize(bud.Peak()), paging.FormatSize(r.MovedPerCall()))
		}
	}
	return nil
}
