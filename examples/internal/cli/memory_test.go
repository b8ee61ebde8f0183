package cli

import (
	"strings"
	"testing"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/paging"
)

// TestCheckPlacement: the hybrid and cpu strategies and the unified
// memory modes are usage errors on the CPU, and pass on a GPU.
func TestCheckPlacement(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mem   engine.Memory
		specs []string
		err   string
	}{
		{"balanced on cpu", engine.Memory{Strategy: paging.StrategyBalanced}, []string{"cpu"}, ""},
		{"hybrid on cpu", engine.Memory{Strategy: paging.StrategyHybrid}, []string{"cpu"}, "-offload hybrid computes beside a GPU"},
		{"cpu strategy on cpu devices", engine.Memory{Strategy: paging.StrategyCPU}, []string{"cpu:0", "cpu:1"}, "-offload cpu computes beside a GPU"},
		{"hybrid on cuda", engine.Memory{Strategy: paging.StrategyHybrid}, []string{"cuda"}, ""},
		{"unified on cpu", engine.Memory{Mode: paging.ModeUnified}, []string{"cpu"}, "-memory-mode unified needs a device with unified memory"},
		{"explicit on cpu", engine.Memory{Mode: paging.ModeExplicit}, []string{"cpu"}, ""},
		{"unified on cuda", engine.Memory{Mode: paging.ModeUnified}, []string{"cuda:1"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckPlacement(tc.mem, tc.specs)
			if tc.err == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !IsUsage(err) || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("CheckPlacement = %v, want a usage error with %q", err, tc.err)
			}
		})
	}
}
