// Package filetest helps tests check that outputs lose nothing: it
// records a directory's files to compare byte for byte, lists the
// temporary files a write left behind, makes writes fail as on a full disk,
// and makes named pipes to feed where a regular file is expected.
package filetest

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Tree returns the contents of every regular file under root (root itself
// may be a file), by path relative to root; nil when root does not exist.
func Tree(t testing.TB, root string) map[string]string {
	t.Helper()
	if _, err := os.Lstat(root); os.IsNotExist(err) {
		return nil
	}
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		out[rel] = string(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// SameTree fails the test unless root holds exactly the files of want
// (from Tree), byte for byte.
func SameTree(t testing.TB, root string, want map[string]string) {
	t.Helper()
	got := Tree(t, root)
	if len(got) != len(want) {
		t.Errorf("%s holds %d files, want %d as before", root, len(got), len(want))
	}
	for name, w := range want {
		g, ok := got[name]
		switch {
		case !ok:
			t.Errorf("%s: %s is gone", root, name)
		case g != w:
			t.Errorf("%s: %s changed (%d bytes, was %d)", root, name, len(g), len(w))
		}
	}
}

// Temps lists the entries under dir (recursively) whose names mark them as
// temporary: "*.tmp", ".X.tmp-*" or ".X.old-*".
func Temps(t testing.TB, dir string) []string {
	t.Helper()
	var out []string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		n := d.Name()
		if strings.HasSuffix(n, ".tmp") || strings.Contains(n, ".tmp-") || strings.Contains(n, ".old-") {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// NoTemps fails the test when dir holds temporary files.
func NoTemps(t testing.TB, dir string) {
	t.Helper()
	if tmp := Temps(t, dir); len(tmp) > 0 {
		t.Errorf("temporary files left behind: %v", tmp)
	}
}
