package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader/fixtures"
)

// shortContextFixture writes a copy of the F16 fixture whose config allows
// 16 positions (max_position_embeddings) instead of 256.
func shortContextFixture(t *testing.T) string {
	t.Helper()
	dir, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "config.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg := map[string]any{}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["max_position_embeddings"] = 16
	if raw, err = json.Marshal(cfg); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestFinetuneContext trains and takes gradients on a model of 16
// positions: -seq-len past them is clamped with one line on stderr (and
// training runs), -ids past them are a usage error naming the numbers.
func TestFinetuneContext(t *testing.T) {
	short, data := shortContextFixture(t), writeData(t)
	ids := func(n int) string { return strings.TrimSuffix(strings.Repeat("7,", n), ",") }
	grads := filepath.Join(t.TempDir(), "grads.safetensors")
	cases := []struct {
		name    string
		args    []string
		usage   []string // a usage error mentioning each
		clamped string   // success, with this on stderr
	}{
		{name: "seq-len clamped", args: []string{"-model", short, "-data", data, "-steps", "2", "-seq-len", "64"},
			clamped: "-seq-len 64 clamped to 16: longer than the model's context of 16 positions (max_position_embeddings)"},
		{name: "seq-len within", args: []string{"-model", short, "-data", data, "-steps", "1", "-seq-len", "16"}},
		{name: "seq-len clamped under a budget", args: []string{"-model", short, "-data", data, "-steps", "1", "-seq-len", "1000000000", "-gpu-memory-limit", "1GiB"},
			clamped: "clamped to 16"},
		{name: "grads of data clamped", args: []string{"-model", short, "-data", data, "-steps", "0", "-grads-out", grads},
			clamped: "-seq-len 64 clamped to 16"},
		{name: "ids within", args: []string{"-model", short, "-grads-out", grads, "-ids", ids(17)}},
		{name: "ids past the context", args: []string{"-model", short, "-grads-out", grads, "-ids", ids(18)},
			usage: []string{"18 token ids", "17 positions", "context of 16 positions"}},
		{name: "ids past the default model's", args: []string{"-grads-out", grads, "-ids", ids(300)},
			usage: []string{"299 positions", "context of 256 positions"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, stderr, err := runArgs(t, append(c.args, "-quiet")...)
			if c.usage != nil {
				if !cli.IsUsage(err) {
					t.Fatalf("error %v, want a usage error", err)
				}
				for _, w := range c.usage {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not mention %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Contains(stderr, "clamped"); got != (c.clamped != "") || !strings.Contains(stderr, c.clamped) {
				t.Errorf("stderr %q, want a note %q", stderr, c.clamped)
			}
		})
	}
}
