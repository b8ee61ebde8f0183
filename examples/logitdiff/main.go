// Command logitdiff compares the logits several models gave for one token
// sequence (generate -ids ... -max-new-tokens 0 -logits-out FILE) with a
// reference's: the RMS of their difference as a share of the RMS of the
// reference's logits, and how often both put the largest logit on the same
// token (top-1 agreement), over the positions from -from on. It is how the
// quantized formats' accuracy is measured (examples/bench/results).
//
//	go run ./examples/logitdiff -from 15 f16.safetensors q8_0.safetensors q4_k.safetensors
//
// With -sums it prints the raw sums (squared error, squared reference,
// agreeing positions, positions) for a caller that adds several sequences.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

func main() {
	cli.Main("logitdiff", func(ctx context.Context, args []string, stdout, _ io.Writer) error {
		return run(ctx, args, stdout)
	})
}

const usage = "usage: logitdiff [-from N] [-sums] REFERENCE.safetensors OTHER.safetensors..."

// logits is the [positions, vocab] F32 tensor "logits" of a file.
type logits struct {
	vals        []float32
	rows, vocab int
}

func read(ctx context.Context, path string) (logits, error) {
	f, err := loader.OpenSafetensors(path)
	if err != nil {
		return logits{}, err
	}
	defer f.Close()
	t, err := f.ReadTensor(ctx, "logits")
	if err != nil {
		return logits{}, fmt.Errorf("%s: %w", path, err)
	}
	if s := t.Shape(); len(s) != 2 || t.DType() != tensor.F32 || s[1] == 0 {
		return logits{}, fmt.Errorf("%s: logits are %v %v, want F32 [positions, vocab]", path, t.DType(), s)
	}
	return logits{vals: append([]float32(nil), t.F32()...), rows: t.Shape()[0], vocab: t.Shape()[1]}, nil
}

// diff is the comparison of one file with the reference.
type diff struct {
	se, sr      float64 // squared difference, squared reference
	agree, rows int
}

func (d diff) rms() float64 { return math.Sqrt(d.se / d.sr) }

func compare(ref, got logits, from int) diff {
	var d diff
	for r := from; r < ref.rows; r++ {
		a, b := ref.vals[r*ref.vocab:(r+1)*ref.vocab], got.vals[r*ref.vocab:(r+1)*ref.vocab]
		for i := range a {
			e := float64(a[i]) - float64(b[i])
			d.se += e * e
			d.sr += float64(a[i]) * float64(a[i])
		}
		if argmax(a) == argmax(b) {
			d.agree++
		}
		d.rows++
	}
	return d
}

// argmax is the first index of the largest value.
func argmax(v []float32) int {
	best := 0
	for i, x := range v {
		if x > v[best] {
			best = i
		}
	}
	return best
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("logitdiff", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	from := fs.Int("from", 0, "first position counted (a prompt's last position predicts the first generated token)")
	sums := fs.Bool("sums", false, "print the raw sums instead of the shares")
	if err := fs.Parse(args); err != nil {
		return cli.Usagef("%v (%s)", err, usage)
	}
	files := fs.Args()
	if len(files) < 2 {
		return cli.Usagef("%s", usage)
	}
	if *from < 0 {
		return cli.Usagef("-from %d: a position is not negative", *from)
	}
	ref, err := read(ctx, files[0])
	if err != nil {
		return err
	}
	if *from >= ref.rows {
		return cli.Usagef("-from %d: %s has %d positions", *from, files[0], ref.rows)
	}
	for _, p := range files[1:] {
		got, err := read(ctx, p)
		if err != nil {
			return err
		}
		if got.rows != ref.rows || got.vocab != ref.vocab {
			return fmt.Errorf("%s: logits [%d, %d], the reference's [%d, %d]", p, got.rows, got.vocab, ref.rows, ref.vocab)
		}
		d := compare(ref, got, *from)
		if *sums {
			fmt.Fprintf(stdout, "%s %g %g %d %d\n", p, d.se, d.sr, d.agree, d.rows)
			continue
		}
		fmt.Fprintf(stdout, "%s: RMS logit error %.2f%% of the reference's RMS, top-1 agreement %d/%d (%.1f%%)\n",
			p, 100*d.rms(), d.agree, d.rows, 100*float64(d.agree)/float64(d.rows))
	}
	return nil
}
