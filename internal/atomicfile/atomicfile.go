// Package atomicfile writes output files so that nothing the user had is
// lost: the bytes go to a fresh temporary file in the destination's
// directory, which is synced and then renamed over the destination. A
// failed write (a full disk, a cancelled run) leaves the old file as it
// was and no temporary file behind; two writers to one path each rename a
// complete file, so the path never holds a broken one; a symbolic link at
// the destination is replaced, never written through.
//
// It also answers the question every command with outputs must ask first:
// is this output one of the run's inputs (CheckNotInput)?
package atomicfile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Write creates a fresh temporary file beside path, lets fill write it,
// syncs it and renames it over path. When fill or any step fails, the
// temporary file is removed and path is untouched.
func Write(path string, fill func(w io.Writer) error) (err error) {
	dir, base := filepath.Split(path)
	if base == "" {
		return fmt.Errorf("%s: not a file name", path)
	}
	if dir == "" {
		dir = "."
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return fmt.Errorf("%s: is a directory", path)
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if err = fill(f); err != nil {
		return err
	}
	if err = f.Chmod(0o644); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, path); err != nil {
		return err
	}
	syncDir(dir)
	return nil
}

// WriteFile is Write for bytes already in memory, like os.WriteFile.
func WriteFile(path string, data []byte) error {
	return Write(path, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// syncDir makes a rename durable. Failure is not reported: some file
// systems cannot sync a directory, and the file itself is complete.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}

// ErrIsInput is wrapped by CheckNotInput.
var ErrIsInput = errors.New("is one of the run's inputs")

// CheckNotInput refuses an output path that names one of the run's input
// files or directories (the same file through any path or link). Callers
// list every file they read: the model's shards, config and tokenizer, a
// data file. flag names the output in the error ("-o").
func CheckNotInput(flag, out string, inputs ...string) error {
	if out == "" {
		return nil
	}
	ost, err := os.Stat(out)
	if err != nil {
		return nil // nothing there yet: not an input
	}
	for _, in := range inputs {
		if in == "" {
			continue
		}
		if ist, err := os.Stat(in); err == nil && os.SameFile(ost, ist) {
			return fmt.Errorf("%s %s: %w (%s)", flag, out, ErrIsInput, in)
		}
	}
	return nil
}
