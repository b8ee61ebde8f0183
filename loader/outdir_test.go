package loader

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/tensor"
)

// tinyConfig is a small model for output tests: 2 blocks, about 100 KB of
// F16 weights.
func tinyConfig(t *testing.T) *arch.Config {
	t.Helper()
	cfg, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cfg.NumLayers = 2
	return cfg
}

var errNotApplicable = errors.New("not applicable")

// TestWriteOutputsLoseNothing: each writer, failing in each way (a full
// disk, a cancelled context, a filler's error), leaves the files that were
// there byte for byte and no temporary file; succeeding, it replaces them.
func TestWriteOutputsLoseNothing(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	boom := errors.New("boom")
	big := tensor.New(tensor.F32, tensor.Shape{1 << 14})
	sharded := func(ctx context.Context, dir string, fill FillFunc) error {
		w := NewShardedWriter(dir, 40_000)
		for _, n := range []string{"a", "b", "c"} {
			f := func(dst []byte, off int64) error { clear(dst); return nil }
			if n == "c" && fill != nil {
				f = fill
			}
			if err := w.Add(n, tensor.F32, tensor.Shape{1 << 14}, f); err != nil {
				return err
			}
		}
		_, err := w.Write(ctx)
		return err
	}
	type output struct {
		name  string
		setup func(t *testing.T, dir string) // the earlier output
		write func(ctx context.Context, dir string, fill FillFunc) error
	}
	outputs := []output{
		{"WriteSafetensors",
			func(t *testing.T, dir string) {
				if err := WriteSafetensors(filepath.Join(dir, "x.safetensors"), []NamedTensor{{"old", tensor.New(tensor.F32, tensor.Shape{3})}}, nil); err != nil {
					t.Fatal(err)
				}
			},
			func(ctx context.Context, dir string, fill FillFunc) error {
				if fill != nil || ctx.Err() != nil {
					return errNotApplicable
				}
				return WriteSafetensors(filepath.Join(dir, "x.safetensors"), []NamedTensor{{"new", big}}, nil)
			}},
		{"ShardedWriter",
			func(t *testing.T, dir string) {
				if err := sharded(context.Background(), dir, func(dst []byte, off int64) error {
					for i := range dst {
						dst[i] = 1
					}
					return nil
				}); err != nil {
					t.Fatal(err)
				}
			},
			sharded},
		{"Synthesize",
			func(t *testing.T, dir string) {
				if err := Synthesize(context.Background(), filepath.Join(dir, "model"), tinyConfig(t), SynthOptions{Seed: 1, MaxShardBytes: 30_000}); err != nil {
					t.Fatal(err)
				}
			},
			func(ctx context.Context, dir string, fill FillFunc) error {
				if fill != nil {
					return errNotApplicable
				}
				return Synthesize(ctx, filepath.Join(dir, "model"), tinyConfig(t), SynthOptions{Seed: 2})
			}},
	}
	failures := []struct {
		name  string
		setup func(t *testing.T) bool // false: the test ran elsewhere
		ctx   context.Context
		fill  FillFunc
	}{
		{"disk full", func(t *testing.T) bool { return filetest.LimitFileSize(t, 20_000) }, context.Background(), nil},
		{"cancelled", nil, cancelled, nil},
		{"fill fails", nil, context.Background(), func([]byte, int64) error { return boom }},
	}
	for _, out := range outputs {
		for _, f := range failures {
			t.Run(out.name+"/"+f.name, func(t *testing.T) {
				dir := t.TempDir()
				out.setup(t, dir)
				before := filetest.Tree(t, dir)
				if len(before) == 0 {
					t.Fatal("no earlier output")
				}
				if f.setup != nil && !f.setup(t) {
					return
				}
				err := out.write(f.ctx, dir, f.fill)
				if errors.Is(err, errNotApplicable) {
					t.Skip("this writer takes no", f.name)
				}
				if err == nil {
					t.Fatal("the write succeeded")
				}
				filetest.SameTree(t, dir, before)
				filetest.NoTemps(t, dir)
			})
		}
		t.Run(out.name+"/succeeds", func(t *testing.T) {
			dir := t.TempDir()
			out.setup(t, dir)
			before := filetest.Tree(t, dir)
			if err := out.write(context.Background(), dir, nil); err != nil {
				t.Fatal(err)
			}
			after := filetest.Tree(t, dir)
			changed := 0
			for name, b := range before {
				if after[name] != b {
					changed++
				}
			}
			if changed == 0 {
				t.Error("nothing was replaced")
			}
			filetest.NoTemps(t, dir)
		})
	}
}

