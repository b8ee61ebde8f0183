package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
)

// TestBenchFlags checks that the lengths a run times must fit in the
// model's context (256 positions for the fixture) and be positive, refused

// benchOne runs bench with args and -out into a fresh file, which must
// hold one JSON line: its output, the file and the result.
func benchOne(t *testing.T, args ...string) (stdout, out string, r Result) {
	t.Helper()
	out = filepath.Join(t.TempDir(), "r.jsonl")
	var buf bytes.Buffer
	if err := run(context.Background(), append(args, "-out", out), &buf); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(string(data), "\n"); lines != 1 {
		t.Fatalf("%d JSON lines, want one run: %s", lines, data)
	}
	if err := json.Unmarshal(data, &r); err != nil {
		t.Fatal(err)
	}
	return buf.String(), out, r
}

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
		{[]string{"-streams", "1,0,8"}, "-streams 1,0,8: want stream counts of at least 1"},
		{[]string{"-streams", "8,x"}, "-streams 8,x"},
		{[]string{"-streams", "8,,32"}, "-streams 8,,32"},
		{[]string{"-streams", "8,32,8"}, "8 is given twice"},
		{[]string{"-prompt-tokens", "0"}, "-prompt-tokens 0"},
		{[]string{"-prompt-tokens", "250"}, "need more positions"},
		{[]string{"-kv-cache", "disk"}, "-kv-cache"},
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2", "-kv-dtype", "q8_0"}, ""},
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2", "-kv-dtype", "q8_b8"}, ""},
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2", "-kv-dtype", "bf16"}, ""},
		{[]string{"-kv-dtype", "int4"}, `-kv-dtype: unknown KV cache dtype "int4"`},
		{[]string{"-router-locality", "0.5"}, "-router-locality needs -router-skew"},
		{[]string{"-router-skew", "1"}, "-router-skew: the llama model"},
		{[]string{"-experts-cpu", "sometimes"}, `-experts-cpu: unknown policy "sometimes"`},
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2", "-staging-readers", "4", "-staging-piece", "4MiB", "-staging-buffers", "-1", "-staging-mapped=false"}, ""},
		{[]string{"-staging-readers", "-1"}, "-staging-readers -1 must be >= 0"},
		{[]string{"-staging-buffers", "-2"}, "-staging-buffers -2 must be >= -1"},
		{[]string{"-staging-piece", "0"}, "-staging-piece 0 must be more than 0 bytes"},
		{[]string{"-staging-piece", "lots"}, "-staging-piece: "},
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
// buffers and bytes staged per token in the table's host staging column,
// the bytes copied in place from page-locked weight files, and, with the
// rate its reads ran at and the ceilings' pinned rate, its
// own bound (its streamed bytes at the slower of the two) and its share of
// it, in the cell and in the JSON; a run without one shows "-"; every
// row, an error's too, has as many cells as the header.
func TestReportStaging(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "results.jsonl")
	lines := `{"kind":"ceilings","device":"gpu","copy_bytes":1048576,"pinned_GBps":55,"pageable_GBps":8,"device_GBps":4000}
{"kind":"strata","model":"m","run":"4GiB:aggressive","budget_bytes":4294967296,"strategy":"aggressive","decode_tok_s":3,"streamed_bytes":1000,"bytes_per_token":1000,"staging_bytes":3221225472,"staging_slots":3,"staged_per_token":1048576,"pinned_host_bytes":0}
{"kind":"strata","model":"m","run":"4GiB:aggressive-reads","budget_bytes":4294967296,"strategy":"aggressive","decode_tok_s":1.5,"streamed_bytes":10000000000,"bytes_per_token":10000000000,"staging_bytes":3221225472,"staging_slots":3,"staged_per_token":1048576,"staged_read_GBps":30}
{"kind":"strata","model":"m","run":"4GiB:aggressive-fast-reads","budget_bytes":4294967296,"strategy":"aggressive","decode_tok_s":4.4,"streamed_bytes":10000000000,"bytes_per_token":10000000000,"staging_bytes":3221225472,"staging_slots":4,"staged_per_token":1048576,"staged_read_GBps":80}
{"kind":"strata","model":"m","run":"4GiB:aggressive-in-place","budget_bytes":4294967296,"strategy":"aggressive","decode_tok_s":4,"streamed_bytes":10000000000,"bytes_per_token":10000000000,"staging_bytes":3221225472,"staging_slots":3,"mapped_per_token":1073741824,"mapped_bytes":13476864728}
{"kind":"strata","model":"m","run":"4GiB:balanced","budget_bytes":4294967296,"strategy":"balanced","decode_tok_s":3,"streamed_bytes":1000,"bytes_per_token":1000}
{"kind":"strata","model":"m","run":"1GiB:aggressive","budget_bytes":1073741824,"strategy":"aggressive","error":"no room"}
`
	if err := os.WriteFile(in, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	jsonOut := filepath.Join(dir, "report.json")
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-report", in, "-json", jsonOut}, &out); err != nil {
		t.Fatal(err)
	}
	var rows []string
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if strings.HasPrefix(l, "|") {
			rows = append(rows, l)
		}
	}
	if len(rows) != 8 {
		t.Fatalf("%d table lines, want a header, a rule and 6 rows:\n%s", len(rows), out.String())
	}
	cells := func(row string) []string { return strings.Split(strings.Trim(row, "|"), "|") }
	head := cells(rows[0])
	col := slices.IndexFunc(head, func(c string) bool { return strings.TrimSpace(c) == "host staging" })
	if col < 0 {
		t.Fatalf("no host staging column: %s", rows[0])
	}
	for i, want := range []string{
		"3.00 GiB pinned (3 buffers), 1.00 MiB/token",
		"3.00 GiB pinned (3 buffers), 1.00 MiB/token, reads 30.0 GB/s; own bound 3.00 tok/s (50%)",   // the reads bound it
		"3.00 GiB pinned (4 buffers), 1.00 MiB/token, reads 80.0 GB/s; own bound 5.50 tok/s (80%)",   // the copies bound it
		"3.00 GiB pinned (3 buffers), 0 B/token, 1.00 GiB/token in place from 12.55 GiB page-locked", // nothing read
		"-",
	} {
		if got := strings.TrimSpace(cells(rows[2+i])[col]); got != want {
			t.Errorf("row %d: host staging %q, want %q", i, got, want)
		}
	}
	for _, row := range rows[1:] {
		if n := strings.Count(row, "|"); n != strings.Count(rows[0], "|") {
			t.Errorf("%d cell borders, the header has %d: %s", n, strings.Count(rows[0], "|"), row)
		}
	}
	raw, err := os.ReadFile(jsonOut)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct{ Rows []Row }
	if err := json.Unmarshal(raw, &rep); err != nil {
		t.Fatal(err)
	}
	for i, want := range [][2]float64{{0, 0}, {3, 0.5}, {5.5, 0.8}, {0, 0}, {0, 0}} {
		r := rep.Rows[i]
		if math.Abs(r.StagingBoundTokS-want[0]) > 1e-9 || math.Abs(r.OfStagingBound-want[1]) > 1e-9 {
			t.Errorf("row %d (%s): staging bound %v tok/s, %v of it; want %v and %v", i, r.Run, r.StagingBoundTokS, r.OfStagingBound, want[0], want[1])
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

// TestReportStreams checks the streams column: a batched strata run's
// aggregate rate and latencies, compared with Hugging Face's batched run of
// the same budget and batch size (compiled over eager when both ran) and
// with none of another size or budget; hf_baseline's batched lines are no
// single-stream baseline, and their decode cell is "-".
func TestReportStreams(t *testing.T) {
	const (
		single  = `{"kind":"accelerate","model":"m","device":"cuda:0","run":"4GiB","budget_bytes":4294967296,"decode_tok_s":2,"decode_tokens":4}` + "\n"
		hf8     = `{"kind":"accelerate","model":"m","device":"cuda:0","run":"4GiB","budget_bytes":4294967296,"decode_tok_s":0,"decode_tokens":4,"streams":{"streams":8,"decode_tok_s":16,"inter_token_p50_ms":500,"inter_token_p99_ms":510,"ttft_p50_ms":900,"ttft_p99_ms":900}}` + "\n"
		hf8res  = `{"kind":"transformers","model":"m","device":"cuda:0","run":"resident","decode_tok_s":0,"decode_tokens":4,"streams":{"streams":8,"decode_tok_s":200}}` + "\n"
		hf8comp = `{"kind":"transformers-compiled","model":"m","device":"cuda:0","run":"compiled","decode_tok_s":0,"decode_tokens":4,"streams":{"streams":8,"decode_tok_s":400}}` + "\n"
		st8     = `{"kind":"strata","model":"m","device":"cuda:0","run":"4GiB:balanced","budget_bytes":4294967296,"decode_tok_s":10,"decode_tokens":64,"streams":{"streams":8,"decode_tok_s":64,"inter_token_p50_ms":120,"inter_token_p99_ms":150.5,"ttft_p50_ms":300,"ttft_p99_ms":420}}` + "\n"
		st32    = `{"kind":"strata","model":"m","device":"cuda:0","run":"4GiB:balanced","budget_bytes":4294967296,"decode_tok_s":10,"decode_tokens":64,"streams":{"streams":32,"decode_tok_s":100,"inter_token_p50_ms":300,"inter_token_p99_ms":330,"ttft_p50_ms":900,"ttft_p99_ms":1200}}` + "\n"
		res8    = `{"kind":"strata","model":"m","device":"cuda:0","run":"none","decode_tok_s":50,"decode_tokens":64,"streams":{"streams":8,"decode_tok_s":800}}` + "\n"
	)
	cases := []struct {
		name, lines string
		want, not   []string
	}{
		{"budget", hf8 + single + st8 + st32,
			[]string{
				"| 10.00 |", "5.00x accelerate 4GiB | 8: 64.0 tok/s, inter-token p50 120.0 p99 150.5 ms, first token p50 300 p99 420 ms, 4.00x accelerate 4GiB |",
				"| 32: 100.0 tok/s, inter-token p50 300.0 p99 330.0 ms, first token p50 900 p99 1200 ms |",
				"| accelerate | 4.00 GiB |  |  | - |",
			}, []string{"0.62x"}},
		{"resident", hf8res + hf8comp + res8, []string{"| 8: 800.0 tok/s, inter-token p50 0.0 p99 0.0 ms, first token p50 0 p99 0 ms, 2.00x transformers-compiled compiled |"}, nil},
		{"no baseline", st8, []string{"first token p50 300 p99 420 ms |"}, []string{"x accelerate"}},
	}
	dir := t.TempDir()
	for _, c := range cases {
		path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".jsonl")
		if err := os.WriteFile(path, []byte(c.lines), 0o644); err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if err := run(context.Background(), []string{"-report", path}, &out); err != nil {
			t.Fatal(err)
		}
		for _, w := range append(c.want, "| vs baseline | streams |") {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%s: the table lacks %q:\n%s", c.name, w, out.String())
			}
		}
		for _, w := range c.not {
			if strings.Contains(out.String(), w) {
				t.Errorf("%s: the table has %q:\n%s", c.name, w, out.String())
			}
		}
	}
}

