package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// snapshotJSON is testSnapshot as JSON, edited by fn.
func snapshotJSON(t *testing.T, fn func(m map[string]any)) string {
	t.Helper()
	data, err := json.Marshal(testSnapshot())
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	fn(m)
	if data, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// event returns testSnapshot's event i from the JSON map.
func event(m map[string]any, i int) map[string]any { return m["events"].([]any)[i].(map[string]any) }

// runBad runs memviz on in and checks it fails with one line containing
// want, writing nothing.
func runBad(t *testing.T, in, want string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "out.svg")
	done := make(chan error, 1)
	go func() { done <- run([]string{in, "-o", out}, io.Discard) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("memviz %s hangs", in)
	}
	switch {
	case err == nil:
		t.Fatalf("memviz %s succeeded", in)
	case strings.Contains(err.Error(), "\n"):
		t.Errorf("error of several lines: %q", err)
	case !strings.Contains(err.Error(), want):
		t.Errorf("error %q does not say %q", err, want)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("an output was written: %v", err)
	}
}

// TestBadSnapshots: each damaged or wrong snapshot is refused with one
// line naming the problem.
func TestBadSnapshots(t *testing.T) {
	good := snapshotJSON(t, func(map[string]any) {})
	for _, tc := range []struct {
		name, data, want string
	}{
		{"empty file", "", "empty input"},
		{"blank file", " \n\t", "empty input"},
		{"truncated", good[:len(good)/2], "truncated"},
		{"truncated header", `{"device": "cpu", "limit_bytes": 10`, "truncated"},
		{"not JSON", "{not json", "invalid JSON"},
		{"an array", "[]", "want an object"},
		{"a string", `"snapshot"`, "want an object"},
		{"other JSON", `{"x": 1}`, `no "device" field`},
		{"data after", good + "{}", "after the snapshot"},
		{"events twice", strings.Replace(good, `"events":`, `"events":[],"events":`, 1), `"events" appears twice`},
		{"limit a string", snapshotJSON(t, func(m map[string]any) { m["limit_bytes"] = "lots" }), `field "limit_bytes"`},
		{"events an object", snapshotJSON(t, func(m map[string]any) { m["events"] = map[string]any{} }), "an array of events"},
		{"closed a number", snapshotJSON(t, func(m map[string]any) { m["closed"] = 1 }), `field "closed"`},
		{"time a string", snapshotJSON(t, func(m map[string]any) { event(m, 3)["t_ns"] = "soon" }), "event 3"},
		{"event a number", snapshotJSON(t, func(m map[string]any) { m["events"].([]any)[2] = 7 }), "event 2"},
		{"negative limit", snapshotJSON(t, func(m map[string]any) { m["limit_bytes"] = -1 }), "limit_bytes of -1"},
		{"negative peak", snapshotJSON(t, func(m map[string]any) { m["peak_bytes"] = -5 }), "peak_bytes of -5"},
		{"negative bytes", snapshotJSON(t, func(m map[string]any) { event(m, 1)["bytes"] = -300 }), "alloc of -300 bytes"},
		{"negative stats", snapshotJSON(t, func(m map[string]any) {
			m["categories"].([]any)[0].(map[string]any)["reserved_bytes"] = -1
		}), "kv cache: a count of -1"},
		{"charge above bytes", snapshotJSON(t, func(m map[string]any) { event(m, 1)["charged"] = 301 }), "alloc of 300 bytes charges 301"},
		{"free that charges", snapshotJSON(t, func(m map[string]any) {
			ev := event(m, len(m["events"].([]any))-1)
			ev["charged"] = ev["bytes"]
		}), "unreserve of 400 bytes charges 400"},
		{"unknown category", snapshotJSON(t, func(m map[string]any) { event(m, 1)["category"] = "gpu stuff" }), `unknown category "gpu stuff"`},
		{"no category", snapshotJSON(t, func(m map[string]any) { delete(event(m, 1), "category") }), `alloc: unknown category ""`},
		{"unknown category in stats", snapshotJSON(t, func(m map[string]any) {
			m["categories"].([]any)[0].(map[string]any)["category"] = "cache"
		}), `unknown category "cache"`},
		{"unknown kind", snapshotJSON(t, func(m map[string]any) { event(m, 2)["kind"] = "teleport" }), `unknown kind "teleport"`},
		{"time backwards", snapshotJSON(t, func(m map[string]any) { event(m, 5)["t_ns"] = 1 }), "time goes backwards"},
		{"negative time", snapshotJSON(t, func(m map[string]any) { event(m, 0)["t_ns"] = -1 }), "negative time"},
		{"layer below -1", snapshotJSON(t, func(m map[string]any) { event(m, 2)["layer"] = -7 }), "layer -7"},
		{"free before alloc", snapshotJSON(t, func(m map[string]any) {
			evs := m["events"].([]any)
			last := evs[len(evs)-1]
			last.(map[string]any)["t_ns"] = 0
			m["events"] = append([]any{last}, evs...)
		}), "does not start from an empty device"},
		{"overflowing charges", snapshotJSON(t, func(m map[string]any) {
			for _, i := range []int{0, 1} {
				event(m, i)["bytes"], event(m, i)["charged"] = 1<<62, 1<<62
			}
		}), "more than 2^62 bytes charged"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := filepath.Join(t.TempDir(), "snap.json")
			if err := os.WriteFile(in, []byte(tc.data), 0o644); err != nil {
				t.Fatal(err)
			}
			runBad(t, in, tc.want)
		})
	}
	t.Run("directory", func(t *testing.T) { runBad(t, t.TempDir(), "is a directory") })
	t.Run("missing", func(t *testing.T) { runBad(t, filepath.Join(t.TempDir(), "none.json"), "no such file") })
}

// TestOldSnapshot: a snapshot written before the closed field existed
// still draws.
func TestOldSnapshot(t *testing.T) {
	snap := testSnapshot()
	snap.Closed = nil
	svg, _ := draw(t, snap)
	if !strings.Contains(svg, `data-category="kv cache"`) || strings.Contains(svg, `class="leak"`) {
		t.Error("an old snapshot is not drawn, or its live bytes are called a leak")
	}
}
