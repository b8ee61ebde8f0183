// Command plot draws the loss log of examples/train (-log, a JSON object a
// line) as an SVG picture: the training loss of every step (faint) and its
// moving average over -smooth steps, the held-out loss of each evaluation
// as points, and the uniform baseline ln(vocabulary) when -vocab is given.
//
//	go run ./examples/train/plot -log loss.jsonl -out loss.svg [-title T]
//	    [-vocab N] [-smooth 25]
//
// Exit status: 0 on success, 2 for a bad flag, 1 for any other error.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"strings"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/internal/infile"
)

func main() { cli.Main("plot", run) }

// line is the part of a loss log line the picture needs.
type line struct {
	Step        int      `json:"step"`
	Seconds     float64  `json:"seconds"`
	Loss        *float64 `json:"loss"`
	HeldoutLoss *float64 `json:"heldout_loss"`
	HeldoutPPL  *float64 `json:"heldout_ppl"`
}

type point struct{ x, y float64 }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var logPath, out, title string
	var vocab, smooth int
	fs := flag.NewFlagSet("plot", flag.ContinueOnError)
	fs.StringVar(&logPath, "log", "", "loss log `file` written by examples/train -log (required)")
	fs.StringVar(&out, "out", "", "SVG `file` to write (required)")
	fs.StringVar(&title, "title", "strata: training loss", "the picture's title")
	fs.IntVar(&vocab, "vocab", 0, "vocabulary size: draws the uniform baseline ln(N) (0: none)")
	fs.IntVar(&smooth, "smooth", 25, "steps of the moving average (1: none)")
	if err := cli.Parse(fs, args, stderr); err != nil {
		return err
	}
	switch {
	case logPath == "" || out == "":
		return cli.Usagef("give -log FILE and -out FILE.svg")
	case smooth < 1:
		return cli.Usagef("-smooth %d must be >= 1", smooth)
	case vocab < 0:
		return cli.Usagef("-vocab %d must be >= 0", vocab)
	}
	if err := atomicfile.CheckNotInput("-out", out, logPath); err != nil {
		return cli.UsageError{Err: err}
	}
	b, err := infile.ReadFile(ctx, logPath)
	if err != nil {
		return fmt.Errorf("-log: %w", err)
	}
	var steps, held []point
	for i, s := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(s) == "" {
			continue
		}
		var l line
		if err := json.Unmarshal([]byte(s), &l); err != nil {
			return fmt.Errorf("%s:%d: not a loss log line: %v", logPath, i+1, err)
		}
		switch {
		case l.Loss != nil:
			steps = append(steps, point{float64(l.Step), *l.Loss})
		case l.HeldoutLoss != nil:
			held = append(held, point{float64(l.Step), *l.HeldoutLoss})
		}
	}
	if len(steps) == 0 {
		return fmt.Errorf("%s holds no step's loss", logPath)
	}
	svg := draw(title, steps, held, vocab, smooth)
	if err := atomicfile.WriteFile(out, []byte(svg)); err != nil {
		return err
	}
	last := steps[len(steps)-1]
	msg := fmt.Sprintf("plot: %d steps, loss %.3f -> %.3f", len(steps), steps[0].y, last.y)
	if len(held) > 0 {
		h := held[len(held)-1]
		msg += fmt.Sprintf(", held-out %.3f (perplexity %.1f)", h.y, math.Exp(h.y))
	}
	fmt.Fprintf(stdout, "%s; wrote %s\n", msg, out)
	return nil
}

// movingAverage is the mean of the last n points at each point.
func movingAverage(ps []point, n int) []point {
	out := make([]point, len(ps))
	var sum float64
	for i, p := range ps {
		sum += p.y
		if i >= n {
			sum -= ps[i-n].y
		}
		out[i] = point{p.x, sum / float64(min(i+1, n))}
	}
	return out
}

// maxPoints bounds the points of a line, which keeps the picture small
// (a line of 720 pixels shows no more).
const maxPoints = 1000

// thin keeps every k-th point of ps and its last, at most about n.
func thin(ps []point, n int) []point {
	k := (len(ps) + n - 1) / n
	if k <= 1 {
		return ps
	}
	var out []point
	for i := 0; i < len(ps); i += k {
		out = append(out, ps[i])
	}
	if last := ps[len(ps)-1]; out[len(out)-1] != last {
		out = append(out, last)
	}
	return out
}