// TestBenchPromptTokens: -prompt-tokens sets the context the timed decode
// steps attend over, its prefill is timed under its length, and the result
// reports the KV cache (all on the device on the CPU, with the bytes the
// steps read from it).
func TestBenchPromptTokens(t *testing.T) {
	_, _, r := benchOne(t, "-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-prompt-tokens", "100", "-warmup", "1", "-decode", "3")
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

// TestBoundsLinkRate: the stream and expert bounds take the run's own
// copy rate where it beat the ceilings' pinned rate (a ceiling measured on
// a busy host), and the ceiling where the run copied slower.
func TestBoundsLinkRate(t *testing.T) {
	c := &Ceilings{PinnedGBps: 40, DeviceGBps: 4000}
	for _, tc := range []struct {
		run, want float64 // the run's copy rate, the link rate of the bound
	}{{55, 55}, {30, 40}, {0, 40}} {
		row := Row{Result: Result{Strategy: "balanced", StreamedBytes: 10e9, WeightBytes: 13e9, DecodeTokS: 3, H2DGBps: tc.run}}
		bounds(&row, c)
		if want := tc.want / 10; row.Bound != "stream" || math.Abs(row.BoundTokS-want) > 1e-9 {
			t.Errorf("copies at %g GB/s: bound %q %.3f tok/s, want stream %.3f", tc.run, row.Bound, row.BoundTokS, want)
		}
		x := &engine.ExpertReport{Experts: 8, WeightBytes: 8e9, ExpertBytes: 1e9, MissesPerToken: 2, AcquiresPerToken: 2, Tokens: 4}
		row = Row{Result: Result{Strategy: "balanced", WeightBytes: 9e9, DecodeTokS: 1, H2DGBps: tc.run, Experts: x}}
		bounds(&row, c)
		hbm := (1e9 + 2e9) / 4000e9
		if want := 1 / (2e9/(tc.want*1e9) + hbm); row.Bound != "experts" || math.Abs(row.BoundTokS-want) > 1e-9 {
			t.Errorf("experts, copies at %g GB/s: bound %q %.4f tok/s, want experts %.4f", tc.run, row.Bound, row.BoundTokS, want)
		}
	}
	if c.PinnedGBps != 40 {
		t.Errorf("bounds changed the ceilings: pinned %g", c.PinnedGBps)
	}
}

// TestBenchStreams: -streams 3 decodes three requests at once through the
// batcher and reports them, in the output and in the JSON line: the
// aggregate rate, latencies that are positive and ordered (p50 <= p99), a
// mean batch above one, the KV pool, steps a second and rows a step (at
// least the mean batch: each sequence runs a row or more).
func TestBenchStreams(t *testing.T) {
	stdout, _, r := benchOne(t, "-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-warmup", "2", "-decode", "12", "-streams", "3")
	if !strings.Contains(stdout, "3 streams: decode") {
		t.Errorf("output %q", stdout)
	}
	s := r.Streams
	if s == nil {
		t.Fatalf("no streams in %+v", r)
	}
	t.Logf("%s", s)
	if s.Streams != 3 || !(s.DecodeTokS > 0) || !(s.InterTokenP50Ms > 0) || s.InterTokenP50Ms > s.InterTokenP99Ms ||
		!(s.TTFTP50Ms > 0) || s.TTFTP50Ms > s.TTFTP99Ms || !(s.MeanBatch > 1) || s.KVBlocks < 3 || s.BlockSize <= 0 ||
		!(s.StepsS > 0) || s.RowsPerStep < s.MeanBatch {
		t.Errorf("streams %+v", s)
	}
	// A step's time by part: the parts add up to the step, the CPU's
	// device time is its launch (it computes as called), and the logits'
	// download and the sampling are counted.
	sp := s.Step
	if sp == nil {
		t.Fatalf("no step split in %+v", s)
	}
	sum := sp.ScheduleMs + sp.PrepareMs + sp.LaunchMs + sp.WaitMs + sp.DownloadMs + sp.SampleMs
	if math.Abs(sum-sp.StepMs) > 1e-6*sp.StepMs || !(sp.LaunchMs > 0) || sp.DeviceMs != sp.LaunchMs || !(sp.DownloadMs > 0) || !(sp.SampleMs > 0) ||
		math.Abs(1000/sp.StepMs-s.StepsS) > 1e-6*s.StepsS {
		t.Errorf("step split %+v (%.2f steps/s)", sp, s.StepsS)
	}
	if !strings.Contains(stdout, "ms a step "+sp.String()) {
		t.Errorf("the output lacks the step split %q: %s", sp, stdout)
	}
}

// TestBoundsHybrid: a hybrid row's bounds come from its own rates (not the
// ceilings') over the weights it reads outside device memory, the KV
// cache's reads and the calibrated costs left out; the table shows its
// prediction and says what the bounds and the prediction are.
func TestBoundsHybrid(t *testing.T) {
	c := &Ceilings{PinnedGBps: 50, CPUGBps: 200, DeviceGBps: 4000}
	rates := paging.Rates{H2D: 55e9, CPU: 100e9, H2DShared: 50e9, CPUShared: 90e9, CPULayer: time.Millisecond, CPUAttention: 20e9}
	r := Result{Model: "m", Kind: "strata", Strategy: "hybrid", StreamedBytes: 4e9, WeightBytes: 13e9, DecodeTokS: 11,
		Hybrid: &HybridResult{StreamedBytes: 4e9, CPUBytes: 10e9, HostKVBytes: 2e9, PredictedTokS: 12.5, Rates: rates}}
	row := Row{Result: r}
	bounds(&row, c)
	if row.Bound != "hybrid" || math.Abs(row.BoundTokS-10) > 1e-9 || math.Abs(row.CPUBoundTokS-100/14.) > 1e-9 {
		t.Errorf("bound %q %.3f tok/s, CPU bound %.3f; want hybrid 10 (140 GB/s over 14 GB), CPU 7.14", row.Bound, row.BoundTokS, row.CPUBoundTokS)
	}
	md := markdown(nil, []Row{row})
	if !strings.Contains(md, "| 12.50 |") || !strings.Contains(md, "over the run's own rates, measured at Open") {
		t.Errorf("table:\n%s", md)
	}
	if md := markdown(nil, []Row{{Result: Result{Model: "m", Strategy: "balanced"}}}); strings.Contains(md, "CPU and hybrid bounds") {
		t.Errorf("the note on a table without hybrid rows:\n%s", md)
	}
}

// TestBenchCPUProfile: -cpuprofile writes a CPU profile of each run's
// timed decode steps, named after the run, and refuses a directory.
func TestBenchCPUProfile(t *testing.T) {
	dir := t.TempDir()
	prof := filepath.Join(dir, "decode.pprof")
	args := []string{"-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-warmup", "1", "-decode", "4", "-runs", "none,300KiB", "-cpuprofile", prof}
	var stdout bytes.Buffer
	if err := run(context.Background(), args, &stdout); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"decode-none-none-explicit.pprof", "decode-300KiB-balanced-explicit.pprof"} {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if len(data) < 2 || data[0] != 0x1f || data[1] != 0x8b { // a profile is gzipped
			t.Errorf("%s: %d bytes, not a profile", name, len(data))
		}
	}
	if _, err := os.Stat(prof); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s written: %v", prof, err)
	}
	if err := run(context.Background(), []string{"-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-cpuprofile", dir}, &stdout); err == nil {
		t.Error("-cpuprofile of a directory: no error")
	}
}

