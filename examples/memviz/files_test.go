package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/internal/filetest"
)

// TestOutputLosesNothing: an earlier drawing stays byte for byte when
// writing the new one fails (a full disk) or the run is cancelled, and is
// replaced when it succeeds; an output that is the input is refused with
// the input unchanged. No temporary file remains.
func TestOutputLosesNothing(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name  string
		ctx   context.Context
		limit uint64
		out   func(in, out string) string
		ok    bool
	}{
		{name: "succeeds", ok: true},
		{name: "disk full", limit: 1000},
		{name: "cancelled", ctx: cancelled},
		{name: "output is the input", out: func(in, _ string) string { return in }},
		{name: "output is the input through a link", out: func(in, out string) string {
			link := filepath.Join(filepath.Dir(out), "link.svg")
			os.Symlink(in, link)
			return link
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			in := writeSnapshot(t, dir, testSnapshot())
			out := filepath.Join(dir, "mem.svg")
			os.WriteFile(out, []byte("earlier drawing"), 0o644)
			if tc.out != nil {
				out = tc.out(in, out)
			}
			before := filetest.Tree(t, dir)
			if tc.limit > 0 && !filetest.LimitFileSize(t, tc.limit) {
				return
			}
			ctx := tc.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			err := runContext(ctx, []string{in, "-o", out}, io.Discard)
			if (err == nil) != tc.ok || err != nil && strings.Contains(err.Error(), "\n") {
				t.Fatalf("err = %v, want ok %v (or one line)", err, tc.ok)
			}
			if tc.ok {
				if b, _ := os.ReadFile(out); !strings.HasPrefix(string(b), "<svg") {
					t.Errorf("the drawing was not replaced: %.40q", b)
				}
			} else {
				filetest.SameTree(t, dir, before)
			}
			if tc.ctx != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("cancelled: %v", err)
			}
			filetest.NoTemps(t, dir)
		})
	}
}
