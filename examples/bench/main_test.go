package main

import (
	"bytes"
	"context"
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
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2", "-kv-dtype", "q8_0"}, ""},
		{[]string{"-prefill", "16", "-warmup", "0", "-decode", "2", "-kv-dtype", "bf16"}, ""},
		{[]string{"-kv-dtype", "int4"}, `-kv-dtype: unknown KV cache dtype "int4"`},
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
