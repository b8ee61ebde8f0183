package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// writeLargeSnapshot writes a snapshot of at least size bytes in the
// indented form WriteSnapshot uses: a ring and a KV cache, then layers
// streamed through the ring with activations coming and going. It returns
// the path and the number of events.
func writeLargeSnapshot(t testing.TB, dir string, size int64) (string, int64) {
	t.Helper()
	path := filepath.Join(dir, "large.json")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cw := &countingWriter{w: f}
	w := bufio.NewWriter(cw)
	fmt.Fprintf(w, "{\n \"device\": \"cuda:0\",\n \"limit_bytes\": %d,\n \"used_bytes\": 0,\n \"peak_bytes\": %d,\n \"start\": \"2026-01-01T00:00:00Z\",\n \"categories\": [],\n \"closed\": true,\n \"events\": [", 3<<30, 5<<28+1<<20)
	var n, tns int64
	ev := func(kind, cat string, layer int, bytes, charged int64) {
		if n > 0 {
			w.WriteString(",")
		}
		n++
		tns += 1000
		fmt.Fprintf(w, "\n  {\n   \"t_ns\": %d,\n   \"kind\": %q,\n   \"device\": \"cuda:0\",\n   \"category\": %q,\n   \"layer\": %d,\n   \"bytes\": %d,\n   \"charged\": %d\n  }", tns, kind, cat, layer, bytes, charged)
	}
	ev("reserve", "streamed weights", -1, 1<<30, 1<<30)
	ev("alloc", "kv cache", -1, 1<<28, 1<<28)
	for cw.n+int64(w.Buffered()) < size {
		for l := range 32 {
			ev("alloc", "streamed weights", l, 1<<25, 0)
			ev("alloc", "activations", l, 1<<20, 1<<20)
			ev("free", "activations", l, 1<<20, -(1 << 20))
			ev("free", "streamed weights", l, 1<<25, 0)
		}
	}
	ev("free", "kv cache", -1, 1<<28, -(1 << 28))
	ev("unreserve", "streamed weights", -1, 1<<30, -(1 << 30))
	w.WriteString("\n ]\n}\n")
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	return path, n
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// heapProbe reads through r and, every `every` bytes, measures the live
// heap (after a collection) to find its largest value during the read.
type heapProbe struct {
	r           io.Reader
	every, next int64
	read        int64
	maxLive     uint64
}

func (p *heapProbe) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.read += int64(n)
	if p.read >= p.next {
		p.next += p.every
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		p.maxLive = max(p.maxLive, ms.HeapAlloc)
	}
	return n, err
}

// TestStreamingMemory: reading a snapshot keeps neither its bytes nor its
// events: the live heap stays far below the file's size, and so do the
// bytes allocated along the way.
func TestStreamingMemory(t *testing.T) {
	const size = 32 << 20
	path, events := writeLargeSnapshot(t, t.TempDir(), size)
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	probe := &heapProbe{r: f, every: 2 << 20}
	_, h, err := readHistory(probe, plotWidth(1100))
	if err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if h.events != events || h.peak != 5<<28+1<<20 {
		t.Fatalf("read %d events, peak %d; wrote %d, peak %d", h.events, h.peak, events, 5<<28+1<<20)
	}
	live := int64(probe.maxLive) - int64(before.HeapAlloc)
	alloc := int64(after.TotalAlloc - before.TotalAlloc)
	t.Logf("%d MiB, %d events: live heap grew by at most %d KiB; %d MiB allocated", probe.read>>20, events, live>>10, alloc>>20)
	if live > size/16 {
		t.Errorf("the live heap grew by %d KiB reading %d MiB: the events are kept", live>>10, probe.read>>20)
	}
	if alloc > size/2 {
		t.Errorf("%d MiB allocated reading %d MiB", alloc>>20, probe.read>>20)
	}
}

// BenchmarkReadSnapshot reads a 150 MB snapshot (-benchtime 1x is enough),
// reporting the largest live heap and the bytes allocated.
func BenchmarkReadSnapshot(b *testing.B) {
	path, _ := writeLargeSnapshot(b, b.TempDir(), 150e6)
	fi, err := os.Stat(path)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(fi.Size())
	var maxLive uint64
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for b.Loop() {
		f, err := os.Open(path)
		if err != nil {
			b.Fatal(err)
		}
		probe := &heapProbe{r: f, every: 8 << 20}
		if _, _, err := readHistory(probe, plotWidth(1100)); err != nil {
			b.Fatal(err)
		}
		f.Close()
		maxLive = max(maxLive, probe.maxLive)
	}
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(int64(maxLive)-int64(before.HeapAlloc))/(1<<20), "live-MiB")
	b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(b.N)/(1<<20), "alloc-MiB/op")
}
