package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// expertLimit is a -gpu-memory-limit that holds lm's layers and slots of
// its experts, for a run of contextLen positions.
func expertLimit(t *testing.T, lm *loader.Model, contextLen, slots int) string {
	t.Helper()
	info, err := nn.ModelInfo(lm, lm.Config)
	if err != nil {
		t.Fatal(err)
	}
	p, err := paging.Plan(info, 1<<40, paging.StrategyBalanced, contextLen, 1, paging.WithChunkTokens(contextLen), paging.WithExpertCache(lm.Config.MoE.ExpertsPerToken))
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%dB", p.PredictedPeakBytes-p.ExpertCacheBytes+int64(slots)*p.ExpertSlotBytes)
}

// TestExpertsReport: a mixture of experts under a budget reports its
// expert cache in -json (over the decode steps) and -memory-summary, with
// the policy asked for; a synthetic model says "synthetic routing"; an
// unknown policy is a usage error.
func TestExpertsReport(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyMixtralBF16)
	lm, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	const ids, steps = "1,42,71,345,81", 10
	limit := expertLimit(t, lm, 5+steps, 4)
	stdout, _, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-max-new-tokens", fmt.Sprint(steps), "-json", "-gpu-memory-limit", limit, "-expert-policy", "lfu")
	if err != nil {
		t.Fatal(err)
	}
	var r report
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatal(err)
	}
	x := r.Experts
	if x == nil {
		t.Fatalf("no experts in the report:\n%s", stdout)
	}
	if x.Slots != 4 || x.Experts != 24 || x.Policy != paging.ExpertLFU || x.Routing != "router" || x.Tokens != steps-1 {
		t.Errorf("experts %+v", x)
	}
	if x.Acquires != int64(x.Tokens*3*2) || x.HitRate != float64(x.Hits)/float64(x.Acquires) ||
		x.BytesPerToken != float64((x.Misses+x.Prefetches)*x.ExpertBytes)/float64(x.Tokens) {
		t.Errorf("a decode step acquires 2 experts in each of 3 blocks and moves the misses and prefetches: %+v", x)
	}
	_, stderr, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-max-new-tokens", "3", "-quiet", "-memory-summary", "-gpu-memory-limit", limit)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stderr, "experts [router]: cache of ") || !strings.Contains(stderr, "of 24 (") || !strings.Contains(stderr, "lru") {
		t.Errorf("summary without the experts' line:\n%s", stderr)
	}
	if _, _, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-expert-policy", "fifo"); err == nil || !strings.Contains(err.Error(), "-expert-policy") {
		t.Errorf("-expert-policy fifo: %v", err)
	}

	// -experts-cpu always computes the missing experts on the CPU: -json
	// counts them, per decode step too, and the text is the same.
	want, _, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-max-new-tokens", fmt.Sprint(steps), "-quiet", "-gpu-memory-limit", limit)
	if err != nil {
		t.Fatal(err)
	}
	got, _, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-max-new-tokens", fmt.Sprint(steps), "-quiet", "-gpu-memory-limit", limit, "-experts-cpu", "always")
	if err != nil || got != want {
		t.Errorf("-experts-cpu always: %q, %v; want %q", got, err, want)
	}
	stdout, _, err = runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-max-new-tokens", fmt.Sprint(steps), "-json", "-gpu-memory-limit", limit, "-experts-cpu", "always")
	if err != nil {
		t.Fatal(err)
	}
	r = report{}
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatal(err)
	}
	if x := r.Experts; x == nil || x.OnCPU == 0 || x.OnCPUPerToken != float64(x.OnCPU)/float64(x.Tokens) || x.CPUBytes != x.OnCPU*x.ExpertBytes {
		t.Errorf("-experts-cpu always: experts %+v", x)
	}
	if _, _, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-experts-cpu", "sometimes"); err == nil || !strings.Contains(err.Error(), "-experts-cpu") {
		t.Errorf("-experts-cpu sometimes: %v", err)
	}

	// A synthetic model's report says its routing is synthetic.
	cfg := lm.Config.Clone()
	cfg.MoE.Synthetic = &arch.SyntheticRouting{Skew: 1.2, Locality: 0.5, Seed: 4}
	syn := t.TempDir()
	if err := loader.Synthesize(context.Background(), syn, cfg, loader.SynthOptions{DType: tensor.BF16, Seed: 2}); err != nil {
		t.Fatal(err)
	}
	stdout, _, err = runArgs(t, "-model", syn, "-device", "cpu", "-ids", ids, "-max-new-tokens", "4", "-json", "-gpu-memory-limit", limit)
	if err != nil {
		t.Fatal(err)
	}
	r = report{}
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatal(err)
	}
	if r.Experts == nil || r.Experts.Routing != "synthetic routing (skew 1.2, locality 0.5)" {
		t.Errorf("synthetic model: experts %+v", r.Experts)
	}
}
