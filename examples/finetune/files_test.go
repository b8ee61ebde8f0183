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
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

// outputCases are finetune's outputs: the flag, the arguments that make
// it (after -flag path), and whether its path is a directory.
var outputCases = []struct {
	flag  string
	args  func(data string) []string
	isDir bool
}{
	{"-grads-out", func(data string) []string { return []string{"-data", data, "-steps", "0", "-ids", "1,2,3"} }, false},
	{"-cpuprofile", func(data string) []string { return []string{"-data", data, "-steps", "1"} }, false},
	{"-save", func(data string) []string { return []string{"-data", data, "-steps", "1"} }, true},
}

// earlierOutput puts an earlier output at path: a file, or a checkpoint
// directory.
func earlierOutput(t *testing.T, path string, isDir bool) {
	t.Helper()
	if !isDir {
		os.WriteFile(path, []byte("earlier output"), 0o644)
		return
	}
	os.Mkdir(path, 0o755)
	for _, n := range []string{"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"} {
		os.WriteFile(filepath.Join(path, n), []byte("earlier "+n), 0o644)
	}
}

// TestOutputsLoseNothing: for each output, an earlier one stays byte for
// byte when the write fails (a full disk) and is replaced when it
// succeeds; no temporary file remains either way.
func TestOutputsLoseNothing(t *testing.T) {
	data := writeData(t)
	for _, oc := range outputCases {
		for _, fail := range []bool{true, false} {
			t.Run(oc.flag+map[bool]string{true: "/disk full", false: "/succeeds"}[fail], func(t *testing.T) {
				dir := t.TempDir()
				out := filepath.Join(dir, "out")
				earlierOutput(t, out, oc.isDir)
				before := filetest.Tree(t, dir)
				if fail && !filetest.LimitFileSize(t, 100) {
					return
				}
				_, _, err := runArgs(t, append(oc.args(data), "-quiet", "-device", "cpu", oc.flag, out)...)
				if fail {
					if err == nil {
						t.Fatal("the run succeeded")
					}
					filetest.SameTree(t, dir, before)
				} else {
					if err != nil {
						t.Fatal(err)
					}
					after := filetest.Tree(t, out)
					for name, b := range filetest.Tree(t, out) {
						if strings.HasPrefix(b, "earlier") {
							t.Errorf("%s: %s was not replaced", oc.flag, name)
						}
					}
					if oc.isDir {
						if _, ok := after["model-00002-of-00002.safetensors"]; ok {
							t.Error("a shard of the earlier checkpoint stayed")
						}
						m, err := loader.Open(out)
						if err != nil {
							t.Fatal(err)
						}
						m.Close()
					}
				}
				filetest.NoTemps(t, dir)
			})
		}
	}
}

// TestOutputIsInput: an output naming one of the run's inputs is refused
// before any work (no step is run), and the input is unchanged.
func TestOutputIsInput(t *testing.T) {
	model, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data := writeData(t)
	inputs := []string{
		data, filepath.Join(model, "config.json"), filepath.Join(model, "tokenizer.json"),
		filepath.Join(model, "model.safetensors.index.json"), filepath.Join(model, "model-00001-of-00022.safetensors"), model,
	}
	for _, oc := range outputCases {
		for _, in := range inputs {
			t.Run(oc.flag+"/"+filepath.Base(in), func(t *testing.T) {
				before, dataBefore := filetest.Tree(t, model), filetest.Tree(t, data)
				stdout, _, err := runArgs(t, append(oc.args(data), "-model", model, "-quiet", "-device", "cpu", oc.flag, in)...)
				if !cli.IsUsage(err) || strings.Contains(err.Error(), "\n") || stdout != "" {
					t.Fatalf("err = %v, stdout %q; want a one-line usage error before any step", err, stdout)
				}
				filetest.SameTree(t, model, before)
				filetest.SameTree(t, data, dataBefore)
			})
		}
	}
}

