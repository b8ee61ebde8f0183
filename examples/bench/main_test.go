package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
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

// TestReportLaunches checks the launches-per-token column: a run's count,
// marked when its decode steps ran as graphs, and "-" for a run whose
// device does not count launches.
func TestReportLaunches(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "results.jsonl")
	lines := `{"kind":"strata","model":"m","device":"cuda:0","run":"none","decode_tok_s":250,"decode_tokens":64,"launches":{"kernels":0,"copies":320,"library":0,"graphs":2048},"launches_per_token":37,"graphs":true}
{"kind":"strata","model":"m","device":"cuda:0","run":"none","decode_tok_s":180,"decode_tokens":64,"launches":{"kernels":22400,"copies":512,"library":0,"graphs":0},"launches_per_token":358}
{"kind":"strata","model":"m","device":"cpu","run":"none","decode_tok_s":20,"decode_tokens":64}
`
	if err := os.WriteFile(path, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-report", path}, &out); err != nil {
		t.Fatal(err)
	}
	table := out.String()
	for _, want := range []string{"| launches/token |", "| 250.00 | 37.0 (graphs: 32.0 replays) |", "| 180.00 | 358.0 |", "| 20.00 | - |"} {
		if !strings.Contains(table, want) {
			t.Errorf("the table lacks %q:\n%s", want, table)
		}
	}
}

// TestReportCompiledBaseline checks that a resident row is compared with
// transformers compiled (static cache, torch.compile) when that run
// succeeded, and with eager transformers when it failed; the failed run
// keeps its row with the error.
func TestReportCompiledBaseline(t *testing.T) {
	dir := t.TempDir()
	eager := `{"kind":"transformers","model":"m","device":"cuda:0","run":"resident","decode_tok_s":10,"decode_tokens":64}` + "\n"
	compiled := `{"kind":"transformers-compiled","model":"m","device":"cuda:0","run":"compiled","decode_tok_s":100,"decode_tokens":64}` + "\n"
	failed := `{"kind":"transformers-compiled","model":"m","device":"cuda:0","run":"compiled","decode_tokens":64,"error":"BackendCompilerFailed: inductor"}` + "\n"
	strata := `{"kind":"strata","model":"m","device":"cuda:0","run":"none","decode_tok_s":200,"decode_tokens":64}` + "\n"
	cases := []struct{ name, lines, want string }{
		{"compiled", eager + compiled + strata, "| 2.00x transformers-compiled compiled |"},
		{"compiled-first", compiled + eager + strata, "| 2.00x transformers-compiled compiled |"},
		{"compile-failed", eager + failed + strata, "| 20.00x transformers resident |"},
	}
	for _, c := range cases {
		path := filepath.Join(dir, c.name+".jsonl")
		if err := os.WriteFile(path, []byte(c.lines), 0o644); err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if err := run(context.Background(), []string{"-report", path}, &out); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), c.want) {
			t.Errorf("%s: the table lacks %q:\n%s", c.name, c.want, out.String())
		}
		if c.name == "compile-failed" && !strings.Contains(out.String(), "error: BackendCompilerFailed") {
			t.Errorf("%s: the failed run's row is missing:\n%s", c.name, out.String())
		}
	}
}
