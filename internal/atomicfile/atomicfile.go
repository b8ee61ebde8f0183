// Package atomicfile writes output files so that nothing the user had is
// lost: the bytes go to a fresh temporary file in the destination's
// directory, which is synced and then renamed over the destination. A
// failed write (a full disk, a cancelled run) leaves the old file as it
// was and no temporary file behind; two writers to one path each rename a
// complete file, so the path never holds a broken one; a symbolic link at
// the destination is replaced, never written through. ReplaceDir does the
// same for a directory written as a whole (a model checkpoint).
//
// It also answers the questions every command with outputs must ask before
// it starts work: can this output be written at all (Check, CheckDir), and
// is it one of the run's inputs (CheckNotInput)?
package atomicfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// File is an output being written: a fresh temporary file beside its
// destination. Commit makes it the destination; Abort removes it. Writers
// that need more than an io.Writer (positioned writes, a CPU profile that
// lasts the whole run) use it; the others use Write.
type File struct {
	*os.File
	path string
	done bool
}

// Create creates a fresh temporary file beside path, which is untouched
// until Commit.
func Create(path string) (*File, error) {
	dir, base := filepath.Split(path)
	if base == "" {
		return nil, fmt.Errorf("%s: not a file name", path)
	}
	if dir == "" {
		dir = "."
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return nil, fmt.Errorf("%s: is a directory", path)
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return nil, err
	}
	return &File{File: f, path: path}, nil
}

// Path is the destination.
func (f *File) Path() string { return f.path }

// Commit syncs the temporary file, closes it and renames it over the
// destination. When any step fails the temporary file is removed and the
// destination is untouched.
func (f *File) Commit() (err error) {
	if f.done {
		return fmt.Errorf("%s: already committed or aborted", f.path)
	}
	defer func() {
		if err != nil {
			f.Abort()
		}
	}()
	if err = f.Chmod(0o644); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(f.Name(), f.path); err != nil {
		return err
	}
	f.done = true
	syncDir(filepath.Dir(f.path))
	return nil
}

// Abort closes and removes the temporary file, leaving the destination as
// it was. It does nothing after Commit, so it can be deferred.
func (f *File) Abort() {
	if f.done {
		return
	}
	f.done = true
	f.Close()
	os.Remove(f.Name())
}

// Write creates a fresh temporary file beside path, lets fill write it,
// syncs it and renames it over path. When fill or any step fails, the
// temporary file is removed and path is untouched.
func Write(path string, fill func(w io.Writer) error) error {
	f, err := Create(path)
	if err != nil {
		return err
	}
	if err := fill(f); err != nil {
		f.Abort()
		return err
	}
	return f.Commit()
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

// Check reports whether an output file can be written at path, so that a
// command finds out before its work rather than after: path names a file
// (not a directory) in an existing directory where a new file can be
// created (a probe file is created and removed). flag names the output in
// the error ("-o").
func Check(flag, path string) error {
	dir, base := filepath.Split(path)
	if base == "" {
		return fmt.Errorf("%s %s: not a file name", flag, path)
	}
	if dir == "" {
		dir = "."
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return fmt.Errorf("%s %s: is a directory", flag, path)
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("%s %s: cannot create files in %s: %w", flag, path, dir, bare(err))
	}
	f.Close()
	os.Remove(f.Name())
	return nil
}

// CheckDir is Check for a directory that ReplaceDir will write: path is
// not a file, and its parent directory exists and accepts new entries.
func CheckDir(flag, path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return fmt.Errorf("%s %s: %w", flag, path, err)
	}
	parent, base := filepath.Split(abs)
	if base == "" {
		return fmt.Errorf("%s %s: not a directory name", flag, path)
	}
	if st, err := os.Stat(abs); err == nil && !st.IsDir() {
		return fmt.Errorf("%s %s: not a directory", flag, path)
	}
	d, err := os.MkdirTemp(parent, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("%s %s: cannot create directories in %s: %w", flag, path, parent, bare(err))
	}
	os.Remove(d)
	return nil
}

// bare drops the path an *fs.PathError repeats: the caller names it.
func bare(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// ReplaceDir writes a directory as a whole: fill writes the new contents
// into a fresh temporary directory beside dir, which then takes dir's
// place in one step (on Linux an atomic exchange; elsewhere two renames,
// with the old directory put back if the second fails). The old contents
// are removed only once the new ones are in place; when fill or any step
// fails, dir is as it was and the temporary directory is removed. A
// symbolic link at dir is replaced, not followed.
func ReplaceDir(dir string, fill func(tmp string) error) error {
	return replaceDir(dir, fill, exchange)
}

func replaceDir(dir string, fill func(tmp string) error, exchange func(a, b string) error) (err error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	parent, base := filepath.Split(abs)
	if base == "" {
		return fmt.Errorf("%s: not a directory name", dir)
	}
	old, statErr := os.Lstat(abs)
	if statErr == nil && !old.IsDir() && old.Mode()&fs.ModeSymlink == 0 {
		return fmt.Errorf("%s: not a directory", dir)
	}
	tmp, err := os.MkdirTemp(parent, "."+base+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	if err = os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	if err = fill(tmp); err != nil {
		return err
	}
	syncDir(tmp)
	if errors.Is(statErr, fs.ErrNotExist) {
		if err = os.Rename(tmp, abs); err != nil {
			return err
		}
		syncDir(parent)
		return nil
	}
	if err = exchange(tmp, abs); err != nil {
		return err
	}
	syncDir(parent)
	// tmp now holds the old contents.
	if rerr := os.RemoveAll(tmp); rerr != nil {
		return fmt.Errorf("%s: written, but the old contents in %s could not be removed: %w", dir, tmp, rerr)
	}
	return nil
}

// renameSwap exchanges a and b with two renames through a fresh name,
// putting b back when the second rename fails.
func renameSwap(a, b string) error {
	parent, base := filepath.Split(b)
	side, err := os.MkdirTemp(parent, "."+base+".old-*")
	if err != nil {
		return err
	}
	os.Remove(side) // a fresh name: os.Rename will not replace a directory
	if err := os.Rename(b, side); err != nil {
		return err
	}
	if err := os.Rename(a, b); err != nil {
		os.Rename(side, b)
		return err
	}
	return os.Rename(side, a)
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
