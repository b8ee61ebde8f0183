package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/internal/filetest"
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

// TestWriteFailures: however a write fails (the filler's error, a full
// disk, a destination that cannot be replaced), the old file stays byte for
// byte and no temporary file remains; a write that succeeds replaces it.
func TestWriteFailures(t *testing.T) {
	big := make([]byte, 1<<16)
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, p string) bool // false: the test ran elsewhere
		write func(p string) error
	}{
		{"filler fails", nil, func(p string) error {
			return Write(p, func(w io.Writer) error { w.Write(big); return errors.New("boom") })
		}},
		{"disk full", func(t *testing.T, p string) bool { return filetest.LimitFileSize(t, 1<<12) }, func(p string) error { return WriteFile(p, big) }},
		{"positioned writes, disk full", func(t *testing.T, p string) bool { return filetest.LimitFileSize(t, 1<<12) }, func(p string) error {
			f, err := Create(p)
			if err != nil {
				return err
			}
			defer f.Abort()
			if _, err := f.WriteAt(big, 1<<13); err != nil {
				return err
			}
			return f.Commit()
		}},
		{"aborted", nil, func(p string) error {
			f, err := Create(p)
			if err != nil {
				return err
			}
			f.Write(big)
			f.Abort()
			f.Abort()
			return errors.New("aborted")
		}},
		{"destination is a directory", func(t *testing.T, p string) bool {
			os.Remove(p)
			os.Mkdir(p, 0o755)
			os.WriteFile(filepath.Join(p, "inside"), []byte("old"), 0o644)
			return true
		}, func(p string) error { return WriteFile(p, big) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "out.bin")
			os.WriteFile(p, []byte("old"), 0o644)
			if tc.setup != nil && !tc.setup(t, p) {
				return
			}
			before := filetest.Tree(t, dir)
			if err := tc.write(p); err == nil {
				t.Fatal("the write succeeded")
			}
			filetest.SameTree(t, dir, before)
			filetest.NoTemps(t, dir)
		})
	}
}

func TestCreateCommit(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "out.bin")
	os.WriteFile(p, []byte("old"), 0o600)
	f, err := Create(p)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("new"), 0)
	if b, _ := os.ReadFile(p); string(b) != "old" {
		t.Fatalf("before Commit the destination holds %q", b)
	}
	if err := f.Commit(); err != nil {
		t.Fatal(err)
	}
	f.Abort() // after Commit: nothing
	if b, _ := os.ReadFile(p); string(b) != "new" {
		t.Fatalf("after Commit the destination holds %q", b)
	}
	if err := f.Commit(); err == nil {
		t.Error("a second Commit succeeded")
	}
	filetest.NoTemps(t, dir)
}

func TestCheck(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	os.WriteFile(file, nil, 0o644)
	for _, tc := range []struct {
		path string
		ok   bool
	}{
		{filepath.Join(dir, "new"), true},
		{file, true},
		{dir, false},
		{filepath.Join(dir, "missing", "out"), false},
		{filepath.Join(file, "out"), false},
		{dir + "/", false},
	} {
		err := Check("-o", tc.path)
		if (err == nil) != tc.ok {
			t.Errorf("Check(%s) = %v, want ok %v", tc.path, err, tc.ok)
		}
		if err != nil && (!strings.HasPrefix(err.Error(), "-o ") || strings.Contains(err.Error(), "\n")) {
			t.Errorf("Check(%s) = %q: want one line naming the flag", tc.path, err)
		}
	}
	filetest.NoTemps(t, dir)
}

func TestCheckDir(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	os.WriteFile(file, nil, 0o644)
	for _, tc := range []struct {
		path string
		ok   bool
	}{
		{filepath.Join(dir, "new"), true},
		{dir, true},
		{file, false},
		{filepath.Join(dir, "missing", "out"), false},
		{filepath.Join(file, "out"), false},
	} {
		if err := CheckDir("-save", tc.path); (err == nil) != tc.ok {
			t.Errorf("CheckDir(%s) = %v, want ok %v", tc.path, err, tc.ok)
		}
	}
	filetest.NoTemps(t, dir)
}

// TestReplaceDir: a failure anywhere leaves the old directory complete and
// no temporary directory; success replaces the whole directory, through the
// exchange and through the two-rename fallback.
func TestReplaceDir(t *testing.T) {
	write := func(files ...string) func(string) error {
		return func(tmp string) error {
			for _, f := range files {
				if err := os.WriteFile(filepath.Join(tmp, f), []byte("new "+f), 0o644); err != nil {
					return err
				}
			}
			return nil
		}
	}
	fail := func(tmp string) error {
		write("a", "b")(tmp)
		return errors.New("boom")
	}
	for _, tc := range []struct {
		name   string
		exists bool
		fill   func(string) error
		swap   func(a, b string) error
		ok     bool
	}{
		{"new directory", false, write("a"), exchange, true},
		{"replace", true, write("a", "c"), exchange, true},
		{"replace by renames", true, write("a", "c"), renameSwap, true},
		{"fill fails", true, fail, exchange, false},
		{"fill fails, nothing there", false, fail, exchange, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := filepath.Join(parent, "model")
			if tc.exists {
				os.Mkdir(dir, 0o755)
				os.WriteFile(filepath.Join(dir, "a"), []byte("old a"), 0o644)
				os.WriteFile(filepath.Join(dir, "b"), []byte("old b"), 0o644)
			}
			before := filetest.Tree(t, dir)
			err := replaceDir(dir, tc.fill, tc.swap)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok %v", err, tc.ok)
			}
			if tc.ok {
				want, _ := os.MkdirTemp(parent, "want")
				tc.fill(want)
				filetest.SameTree(t, dir, filetest.Tree(t, want))
				os.RemoveAll(want)
				if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o755 {
					t.Errorf("the new directory: %v %v", st.Mode(), err)
				}
			} else {
				filetest.SameTree(t, dir, before)
			}
			filetest.NoTemps(t, parent)
		})
	}
}

func TestReplaceDirRefusesFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "file")
	os.WriteFile(p, []byte("keep"), 0o644)
	if err := ReplaceDir(p, func(string) error { return nil }); err == nil {
		t.Fatal("a file was replaced by a directory")
	}
	filetest.SameTree(t, dir, map[string]string{"file": "keep"})
}
