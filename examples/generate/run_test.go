package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

func runArgs(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
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
		{"bad device", []string{"-device", "tpu"}, true, "tpu"},
		{"bad top-p", []string{"-top-p", "2"}, true, "top-p"},
		{"unknown flag", []string{"-frobnicate"}, true, "frobnicate"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := runArgs(t, append(tc.args, "-quiet")...)
			if err == nil {
				t.Fatal("no error")
			}
			if isUsage := errors.As(err, new(usageError)); isUsage != tc.usage {
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
