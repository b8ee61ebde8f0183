package main

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

func write(t *testing.T, dir, name string, rows, vocab int, v []float32) string {
	t.Helper()
	x, err := tensor.FromF32(tensor.Shape{rows, vocab}, v)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := loader.WriteSafetensors(p, []loader.NamedTensor{{Name: "logits", T: x}}, nil); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestLogitDiff checks the shares against sums worked by hand: three
// positions of four logits, the other file off by 0.5 in one logit of each
// row and with another largest logit in the last row; -from skips the
// first position.
func TestLogitDiff(t *testing.T) {
	dir := t.TempDir()
	ref := []float32{1, 2, 3, 4, 4, 3, 2, 1, 0, 0, 1, 2}
	got := []float32{1, 2, 3, 4.5, 4.5, 3, 2, 1, 0, 0, 2.5, 2}
	rp, gp := write(t, dir, "ref.safetensors", 3, 4, ref), write(t, dir, "got.safetensors", 3, 4, got)
	for _, c := range []struct {
		from        int
		se, sr      float64
		agree, rows int
	}{
		{0, 0.25 + 0.25 + 2.25, 30 + 30 + 5, 2, 3},
		{1, 0.25 + 2.25, 30 + 5, 1, 2},
	} {
		var out bytes.Buffer
		if err := run(context.Background(), []string{"-from", fmt.Sprint(c.from), rp, gp}, &out); err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("%s: RMS logit error %.2f%% of the reference's RMS, top-1 agreement %d/%d (%.1f%%)\n",
			gp, 100*math.Sqrt(c.se/c.sr), c.agree, c.rows, 100*float64(c.agree)/float64(c.rows))
		if out.String() != want {
			t.Errorf("-from %d: got %q, want %q", c.from, out.String(), want)
		}
		out.Reset()
		if err := run(context.Background(), []string{"-sums", "-from", fmt.Sprint(c.from), rp, gp}, &out); err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("%s %g %g %d %d\n", gp, c.se, c.sr, c.agree, c.rows); out.String() != want {
			t.Errorf("-sums -from %d: got %q, want %q", c.from, out.String(), want)
		}
	}
}

// TestLogitDiffBadInput: each bad input is a one-line error naming the
// problem (usage errors for the flags), and no file is written.
func TestLogitDiffBadInput(t *testing.T) {
	dir := t.TempDir()
	rp := write(t, dir, "ref.safetensors", 3, 4, make([]float32, 12))
	short := write(t, dir, "short.safetensors", 2, 4, make([]float32, 8))
	notLogits := filepath.Join(dir, "other.safetensors")
	x, _ := tensor.FromF32(tensor.Shape{3, 4}, make([]float32, 12))
	if err := loader.WriteSafetensors(notLogits, []loader.NamedTensor{{Name: "weights", T: x}}, nil); err != nil {
		t.Fatal(err)
	}
	garbage := filepath.Join(dir, "garbage.safetensors")
	if err := os.WriteFile(garbage, []byte("not a safetensors file"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		args  []string
		usage bool
		says  string
	}{
		{"one file", []string{rp}, true, "usage"},
		{"negative -from", []string{"-from", "-1", rp, rp}, true, "-from -1"},
		{"-from past the positions", []string{"-from", "3", rp, rp}, true, "has 3 positions"},
		{"unknown flag", []string{"-x", rp, rp}, true, "usage"},
		{"missing file", []string{rp, filepath.Join(dir, "none.safetensors")}, false, "none.safetensors"},
		{"other shape", []string{rp, short}, false, "the reference's [3, 4]"},
		{"no logits tensor", []string{rp, notLogits}, false, "other.safetensors"},
		{"not safetensors", []string{garbage, rp}, false, "garbage.safetensors"},
	} {
		var out bytes.Buffer
		err := run(context.Background(), c.args, &out)
		if err == nil || cli.IsUsage(err) != c.usage || !strings.Contains(err.Error(), c.says) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error %v (usage %v), want a one-line error saying %q (usage %v)", c.name, err, cli.IsUsage(err), c.says, c.usage)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 4 {
		t.Errorf("%d files in the directory after the bad runs, want the 4 made", len(entries))
	}
}
