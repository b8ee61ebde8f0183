package loader

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strconv"
	"sync"
)

// MmapEnv names the environment variable that, set to 0, makes Open read
// weight files with pread (os.File.ReadAt) instead of copying from a
// read-only mapping of them. It is read when a file is opened.
const MmapEnv = "STRATA_MMAP"

// errMapFault is the error of a read whose mapped pages could not be read
// (the file shrank after it was opened, or its storage failed).
// It wraps io.ErrUnexpectedEOF, as a pread of a file that shrank does.
var errMapFault = fmt.Errorf("fault reading the mapped file (did it shrink after it was opened?): %w", io.ErrUnexpectedEOF)

// mappedFile reads a weight file by copying from a read-only mapping of
// it: no system call and no page-cache lookup per read, and Go's copy of
// large blocks (non-temporal stores) moves about a third less memory than
// the kernel's copy of a pread. The pager's staging ring reads every
// streamed layer from the page cache for every token (the aggressive
// strategy), on many goroutines at once, where memory bandwidth is the
// limit. A fault in the mapping (a file truncated under the reader) is an
// error, not a crash; Close waits for the reads under way before it
// unmaps.
type mappedFile struct {
	f    *os.File
	mu   sync.RWMutex // held for reading by each copy, for writing by Close
	data []byte       // nil once closed
}

// mapOrFile returns a mapping of f, of size bytes, or f itself when the
// platform cannot map it, the file is empty, or MmapEnv is "0".
func mapOrFile(f *os.File, size int64) readerAtCloser {
	if os.Getenv(MmapEnv) == "0" || size <= 0 || strconv.IntSize < 64 {
		return f
	}
	data, err := mapFile(f, size)
	if err != nil {
		return f // reads go through pread as before
	}
	return &mappedFile{f: f, data: data}
}

func (m *mappedFile) ReadAt(p []byte, off int64) (n int, err error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.data == nil {
		return 0, os.ErrClosed
	}
	if off < 0 {
		return 0, fmt.Errorf("read at negative offset %d", off)
	}
	if off >= int64(len(m.data)) {
		return 0, io.EOF
	}
	defer func() {
		if r := recover(); r != nil {
			n, err = 0, errMapFault
		}
	}()
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	n = copy(p, m.data[off:])
	if n < len(p) {
		err = io.EOF
	}
	return n, err
}

func (m *mappedFile) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.data == nil {
		return os.ErrClosed
	}
	err := unmapFile(m.data)
	m.data = nil
	return errors.Join(err, m.f.Close())
}
