package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/engine"
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
		{[]string{"-prefill", "300"}, "-prefill and -prompt-tokens up to 300, -warmup 4 and -decode 64 need more positions than the model's context of 256 positions"},
		{[]string{"-prefill", "128", "-decode", "128"}, "need more positions"},
		{[]string{"-decode", "9223372036854775807"}, "need more positions"},
		{[]string{"-decode", "0"}, "-decode 0"},
		{[]string{"-warmup", "-1"}, "-warmup -1"},
		{[]string{"-chunk", "-1"}, "-chunk -1"},
		{[]string{"-streams", "-1"}, "-streams -1"},
		{[]string{"-prompt-tokens", "0"}, "-prompt-tokens 0"},
		{[]string{"-prompt-tokens", "250"}, "need more positions"},
		{[]string{"-kv-cache", "disk"}, "-kv-cache"},
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

// TestBenchPromptTokens: -prompt-tokens sets the context the timed decode
// steps attend over, its prefill is timed under its length, and the result
// reports the KV cache (all on the device on the CPU, with the bytes the
// steps read from it).
func TestBenchPromptTokens(t *testing.T) {
	out := filepath.Join(t.TempDir(), "r.jsonl")
	var stdout bytes.Buffer
	args := []string{"-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-prompt-tokens", "100", "-warmup", "1", "-decode", "3", "-out", out}
	if err := run(context.Background(), args, &stdout); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var r Result
	if err := json.Unmarshal(bytes.TrimSpace(data), &r); err != nil {
		t.Fatal(err)
	}
	if r.PrefillTokS["100"] <= 0 || r.PrefillTokS["16"] <= 0 {
		t.Errorf("prefill rates %v, want 16 and 100", r.PrefillTokS)
	}
	// 4 blocks x 2 x 4 bytes x KVDim 32 x (100 + 1 + 3/2) positions.
	if r.KV == nil || r.KV.Placement != "device" || r.KV.PromptTokens != 100 || r.KV.DeviceKVReadPerToken != 4*8*32*102.5 || r.KV.HostKVReadPerToken != 0 {
		t.Errorf("kv %+v", r.KV)
	}
}

// TestBoundsHostKV: a run with its KV cache in host memory is judged
// against the decode bound with the host KV reads counted, not the
// streaming bound alone.
func TestBoundsHostKV(t *testing.T) {
	c := &Ceilings{PinnedGBps: 50, DeviceGBps: 4000}
	r := Result{Strategy: "balanced", StreamedBytes: 10e9, WeightBytes: 13e9, DecodeTokS: 3,
		KV: &KVResult{KVReport: &engine.KVReport{HostBlocks: []int{30, 31}}, DecodeBoundTokS: 4}}
	row := Row{Result: r}
	bounds(&row, c)
	if row.Bound != "stream+host KV" || row.BoundTokS != 4 || row.OfBound != 0.75 {
		t.Errorf("bound %q %.2f tok/s, of bound %.2f; want stream+host KV 4, 0.75", row.Bound, row.BoundTokS, row.OfBound)
	}
	r.KV = nil
	row = Row{Result: r}
	bounds(&row, c)
	if row.Bound != "stream" || row.BoundTokS != 5 {
		t.Errorf("without host KV: bound %q %.2f tok/s, want stream 5", row.Bound, row.BoundTokS)
	}
}

// TestBenchStreams: -streams 3 decodes three requests at once through the
// batcher and reports them, in the output and in the JSON line: the
// aggregate rate, latencies that are positive and ordered (p50 <= p99), a
// mean batch above one, the KV pool, steps a second and rows a step (at
// least the mean batch: each sequence runs a row or more).
func TestBenchStreams(t *testing.T) {
	out := filepath.Join(t.TempDir(), "r.jsonl")
	var stdout bytes.Buffer
	args := []string{"-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-warmup", "2", "-decode", "12", "-streams", "3", "-out", out}
	if err := run(context.Background(), args, &stdout); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stdout.String(), "3 streams: decode") {
		t.Errorf("output %q", stdout.String())
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var r Result
	if err := json.Unmarshal(data, &r); err != nil {
		t.Fatal(err)
	}
	s := r.Streams
	if s == nil {
		t.Fatalf("no streams in %s", data)
	}
	t.Logf("%s", s)
	if s.Streams != 3 || !(s.DecodeTokS > 0) || !(s.InterTokenP50Ms > 0) || s.InterTokenP50Ms > s.InterTokenP99Ms ||
		!(s.TTFTP50Ms > 0) || s.TTFTP50Ms > s.TTFTP99Ms || !(s.MeanBatch > 1) || s.KVBlocks < 3 || s.BlockSize <= 0 ||
		!(s.StepsS > 0) || s.RowsPerStep < s.MeanBatch {
		t.Errorf("streams %+v", s)
	}
}
