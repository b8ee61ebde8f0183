package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestTimeDecodePieces: the steps run in pieces of the meter's size (the
// last one shorter), the bandwidth is measured before each piece and after
// the last, each piece is set against the measures on either side of it,
// and the time returned leaves the measures out.
func TestTimeDecodePieces(t *testing.T) {
	const readTime = 30 * time.Millisecond
	bws := []float64{10, 30, 20, 40}
	reads := 0
	m := &bwMeter{piece: 4, c: CPUBandwidth{ReadBytesPerToken: 1e6}, read: func() float64 {
		time.Sleep(readTime)
		reads++
		return bws[reads-1]
	}}
	steps := 0
	el, err := timeDecode(10, func() error { steps++; return nil }, m)
	if err != nil {
		t.Fatal(err)
	}
	if steps != 10 || reads != 4 {
		t.Errorf("%d steps and %d bandwidth measures, want 10 and 4", steps, reads)
	}
	if el >= readTime {
		t.Errorf("decode timed at %v: the measures (%v each) were counted", el, readTime)
	}
	var got []int
	for i, p := range m.c.Pieces {
		got = append(got, p.Steps)
		if p.BeforeGBps != bws[i] || p.AfterGBps != bws[i+1] {
			t.Errorf("piece %d between %v and %v GB/s, want %v and %v", i, p.BeforeGBps, p.AfterGBps, bws[i], bws[i+1])
		}
		if want := p.GBps / ((bws[i] + bws[i+1]) / 2); p.Ratio != want || p.Ratio <= 0 {
			t.Errorf("piece %d ratio %v, want %v", i, p.Ratio, want)
		}
	}
	if !slices.Equal(got, []int{4, 4, 2}) || m.c.PieceSteps != 4 {
		t.Errorf("pieces of %v steps (piece %d), want [4 4 2]", got, m.c.PieceSteps)
	}
	if m.c.ReadGBps != 25 {
		t.Errorf("read bandwidth %v, want the median of %v: 25", m.c.ReadGBps, bws)
	}
	if want := float64(10) * 1e6 / el.Seconds() / 1e9; math.Abs(m.c.DecodeGBps-want) > 1e-9*want {
		t.Errorf("decode %v GB/s, want %v", m.c.DecodeGBps, want)
	}

	// A failing step ends the decode with its error.
	boom := errors.New("boom")
	m = &bwMeter{piece: 2, read: func() float64 { return 1 }}
	if _, err := timeDecode(5, func() error { return boom }, m); !errors.Is(err, boom) {
		t.Errorf("error %v, want %v", err, boom)
	}
	if _, err := timeDecode(5, func() error { return boom }, nil); !errors.Is(err, boom) {
		t.Errorf("without a meter: error %v, want %v", err, boom)
	}
}

func TestPieceAndMedian(t *testing.T) {
	for _, c := range []struct {
		name          string
		k             int
		d             time.Duration
		perToken      int64
		before, after float64
		tokS, gbps, r float64
	}{
		{"at the bandwidth", 8, time.Second, 1e9, 10, 6, 8, 8, 1},
		{"half of it", 4, 2 * time.Second, 5e9, 25, 15, 2, 10, 0.5},
		{"no bandwidth measured", 4, time.Second, 1e9, 0, 0, 4, 4, 0},
	} {
		p := piece(c.k, c.d, c.perToken, c.before, c.after)
		if p.TokS != c.tokS || p.GBps != c.gbps || p.Ratio != c.r || p.Steps != c.k {
			t.Errorf("%s: %+v, want %v tok/s, %v GB/s, ratio %v", c.name, p, c.tokS, c.gbps, c.r)
		}
	}
	for _, c := range []struct {
		v    []float64
		want float64
	}{{nil, 0}, {[]float64{3}, 3}, {[]float64{5, 1, 3}, 3}, {[]float64{4, 1, 3, 2}, 2.5}} {
		if got := medianOf(c.v); got != c.want {
			t.Errorf("medianOf(%v) = %v, want %v", c.v, got, c.want)
		}
	}
}

// TestReadBytesPerToken: a step reads every layer but one row of the
// embedding table; with tied embeddings the head reads the whole table.
func TestReadBytesPerToken(t *testing.T) {
	for _, name := range []string{fixtures.TinyLlamaBF16, fixtures.TinyQwen3F16} {
		lm, err := loader.Open(fixtures.Dir(name))
		if err != nil {
			t.Fatal(err)
		}
		emb, _ := lm.Tensor("model.embed_tokens.weight")
		want := lm.WeightBytes() - emb.Size + emb.Size/int64(lm.Config.VocabSize)
		if lm.Config.TieEmbeddings {
			want += emb.Size
		}
		if got := readBytesPerToken(lm); got != want {
			t.Errorf("%s: %d bytes a token, want %d", name, got, want)
		}
		lm.Close()
	}
}

// TestBenchCPUBandwidth: a run on the CPU device carries its pieces and
// their ratios in its JSON line, its line of output and the report's
// table; -bw-piece 0 measures no bandwidth, and a negative one is refused.
func TestBenchCPUBandwidth(t *testing.T) {
	stdout, out, r := benchOne(t, "-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "8", "-warmup", "1", "-decode", "5", "-bw-piece", "2", "-threads", "2")
	if !strings.Contains(stdout, "ratio per piece of 2 steps") {
		t.Errorf("output has no ratios:\n%s", stdout)
	}
	c := r.CPUBandwidth
	if c == nil || c.Threads != 2 || len(c.Pieces) != 3 || c.Pieces[2].Steps != 1 || c.ReadGBps <= 0 || c.MedianRatio <= 0 || c.ReadBytesPerToken <= 0 {
		t.Fatalf("cpu bandwidth %+v", c)
	}
	var md bytes.Buffer
	if err := run(context.Background(), []string{"-report", out}, &md); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md.String(), "| median ratio |") || !strings.Contains(md.String(), " | 2 | ") {
		t.Errorf("report has no CPU bandwidth table:\n%s", md.String())
	}

	_, out0, _ := benchOne(t, "-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "8", "-warmup", "1", "-decode", "3", "-bw-piece", "0")
	data, err := os.ReadFile(out0)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(data, []byte("cpu_bandwidth")) {
		t.Errorf("-bw-piece 0 measured the bandwidth: %s", data)
	}
	if err := run(context.Background(), []string{"-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-bw-piece", "-1"}, io.Discard); err == nil || !strings.Contains(err.Error(), "-bw-piece") {
		t.Errorf("-bw-piece -1: %v", err)
	}
}