// TestSaveCheckedFirst: a -save directory that cannot take the checkpoint
// is refused before training starts, not after the last step, and nothing
// is written.
func TestSaveCheckedFirst(t *testing.T) {
	data := writeData(t)
	tmp := t.TempDir()
	file := filepath.Join(tmp, "file")
	os.WriteFile(file, []byte("x"), 0o644)
	notes := filepath.Join(tmp, "notes")
	os.Mkdir(notes, 0o755)
	os.WriteFile(filepath.Join(notes, "todo.txt"), []byte("x"), 0o644)
	model, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"a file", []string{"-save", file}},
		{"no parent", []string{"-save", filepath.Join(tmp, "missing", "ckpt")}},
		{"other files", []string{"-save", notes}},
		{"the model", []string{"-model", model, "-save", model}},
		{"inside the model", []string{"-model", model, "-save", filepath.Join(model, "ckpt")}},
		{"-grads-out inside", []string{"-save", tmp, "-grads-out", filepath.Join(tmp, "g.safetensors")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, modelBefore := filetest.Tree(t, tmp), filetest.Tree(t, model)
			stdout, _, err := runArgs(t, append([]string{"-data", data, "-steps", "2", "-quiet", "-device", "cpu"}, tc.args...)...)
			if !cli.IsUsage(err) || strings.Contains(err.Error(), "\n") || stdout != "" {
				t.Fatalf("err = %v, stdout %q; want a one-line usage error before any step", err, stdout)
			}
			filetest.SameTree(t, tmp, before)
			filetest.SameTree(t, model, modelBefore)
			filetest.NoTemps(t, tmp)
		})
	}
}

// TestInputNotRegular: a -data file or model file that is a named pipe is
// refused at once, in one line naming it.
func TestInputNotRegular(t *testing.T) {
	for _, name := range []string{"data", "model-00003-of-00022.safetensors", "tokenizer.json"} {
		t.Run(name, func(t *testing.T) {
			model, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			data := writeData(t)
			p := filepath.Join(model, name)
			if name == "data" {
				p = data
			}
			os.Remove(p)
			filetest.Mkfifo(t, p)
			done := make(chan error, 1)
			go func() {
				_, _, err := runArgs(t, "-model", model, "-data", data, "-steps", "1", "-quiet", "-device", "cpu")
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "not a regular file") || strings.Contains(err.Error(), "\n") {
					t.Fatalf("err = %v, want one line naming %s", err, p)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("finetune hangs on a named pipe")
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

// TestCancelled: a cancelled run, before it starts or after its first
// step, returns promptly with the context's error, leaves the earlier
// checkpoint as it was, and leaves no temporary file.
func TestCancelled(t *testing.T) {
	data := writeData(t)
	for _, mid := range []bool{false, true} {
		t.Run(map[bool]string{false: "before", true: "training"}[mid], func(t *testing.T) {
			dir := t.TempDir()
			save, prof := filepath.Join(dir, "ckpt"), filepath.Join(dir, "cpu.prof")
			earlierOutput(t, save, true)
			before := filetest.Tree(t, save)
			ctx, cancel := context.WithCancel(context.Background())
			stdout := &cancelWriter{cancel: cancel}
			if !mid {
				cancel()
			}
			start := time.Now()
			err := run(ctx, []string{"-data", data, "-steps", "1000", "-quiet", "-device", "cpu", "-save", save, "-cpuprofile", prof}, stdout, &bytes.Buffer{})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("err = %v, want context.Canceled", err)
			}
			if n := strings.Count(stdout.buf.String(), "step "); mid && n != 1 {
				t.Errorf("%d steps after the cancel at the first", n)
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("took %v to stop", d)
			}
			filetest.SameTree(t, save, before)
			filetest.NoTemps(t, dir)
		})
	}
}

// TestDefaultModelNoTempDir: the embedded model trains with nothing
// written under the temporary directory.
func TestDefaultModelNoTempDir(t *testing.T) {
	data := writeData(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	var during []os.DirEntry
	ctx := context.Background()
	w := &probeWriter{probe: func() { during, _ = os.ReadDir(tmp) }}
	if err := run(ctx, []string{"-data", data, "-steps", "2", "-quiet", "-device", "cpu"}, w, &bytes.Buffer{}); err != nil {
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
