// Package cli holds what the example commands share: exit statuses and
// one-line errors, usage errors, and the embedded model used when no
// -model is given.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"

	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/loader/fixtures"
)

// UsageError is a bad flag or flag value: the command exits with status 2.
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// Usagef returns a UsageError.
func Usagef(format string, a ...any) error { return UsageError{fmt.Errorf(format, a...)} }

// IsUsage reports whether err is (or wraps) a UsageError.
func IsUsage(err error) bool { return errors.As(err, new(UsageError)) }

// Main runs a command until it returns or is interrupted, and exits: 0 on
// success or -h, 2 after a usage error, 1 after any other, with one line
// "name: error" on stderr.
func Main(name string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
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

// ModelDir returns dir after checking it is a directory, or, when dir is
// empty, a temporary copy of the embedded fixture; cleanup removes the copy.
func ModelDir(dir, fixture string) (path string, cleanup func(), err error) {
	cleanup = func() {}
	if dir != "" {
		st, err := os.Stat(dir)
		if err != nil {
			var pe *os.PathError
			if errors.As(err, &pe) {
				err = pe.Err // the path is in the message already
			}
			return "", cleanup, fmt.Errorf("model directory %s: %w", dir, err)
		}
		if !st.IsDir() {
			return "", cleanup, fmt.Errorf("model directory %s: not a directory", dir)
		}
		return dir, cleanup, nil
	}
	tmp, err := os.MkdirTemp("", "strata-model-")
	if err != nil {
		return "", cleanup, err
	}
	cleanup = func() { os.RemoveAll(tmp) }
	path, err = fixtures.Extract(fixture, tmp)
	if err != nil {
		cleanup()
		return "", func() {}, err
	}
	return path, cleanup, nil
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
