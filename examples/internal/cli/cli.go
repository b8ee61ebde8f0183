// Package cli holds what the example commands share: exit statuses and
// one-line errors, usage errors, Ctrl-C, checks of output paths, and the
// embedded default model used when no -model is given.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"

	"github.com/strata-llm/strata/examples/internal/defaultmodel"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/tokenizer"
)

// UsageError is a bad flag or flag value: the command exits with status 2.
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// Usagef returns a UsageError.
func Usagef(format string, a ...any) error { return UsageError{fmt.Errorf(format, a...)} }

// IsUsage reports whether err is (or wraps) a UsageError.
func IsUsage(err error) bool { return errors.As(err, new(UsageError)) }

// ErrInterrupted is the cause of a command's context cancelled by Main
// on SIGINT or SIGTERM.
var ErrInterrupted = errors.New("interrupted")

// Main runs a command and exits: 0 on success or -h, 2 after a usage
// error, 1 after any other, with one line "name: error" on stderr. The
// first SIGINT or SIGTERM cancels the command's context (the command
// returns promptly with its error, reported as "interrupted by SIGINT");
// the signals then have their default effect again, so a second one ends
// the process even when the command is stuck.
func Main(name string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	ctx, stop := NotifyContext(context.Background())
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && errors.Is(err, context.Canceled) && errors.Is(context.Cause(ctx), ErrInterrupted) {
		err = context.Cause(ctx)
	}
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case IsUsage(err):
		fmt.Fprintln(os.Stderr, Message(name, err))
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, Message(name, err))
		os.Exit(1)
	}
}

// Message is the line Main prints for err, "name: error": one line even
// when a wrapped error's text is not (the packages keep theirs on one line;
// this catches what they cannot, a path with a line break in it).
func Message(name string, err error) string {
	return name + ": " + oneline.String(err.Error())
}

// NotifyContext returns a context that the first SIGINT or SIGTERM
// cancels, with a cause wrapping ErrInterrupted; from then on the signals
// have their default effect (they end the process). stop releases the
// signals and the context.
func NotifyContext(parent context.Context) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(parent)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-sigs:
			signal.Stop(sigs)
			name := "SIGTERM"
			if sig == os.Interrupt {
				name = "SIGINT"
			}
			cancel(fmt.Errorf("%w by %s", ErrInterrupted, name))
		case <-done:
		}
	}()
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			signal.Stop(sigs)
			close(done)
			cancel(nil)
		})
	}
}

// OpenModel opens the model at path, a Hugging Face model directory or a
// GGUF file, or, when path is empty, the embedded default model
// (defaultmodel), read in place: nothing is written to disk.
func OpenModel(path string) (*loader.Model, error) {
	if path == "" {
		return defaultmodel.Open()
	}
	if _, err := os.Stat(path); err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err // the path is in the message already
		}
		return nil, fmt.Errorf("model %s: %w", path, err)
	}
	return loader.Open(path)
}

// LoadTokenizer loads the tokenizer of lm (tokenizer.json, or a GGUF
// file's own), or returns nil when lm has none.
func LoadTokenizer(lm *loader.Model) (*tokenizer.Tokenizer, error) {
	return lm.Tokenizer()
}

// InputsOf lists the files a run on lm reads, with its directory and the
// other inputs given, for atomicfile.CheckNotInput.
func InputsOf(lm *loader.Model, more ...string) []string {
	in := lm.InputFiles()
	if in != nil {
		in = append(in, lm.Dir)
	}
	return append(in, more...)
}

// CheckOutputs checks, before any work, each output file (flag name to
// path; empty paths are skipped): it can be written (atomicfile.Check), it
// is none of inputs (atomicfile.CheckNotInput), and no two outputs are the
// same file. Each failure is a usage error.
func CheckOutputs(outputs [][2]string, inputs []string) error {
	seen := map[string]string{}
	for _, o := range outputs {
		flag, path := o[0], o[1]
		if path == "" {
			continue
		}
		if err := atomicfile.CheckNotInput(flag, path, inputs...); err != nil {
			return UsageError{err}
		}
		if err := atomicfile.Check(flag, path); err != nil {
			return UsageError{err}
		}
		abs, err := filepath.Abs(path)
		if err != nil {
			return UsageError{err}
		}
		if prev, ok := seen[abs]; ok {
			return Usagef("%s and %s name the same file %s", prev, flag, path)
		}
		seen[abs] = flag
		for other, f := range seen {
			if other != abs && atomicfile.CheckNotInput(flag, path, other) != nil {
				return Usagef("%s and %s name the same file %s", f, flag, path)
			}
		}
	}
	return nil
}

// Parse parses args into fs. A bad flag is a UsageError of one line (the
// flag package's usage text is printed for -h only, to stderr).
func Parse(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fs.SetOutput(stderr)
		fmt.Fprintf(stderr, "usage of %s:\n", fs.Name())
		fs.PrintDefaults()
		return err
	case err != nil:
		return UsageError{err}
	case fs.NArg() > 0:
		return Usagef("unexpected argument %q", fs.Arg(0))
	}
	return nil
}
