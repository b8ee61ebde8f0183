//go:build unix

package main

import (
	"path/filepath"
	"syscall"
	"testing"
)

// TestSpecialFiles: a pipe or a device is refused before it is opened, so
// that memviz neither hangs on a pipe with no writer nor reads a device.
func TestSpecialFiles(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "snap.json")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	runBad(t, fifo, "is a named pipe")
	runBad(t, "/dev/null", "is a device")
}
