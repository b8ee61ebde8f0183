// Command memviz draws a memory snapshot written by paging's
// Budget.WriteSnapshot: the device bytes over time, stacked by category,
// with the budget, the peak and every layer load marked. Bytes still
// charged at the end are called a leak only when the snapshot was taken
// after its budget was closed (generate takes its snapshot with the model
// still open).
//
//	go run ./examples/memviz snapshot.json -o memory.svg
//	go run ./examples/memviz snapshot.json -o memory.html
//
// The output is a self-contained SVG (or an HTML page embedding it); no
// external dependencies.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/paging"
)

func main() {
	cli.Main("memviz", func(ctx context.Context, args []string, stdout, _ io.Writer) error {
		return runContext(ctx, args, stdout)
	})
}

type options struct {
	in, out       string
	width, height int
}

func parseArgs(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("memviz", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.out, "o", "", "output file, .svg or .html (default: the input with .svg)")
	fs.IntVar(&o.width, "width", 1100, "drawing width in pixels")
	fs.IntVar(&o.height, "height", 520, "drawing height in pixels")
	var pos []string
	for len(args) > 0 { // flags may come before or after the file
		if err := fs.Parse(args); err != nil {
			return o, fmt.Errorf("%v (usage: memviz SNAPSHOT.json [-o OUT.svg|OUT.html] [-width N] [-height N])", err)
		}
		args = fs.Args()
		if len(args) > 0 {
			pos = append(pos, args[0])
			args = args[1:]
		}
	}
	if len(pos) != 1 {
		return o, errors.New("usage: memviz SNAPSHOT.json [-o OUT.svg|OUT.html] [-width N] [-height N]")
	}
	o.in = pos[0]
	if o.out == "" {
		o.out = strings.TrimSuffix(o.in, filepath.Ext(o.in)) + ".svg"
	}
	if o.width < 480 || o.height < 420 {
		return o, fmt.Errorf("drawing of %dx%d is too small (at least 480x420, what the legend and lanes need)", o.width, o.height)
	}
	return o, nil
}

func run(args []string, stdout io.Writer) error {
	return runContext(context.Background(), args, stdout)
}

// runContext draws the snapshot; reading it stops when ctx is cancelled.
// The output is checked before the input is read: it must not be the
// input, and its directory must take new files. It is written through a
// temporary file, so an earlier drawing stays whole if anything fails.
func runContext(ctx context.Context, args []string, stdout io.Writer) error {
	o, err := parseArgs(args)
	if err != nil {
		return err
	}
	if err := atomicfile.CheckNotInput("-o", o.out, o.in); err != nil {
		return err
	}
	if err := atomicfile.Check("-o", o.out); err != nil {
		return err
	}
	snap, h, err := readSnapshot(ctx, o.in, plotWidth(o.width))
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	svg := render(snap, h, o.width, o.height)
	var out string
	switch strings.ToLower(filepath.Ext(o.out)) {
	case ".svg":
		out = svg
	case ".html", ".htm":
		out = page(snap, svg)
	default:
		return fmt.Errorf("output %s: want a .svg or .html file", o.out)
	}
	if err := atomicfile.WriteFile(o.out, []byte(out)); err != nil {
		return fmt.Errorf("-o: %w", err)
	}
	fmt.Fprintf(stdout, "memviz: %s: %d events, peak %s, %s -> %s\n", o.in, h.events, paging.FormatSize(snap.Peak), budgetText(snap.Limit), o.out)
	return nil
}
