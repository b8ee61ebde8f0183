package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

// runArgs runs the command on args, on the BF16 fixture when args name no
// -model: the fixtures, with their transformers references, are what the
// tests check against, not the embedded default model.
func runArgs(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	args = withFixture(args, fixtures.TinyLlamaBF16)
	var o, e bytes.Buffer
	err = run(context.Background(), args, &o, &e)
	return o.String(), e.String(), err
}

// TestLogitsOut checks the CLI end to end against transformers' logits for
// the sharded F16 fixture.
func TestLogitsOut(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	ref, err := loader.OpenSafetensors(filepath.Join(dir, "reference.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	ctx := context.Background()
	in, _ := ref.ReadTensor(ctx, "input_ids")
	want, _ := ref.ReadTensor(ctx, "logits")
	var ids []string
	for _, v := range in.I64() {
		ids = append(ids, itoa(v))
	}
	out := filepath.Join(t.TempDir(), "logits.safetensors")
	stdout, _, err := runArgs(t, "-model", dir, "-ids", strings.Join(ids, ","), "-max-new-tokens", "4", "-logits-out", out, "-json")
	if err != nil {
		t.Fatal(err)
	}
	var r report
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("-json output is not one JSON object: %v\n%s", err, stdout)
	}
	if len(r.PromptIDs) != len(ids) || len(r.IDs) != 4 || r.Text == nil || r.PeakHostBytes <= 0 || r.PrefillTokS <= 0 {
		t.Errorf("report missing fields: %+v", r)
	}
	f, err := loader.OpenSafetensors(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got, err := f.ReadTensor(ctx, "logits")
	if err != nil {
		t.Fatal(err)
	}
	if !got.Shape().Equal(want.Shape()) {
		t.Fatalf("logits shape %v, want %v", got.Shape(), want.Shape())
	}
	g, w := got.F32(), want.F32()
	for i := range w {
		if d := math.Abs(float64(g[i] - w[i])); !(d <= 1e-3) {
			t.Fatalf("logit %d: %v, transformers %v", i, g[i], w[i])
		}
	}
}

func itoa(v int64) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestDefaultModelStreamsText(t *testing.T) {
	stdout, _, err := runArgs(t, "-prompt", "Hello", "-max-new-tokens", "8", "-quiet")
	if err != nil {
		t.Fatal(err)
	}
	if len(stdout) == 0 {
		t.Fatal("no text streamed")
	}
	// Greedy decoding is deterministic: the JSON run gives the same text.
	js, _, err := runArgs(t, "-prompt", "Hello", "-max-new-tokens", "8", "-json")
	if err != nil {
		t.Fatal(err)
	}
	var r report
	if err := json.Unmarshal([]byte(js), &r); err != nil {
		t.Fatal(err)
	}
	if r.Text == nil || *r.Text+"\n" != stdout {
		t.Errorf("streamed %q, -json text %q", stdout, *r.Text)
	}
}

func TestBadInput(t *testing.T) {
	tmp := t.TempDir()
	noConfig := filepath.Join(tmp, "empty")
	os.Mkdir(noConfig, 0o755)
	// A copy of the BF16 fixture with its weights cut short.
	trunc, err := fixtures.Extract(fixtures.TinyLlamaBF16, filepath.Join(tmp, "trunc"))
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(filepath.Join(trunc, "model.safetensors"))
	os.Truncate(filepath.Join(trunc, "model.safetensors"), st.Size()/2)
	// One with an unsupported architecture.
	arch, _ := fixtures.Extract(fixtures.TinyLlamaBF16, filepath.Join(tmp, "arch"))
	cfg, _ := os.ReadFile(filepath.Join(arch, "config.json"))
	os.WriteFile(filepath.Join(arch, "config.json"), bytes.Replace(cfg, []byte("LlamaForCausalLM"), []byte("GPT2LMHeadModel"), 1), 0o644)

	cases := []struct {
		name  string
		args  []string
		usage bool   // a bad flag: exit status 2
		want  string // in the error
	}{
		{"missing dir", []string{"-model", filepath.Join(tmp, "nope"), "-ids", "1"}, false, "no such file"},
		{"no config", []string{"-model", noConfig, "-ids", "1"}, false, "config.json"},
		{"architecture", []string{"-model", arch, "-ids", "1"}, false, "GPT2LMHeadModel"},
		{"truncated shard", []string{"-model", trunc, "-ids", "1"}, false, "model.safetensors"},
		{"id outside vocab", []string{"-ids", "1,512"}, true, "outside the vocabulary"},
		{"bad ids", []string{"-ids", "1,x"}, true, `"x"`},
		{"negative tokens", []string{"-max-new-tokens", "-1"}, true, "max-new-tokens"},
		{"bad device", []string{"-device", "cuda:x"}, true, "cuda:x"},
		{"unknown device driver", []string{"-device", "tpu", "-ids", "1"}, false, "registered: cpu"},
		{"bad top-p", []string{"-top-p", "2"}, true, "top-p"},
		{"unknown flag", []string{"-frobnicate"}, true, "frobnicate"},
		{"no cuda", []string{"-device", "cuda", "-ids", "1"}, false, "cuda"},
		{"bad kv cache", []string{"-kv-cache", "disk", "-ids", "1"}, true, "-kv-cache"},
		{"kv cache host on the cpu", []string{"-device", "cpu", "-kv-cache", "host", "-ids", "1"}, false, "no memory of its own"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := runArgs(t, append(tc.args, "-quiet")...)
			if err == nil {
				t.Fatal("no error")
			}
			if isUsage := cli.IsUsage(err); isUsage != tc.usage {
				t.Errorf("usage error = %v, want %v (%v)", isUsage, tc.usage, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not mention %q", err, tc.want)
			}
			if strings.Count(err.Error(), "\n") > 0 {
				t.Errorf("error is more than one line: %q", err)
			}
		})
	}
}

// TestBudgetsBitIdentical runs the CLI with every strategy under a tight
// budget and compares ids and logits with the unbudgeted run.
func TestBudgetsBitIdentical(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	tmp := t.TempDir()
	runOne := func(name string, extra ...string) (report, []byte) {
		t.Helper()
		out := filepath.Join(tmp, name+".safetensors")
		args := append([]string{"-model", dir, "-ids", "1,42,71,345,81,14", "-max-new-tokens", "10", "-json", "-logits-out", out}, extra...)
		stdout, _, err := runArgs(t, args...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var r report
		if err := json.Unmarshal([]byte(stdout), &r); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return r, b
	}
	base, baseLogits := runOne("base")
	if base.Plan == nil || base.Strategy != "none" {
		t.Fatalf("unbudgeted run: strategy %q, plan %v", base.Strategy, base.Plan)
	}
	if base.KV == nil || base.KV.Placement != "device" || base.KV.DeviceBytes != base.Plan.KVCacheBytes || base.KV.DeviceBytes == 0 || base.KV.HostBytes != 0 {
		t.Errorf("-json kv report %+v, want all %d bytes on the device", base.KV, base.Plan.KVCacheBytes)
	}
	for _, s := range []string{"minimal", "balanced", "aggressive"} {
		r, logits := runOne(s, "-gpu-memory-limit", "190KiB", "-offload", s)
		if !bytes.Equal(logits, baseLogits) {
			t.Errorf("%s: logits differ from the unbudgeted run", s)
		}
		if len(r.IDs) != len(base.IDs) {
			t.Fatalf("%s: %d ids, want %d", s, len(r.IDs), len(base.IDs))
		}
		for i := range r.IDs {
			if r.IDs[i] != base.IDs[i] {
				t.Fatalf("%s: ids %v, unbudgeted %v", s, r.IDs, base.IDs)
			}
		}
		if r.BudgetBytes != 190<<10 || r.PeakDeviceBytes > r.BudgetBytes || r.PeakDeviceBytes == 0 {
			t.Errorf("%s: budget %d, peak %d", s, r.BudgetBytes, r.PeakDeviceBytes)
		}
		if r.StreamedBytesPerToken <= 0 || r.LayerMisses == 0 {
			t.Errorf("%s: nothing streamed under a budget smaller than the weights: %+v", s, r.Paging)
		}
	}
}

func TestConfigFileAndMemoryFlags(t *testing.T) {
	tmp := t.TempDir()
	cfg := filepath.Join(tmp, "strata.yaml")
	os.WriteFile(cfg, []byte("memory:\n  offload_strategy: aggressive\n  max_gpu_memory: 200KiB\n"), 0o644)
	stdout, _, err := runArgs(t, "-ids", "1,2,3", "-max-new-tokens", "2", "-json", "-config", cfg)
	if err != nil {
		t.Fatal(err)
	}
	var r report
	json.Unmarshal([]byte(stdout), &r)
	if r.Strategy != "aggressive" || r.BudgetBytes != 200<<10 {
		t.Errorf("from the file: strategy %q budget %d", r.Strategy, r.BudgetBytes)
	}
	// Flags override the file.
	stdout, _, err = runArgs(t, "-ids", "1,2,3", "-max-new-tokens", "2", "-json", "-config", cfg, "-offload", "minimal", "-gpu-memory-limit", "0.00025")
	if err != nil {
		t.Fatal(err)
	}
	json.Unmarshal([]byte(stdout), &r)
	if r.Strategy != "minimal" || r.BudgetBytes != 1<<30/4000 {
		t.Errorf("flags over the file: strategy %q budget %d", r.Strategy, r.BudgetBytes)
	}
	// A snapshot file is written, and the summary names the categories.
	snap := filepath.Join(tmp, "snap.json")
	_, stderr, err := runArgs(t, "-ids", "1,2,3", "-max-new-tokens", "2", "-quiet", "-memory-summary", "-memory-snapshot", snap, "-gpu-memory-limit", "200KiB")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stderr, "kv cache") || !strings.Contains(stderr, "streamed weights") {
		t.Errorf("memory summary lacks categories:\n%s", stderr)
	}
	if st, err := os.Stat(snap); err != nil || st.Size() == 0 {
		t.Errorf("snapshot not written: %v", err)
	}

	bad := []struct {
		args []string
		want string
	}{
		{[]string{"-gpu-memory-limit", "lots"}, "gpu-memory-limit"},
		{[]string{"-gpu-memory-limit", "10B"}, "budget"},
		{[]string{"-offload", "everything"}, "offload"},
		{[]string{"-offload", "none", "-gpu-memory-limit", "100KiB"}, "none"},
		{[]string{"-gpu-memory-fraction", "0.5"}, "fraction"},
		{[]string{"-memory-mode", "unified"}, "cuda"},
		{[]string{"-config", filepath.Join(tmp, "missing.yaml")}, "missing.yaml"},
	}
	for _, c := range bad {
		_, _, err := runArgs(t, append([]string{"-ids", "1", "-quiet"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want one mentioning %q", c.args, err, c.want)
		}
	}
}

// TestDevices spreads the F16 fixture over two and three CPU backends
// standing in for devices, with per-device budgets, and compares logits and
// ids with one device.
func TestDevices(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	tmp := t.TempDir()
	runOne := func(name string, extra ...string) (report, []byte) {
		t.Helper()
		out := filepath.Join(tmp, name+".safetensors")
		args := append([]string{"-model", dir, "-device", "cpu", "-ids", "1,42,71,345,81,14", "-max-new-tokens", "8", "-json", "-logits-out", out}, extra...)
		stdout, _, err := runArgs(t, args...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var r report
		if err := json.Unmarshal([]byte(stdout), &r); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return r, b
	}
	base, baseLogits := runOne("one")
	for _, c := range []struct {
		name string
		args []string
	}{
		{"two resident", []string{"-devices", "0,1"}},
		{"two through host memory", []string{"-devices", "0,1", "-no-peer-copies"}},
		{"two budgets", []string{"-devices", "0,1", "-gpu-memory-limit", "0=220KiB,1=300KiB"}},
		{"three streaming", []string{"-devices", "0,1,2", "-gpu-memory-limit", "170KiB", "-offload", "minimal"}},
	} {
		r, logits := runOne(c.name, c.args...)
		if !bytes.Equal(logits, baseLogits) {
			t.Errorf("%s: logits differ from one device", c.name)
		}
		if fmt.Sprint(r.IDs) != fmt.Sprint(base.IDs) {
			t.Errorf("%s: ids %v, one device %v", c.name, r.IDs, base.IDs)
		}
		if len(r.Devices) < 2 {
			t.Fatalf("%s: report has %d devices", c.name, len(r.Devices))
		}
		next := 0
		for _, d := range r.Devices {
			if d.Placement.FirstBlock != next || d.Plan == nil {
				t.Errorf("%s: device %s placement %+v", c.name, d.Name, d.Placement)
			}
			next = d.Placement.EndBlock
			if d.PeakDeviceBytes > d.BudgetBytes {
				t.Errorf("%s: device %s peaked at %d over its budget %d", c.name, d.Name, d.PeakDeviceBytes, d.BudgetBytes)
			}
		}
	}
	for _, bad := range [][]string{
		{"-devices", "0,x"},
		{"-devices", "0,0"},
		{"-devices", "0,1", "-gpu-memory-limit", "0=1GiB"},
		{"-devices", "0,1", "-gpu-memory-limit", "0:1GiB,1:1GiB"},
		{"-devices", "0,1", "-memory-snapshot", filepath.Join(tmp, "s.json")},
	} {
		if _, _, err := runArgs(t, append([]string{"-model", dir, "-device", "cpu", "-ids", "1", "-quiet"}, bad...)...); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}
}

func TestConfigFilePerDevice(t *testing.T) {
	tmp := t.TempDir()
	cfg := filepath.Join(tmp, "strata.yaml")
	os.WriteFile(cfg, []byte("memory:\n  max_gpu_memory: 0=220KiB,1=300KiB\n  offload_strategy: minimal\n"), 0o644)
	stdout, _, err := runArgs(t, "-model", fixtures.Dir(fixtures.TinyLlamaF16Sharded), "-device", "cpu", "-devices", "0,1",
		"-ids", "1,2,3", "-max-new-tokens", "2", "-json", "-config", cfg)
	if err != nil {
		t.Fatal(err)
	}
	var r report
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatal(err)
	}
	if len(r.Devices) != 2 || r.Devices[0].BudgetBytes != 220<<10 || r.Devices[1].BudgetBytes != 300<<10 || r.Strategy != "minimal" {
		t.Errorf("per-device budgets from the file: %+v, strategy %q", r.Devices, r.Strategy)
	}
	os.WriteFile(cfg, []byte("memory:\n  gpu_memory_fraction: 0=1.5\n"), 0o644)
	if _, _, err := runArgs(t, "-ids", "1", "-quiet", "-config", cfg); err == nil || !strings.Contains(err.Error(), "gpu_memory_fraction") {
		t.Errorf("a fraction of 1.5 in the file: %v", err)
	}
}

// TestTopPZero samples with -top-p 0, which as in Hugging Face keeps only
// the most likely token: the ids are the greedy ones at any temperature,
// and differ from sampling with -top-p 1.
func TestTopPZero(t *testing.T) {
	ids := func(args ...string) string {
		t.Helper()
		stdout, _, err := runArgs(t, append([]string{"-ids", "1,42,71", "-max-new-tokens", "24", "-json"}, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		var r report
		if err := json.Unmarshal([]byte(stdout), &r); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(r.IDs)
	}
	greedy := ids("-temperature", "0")
	for _, temp := range []string{"0.7", "1", "50"} {
		if got := ids("-temperature", temp, "-top-p", "0", "-seed", "3"); got != greedy {
			t.Errorf("-temperature %s -top-p 0: ids %s, greedy %s", temp, got, greedy)
		}
	}
	if got := ids("-temperature", "50", "-top-p", "1", "-seed", "3"); got == greedy {
		t.Errorf("-temperature 50 -top-p 1 gave the greedy ids %s", got)
	}
}

// withFixture puts -model and the fixture's directory in front of args
// that name no model.
func withFixture(args []string, fixture string) []string {
	if slices.Contains(args, "-model") {
		return args
	}
	return append([]string{"-model", fixtures.Dir(fixture)}, args...)
}
