package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
)

func runArgs(args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, &stdout, &stderr)
	return stdout.String(), err
}

const log = `{"step":1,"tokens":10,"seconds":0.1,"lr":0.001,"loss":8.1,"scale":65536,"grad_norm":3}
{"step":2,"tokens":20,"seconds":0.2,"lr":0.002,"loss":7.2,"scale":65536,"grad_norm":2}
{"step":3,"tokens":30,"seconds":0.3,"lr":0.002,"loss":6.0,"scale":65536,"grad_norm":1}
{"step":3,"tokens":30,"seconds":0.4,"lr":0.002,"scale":65536,"heldout_loss":6.5,"heldout_ppl":665.1,"heldout_tokens":99}
`

// TestPlot: the picture is well-formed SVG whose lines and points all lie
// in its frame, with the held-out point and the uniform baseline; a log
// that is not one is a one-line error, and bad flags usage errors.
func TestPlot(t *testing.T) {
	dir := t.TempDir()
	in, out := filepath.Join(dir, "loss.jsonl"), filepath.Join(dir, "loss.svg")
	os.WriteFile(in, []byte(log), 0o644)
	stdout, err := runArgs("-log", in, "-out", out, "-vocab", "3072", "-smooth", "2")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stdout, "3 steps, loss 8.100 -> 6.000, held-out 6.500") {
		t.Errorf("stdout %q", stdout)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var svg struct {
		Width    float64 `xml:"width,attr"`
		Height   float64 `xml:"height,attr"`
		Polyline []struct {
			Points string `xml:"points,attr"`
		} `xml:"polyline"`
		Circle []struct {
			CX float64 `xml:"cx,attr"`
			CY float64 `xml:"cy,attr"`
		} `xml:"circle"`
	}
	if err := xml.Unmarshal(b, &svg); err != nil {
		t.Fatalf("not SVG: %v", err)
	}
	if len(svg.Polyline) != 2 || len(svg.Circle) != 2 || !strings.Contains(string(b), "ln 3072 = 8.03") {
		t.Errorf("%d lines, %d circles (want 2 and 2: the held-out point and the legend's), baseline shown %v",
			len(svg.Polyline), len(svg.Circle), strings.Contains(string(b), "ln 3072"))
	}
	for _, pl := range svg.Polyline {
		pts := strings.Fields(pl.Points)
		if len(pts) != 3 {
			t.Errorf("a line of %d points; want 3", len(pts))
		}
		for _, p := range pts {
			x, _ := strconv.ParseFloat(p[:strings.IndexByte(p, ',')], 64)
			y, _ := strconv.ParseFloat(p[strings.IndexByte(p, ',')+1:], 64)
			if x < 0 || x > svg.Width || y < 0 || y > svg.Height {
				t.Errorf("point %s outside the %gx%g picture", p, svg.Width, svg.Height)
			}
		}
	}

	bad := filepath.Join(dir, "bad.jsonl")
	os.WriteFile(bad, []byte("step\tloss\n"), 0o644)
	if _, err := runArgs("-log", bad, "-out", filepath.Join(dir, "b.svg")); err == nil || strings.Contains(err.Error(), "\n") ||
		!strings.Contains(err.Error(), "bad.jsonl:1") {
		t.Errorf("a TSV log: %v; want a one-line error naming the line", err)
	}
	for _, args := range [][]string{{"-log", in}, {"-log", in, "-out", in}, {"-log", in, "-out", out, "-smooth", "0"}} {
		if _, err := runArgs(args...); !cli.IsUsage(err) {
			t.Errorf("%q: %v; want a usage error", args, err)
		}
	}
}

// TestThin: a long line keeps at most about maxPoints points, its first
// and its last; a short one is kept whole.
func TestThin(t *testing.T) {
	for _, n := range []int{1, 3, 1000, 1001, 6342, 100000} {
		ps := make([]point, n)
		for i := range ps {
			ps[i] = point{float64(i), float64(i)}
		}
		got := thin(ps, maxPoints)
		if len(got) > maxPoints+1 || got[0] != ps[0] || got[len(got)-1] != ps[n-1] || (n <= maxPoints && len(got) != n) {
			t.Errorf("%d points: thinned to %d, first %v, last %v", n, len(got), got[0], got[len(got)-1])
		}
	}
}
