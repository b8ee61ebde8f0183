package main

import (
	"encoding/json"
	"github.com/strata-llm/strata/internal/fixturetest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/examples/internal/cli"
)

func idList(n int) string {
	return strings.TrimSuffix(strings.Repeat("5,", n), ",")
}

// TestContextLimits runs prompts and -max-new-tokens against the model's
// context (max_position_embeddings 256, or a sliding window of 8), with
// and without a budget: a prompt too long is a usage error naming the
// numbers, -max-new-tokens beyond the context is clamped with one line on
// stderr, and the report says the context filled up.
func TestContextLimits(t *testing.T) {
	mistral := fixturetest.Mistral(t, 8)
	long := strings.Repeat("hello world ", 250)            // 3000 bytes, over 2000 tokens
	huge := strings.Repeat("hello world ", 10000)[:120000] // refused before it is encoded
	cases := []struct {
		name    string
		args    []string
		usage   []string // a usage error mentioning each
		clamped []string // success, the stderr note mentioning each
		newIDs  int      // ids generated, on success
		stop    string
	}{
		{name: "window clamps", args: []string{"-model", mistral, "-ids", "1,2,3", "-max-new-tokens", "20"},
			clamped: []string{"-max-new-tokens 20 clamped to 5", "3 tokens", "window of 8 positions (sliding_window)"}, newIDs: 5, stop: "context_full"},
		{name: "window refuses the prompt", args: []string{"-model", mistral, "-ids", idList(9)},
			usage: []string{"9 tokens", "window of 8 positions"}},
		{name: "prompt fills the window", args: []string{"-model", mistral, "-ids", idList(8), "-max-new-tokens", "1"},
			clamped: []string{"clamped to 0"}, newIDs: 0, stop: "context_full"},
		{name: "prompt only", args: []string{"-model", mistral, "-ids", idList(8), "-max-new-tokens", "0"},
			newIDs: 0, stop: "prompt_only"},
		{name: "within the window", args: []string{"-model", mistral, "-ids", "1,2,3", "-max-new-tokens", "5"},
			newIDs: 5, stop: "max_new_tokens"},
		{name: "300 new tokens", args: []string{"-ids", idList(6), "-max-new-tokens", "300"},
			clamped: []string{"-max-new-tokens 300 clamped to 250", "6 tokens", "context of 256 positions (max_position_embeddings)"}, newIDs: 250, stop: "context_full"},
		{name: "a billion new tokens", args: []string{"-ids", idList(6), "-max-new-tokens", "1000000000"},
			clamped: []string{"clamped to 250"}, newIDs: 250, stop: "context_full"},
		{name: "a billion under a budget", args: []string{"-ids", idList(6), "-max-new-tokens", "1000000000", "-gpu-memory-limit", "1GiB"},
			clamped: []string{"clamped to 250"}, newIDs: 250, stop: "context_full"},
		{name: "ids past the context", args: []string{"-ids", idList(257)},
			usage: []string{"-ids", "257 tokens", "context of 256 positions"}},
		{name: "ids past the context under a budget", args: []string{"-ids", idList(257), "-gpu-memory-limit", "1GiB"},
			usage: []string{"257 tokens"}},
		{name: "prompt past the context", args: []string{"-prompt", long},
			usage: []string{"tokens is longer than the model's context of 256 positions"}},
		{name: "huge prompt", args: []string{"-prompt", huge, "-gpu-memory-limit", "1GiB"},
			usage: []string{"-prompt of 120000 bytes", "context of 256 positions", "24 bytes"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			start := time.Now()
			stdout, stderr, err := runArgs(t, append(c.args, "-json")...)
			took := time.Since(start)
			runtime.ReadMemStats(&after)
			if took > 20*time.Second {
				t.Errorf("took %v", took)
			}
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 256<<20 {
				t.Errorf("allocated %d MiB", alloc>>20)
			}
			if c.usage != nil {
				if err == nil || !cli.IsUsage(err) {
					t.Fatalf("error %v, want a usage error", err)
				}
				for _, w := range c.usage {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not mention %q", err, w)
					}
				}
				if strings.Contains(err.Error(), "\n") {
					t.Errorf("error is more than one line: %q", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.clamped == nil && stderr != "" {
				t.Errorf("stderr %q, want nothing", stderr)
			}
			if c.clamped != nil && strings.Count(stderr, "\n") != 1 {
				t.Errorf("stderr %q, want one line", stderr)
			}
			for _, w := range c.clamped {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr %q does not mention %q", stderr, w)
				}
			}
			var r report
			if err := json.Unmarshal([]byte(stdout), &r); err != nil {
				t.Fatal(err)
			}
			if len(r.IDs) != c.newIDs || r.StopReason != c.stop {
				t.Errorf("%d new ids, stop %q; want %d, %q", len(r.IDs), r.StopReason, c.newIDs, c.stop)
			}
		})
	}
}