// TestReplaceModelDir: a model directory holding anything but a model's
// files is refused before anything is written; an empty or missing one,
// or one holding a model, is accepted.
func TestReplaceModelDir(t *testing.T) {
	for _, tc := range []struct {
		name     string
		files    []string
		ok       bool
		hasModel bool
	}{
		{"missing", nil, true, false},
		{"empty", []string{}, true, false},
		{"model", []string{"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"}, true, true},
		{"notes", []string{"config.json", "model.safetensors", "notes.txt"}, false, false},
		{"reference", []string{"model.safetensors", "reference.safetensors"}, false, false},
		{"subdirectory", []string{"config.json", "runs/"}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := filepath.Join(parent, "m")
			if tc.files != nil {
				os.Mkdir(dir, 0o755)
			}
			for _, f := range tc.files {
				if f[len(f)-1] == '/' {
					os.Mkdir(filepath.Join(dir, f), 0o755)
				} else {
					os.WriteFile(filepath.Join(dir, f), []byte("old "+f), 0o644)
				}
			}
			before := filetest.Tree(t, dir)
			hasModel, err := CheckModelDir(dir)
			if (err == nil) != tc.ok || hasModel != tc.hasModel {
				t.Fatalf("CheckModelDir = %v, %v; want ok %v, model %v", hasModel, err, tc.ok, tc.hasModel)
			}
			if err != nil && !errors.Is(err, ErrNotModelDir) {
				t.Errorf("error %v does not wrap ErrNotModelDir", err)
			}
			err = Synthesize(context.Background(), dir, tinyConfig(t), SynthOptions{Seed: 1})
			if (err == nil) != tc.ok {
				t.Fatalf("Synthesize = %v, want ok %v", err, tc.ok)
			}
			if !tc.ok {
				filetest.SameTree(t, dir, before)
			} else {
				m, err := Open(dir)
				if err != nil {
					t.Fatal(err)
				}
				m.Close()
				if _, err := os.Stat(filepath.Join(dir, "model-00001-of-00002.safetensors")); err == nil {
					t.Error("a shard of the old model is still there")
				}
			}
			filetest.NoTemps(t, parent)
		})
	}
}

// TestWriteNoFixedTempName: a link planted at the name "X.tmp" that a
// writer with a fixed temporary name would write through is left alone.
func TestWriteNoFixedTempName(t *testing.T) {
	for _, tc := range []struct {
		name   string
		target string
		write  func(dir string) error
	}{
		{"WriteSafetensors", "x.safetensors", func(dir string) error {
			return WriteSafetensors(filepath.Join(dir, "x.safetensors"), []NamedTensor{{"a", tensor.New(tensor.F32, tensor.Shape{3})}}, nil)
		}},
		{"ShardedWriter index", IndexFile, func(dir string) error {
			w := NewShardedWriter(dir, 8)
			w.Add("a", tensor.F32, tensor.Shape{4}, func(dst []byte, _ int64) error { return nil })
			w.Add("b", tensor.F32, tensor.Shape{4}, func(dst []byte, _ int64) error { return nil })
			_, err := w.Write(context.Background())
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, elsewhere := t.TempDir(), t.TempDir()
			precious := filepath.Join(elsewhere, "precious")
			os.WriteFile(precious, []byte("keep"), 0o644)
			if err := os.Symlink(precious, filepath.Join(dir, tc.target+".tmp")); err != nil {
				t.Skip("no symlinks here:", err)
			}
			if err := tc.write(dir); err != nil {
				t.Fatal(err)
			}
			if b, _ := os.ReadFile(precious); string(b) != "keep" {
				t.Fatalf("the file a planted link points to was overwritten: %q", b)
			}
		})
	}
}