// TestBenchStreamsSweep: -streams 1,3,2 measures each count in turn over
// the one engine of the run: one JSON line (one load), its sweep in the
// order given, each count's own pool and batch (a mean batch above one for
// several streams, exactly one for one), and a line of output per count.
func TestBenchStreamsSweep(t *testing.T) {
	stdout, _, r := benchOne(t, "-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-warmup", "2", "-decode", "8", "-streams", "1,3,2")
	for _, n := range []string{"1 streams: decode", "3 streams: decode", "2 streams: decode"} {
		if !strings.Contains(stdout, n) {
			t.Errorf("output lacks %q: %s", n, stdout)
		}
	}
	if r.Streams != nil || len(r.StreamsSweep) != 3 {
		t.Fatalf("streams %v, sweep %v: want a sweep of 3", r.Streams, r.StreamsSweep)
	}
	var prevBlocks int
	for i, want := range []int{1, 3, 2} {
		s := r.StreamsSweep[i]
		t.Logf("%s (%d KV blocks)", s, s.KVBlocks)
		if s.Streams != want || s.Error != "" || !(s.DecodeTokS > 0) || !(s.InterTokenP50Ms > 0) || s.InterTokenP50Ms > s.InterTokenP99Ms ||
			!(s.TTFTP50Ms > 0) || s.TTFTP50Ms > s.TTFTP99Ms || s.KVBlocks < want {
			t.Errorf("count %d: %+v", want, s)
		}
		if want == 1 && s.MeanBatch != 1 || want > 1 && !(s.MeanBatch > 1) {
			t.Errorf("%d streams ran a mean batch of %.2f", want, s.MeanBatch)
		}
		if i == 1 && s.KVBlocks <= prevBlocks {
			t.Errorf("the pool of 3 streams has %d blocks, that of 1 %d: one pool for all", s.KVBlocks, prevBlocks)
		}
		prevBlocks = s.KVBlocks
	}
}

