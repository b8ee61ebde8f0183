package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

// small is a model of a few hundred KB, in shards.
var small = []string{"-preset", "tiny", "-layers", "2", "-shard-size", "50KB"}

// TestOutputLosesNothing: synth into a directory that holds a model is
// refused without -force and leaves it byte for byte; with -force, a write
// that fails (a full disk, a cancelled run) leaves the old model complete,
// and one that succeeds replaces it as a whole; a directory holding
// anything else, or an input, is refused even with -force. No temporary
// file or directory remains.
func TestOutputLosesNothing(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name  string
		args  []string
		ctx   context.Context
		limit uint64 // a full disk after this many bytes per file; 0: none
		prep  func(t *testing.T, out string) []string
		usage bool // refused as a usage error
		ok    bool
	}{
		{name: "no -force", usage: true},
		{name: "-force", args: []string{"-force"}, ok: true},
		{name: "-force, disk full", args: []string{"-force"}, limit: 20_000},
		{name: "-force, cancelled", args: []string{"-force"}, ctx: cancelled},
		{name: "-force, other files", args: []string{"-force"}, usage: true, prep: func(t *testing.T, out string) []string {
			os.WriteFile(filepath.Join(out, "notes.txt"), []byte("mine"), 0o644)
			return nil
		}},
		{name: "-force, -out is -tokenizer-from", args: []string{"-force"}, usage: true, prep: func(t *testing.T, out string) []string {
			return []string{"-tokenizer-from", out}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent := t.TempDir()
			out := filepath.Join(parent, "model")
			if _, _, err := runArgs(append(small, "-out", out, "-seed", "1", "-tokenizer-from", fixtures.Dir(fixtures.TinyLlamaBF16))...); err != nil {
				t.Fatal(err)
			}
			args := append(append([]string{}, small...), "-out", out, "-seed", "2", "-shard-size", "0")
			args = append(args, tc.args...)
			if tc.prep != nil {
				args = append(args, tc.prep(t, out)...)
			}
			before := filetest.Tree(t, out)
			if tc.limit > 0 && !filetest.LimitFileSize(t, tc.limit) {
				return
			}
			ctx := tc.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			_, _, err := runContext(ctx, args...)
			switch {
			case tc.ok && err != nil:
				t.Fatal(err)
			case !tc.ok && err == nil:
				t.Fatal("synth succeeded")
			case err != nil && (cli.IsUsage(err) != tc.usage || strings.Contains(err.Error(), "\n")):
				t.Fatalf("err = %v, want a one-line error, usage %v", err, tc.usage)
			}
			if tc.ok {
				after := filetest.Tree(t, out)
				if _, ok := after[loader.SingleFile]; !ok || len(after) >= len(before) {
					t.Errorf("the new model has %v: the old shards stayed", len(after))
				}
				m, err := loader.Open(out)
				if err != nil {
					t.Fatal(err)
				}
				m.Close()
			} else {
				filetest.SameTree(t, out, before)
			}
			if tc.ctx != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("cancelled: %v", err)
			}
			filetest.NoTemps(t, parent)
		})
	}
}

// TestOutPaths: -out that is a file, or in a directory that does not
// exist, is refused before any work.
func TestOutPaths(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	os.WriteFile(file, []byte("keep"), 0o644)
	for _, out := range []string{file, filepath.Join(dir, "missing", "model")} {
		before := filetest.Tree(t, dir)
		_, _, err := runArgs(append(small, "-out", out, "-force")...)
		if !cli.IsUsage(err) || strings.Contains(err.Error(), "\n") {
			t.Errorf("-out %s: %v, want a one-line usage error", out, err)
		}
		filetest.SameTree(t, dir, before)
		filetest.NoTemps(t, dir)
	}
}
