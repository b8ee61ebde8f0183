package main

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestKVDType runs the F16 fixture with each -kv-dtype (and the config
// file's kv_dtype): the report names the dtype, and the plan's KV bytes
// are the dtype's (F32 4 bytes a value, F16 and BF16 2, Q8_0 34 bytes a
// block of 32, Q8_B8 10 bytes a block of 8); a flag overrides the file; an unknown dtype is a usage
// error naming the flag.
func TestKVDType(t *testing.T) {
	dir := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	// 4 layers, K and V, 2 KV heads of 16: 32 values a position.
	const ids, steps = "1,42,71,345,81", 4
	perPos := map[string]int64{"F32": 2 * 4 * 32 * 4, "F16": 2 * 4 * 32 * 2, "BF16": 2 * 4 * 32 * 2, "Q8_0": 2 * 4 * 34, "Q8_B8": 2 * 4 * 40}
	conf := filepath.Join(t.TempDir(), "q8.yaml")
	if err := os.WriteFile(conf, []byte("memory:\n  kv_dtype: q8_0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "F32"},
		{[]string{"-kv-dtype", "f16"}, "F16"},
		{[]string{"-kv-dtype", "BF16"}, "BF16"},
		{[]string{"-kv-dtype", "q8_0"}, "Q8_0"},
		{[]string{"-kv-dtype", "q8_b8"}, "Q8_B8"},
		{[]string{"-config", conf}, "Q8_0"},
		{[]string{"-config", conf, "-kv-dtype", "f16"}, "F16"},
	} {
		t.Run(strings.Join(append([]string{"run"}, c.args...), " "), func(t *testing.T) {
			args := append([]string{"-model", dir, "-device", "cpu", "-ids", ids, "-max-new-tokens", "4", "-json", "-gpu-memory-limit", "1GiB"}, c.args...)
			stdout, _, err := runArgs(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			var r report
			if err := json.Unmarshal([]byte(stdout), &r); err != nil {
				t.Fatal(err)
			}
			if r.KVDType != c.want {
				t.Errorf("kv_dtype %q, want %q", r.KVDType, c.want)
			}
			if r.Plan == nil {
				t.Fatal("no plan in the report")
			}
			if got, want := r.Plan.KVCacheBytes, 9*perPos[c.want]; got != want {
				t.Errorf("plan's KV cache %d bytes, want %d (9 positions of %d)", got, want, perPos[c.want])
			}
			if len(r.IDs) != steps {
				t.Errorf("%d ids generated, want %d", len(r.IDs), steps)
			}
		})
	}
	_, _, err := runArgs(t, "-model", dir, "-device", "cpu", "-ids", ids, "-kv-dtype", "q4_0")
	var ue cli.UsageError
	if err == nil || !strings.Contains(err.Error(), "-kv-dtype") || !errors.As(err, &ue) {
		t.Errorf("-kv-dtype q4_0: %v, want a usage error naming -kv-dtype", err)
	}
}
