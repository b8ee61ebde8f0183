package infile

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/strata-llm/strata/internal/filetest"
)

// TestRefusesNonRegular: a named pipe, a directory and a device are refused
// with one line naming them, at once (a named pipe opened for reading would
// block); a regular file and a link to one are read.
func TestRefusesNonRegular(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	os.WriteFile(file, []byte("data"), 0o644)
	link := filepath.Join(dir, "link")
	os.Symlink(file, link)
	fifo := filepath.Join(dir, "fifo")
	filetest.Mkfifo(t, fifo)
	for _, tc := range []struct {
		path, what string
	}{
		{file, ""},
		{link, ""},
		{fifo, "a named pipe"},
		{dir, "a directory"},
		{"/dev/null", "a device"},
	} {
		done := make(chan error, 1)
		go func() {
			_, err := ReadFile(context.Background(), tc.path)
			done <- err
		}()
		select {
		case err := <-done:
			if tc.what == "" {
				if err != nil {
					t.Errorf("%s: %v", tc.path, err)
				}
				continue
			}
			if !errors.Is(err, ErrNotRegular) || !strings.Contains(err.Error(), tc.path) || !strings.Contains(err.Error(), tc.what) || strings.Contains(err.Error(), "\n") {
				t.Errorf("%s: error %v, want one line naming it as %s", tc.path, err, tc.what)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("reading %s hangs", tc.path)
		}
	}
	fsys := fstest.MapFS{"a": {Data: []byte("x")}, "d": {Mode: os.ModeDir}}
	if _, err := ReadFileFS(fsys, "d"); !errors.Is(err, ErrNotRegular) {
		t.Errorf("ReadFileFS(directory) = %v", err)
	}
	if b, err := ReadFileFS(fsys, "a"); err != nil || string(b) != "x" {
		t.Errorf("ReadFileFS = %q, %v", b, err)
	}
}

func TestReadFileContext(t *testing.T) {
	p := filepath.Join(t.TempDir(), "big")
	want := bytes.Repeat([]byte("0123456789abcdef"), (piece+100)/16)
	os.WriteFile(p, want, 0o644)
	got, err := ReadFile(context.Background(), p)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes (%v), want %d", len(got), err, len(want))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := ReadFile(ctx, p); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	if _, err := Reader(ctx, bytes.NewReader(want)).Read(make([]byte, 10)); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Reader: %v", err)
	}
}