// TestReportStreamsSweep: a strata run with a sweep of 1, 8 and 32
// streams (32 failed) and Hugging Face's batches of 1 and 8 at the same
// budget, and one of 8 at another: the main table's streams cell lists the
// counts and rates; the batched table has a row per batched decode,
// strata's and Hugging Face's of the same size side by side, strata's with
// its ratio to that size only, the failed count with its error, and each
// row as many cells as the header.
func TestReportStreamsSweep(t *testing.T) {
	const (
		sweep = `{"kind":"strata","model":"m","device":"cuda:0","run":"4GiB:balanced","budget_bytes":4294967296,"decode_tok_s":5,"decode_tokens":64,` +
			`"streams_sweep":[{"streams":1,"decode_tok_s":5,"inter_token_p50_ms":200,"inter_token_p99_ms":210,"ttft_p50_ms":400,"ttft_p99_ms":400,"mean_batch":1},` +
			`{"streams":8,"decode_tok_s":36,"inter_token_p50_ms":220,"inter_token_p99_ms":260,"ttft_p50_ms":500,"ttft_p99_ms":610,"mean_batch":7.5,"steps_s":4.5,"rows_per_step":10.25,` +
			`"step":{"step_ms":222.2,"schedule_ms":0.1,"prepare_ms":0.1,"launch_ms":20,"wait_ms":190,"download_ms":2,"sample_ms":10,"device_ms":205,"launches_per_step":1234}},` +
			`{"streams":32,"error":"-streams 32: engine: KV pool larger than the plan's room"}]}` + "\n"
		hf1    = `{"kind":"accelerate","model":"m","device":"cuda:0","run":"4GiB","budget_bytes":4294967296,"decode_tok_s":0,"decode_tokens":4,"streams":{"streams":1,"decode_tok_s":2,"inter_token_p50_ms":500,"inter_token_p99_ms":500,"ttft_p50_ms":700,"ttft_p99_ms":700,"mean_batch":1}}` + "\n"
		hf8    = `{"kind":"accelerate","model":"m","device":"cuda:0","run":"4GiB","budget_bytes":4294967296,"decode_tok_s":0,"decode_tokens":4,"streams":{"streams":8,"decode_tok_s":12,"inter_token_p50_ms":600,"inter_token_p99_ms":650,"ttft_p50_ms":900,"ttft_p99_ms":900,"mean_batch":8}}` + "\n"
		hf8res = `{"kind":"transformers","model":"m","device":"cuda:0","run":"resident","decode_tok_s":0,"decode_tokens":4,"streams":{"streams":8,"decode_tok_s":900,"mean_batch":8}}` + "\n"
	)
	path := filepath.Join(t.TempDir(), "sweep.jsonl")
	if err := os.WriteFile(path, []byte(hf8res+hf8+sweep+hf1), 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	jsonPath := filepath.Join(t.TempDir(), "table.json")
	if err := run(context.Background(), []string{"-report", path, "-json", jsonPath}, &out); err != nil {
		t.Fatal(err)
	}
	table := out.String()
	t.Log(table)
	if !strings.Contains(table, "| 1, 8, 32: 5.0, 36.0, error tok/s (the batched table) |") {
		t.Error("the main table's streams cell does not list the sweep")
	}
	_, batched, ok := strings.Cut(table, "Batched decode")
	if !ok {
		t.Fatal("no batched table")
	}
	want := []string{
		"| m | 4.00 GiB | 1 | strata | 4GiB:balanced | 5.0 | 200.0 | 210.0 | 400 | 400 | 1.00 | 2.50x accelerate 4GiB |",
		"| m | 4.00 GiB | 1 | accelerate | 4GiB | 2.0 | 500.0 | 500.0 | 700 | 700 | 1.00 | - |",
		"| m | 4.00 GiB | 8 | strata | 4GiB:balanced | 36.0 | 220.0 | 260.0 | 500 | 610 | 7.50 | 3.00x accelerate 4GiB |",
		"| m | 4.00 GiB | 8 | accelerate | 4GiB | 12.0 | 600.0 | 650.0 | 900 | 900 | 8.00 | - |",
		"| m | 4.00 GiB | 32 | strata | 4GiB:balanced | error: -streams 32: engine: KV pool larger than the plan's room |||||||||",
	}
	at := 0
	for _, w := range want {
		i := strings.Index(batched[at:], w)
		if i < 0 {
			t.Errorf("the batched table lacks %q after its earlier rows", w)
			continue
		}
		at += i + len(w)
	}
	if !strings.Contains(batched, "| 3.00x accelerate 4GiB | 4.5 of 10.2 | 222.20 = host 0.20 + launch 20.00 + wait 190.00 + download 2.00 + sample 10.00; device 205.00, 1234 launches |") {
		t.Error("the batched table lacks the 8 streams' steps and their split")
	}
	if !strings.Contains(batched, "| m | none | 8 | transformers | resident | 900.0 |") {
		t.Error("the batched table lacks the resident batch of 8")
	}
	var header int
	for _, line := range strings.Split(batched, "\n") {
		if !strings.HasPrefix(line, "|") {
			continue
		}
		if header == 0 {
			header = strings.Count(line, "|")
		} else if n := strings.Count(line, "|"); n != header {
			t.Errorf("row of %d cells, the header has %d: %s", n-1, header-1, line)
		}
	}
	data, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var tbl struct{ Batched []BatchedRow }
	if err := json.Unmarshal(data, &tbl); err != nil {
		t.Fatal(err)
	}
	if len(tbl.Batched) != 6 || tbl.Batched[1].Streams != 1 || tbl.Batched[1].VsBaseline != 2.5 {
		t.Errorf("-json's batched rows: %s", data)
	}
}

// TestBenchStreamsNoRoom: under a budget of 4 MB, -streams 2,400,1 (the
// pool of 400 streams is 12.5 MiB of KV cache): the run's plan keeps room
// for the largest pool it can (2 streams') and the 400 streams' count is
// kept with the plan's error; the other counts are measured, in the
// order given.
func TestBenchStreamsNoRoom(t *testing.T) {
	_, _, r := benchOne(t, "-model", fixtures.Dir(fixtures.TinyLlamaBF16), "-prefill", "16", "-warmup", "2", "-decode", "8", "-streams", "2,400,1", "-runs", "4MB:balanced")
	if r.Error != "" || len(r.StreamsSweep) != 3 {
		t.Fatalf("run error %q, sweep %v: want three counts", r.Error, r.StreamsSweep)
	}
	for i, want := range []int{2, 400, 1} {
		s := r.StreamsSweep[i]
		failed := s.Error != ""
		if s.Streams != want || failed != (want == 400) || !failed && !(s.DecodeTokS > 0) {
			t.Errorf("count %d: %+v", want, s)
		}
	}
	if e := r.StreamsSweep[1].Error; !strings.Contains(e, "a plan with room for the pool of 400 streams") || !strings.Contains(e, "budget too small") {
		t.Errorf("the 400 streams' error: %q", e)
	}
	if want := 2 * 32; r.StreamsPlanPositions != want {
		t.Errorf("the plan kept room for %d positions, want the 2 streams' %d", r.StreamsPlanPositions, want)
	}
}

// TestBenchDevices: -devices 0,1 runs the model over two CPU devices (the
// result names both, and counts the streamed bytes of both plans under a
// budget each), and -streams with -pipeline runs the batcher over them.
func TestBenchDevices(t *testing.T) {
	var rs []Result
	for _, extra := range [][]string{{"-runs", "300KiB:balanced"}, {"-runs", "300KiB:balanced", "-devices", "0,1", "-streams", "4", "-pipeline"}} {
		_, _, r := benchOne(t, append([]string{"-model", fixtures.Dir(fixtures.TinyLlamaF16Sharded), "-prefill", "8", "-warmup", "1", "-decode", "3"}, extra...)...)
		rs = append(rs, r)
	}
	one, two := rs[0], rs[1]
	if one.Device != "cpu" || two.Device != "cpu+cpu" || two.DecodeTokS <= 0 {
		t.Errorf("devices %q and %q, decode %v tok/s", one.Device, two.Device, two.DecodeTokS)
	}
	// Two budgets of 300 KiB hold more of the weights than one.
	if one.StreamedBytes == 0 || two.StreamedBytes >= one.StreamedBytes {
		t.Errorf("streamed per token: %d on one device, %d on two", one.StreamedBytes, two.StreamedBytes)
	}
	if two.Streams == nil || two.Streams.Streams != 4 || two.Streams.DecodeTokS <= 0 {
		t.Errorf("streams %+v", two.Streams)
	}
}

// TestWarmupLengths: before the timed passes the bench runs an 8-token
// pass and the first chunk of every timed prompt longer than that, so
// that no timed prefill is the first of its shape (a quantized model's
// 8-token pass does not reach cuBLAS, whose kernels load on first use).
func TestWarmupLengths(t *testing.T) {
	for _, c := range []struct {
		prefill []int
		chunk   int
		want    []int
	}{
		{[]int{512}, 512, []int{8, 512}},
		{[]int{128, 512}, 512, []int{8, 128, 512}},
		{[]int{512, 128, 512}, 0, []int{8, 128, 512}},
		{[]int{8192}, 2048, []int{8, 2048}},
		{[]int{4, 8}, 512, []int{8}},
		{nil, 512, []int{8}},
	} {
		if got := warmupLengths(c.prefill, c.chunk); !slices.Equal(got, c.want) {
			t.Errorf("warmupLengths(%v, %d) = %v, want %v", c.prefill, c.chunk, got, c.want)
		}
	}
}
