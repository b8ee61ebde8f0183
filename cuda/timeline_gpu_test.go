//go:build cuda

package cuda

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestTimeline: with TimelineEnv set, Close writes a record of each copy
// up (h2d: when queued, when the copy engine ran it), each wait of the
// compute stream for one (stall) and each download (d2h, with when the
// host had it) and each mark (tensor.Mark), in order of their times: a
// copy runs after it was queued and the host has a download after the
// device copied it. Without the variable nothing is written.
func TestTimeline(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tl.tsv")
	t.Setenv(TimelineEnv, path)
	b, err := Open(0)
	if errors.Is(err, ErrNoDevice) {
		t.Skipf("no CUDA device: %v", err)
	}
	if err != nil {
		t.Fatalf("Open(0): %v", err)
	}
	const n = 1 << 20
	pinned, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := b.Alloc(tensor.F32, tensor.Shape{n})
	if err != nil {
		t.Fatal(err)
	}
	host := make([]byte, 4*n)
	for range 3 {
		ready, err := b.UploadAsync(context.Background(), dst, 0, pinned)
		if err != nil {
			t.Fatal(err)
		}
		if err := ready(); err != nil {
			t.Fatal(err)
		}
		if err := b.DownloadComputed(host, dst); err != nil {
			t.Fatal(err)
		}
		tensor.Mark(b, "downloaded")
	}
	b.Free(dst)
	if err := b.FreePinned(pinned); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(path + "*") // path, or path.N where another backend of the process kept one before
	if len(files) != 1 {
		t.Fatalf("timelines after Close: %v, want one", files)
	}
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) < 1 || lines[0] != "kind\tbytes\thost_ns\thost_end_ns\tdev_start_ns\tdev_end_ns" {
		t.Fatalf("header %q", lines[0])
	}
	count := map[string]int{}
	num := func(s string) int64 {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("%q is no number: %v", s, err)
		}
		return v
	}
	for _, l := range lines[1:] {
		f := strings.Split(l, "\t")
		if len(f) != 6 {
			t.Fatalf("record %q: %d fields", l, len(f))
		}
		count[f[0]]++
		if strings.HasPrefix(f[0], "mark:") { // ours, and the backend's own (h2d:called, ...)
			if f[1] != "0" || num(f[2]) < 0 || f[3] != "-" || f[4] != "-" || f[5] != "-" {
				t.Errorf("record %q: want a mark with the host's time alone", l)
			}
			continue
		}
		host, start, end := num(f[2]), num(f[4]), num(f[5])
		if start > end || host < 0 {
			t.Errorf("record %q: the device's span ends before it starts", l)
		}
		switch f[0] {
		case "h2d":
			if num(f[1]) != 4*n || start < host-50_000 { // the clocks agree to within microseconds
				t.Errorf("record %q: want %d bytes copied after they were queued", l, 4*n)
			}
		case "d2h":
			if num(f[1]) != 4*n || num(f[3]) < end-50_000 {
				t.Errorf("record %q: want %d bytes the host has after the device copied them", l, 4*n)
			}
		}
	}
	if count["h2d"] != 3 || count["d2h"] != 3 || count["stall"] != 3 || count["mark:downloaded"] != 3 {
		t.Errorf("records %v, want 3 of each of h2d, stall, d2h and mark:downloaded", count)
	}

	t.Setenv(TimelineEnv, "")
	if b2 := openGPU(t); b2.tl != nil {
		t.Errorf("a backend opened without %s keeps a timeline", TimelineEnv)
	}
}
