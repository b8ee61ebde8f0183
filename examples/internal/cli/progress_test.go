package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestProgressOffTheTerminal: a bar on a buffer, a file or a pipe writes
// nothing at all, however often it is updated.
func TestProgressOffTheTerminal(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	var buf bytes.Buffer
	for _, tc := range []struct {
		name string
		w    interface{ Write([]byte) (int, error) }
	}{{"buffer", &buf}, {"file", f}, {"pipe", w}} {
		if IsTerminal(tc.w) {
			t.Errorf("%s: IsTerminal is true", tc.name)
		}
		p := NewProgress(tc.w, "loading", false)
		if p.On() {
			t.Errorf("%s: the bar is on", tc.name)
		}
		for i := range int64(1000) {
			p.Bytes(i, 999)
			p.Update(i, 999, "x")
			p.Clear()
		}
		p.Done()
	}
	st, _ := f.Stat()
	if buf.Len() != 0 || st.Size() != 0 {
		t.Errorf("the bar wrote %d bytes to a buffer and %d to a file; want none", buf.Len(), st.Size())
	}
}

// TestProgressOnTheTerminal: a bar that is on redraws at most ten times a
// second, always draws the last update, and Clear and Done leave the line
// as they say.
func TestProgressOnTheTerminal(t *testing.T) {
	var buf bytes.Buffer
	p := newProgress(&buf, "training", true)
	for i := range int64(1000) {
		p.Update(i+1, 1000, "step")
	}
	frames := strings.Count(buf.String(), "\r\033[K")
	if frames < 2 || frames > 20 {
		t.Errorf("%d frames for 1000 quick updates; want the first, the last and few between", frames)
	}
	if !strings.HasSuffix(buf.String(), "training [==============================] step") {
		t.Errorf("last frame %q; want the full bar", buf.String()[max(0, buf.Len()-60):])
	}
	buf.Reset()
	p.Clear()
	p.Clear()
	if buf.String() != "\r\033[K" {
		t.Errorf("Clear twice wrote %q; want one erase", buf.String())
	}
	p.Update(5, 10, "half")
	buf.Reset()
	p.Done()
	if buf.String() != "\n" {
		t.Errorf("Done wrote %q; want a newline after the bar", buf.String())
	}
}
