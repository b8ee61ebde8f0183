package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

func runArgs(args ...string) (string, string, error) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), args, &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

// writeDocs writes a .jsonl file of n short documents.
func writeDocs(t *testing.T, name string, n int) string {
	t.Helper()
	var b strings.Builder
	for i := range n {
		if i%2 == 0 {
			b.WriteString(`{"text": "The quick brown fox jumps over the lazy dog."}` + "\n")
		} else {
			b.WriteString(`{"text": "A penny saved is a penny earned."}` + "\n")
		}
	}
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestTrainRun: a short run on the fixture writes a JSON-lines loss log
// with a line per step and the held-out evaluation at the end, lowers the
// loss of its repeated text, and saves a model that loads, in shards of at
// most -shard-bytes.
func TestTrainRun(t *testing.T) {
	data, held := writeDocs(t, "train.jsonl", 40), writeDocs(t, "heldout.jsonl", 4)
	out := t.TempDir()
	save, log := filepath.Join(out, "model"), filepath.Join(out, "loss.jsonl")
	stdout, _, err := runArgs("-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-data", data, "-eval", held,
		"-steps", "12", "-batch", "2", "-seq-len", "16", "-lr", "1e-2", "-min-lr", "1e-3", "-warmup", "2",
		"-checkpoint-segments", "2", "-save", save, "-shard-bytes", "200000", "-log", log, "-sample-tokens", "4")
	if err != nil {
		t.Fatalf("run: %v\n%s", err, stdout)
	}
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	var steps []logLine
	var evals int
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var l logLine
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			t.Fatalf("log line %d %q: %v", i+1, line, err)
		}
		switch {
		case l.Loss != nil:
			steps = append(steps, l)
		case l.HeldoutLoss != nil && l.HeldoutPPL != nil && l.HeldoutTokens > 0:
			evals++
		default:
			t.Errorf("log line %d %q is neither a step nor an evaluation", i+1, line)
		}
	}
	if len(steps) != 12 || evals != 1 {
		t.Fatalf("log has %d steps and %d evaluations; want 12 and 1", len(steps), evals)
	}
	if first, last := *steps[0].Loss, *steps[11].Loss; !(last < first-0.5) {
		t.Errorf("loss %.4f -> %.4f: want it to fall on repeated text", first, last)
	}
	if !strings.Contains(stdout, "held-out loss") || !strings.Contains(stdout, "perplexity") {
		t.Errorf("stdout lacks the held-out perplexity:\n%s", stdout)
	}
	m, err := loader.Open(save)
	if err != nil {
		t.Fatalf("the saved model does not load: %v", err)
	}
	m.Close()
	shards, _ := filepath.Glob(filepath.Join(save, "*.safetensors"))
	if len(shards) < 2 {
		t.Errorf("%d safetensors files; want the model sharded at 200000 bytes", len(shards))
	}
	for _, s := range shards {
		if st, err := os.Stat(s); err != nil || st.Size() > 200000+64<<10 {
			t.Errorf("%s: %v bytes; want about -shard-bytes at most", s, st.Size())
		}
	}
}

// TestTrainDuration: -duration ends the run before -steps, and the
// learning rate's cosine follows the time.
func TestTrainDuration(t *testing.T) {
	data := writeDocs(t, "train.jsonl", 40)
	stdout, _, err := runArgs("-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-data", data, "-steps", "1000000",
		"-batch", "1", "-seq-len", "8", "-duration", "300ms", "-prompt", "")
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	if !strings.Contains(stdout, "train: ") || strings.Contains(stdout, "train: 1000000 steps") {
		t.Errorf("the run did not stop at -duration:\n%s", stdout[max(0, len(stdout)-300):])
	}
	o := &options{steps: 100, warmup: 10, lr: 1, minLR: 0, duration: 10 * time.Second}
	for _, tc := range []struct {
		step    int
		elapsed time.Duration
		want    float64
	}{
		{5, 0, 0.5}, {10, 0, 1}, {55, 0, 0.5}, {11, 5 * time.Second, 0.5}, {11, 20 * time.Second, 0}, {100, 0, 0},
	} {
		if got := o.schedule(tc.step, tc.elapsed); got < tc.want-0.02 || got > tc.want+0.02 {
			t.Errorf("schedule(%d, %v) = %.3f; want %.3f", tc.step, tc.elapsed, got, tc.want)
		}
	}
}

// TestTrainUsage: bad flags are usage errors before any work.
func TestTrainUsage(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyLlamaBF16)
	data := writeDocs(t, "train.jsonl", 2)
	for _, args := range [][]string{
		{"-data", data},
		{"-model", dir, "-data", data, "-duration", "-1s"},
		{"-model", dir, "-data", data, "-shard-bytes", "0"},
		{"-model", dir, "-data", data, "-steps", "0"},
		{"-model", dir, "-data", data, "-save-every", "5"},
		{"-model", dir, "-data", data, "-log", data},
	} {
		_, _, err := runArgs(args...)
		var ue cli.UsageError
		if !errors.As(err, &ue) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: %v; want a one-line usage error", args, err)
		}
	}
}
