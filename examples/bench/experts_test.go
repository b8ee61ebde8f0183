package main

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
)

// TestParseRunsPolicy: a run's fourth part is the expert cache's policy.
func TestParseRunsPolicy(t *testing.T) {
	specs, err := parseRuns("24GiB:balanced:explicit:lfu,8GiB")
	if err != nil {
		t.Fatal(err)
	}
	if specs[0].policy != paging.ExpertLFU || specs[0].String() != "24GiB:balanced:explicit:lfu" || specs[1].policy != "" || specs[1].String() != "8GiB:balanced:explicit" {
		t.Errorf("specs %+v, %q", specs, specs[0].String())
	}
	for _, bad := range []string{"1GiB:balanced:explicit:fifo", "1GiB:balanced:explicit:", "1GiB:balanced:explicit:lru:x"} {
		if _, err := parseRuns(bad); err == nil {
			t.Errorf("run %q accepted", bad)
		}
	}
}

// TestBenchExperts measures the Mixtral fixture with its experts paged: the
// result carries the experts over the timed decode steps, and the report
// judges it against the experts bound.
func TestBenchExperts(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyMixtralBF16)
	lm, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	info, err := nn.ModelInfo(lm, lm.Config)
	lm.Close()
	if err != nil {
		t.Fatal(err)
	}
	const decode = 4
	ctxLen := 16 + 1 + decode + 1 // the shortest prompt a run times, the warm-up and the decode steps
	p, err := paging.Plan(info, 1<<40, paging.StrategyBalanced, ctxLen, 1, paging.WithChunkTokens(8), paging.WithExpertCache(2))
	if err != nil {
		t.Fatal(err)
	}
	budget := p.PredictedPeakBytes - p.ExpertCacheBytes + 4*p.ExpertSlotBytes
	stdout, _, r := benchOne(t, "-model", dir, "-device", "cpu", "-prefill", "8", "-warmup", "1", "-decode", fmt.Sprint(decode), "-chunk", "8",
		"-runs", fmt.Sprintf("%dB:balanced:explicit:lfu", budget))
	if !strings.Contains(stdout, "experts [router]: cache of 4 of 24") {
		t.Errorf("output without the experts:\n%s", stdout)
	}
	x := r.Experts
	if x == nil || x.Tokens != decode || x.Policy != paging.ExpertLFU || x.Slots != 4 || x.AcquiresPerToken != 6 {
		t.Fatalf("experts %+v", x)
	}
	// The report's bound, from made-up ceilings.
	row := Row{Result: r}
	bounds(&row, &Ceilings{PinnedGBps: 50, DeviceGBps: 4000})
	link := float64(r.StreamedBytes) + x.MissesPerToken*float64(x.ExpertBytes)
	hbm := float64(r.WeightBytes-x.WeightBytes) + 6*float64(x.ExpertBytes)
	want := 1 / (link/50e9 + hbm/4000e9)
	if row.Bound != "experts" || math.Abs(row.BoundTokS-want) > 1e-9*want || row.OfBound != r.DecodeTokS/row.BoundTokS {
		t.Errorf("bound %s %v (of bound %v), want experts %v", row.Bound, row.BoundTokS, row.OfBound, want)
	}
	// With experts on the CPU, the missing experts (uploaded and on the
	// CPU) count at the link's and the CPU's rates together, shared when
	// the ceilings measured them so, and the row says so; a run that
	// moved the same misses over the link alone would be judged against a
	// lower bound than a split could reach.
	xc := *x
	xc.OnCPUPerToken, xc.OnCPU = 3, 3*decode
	for _, tc := range []struct {
		c         Ceilings
		link, cpu float64
		label     string
	}{
		{Ceilings{PinnedGBps: 50, DeviceGBps: 4000, CPUGBps: 90}, 50e9, 90e9, "experts: link 50 + CPU 90 GB/s"},
		{Ceilings{PinnedGBps: 50, DeviceGBps: 4000, CPUGBps: 90, H2DSharedGBps: 45, CPUSharedGBps: 80}, 45e9, 80e9, "experts: link 45 + CPU 80 GB/s"},
	} {
		cpuRow := Row{Result: r}
		cpuRow.Experts = &xc
		bounds(&cpuRow, &tc.c)
		missing := (xc.MissesPerToken + 3) * float64(x.ExpertBytes)
		want := 1 / (float64(r.StreamedBytes)/50e9 + missing/(tc.link+tc.cpu) + hbm/4000e9)
		if cpuRow.Bound != tc.label || math.Abs(cpuRow.BoundTokS-want) > 1e-9*want || cpuRow.OfBound != r.DecodeTokS/cpuRow.BoundTokS {
			t.Errorf("bound with experts on the CPU %q %v, want %q %v", cpuRow.Bound, cpuRow.BoundTokS, tc.label, want)
		}
		linkOnly := 1 / (float64(r.StreamedBytes)/50e9 + missing/50e9 + hbm/4000e9)
		if !(cpuRow.BoundTokS > linkOnly) {
			t.Errorf("bound with experts on the CPU %v, not above the link's alone %v", cpuRow.BoundTokS, linkOnly)
		}
		if md := markdown(nil, []Row{cpuRow}); !strings.Contains(md, "("+tc.label+")") {
			t.Errorf("table without the bound's rates %q:\n%s", tc.label, md)
		}
	}
	r.Experts = &engine.ExpertReport{Slots: 3, Experts: 9, Policy: "lru", Routing: "synthetic routing (skew 1.2, locality 0.5)"}
	if md := markdown(nil, []Row{{Result: r}}); !strings.Contains(md, "3 of 9 cached (lru)") || !strings.Contains(md, "synthetic routing (skew 1.2") {
		t.Errorf("table without the experts:\n%s", md)
	}
}

// TestBenchSyntheticRouting: -router-skew and -router-locality run a
// mixture of experts with synthetic routing in place of its router's, and
// the result says so; a skew out of range is refused.
func TestBenchSyntheticRouting(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyMixtralBF16)
	for _, tc := range []struct {
		args []string
		want string // in stdout, or in the error when bad
		bad  bool
	}{
		{[]string{"-router-skew", "1.2", "-router-locality", "0.5"}, "experts [synthetic routing (skew 1.2, locality 0.5)]", false},
		{[]string{"-router-skew", "0"}, "experts [synthetic routing (skew 0, locality 0)]", false},
		{[]string{"-router-skew", "0", "-experts-cpu", "always"}, "experts on the CPU", false},
		{[]string{"-router-skew", "1", "-router-locality", "1"}, "-router-skew: strata_synthetic_routing locality 1 must be in [0, 1)", true},
	} {
		var stdout bytes.Buffer
		args := append([]string{"-model", dir, "-device", "cpu", "-prefill", "8", "-warmup", "1", "-decode", "2", "-chunk", "8", "-runs", "330KB:balanced"}, tc.args...)
		err := run(context.Background(), args, &stdout)
		switch {
		case tc.bad && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v: %v, want an error with %q", tc.args, err, tc.want)
		case !tc.bad && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case !tc.bad && !strings.Contains(stdout.String(), tc.want):
			t.Errorf("%v: output without %q:\n%s", tc.args, tc.want, stdout.String())
		}
	}
}
