package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/examples/internal/defaultmodel"
)

// options are the parsed flags.
type options struct {
	model, name, addr string
	device, devices   string
	threads, chunk    int
	context           int
	maxSeqs, maxQueue int
	kvPositions       int
	drain             time.Duration
	pipeline          bool

	mem cli.MemoryFlags
	set map[string]bool // flags given on the command line
}

// defaultContext caps the positions of a request when -context is not
// given: each running request holds a KV cache of that many positions.
const defaultContext = 4096

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.StringVar(&o.model, "model", "", "Hugging Face model `directory` or GGUF file (default: the embedded model, examples/internal/defaultmodel)")
	fs.StringVar(&o.name, "model-name", "", "the model's `id` in the API (default: the base name of -model)")
	fs.StringVar(&o.addr, "addr", "127.0.0.1:8080", "`host:port` to listen on")
	fs.StringVar(&o.device, "device", "auto", "cpu, cuda, cuda:N or auto (cuda when compiled in and a device exists)")
	fs.StringVar(&o.devices, "devices", "", "spread the layers over these `devices` of -device's driver: 0,1 or all (with -device cpu, CPU backends stand in for devices)")
	fs.IntVar(&o.threads, "threads", 0, "CPU threads; 0 is all cores")
	fs.IntVar(&o.chunk, "prefill-chunk", 512, "prompt tokens processed per forward step")
	fs.IntVar(&o.context, "context", 0, fmt.Sprintf("positions (prompt and generated tokens) of one request; 0 is the model's context, at most %d", defaultContext))
	fs.IntVar(&o.maxSeqs, "max-sequences", 8, "requests run at once")
	fs.IntVar(&o.kvPositions, "kv-positions", 0, "KV cache `positions` the device plan keeps room for, the running requests' together; the KV pool takes that room (0: one -context, and the pool takes what room the plan leaves)")
	fs.BoolVar(&o.pipeline, "pipeline", false, "with -devices, run the batch's steps as a pipeline: while the second device runs one step of some requests, the first runs the next step of the others")
	fs.IntVar(&o.maxQueue, "max-queue", 64, "requests waiting at most; beyond it a request is answered 429")
	fs.DurationVar(&o.drain, "drain-timeout", 30*time.Second, "on SIGINT or SIGTERM, how long the running requests have to finish")
	o.mem.Register(fs)
	if err := cli.Parse(fs, args, stderr); err != nil {
		return nil, err
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	switch {
	case o.chunk <= 0:
		return nil, cli.Usagef("-prefill-chunk %d must be > 0", o.chunk)
	case o.threads < 0:
		return nil, cli.Usagef("-threads %d must be >= 0", o.threads)
	case o.context < 0:
		return nil, cli.Usagef("-context %d must be >= 0", o.context)
	case o.maxSeqs <= 0:
		return nil, cli.Usagef("-max-sequences %d must be > 0", o.maxSeqs)
	case o.kvPositions < 0:
		return nil, cli.Usagef("-kv-positions %d must be >= 0", o.kvPositions)
	case o.maxQueue <= 0:
		return nil, cli.Usagef("-max-queue %d must be > 0", o.maxQueue)
	case o.drain <= 0:
		return nil, cli.Usagef("-drain-timeout %v must be > 0", o.drain)
	case strings.TrimSpace(o.addr) == "":
		return nil, cli.Usagef("-addr is empty")
	}
	return o, cli.CheckDevice(o.device)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) (retErr error) {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
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
	lm, err := cli.OpenModel(o.model)
	if err != nil {
		return err
	}
	defer lm.Close()
	tok, err := cli.LoadTokenizer(lm)
	if err != nil {
		return err
	}
	if tok == nil {
		return cli.Usagef("%s has no tokenizer (tokenizer.json, or a GGUF file's own): serve needs one", lm.Dir)
	}
	if o.name == "" {
		o.name = modelName(o.model)
	}
	maxPos := lm.Config.ContextLength()
	if o.context > maxPos {
		return cli.Usagef("-context %d is longer than %s", o.context, cli.Context(lm.Config))
	}
	if o.context == 0 {
		o.context = min(maxPos, defaultContext)
	}
	// Listen before loading, so that a port in use is told at once.
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return fmt.Errorf("-addr: %w", err)
	}
	defer ln.Close()
	eng, err := engine.Open(ctx, lm, engine.Options{
		Devices: specs, Threads: o.threads, Memory: mem, Context: o.context, Chunk: o.chunk, KVPositions: o.kvPositions,
	})
	if err != nil {
		return err
	}
	defer func() {
		if err := eng.Close(); err != nil && retErr == nil {
			retErr = err
		}
	}()
	b, err := eng.NewBatcher(engine.BatchOptions{MaxSequences: o.maxSeqs, MaxQueue: o.maxQueue, Pipeline: o.pipeline})
	if err != nil {
		return err
	}
	s := newServer(eng, b, tok, o.name)
	if s.tmpl == nil {
		fmt.Fprintf(stderr, "serve: /v1/chat/completions answers 400: %s\n", s.noTemplate().Message)
	}
	fmt.Fprintf(stderr, "serve: %s on http://%s (context %d, %d at once, %d queued at most)\n", o.name, ln.Addr(), o.context, o.maxSeqs, o.maxQueue)
	return s.serve(ctx, ln, o.drain, stderr)
}

// modelName is the API's id of the model at path: its base name without
// .gguf, or the embedded model's name.
func modelName(path string) string {
	if path == "" {
		return defaultmodel.Name
	}
	return strings.TrimSuffix(filepath.Base(filepath.Clean(path)), ".gguf")
}
