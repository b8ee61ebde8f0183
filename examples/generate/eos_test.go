package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
)

// TestEOSNotPrinted: the embedded model's greedy continuation of make
// run's prompt ends with its end-of-sequence token, which ends the text
// (stop reason eos, its id in the JSON ids) without being printed.
func TestEOSNotPrinted(t *testing.T) {
	args := []string{"-prompt", "The secret of life is", "-max-new-tokens", "24", "-quiet"}
	var text bytes.Buffer
	if err := run(context.Background(), args, &text, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	var js bytes.Buffer
	if err := run(context.Background(), append(args, "-json"), &js, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	var r struct {
		IDs        []int32 `json:"ids"`
		StopReason string  `json:"stop_reason"`
	}
	if err := json.Unmarshal(js.Bytes(), &r); err != nil {
		t.Fatalf("%v: %s", err, js.Bytes())
	}
	if r.StopReason != "eos" || len(r.IDs) == 0 {
		t.Fatalf("stop reason %q after %d ids: the test needs a continuation that ends at EOS", r.StopReason, len(r.IDs))
	}
	if s := text.String(); strings.Contains(s, "</s>") || strings.TrimSpace(s) == "" {
		t.Errorf("printed %q: want the text without its end-of-sequence token", s)
	}
}
