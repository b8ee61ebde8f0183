package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader/fixtures"
)

// outputFlags are generate's output files.
var outputFlags = []string{"-logits-out", "-memory-snapshot"}

// TestOutputsLoseNothing: for each output, an earlier file stays byte for
// byte when the write fails (a full disk) and is replaced when it
// succeeds; no temporary file remains either way.
func TestOutputsLoseNothing(t *testing.T) {
	for _, flag := range outputFlags {
		for _, fail := range []bool{true, false} {
			t.Run(flag+map[bool]string{true: "/disk full", false: "/succeeds"}[fail], func(t *testing.T) {
				dir := t.TempDir()
				out := filepath.Join(dir, "out")
				os.WriteFile(out, []byte("earlier output"), 0o644)
				before := filetest.Tree(t, dir)
				if fail && !filetest.LimitFileSize(t, 1000) {
					return
				}
				_, _, err := runArgs(t, "-ids", "1,2,3", "-max-new-tokens", "2", "-quiet", "-device", "cpu", flag, out)
				if fail {
					if err == nil || !strings.Contains(err.Error(), flag) {
						t.Fatalf("err = %v, want a failure naming %s", err, flag)
					}
					filetest.SameTree(t, dir, before)
				} else {
					if err != nil {
						t.Fatal(err)
					}
					if b, _ := os.ReadFile(out); len(b) < 100 || bytes.HasPrefix(b, []byte("earlier")) {
						t.Errorf("%s was not replaced: %q", flag, b[:min(len(b), 40)])
					}
				}
				filetest.NoTemps(t, dir)
			})
		}
	}
}

// modelCopy copies the BF16 fixture into a fresh directory.
func modelCopy(t *testing.T) string {
	t.Helper()
	dir, err := fixtures.Extract(fixtures.TinyLlamaBF16, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestOutputIsInput: an output naming one of the run's inputs is refused
// before any work, and the input is unchanged.
func TestOutputIsInput(t *testing.T) {
	model := modelCopy(t)
	cfgFile := filepath.Join(t.TempDir(), "strata.yaml")
	os.WriteFile(cfgFile, []byte("memory:\n  offload_strategy: none\n"), 0o644)
	link := filepath.Join(t.TempDir(), "link")
	os.Symlink(filepath.Join(model, "model.safetensors"), link)
	for _, flag := range outputFlags {
		for _, in := range []string{
			filepath.Join(model, "model.safetensors"), filepath.Join(model, "config.json"),
			filepath.Join(model, "tokenizer.json"), cfgFile, link, model,
		} {
			t.Run(flag+"/"+filepath.Base(in), func(t *testing.T) {
				before, cfgBefore := filetest.Tree(t, model), filetest.Tree(t, cfgFile)
				_, _, err := runArgs(t, "-model", model, "-config", cfgFile, "-ids", "1,2", "-max-new-tokens", "1", "-quiet", flag, in)
				if err == nil || !cli.IsUsage(err) || strings.Contains(err.Error(), "\n") {
					t.Fatalf("err = %v, want a one-line usage error", err)
				}
				filetest.SameTree(t, model, before)
				filetest.SameTree(t, cfgFile, cfgBefore)
			})
		}
	}
	same := filepath.Join(t.TempDir(), "same")
	if _, _, err := runArgs(t, "-ids", "1,2", "-quiet", "-logits-out", same, "-memory-snapshot", same); !cli.IsUsage(err) {
		t.Errorf("two outputs to one file: %v", err)
	}
}

// TestModelFileNotRegular: a model file or -config file that is a named
// pipe is refused at once, in one line naming it.
func TestModelFileNotRegular(t *testing.T) {
	for _, name := range []string{"model.safetensors", "config.json", "tokenizer.json", "strata.yaml"} {
		t.Run(name, func(t *testing.T) {
			model := modelCopy(t)
			p := filepath.Join(model, name)
			os.Remove(p)
			filetest.Mkfifo(t, p)
			args := []string{"-model", model, "-prompt", "Hi", "-max-new-tokens", "1", "-quiet"}
			if name == "strata.yaml" {
				args = append(args, "-config", p)
			}
			done := make(chan error, 1)
			go func() {
				_, _, err := runArgs(t, args...)
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "not a regular file") || strings.Contains(err.Error(), "\n") {
					t.Fatalf("err = %v, want one line naming %s", err, p)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("generate hangs on a named pipe")
			}
		})
	}
}

// cancelWriter cancels a context when first written to.
type cancelWriter struct {
	cancel context.CancelFunc
	buf    bytes.Buffer
}

func (w *cancelWriter) Write(p []byte) (int, error) {
	w.cancel()
	return w.buf.Write(p)
}

// TestCancelled: a cancelled run, before it starts or in the middle of
// decoding, returns promptly with the context's error and leaves its
// outputs as they were, with no temporary file.
func TestCancelled(t *testing.T) {
	for _, mid := range []bool{false, true} {
		t.Run(map[bool]string{false: "before", true: "decoding"}[mid], func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "logits")
			os.WriteFile(out, []byte("earlier"), 0o644)
			ctx, cancel := context.WithCancel(context.Background())
			stdout := &cancelWriter{cancel: cancel}
			if !mid {
				cancel()
			}
			start := time.Now()
			// -logits-out is written after the prefill: cancelled in the
			// decode, the run still wrote it.
			args := []string{"-ids", "1,2,3", "-max-new-tokens", "200", "-quiet", "-device", "cpu"}
			if !mid {
				args = append(args, "-logits-out", out)
			}
			err := run(ctx, args, stdout, &bytes.Buffer{})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("err = %v, want context.Canceled", err)
			}
			if n := len(strings.Fields(stdout.buf.String())); mid && n > 4 {
				t.Errorf("%d words printed after the cancel at the first", n)
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("took %v to stop", d)
			}
			if b, _ := os.ReadFile(out); string(b) != "earlier" {
				t.Errorf("the earlier output changed")
			}
			filetest.NoTemps(t, dir)
		})
	}
}

// TestDefaultModelNoTempDir: the embedded model runs with nothing written
// under the temporary directory, during the run or after.
func TestDefaultModelNoTempDir(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	var during []os.DirEntry
	w := &probeWriter{probe: func() { during, _ = os.ReadDir(tmp) }}
	if err := run(context.Background(), []string{"-prompt", "Hello", "-max-new-tokens", "4", "-quiet"}, w, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	after, _ := os.ReadDir(tmp)
	if len(during) != 0 || len(after) != 0 || w.n == 0 {
		t.Errorf("the temporary directory held %v during the run and %v after (%d writes)", during, after, w.n)
	}
}

// probeWriter calls probe on its first write.
type probeWriter struct {
	probe func()
	n     int
}

func (w *probeWriter) Write(p []byte) (int, error) {
	if w.n == 0 {
		w.probe()
	}
	w.n++
	return len(p), nil
}
