package tokenizer

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestLoadFS: the embedded fixtures' tokenizers, read in place, encode the
// reference cases as the ones read from the source tree do.
func TestLoadFS(t *testing.T) {
	for _, f := range allFixtures(t) {
		sub, err := fs.Sub(fixtures.FS(), f.name)
		if err != nil {
			t.Fatal(err)
		}
		tok, err := LoadFS(sub)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range f.cases {
			got, err := tok.Encode(c.Text, false)
			if err != nil || !equalIDs(got, c.IDs) {
				t.Errorf("%s: Encode(%q) = %v, %v; want %v", f.name, c.Text, got, err, c.IDs)
			}
		}
	}
	if _, err := LoadFS(fixtures.FS()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("LoadFS of a file system without tokenizer.json: %v", err)
	}
}

// TestLoadRefusesNonRegular: a tokenizer file that is a named pipe or a
// directory is refused at once, in one line naming it.
func TestLoadRefusesNonRegular(t *testing.T) {
	for _, name := range []string{TokenizerFile, ConfigFile} {
		for _, kind := range []string{"named pipe", "directory"} {
			t.Run(name+"/"+kind, func(t *testing.T) {
				dir := t.TempDir()
				src := fixtures.Dir(fixtures.TinyLlamaBF16)
				for _, n := range []string{TokenizerFile, ConfigFile} {
					b, _ := os.ReadFile(filepath.Join(src, n))
					os.WriteFile(filepath.Join(dir, n), b, 0o644)
				}
				p := filepath.Join(dir, name)
				os.Remove(p)
				if kind == "named pipe" {
					filetest.Mkfifo(t, p)
				} else {
					os.Mkdir(p, 0o755)
				}
				done := make(chan error, 1)
				go func() {
					_, err := Load(dir)
					done <- err
				}()
				select {
				case err := <-done:
					if !errors.Is(err, infile.ErrNotRegular) || !strings.Contains(err.Error(), p) || strings.Contains(err.Error(), "\n") {
						t.Fatalf("Load: %v; want one line naming %s as not a regular file", err, p)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("Load hangs on a %s", kind)
				}
			})
		}
	}
}
