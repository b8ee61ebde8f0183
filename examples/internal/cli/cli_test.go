package cli

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
)

// TestMessageOneLine checks the line Main prints for errors whose text
// spans lines: a model directory named with a line break, and a wrapped
// error of several lines.
func TestMessageOneLine(t *testing.T) {
	_, _, dirErr := ModelDir(filepath.Join(t.TempDir(), "two\nlines"), "")
	for _, err := range []error{
		dirErr,
		UsageError{fmt.Errorf("config: %w", errors.New("yaml: unmarshal errors:\n  line 2: field x not found"))},
		errors.New("plain"),
	} {
		if err == nil {
			t.Fatal("no error")
		}
		msg := Message("generate", err)
		if strings.ContainsAny(msg, "\r\n") || !strings.HasPrefix(msg, "generate: ") {
			t.Errorf("Message(%q) = %q", err, msg)
		}
	}
	if got := Message("generate", errors.New("a:\n b\nc")); got != "generate: a: b; c" {
		t.Errorf("Message = %q", got)
	}
}
