package nn

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

// tinySaveModel synthesises a small model with a tokenizer into a fresh
// directory and loads its parameters.
func tinySaveModel(t *testing.T) (*Params, *loader.Model) {
	t.Helper()
	cfg, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cfg.NumLayers = 2
	dir := filepath.Join(t.TempDir(), "src")
	lm, err := loader.SynthesizeOpen(context.Background(), dir, cfg,
		loader.SynthOptions{Seed: 5, TokenizerFrom: fixtures.Dir(fixtures.TinyLlamaBF16)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	p, err := LoadParams(context.Background(), lm)
	if err != nil {
		t.Fatal(err)
	}
	return p, lm
}

// TestSaveLosesNothing: a save over an earlier checkpoint that fails (a
// full disk, a cancelled context) leaves it byte for byte and no temporary
// directory; one that succeeds replaces it as a whole.
func TestSaveLosesNothing(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name  string
		limit uint64 // a full disk after this many bytes per file; 0: none
		ctx   context.Context
		ok    bool
	}{
		{"disk full", 20_000, context.Background(), false},
		{"cancelled", 0, cancelled, false},
		{"succeeds", 0, context.Background(), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, lm := tinySaveModel(t)
			parent := t.TempDir()
			dir := filepath.Join(parent, "ckpt")
			// The earlier checkpoint: sharded, with a different number of
			// shards than the new one.
			if err := p.Save(context.Background(), dir, lm, 30_000); err != nil {
				t.Fatal(err)
			}
			before := filetest.Tree(t, dir)
			for _, prm := range p.byName {
				for i := range prm.work.Bytes() {
					prm.work.Bytes()[i] ^= 1 // the new weights differ
				}
			}
			if tc.limit > 0 && !filetest.LimitFileSize(t, tc.limit) {
				return
			}
			err := p.Save(tc.ctx, dir, lm, 0)
			if (err == nil) != tc.ok {
				t.Fatalf("Save: %v, want ok %v", err, tc.ok)
			}
			if !tc.ok {
				filetest.SameTree(t, dir, before)
			} else {
				after := filetest.Tree(t, dir)
				if len(after) >= len(before) || after[loader.SingleFile] == "" {
					t.Errorf("the new checkpoint has %d files (was %d): the old shards stayed", len(after), len(before))
				}
				if after[loader.ConfigFile] != before[loader.ConfigFile] || after[loader.TokenizerFile] == "" {
					t.Error("config or tokenizer not copied")
				}
			}
			filetest.NoTemps(t, parent)
		})
	}
}

// TestCheckSaveDir: where a checkpoint may be saved, decided before any
// training.
func TestCheckSaveDir(t *testing.T) {
	_, lm := tinySaveModel(t)
	tmp := t.TempDir()
	file := filepath.Join(tmp, "file")
	os.WriteFile(file, []byte("x"), 0o644)
	link := filepath.Join(tmp, "link")
	os.Symlink(lm.Dir, link)
	ckpt := filepath.Join(tmp, "ckpt")
	os.Mkdir(ckpt, 0o755)
	os.WriteFile(filepath.Join(ckpt, loader.ConfigFile), []byte("{}"), 0o644)
	notes := filepath.Join(tmp, "notes")
	os.Mkdir(notes, 0o755)
	os.WriteFile(filepath.Join(notes, "todo.txt"), []byte("x"), 0o644)
	for _, tc := range []struct {
		name, dir string
		ok        bool
	}{
		{"new", filepath.Join(tmp, "new"), true},
		{"empty", t.TempDir(), true},
		{"earlier checkpoint", ckpt, true},
		{"the model's directory", lm.Dir, false},
		{"the model's directory through a link", link, false},
		{"the model's directory, unclean", lm.Dir + "/./", false},
		{"inside the model's directory", filepath.Join(lm.Dir, "out"), false},
		{"inside, through a link", filepath.Join(link, "a", "b"), false},
		{"a file", file, false},
		{"no parent", filepath.Join(tmp, "missing", "out"), false},
		{"other files", notes, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := filetest.Tree(t, tmp)
			err := CheckSaveDir(tc.dir, lm)
			if (err == nil) != tc.ok {
				t.Fatalf("CheckSaveDir(%s) = %v, want ok %v", tc.dir, err, tc.ok)
			}
			filetest.SameTree(t, tmp, before)
			filetest.NoTemps(t, tmp)
		})
	}
}
