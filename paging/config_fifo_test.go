//go:build unix

package paging

import (
	"errors"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/strata-llm/strata/internal/infile"
)

// TestLoadConfigFileFIFO: a named pipe as the config file is refused at
// once, not read (which would wait for a writer for ever).
func TestLoadConfigFileFIFO(t *testing.T) {
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Skip("no named pipes here:", err)
	}
	done := make(chan error, 1)
	go func() { _, err := LoadConfigFile(p); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, infile.ErrNotRegular) {
			t.Fatalf("err = %v, want ErrNotRegular", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("LoadConfigFile blocked on a named pipe")
	}
}
