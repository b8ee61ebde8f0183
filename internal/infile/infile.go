// Package infile opens input files only when they are regular files.
// Opening a named pipe blocks until something writes to it, reading a
// device may never end, and a directory is no file: each is refused before
// it is opened, with an error naming the path and what it is.
package infile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// ErrNotRegular is wrapped by the errors for a path that is not a regular
// file.
var ErrNotRegular = errors.New("not a regular file")

// CheckMode returns an error naming name when mode is not a regular file's.
func CheckMode(name string, mode fs.FileMode) error {
	if mode.IsRegular() {
		return nil
	}
	return fmt.Errorf("%s: %w (%s)", name, ErrNotRegular, Describe(mode))
}

// Describe says what kind of file mode is: "a named pipe", "a directory".
func Describe(mode fs.FileMode) string {
	switch {
	case mode.IsDir():
		return "a directory"
	case mode&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case mode&fs.ModeSocket != 0:
		return "a socket"
	case mode&fs.ModeDevice != 0, mode&fs.ModeCharDevice != 0:
		return "a device"
	case mode&fs.ModeSymlink != 0:
		return "a symbolic link"
	case mode.IsRegular():
		return "a regular file"
	}
	return "mode " + mode.String()
}

// Check stats path (following links) and refuses anything but a regular
// file.
func Check(path string) (fs.FileInfo, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if err := CheckMode(path, st.Mode()); err != nil {
		return nil, err
	}
	return st, nil
}

// Open opens path for reading if it is a regular file. The file is
// checked before it is opened (so a named pipe does not block) and again
// after, in case the path changed between.
func Open(path string) (*os.File, error) {
	if _, err := Check(path); err != nil {
		return nil, err
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err == nil {
		err = CheckMode(path, st.Mode())
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ReadFile reads the regular file at path, like os.ReadFile, checking ctx
// between pieces of 16 MiB so that a large input does not hold up a
// cancelled run.
func ReadFile(ctx context.Context, path string) ([]byte, error) {
	f, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var size int64
	if st, err := f.Stat(); err == nil {
		size = st.Size()
	}
	buf := make([]byte, 0, size+512)
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n, err := io.ReadFull(f, buf[len(buf):min(cap(buf), len(buf)+piece)])
		buf = buf[:len(buf)+n]
		switch {
		case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
			return buf, nil
		case err != nil:
			return nil, err
		}
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)] // grow: the file grew
		}
	}
}

const piece = 16 << 20

// ReadFileFS is ReadFile for a file of fsys.
func ReadFileFS(fsys fs.FS, name string) ([]byte, error) {
	st, err := fs.Stat(fsys, name)
	if err != nil {
		return nil, err
	}
	if err := CheckMode(name, st.Mode()); err != nil {
		return nil, err
	}
	return fs.ReadFile(fsys, name)
}

// Reader wraps r so that reads fail with ctx's error once ctx is done: a
// decoder reading a large input stops when the run is cancelled.
func Reader(ctx context.Context, r io.Reader) io.Reader { return ctxReader{ctx, r} }

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p[:min(len(p), piece)])
}
