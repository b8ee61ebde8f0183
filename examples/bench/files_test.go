package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader/fixtures"
)

const earlierLine = `{"kind":"strata","model":"earlier","run":"none:none:explicit","decode_tok_s":1}` + "\n"

// TestResultFilesLoseNothing: -out keeps its earlier lines when a run
// appends to it and stays byte for byte when the write fails (a full disk)
// or the run is cancelled; -md and -json are replaced whole or not at all;
// an output that is an input is refused. No temporary file remains.
func TestResultFilesLoseNothing(t *testing.T) {
	// A copy: a regression must not write into the source tree.
	model, err := fixtures.Extract(fixtures.TinyLlamaBF16, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	measureArgs := []string{"-model", model, "-device", "cpu", "-prefill", "4", "-decode", "2", "-warmup", "1"}
	for _, tc := range []struct {
		name  string
		args  func(dir, out string) []string
		ctx   context.Context
		limit uint64
		ok    bool
		usage bool
	}{
		{name: "-out appends", args: func(_, out string) []string { return append(measureArgs, "-out", out) }, ok: true},
		{name: "-out disk full", args: func(_, out string) []string { return append(measureArgs, "-out", out) }, limit: 200},
		{name: "-out cancelled", args: func(_, out string) []string { return append(measureArgs, "-out", out) }, ctx: cancelled},
		{name: "-out is a shard", args: func(_, _ string) []string {
			return append(measureArgs, "-out", filepath.Join(model, "model.safetensors"))
		}, usage: true},
		{name: "-md and -json", args: func(dir, out string) []string {
			return []string{"-report", out, "-md", filepath.Join(dir, "t.md"), "-json", filepath.Join(dir, "t.json")}
		}, ok: true},
		{name: "-md disk full", args: func(dir, out string) []string {
			return []string{"-report", out, "-md", filepath.Join(dir, "t.md")}
		}, limit: 100},
		{name: "-md is the report", args: func(dir, out string) []string { return []string{"-report", out, "-md", out} }, usage: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "results.jsonl")
			os.WriteFile(out, []byte(earlierLine), 0o644)
			os.WriteFile(filepath.Join(dir, "t.md"), []byte("earlier table"), 0o644)
			before, modelBefore := filetest.Tree(t, dir), filetest.Tree(t, model)
			args := tc.args(dir, out)
			if tc.limit > 0 && !filetest.LimitFileSize(t, tc.limit) {
				return
			}
			ctx := tc.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			err := run(ctx, args, io.Discard)
			switch {
			case tc.ok && err != nil:
				t.Fatal(err)
			case !tc.ok && err == nil:
				t.Fatal("bench succeeded")
			case err != nil && (cli.IsUsage(err) != tc.usage || strings.Contains(err.Error(), "\n")):
				t.Fatalf("err = %v, want a one-line error, usage %v", err, tc.usage)
			case tc.ctx != nil && !errors.Is(err, context.Canceled):
				t.Errorf("cancelled: %v", err)
			}
			after := filetest.Tree(t, dir)
			if !tc.ok {
				filetest.SameTree(t, dir, before)
			} else if strings.HasPrefix(tc.name, "-out") {
				if got := after["results.jsonl"]; !strings.HasPrefix(got, earlierLine) || strings.Count(got, "\n") != 2 {
					t.Errorf("-out holds %q, want the earlier line and one more", got)
				}
			} else if after["t.md"] == "earlier table" || after["t.json"] == "" {
				t.Error("-md or -json not written")
			}
			filetest.SameTree(t, model, modelBefore)
			filetest.NoTemps(t, dir)
		})
	}
}
