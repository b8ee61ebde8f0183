package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteReplacesAndCleansUp(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "out.bin")
	if err := WriteFile(p, []byte("old")); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("disk full")
	err := Write(p, func(w io.Writer) error {
		w.Write([]byte("half"))
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v, want %v", err, boom)
	}
	if b, _ := os.ReadFile(p); string(b) != "old" {
		t.Fatalf("after a failed write the file holds %q, want the old %q", b, "old")
	}
	if err := WriteFile(p, []byte("new")); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "new" {
		t.Fatalf("file holds %q, want %q", b, "new")
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("directory holds %d entries, want only the output: %v", len(ents), ents)
	}
}

func TestWriteReplacesLinkNotTarget(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "precious")
	os.WriteFile(target, []byte("keep"), 0o644)
	link := filepath.Join(dir, "out")
	if err := os.Symlink(target, link); err != nil {
		t.Skip("no symlinks here:", err)
	}
	if err := WriteFile(link, []byte("new")); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Fatalf("the link's target was overwritten: %q", b)
	}
	if st, _ := os.Lstat(link); st.Mode()&os.ModeSymlink != 0 {
		t.Fatal("the link is still a link")
	}
}

func TestWriteRefusesDirectory(t *testing.T) {
	if err := WriteFile(t.TempDir(), nil); err == nil {
		t.Fatal("writing over a directory succeeded")
	}
}

func TestCheckNotInput(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "model.safetensors")
	os.WriteFile(in, []byte("x"), 0o644)
	link := filepath.Join(dir, "alias")
	os.Symlink(in, link)
	for _, tc := range []struct {
		out  string
		fail bool
	}{
		{in, true},
		{link, true},
		{filepath.Join(dir, ".", "model.safetensors"), true},
		{dir, true},
		{filepath.Join(dir, "new.safetensors"), false},
	} {
		err := CheckNotInput("-o", tc.out, in, dir)
		if (err != nil) != tc.fail || tc.fail && !errors.Is(err, ErrIsInput) {
			t.Errorf("CheckNotInput(%s) = %v, want failure %v", tc.out, err, tc.fail)
		}
	}
}
