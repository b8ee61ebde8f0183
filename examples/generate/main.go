// Command generate runs a Llama-family model from a Hugging Face directory:
// it streams generated text (or ids) to stdout, with a progress bar on stderr
// while weights load.
//
//	go run ./examples/generate [-model DIR] [-prompt TEXT | -ids 1,2,3]
//	    [-max-new-tokens N] [-temperature T] [-top-k K] [-top-p P] [-seed S]
//	    [-device cpu|cuda|auto] [-json] [-logits-out FILE]
//
// Without -model it runs the small BF16 model embedded in the binary.
// Exit status: 0 on success, 2 for a bad flag, 1 for any other error, with
// one line on stderr naming the problem.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "generate:", err)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "generate:", err)
		os.Exit(1)
	}
}

// usageError is a bad flag or flag value.
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

func usagef(format string, a ...any) error { return usageError{fmt.Errorf(format, a...)} }
