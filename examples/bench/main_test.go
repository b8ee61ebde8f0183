package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
)

// TestBenchFlags checks that the lengths a run times must fit in the
// model's context (256 positions for the fixture) and be positive, refused
// before anything is measured.
func TestBenchFlags(t *testing.T) {
	model := fixtures.Dir(fixtures.TinyLlamaBF16)
	cases := []struct {
		args []string
		want string // in the error; "" for success
	}{
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2"}, ""},
		{[]string{"-prefill", "300"}, "-prefill up to 300, -warmup 4 and -decode 64 need more positions than the model's context of 256 positions"},
		{[]string{"-prefill", "128", "-decode", "128"}, "need more positions"},
		{[]string{"-decode", "9223372036854775807"}, "need more positions"},
		{[]string{"-decode", "0"}, "-decode 0"},
		{[]string{"-warmup", "-1"}, "-warmup -1"},
		{[]string{"-chunk", "0"}, "-chunk 0"},
	}
	for _, c := range cases {
		var out bytes.Buffer
		err := run(context.Background(), append([]string{"-model", model}, c.args...), &out)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%v: %v", c.args, err)
		case c.want == "" && !strings.Contains(out.String(), "decode"):
			t.Errorf("%v: output %q", c.args, out.String())
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%v: error %v, want one mentioning %q", c.args, err, c.want)
		}
	}
}

// TestReportStaging: a run whose pager staged its streamed parts (the
// aggressive strategy on a GPU) reports the staging ring's pinned bytes,
// buffers and bytes staged per token in the table's host staging column;
// a run without one shows "-"; every row, an error's too, has as many
// cells as the header.
func TestReportStaging(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "results.jsonl")
	lines := `{"kind":"strata","model":"m","run":"4GiB:aggressive","budget_bytes":4294967296,"strategy":"aggressive","decode_tok_s":3,"streamed_bytes":1000,"bytes_per_token":1000,"staging_bytes":3221225472,"staging_slots":3,"staged_per_token":1048576,"pinned_host_bytes":0}
{"kind":"strata","model":"m","run":"4GiB:balanced","budget_bytes":4294967296,"strategy":"balanced","decode_tok_s":3,"streamed_bytes":1000,"bytes_per_token":1000}
{"kind":"strata","model":"m","run":"1GiB:aggressive","budget_bytes":1073741824,"strategy":"aggressive","error":"no room"}
`
	if err := os.WriteFile(in, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-report", in}, &out); err != nil {
		t.Fatal(err)
	}
	rows := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(rows) != 5 {
		t.Fatalf("%d lines, want a header, a rule and 3 rows:\n%s", len(rows), out.String())
	}
	cells := func(row string) []string { return strings.Split(strings.Trim(row, "|"), "|") }
	head := cells(rows[0])
	col := slices.IndexFunc(head, func(c string) bool { return strings.TrimSpace(c) == "host staging" })
	if col < 0 {
		t.Fatalf("no host staging column: %s", rows[0])
	}
	for i, want := range []string{"3.00 GiB pinned (3 buffers), 1.00 MiB/token", "-"} {
		if got := strings.TrimSpace(cells(rows[2+i])[col]); got != want {
			t.Errorf("row %d: host staging %q, want %q", i, got, want)
		}
	}
	for _, row := range rows[1:] {
		if n := strings.Count(row, "|"); n != strings.Count(rows[0], "|") {
			t.Errorf("%d cell borders, the header has %d: %s", n, strings.Count(rows[0], "|"), row)
		}
	}
}
