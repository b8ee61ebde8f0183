package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// mistralFixture writes a copy of the BF16 fixture as a Mistral model whose
// sliding attention window is 8 positions, shorter than its 256 positions.
func mistralFixture(t *testing.T) string {
	t.Helper()
	dir, err := fixtures.Extract(fixtures.TinyLlamaBF16, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "config.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg := map[string]any{}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["architectures"], cfg["model_type"], cfg["sliding_window"] = []string{"MistralForCausalLM"}, "mistral", 8
	delete(cfg, "attention_bias")
	delete(cfg, "mlp_bias")
	if raw, err = json.Marshal(cfg); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestEngineSessionRefused opens the engine with a context past the
// sliding window, as a caller that skipped run's check would: the session
// is refused with its own error, and the cleanup of what was built before
// it (budget, server, warmed-up layers) does not panic.
func TestEngineSessionRefused(t *testing.T) {
	lm, err := loader.Open(mistralFixture(t))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	for _, devices := range []int{1, 2} {
		var backends []tensor.Backend
		for range devices {
			backends = append(backends, tensor.NewCPU(1))
		}
		mem := &memory{budgets: make([]int64, devices), strategy: paging.StrategyNone, mode: paging.ModeExplicit}
		eng, err := openEngine(context.Background(), lm, cfg, backends, mem, 20, 20, false, newProgress(nil, true, ""))
		if !errors.Is(err, nn.ErrContextTooLong) || eng != nil {
			t.Errorf("%d devices: engine %v, error %v; want nn.ErrContextTooLong", devices, eng, err)
		}
		if err != nil && !strings.Contains(err.Error(), "sliding attention window of 8") {
			t.Errorf("%d devices: error %q does not name the window", devices, err)
		}
	}
	// close copes with an engine built only in part, and with none.
	var none *engine
	if err := none.close(); err != nil {
		t.Error(err)
	}
	if err := (&engine{}).close(); err != nil {
		t.Error(err)
	}
}
