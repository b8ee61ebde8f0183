package paging

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestSnapshotClosedAndLeaked: a snapshot says whether the budget was
// closed, and Close records what it found still allocated.
func TestSnapshotClosedAndLeaked(t *testing.T) {
	for _, leak := range []bool{false, true} {
		bg := newBudget(t, newFake(), 1<<20, "fake:0")
		bg.RecordHistory(100)
		kv, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{256})
		if err != nil {
			t.Fatal(err)
		}
		if s := bg.Snapshot(); s.Closed == nil || *s.Closed {
			t.Fatalf("open budget: closed %v", s.Closed)
		}
		if !leak {
			bg.Free(kv)
		}
		if err := bg.Close(); errors.Is(err, ErrLeak) != leak {
			t.Fatalf("leak %v: Close: %v", leak, err)
		}
		var buf bytes.Buffer
		if err := bg.WriteSnapshot(&buf); err != nil {
			t.Fatal(err)
		}
		s, err := ReadSnapshot(&buf)
		if err != nil {
			t.Fatal(err)
		}
		want := int64(0)
		if leak {
			want = 1024
		}
		if s.Closed == nil || !*s.Closed || s.Categories[KVCache].Leaked != want {
			t.Errorf("leak %v: closed %v, leaked %d; want closed, %d leaked", leak, s.Closed, s.Categories[KVCache].Leaked, want)
		}
	}
}

// TestScanSnapshot: ScanSnapshot hands over the events in order without
// keeping them, stops at fn's error, and reads snapshots older than the
// closed field.
func TestScanSnapshot(t *testing.T) {
	bg := newBudget(t, newFake(), 1<<20, "fake:0")
	bg.RecordHistory(100)
	for range 3 {
		a, err := bg.Alloc(Activations, tensor.F32, tensor.Shape{64})
		if err != nil {
			t.Fatal(err)
		}
		bg.Free(a)
	}
	var buf bytes.Buffer
	if err := bg.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	data := buf.String()
	var got []Event
	s, err := ScanSnapshot(strings.NewReader(data), func(ev Event) error {
		got = append(got, ev)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := bg.Snapshot().Events
	if len(got) != len(want) || s.Events != nil || s.Device != "fake:0" {
		t.Fatalf("%d events handed over, %d kept; want %d, none kept", len(got), len(s.Events), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("event %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	stop := errors.New("stop")
	n := 0
	if _, err := ScanSnapshot(strings.NewReader(data), func(Event) error { n++; return stop }); err != stop || n != 1 {
		t.Errorf("fn's error: %v after %d events", err, n)
	}
	old := strings.Replace(data, "\"closed\": false,", "", 1)
	if old == data {
		t.Fatal("no closed field written")
	}
	s, err = ReadSnapshot(strings.NewReader(old))
	if err != nil {
		t.Fatalf("snapshot without the closed field: %v", err)
	}
	if s.Closed != nil {
		t.Errorf("snapshot without the closed field: closed %v", *s.Closed)
	}
}

// TestScanSnapshotRefuses: a damaged snapshot is refused with one line
// naming the problem.
func TestScanSnapshotRefuses(t *testing.T) {
	const head = `{"device": "cpu", "limit_bytes": 100, "peak_bytes": 0, "events": [`
	ev := func(s string) string { return head + s + `]}` }
	for _, tc := range []struct{ name, data, want string }{
		{"empty", "", "empty input"},
		{"truncated", head + `{"t_ns": 1, "kind": "alloc"`, "truncated"},
		{"invalid", `{"device": cpu}`, "invalid JSON"},
		{"not an object", `[1, 2]`, "want an object"},
		{"not a snapshot", `{"x": 1}`, `no "device" field`},
		{"trailing data", ev(``) + `x`, "after the snapshot"},
		{"wrong type", `{"device": "cpu", "limit_bytes": "10", "peak_bytes": 0, "events": []}`, `field "limit_bytes"`},
		{"negative limit", `{"device": "cpu", "limit_bytes": -10, "peak_bytes": 0, "events": []}`, "limit_bytes of -10"},
		{"event of a wrong type", ev(`{"t_ns": "1", "kind": "alloc"}`), "event 0"},
		{"negative bytes", ev(`{"t_ns": 1, "kind": "alloc", "category": "kv cache", "bytes": -3}`), "alloc of -3 bytes"},
		{"unknown category", ev(`{"t_ns": 1, "kind": "alloc", "category": "kv", "bytes": 3, "charged": 3}`), `unknown category "kv"`},
		{"unknown kind", ev(`{"t_ns": 1, "kind": "grow"}`), `unknown kind "grow"`},
		{"charge of a hit", ev(`{"t_ns": 1, "kind": "hit", "charged": 4}`), "hit of 0 bytes charges 4"},
		{"free that adds", ev(`{"t_ns": 1, "kind": "free", "category": "kv cache", "bytes": 4, "charged": 4}`), "free of 4 bytes charges 4"},
		{"charge above bytes", ev(`{"t_ns": 1, "kind": "reserve", "category": "kv cache", "bytes": 4, "charged": 5}`), "reserve of 4 bytes charges 5"},
		{"time backwards", ev(`{"t_ns": 5, "kind": "hit"}, {"t_ns": 4, "kind": "hit"}`), "event 1 at byte"},
		{"negative time", ev(`{"t_ns": -5, "kind": "hit"}`), "negative time"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ScanSnapshot(strings.NewReader(tc.data), func(Event) error { return nil })
			if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
				t.Errorf("error %v, want one line saying %q", err, tc.want)
			}
		})
	}
}