// niceStep is a round tick spacing for a span: 1, 2 or 5 times a power of
// ten, about span/6.
func niceStep(span float64) float64 {
	if span <= 0 {
		return 1
	}
	raw := span / 6
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

func draw(title string, steps, held []point, vocab, smooth int) string {
	const w, h, left, right, top, bottom = 720.0, 420.0, 60.0, 20.0, 40.0, 50.0
	xmax := steps[len(steps)-1].x
	for _, p := range held {
		xmax = max(xmax, p.x)
	}
	ymin, ymax := math.Inf(1), math.Inf(-1)
	for _, ps := range [][]point{steps, held} {
		for _, p := range ps {
			ymin, ymax = min(ymin, p.y), max(ymax, p.y)
		}
	}
	base := 0.0
	if vocab > 1 {
		base = math.Log(float64(vocab))
		ymax = max(ymax, base)
	}
	ymin = math.Max(0, math.Floor(ymin))
	ymax = math.Ceil(ymax)
	if ymax <= ymin {
		ymax = ymin + 1
	}
	xmax = max(xmax, 1)
	sx := func(x float64) float64 { return left + (w-left-right)*x/xmax }
	sy := func(y float64) float64 { return top + (h-top-bottom)*(ymax-y)/(ymax-ymin) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%g" height="%g" viewBox="0 0 %g %g" font-family="sans-serif" font-size="12">`+"\n", w, h, w, h)
	fmt.Fprintf(&b, `<rect width="%g" height="%g" fill="white"/>`+"\n", w, h)
	fmt.Fprintf(&b, `<text x="%g" y="24" font-size="15" text-anchor="middle">%s</text>`+"\n", w/2, escape(title))
	// Grid and ticks.
	xs := niceStep(xmax)
	for x := 0.0; x <= xmax+xs/1e6; x += xs {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%g" x2="%.1f" y2="%g" stroke="#e4e4e4"/>`+"\n", sx(x), top, sx(x), h-bottom)
		fmt.Fprintf(&b, `<text x="%.1f" y="%g" text-anchor="middle">%g</text>`+"\n", sx(x), h-bottom+16, x)
	}
	ys := niceStep(ymax - ymin)
	for y := ymin; y <= ymax+ys/1e6; y += ys {
		fmt.Fprintf(&b, `<line x1="%g" y1="%.1f" x2="%g" y2="%.1f" stroke="#e4e4e4"/>`+"\n", left, sy(y), w-right, sy(y))
		fmt.Fprintf(&b, `<text x="%g" y="%.1f" text-anchor="end">%g</text>`+"\n", left-6, sy(y)+4, y)
	}
	fmt.Fprintf(&b, `<rect x="%g" y="%g" width="%g" height="%g" fill="none" stroke="#888"/>`+"\n", left, top, w-left-right, h-top-bottom)
	fmt.Fprintf(&b, `<text x="%g" y="%g" text-anchor="middle">step</text>`+"\n", (left+w-right)/2, h-12)
	fmt.Fprintf(&b, `<text x="16" y="%g" text-anchor="middle" transform="rotate(-90 16 %g)">cross-entropy (nats)</text>`+"\n", (top+h-bottom)/2, (top+h-bottom)/2)
	if base > 0 {
		fmt.Fprintf(&b, `<line x1="%g" y1="%.1f" x2="%g" y2="%.1f" stroke="#999" stroke-dasharray="6 4"/>`+"\n", left, sy(base), w-right, sy(base))
		fmt.Fprintf(&b, `<text x="%g" y="%.1f" text-anchor="end" fill="#666">uniform: ln %d = %.2f</text>`+"\n", w-right-6, sy(base)-6, vocab, base)
	}
	poly := func(ps []point, style string) {
		b.WriteString(`<polyline fill="none" ` + style + ` points="`)
		for i, p := range ps {
			if i > 0 {
				b.WriteByte(' ')
			}
			fmt.Fprintf(&b, "%.1f,%.1f", sx(p.x), sy(p.y))
		}
		b.WriteString("\"/>\n")
	}
	poly(thin(steps, maxPoints), `stroke="#9ecae1" stroke-width="0.8"`)
	if smooth > 1 {
		poly(thin(movingAverage(steps, smooth), maxPoints), `stroke="#08519c" stroke-width="2"`)
	}
	for _, p := range held {
		fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="4" fill="#d94801"/>`+"\n", sx(p.x), sy(p.y))
	}
	// Legend.
	lx, ly := w-right-230, top+16
	fmt.Fprintf(&b, `<line x1="%g" y1="%g" x2="%g" y2="%g" stroke="#08519c" stroke-width="2"/><text x="%g" y="%g">training loss (mean of %d steps)</text>`+"\n", lx, ly, lx+24, ly, lx+30, ly+4, smooth)
	if len(held) > 0 {
		hl := held[len(held)-1]
		fmt.Fprintf(&b, `<circle cx="%g" cy="%g" r="4" fill="#d94801"/><text x="%g" y="%g">held-out loss (last %.3f, ppl %.1f)</text>`+"\n", lx+12, ly+18, lx+30, ly+22, hl.y, math.Exp(hl.y))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

func escape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}
