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

// guard runs fn, which reads m.data, holding off Close, and returns
// errMapFault when a read faults; ErrClosed after Close.
func (m *mappedFile) guard(fn func(data []byte)) (err error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.data == nil {
		return os.ErrClosed
	}
	defer func() {
		if r := recover(); r != nil {
			err = errMapFault
		}
	}()
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	fn(m.data)
	return nil
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

// Mapped returns t's stored bytes in place, in the read-only mapping of
// its file, checked once as ReadInto checks them; ok is false when they
// cannot be given in place: the file is not mapped (MmapEnv is 0, the
// platform has no mappings, the model was opened from an fs.FS) or its
// rows are reordered on reading (a GGUF llama's query and key
// projections). The bytes must not be written, and are valid until Close:
// a caller that page-locks them (MappedRegions) copies from them with no
// read at all.
func (m *Model) Mapped(t *TensorInfo) (b []byte, ok bool, err error) {
	f, err := m.fileOf(t)
	if err != nil {
		return nil, false, err
	}
	mf, mapped := f.r.(*mappedFile)
	if !mapped || t.qkHeads > 0 {
		return nil, false, nil
	}
	if t.Offset < 0 || t.Offset+t.Size > f.size {
		return nil, false, &fileError{file: f.Path, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("bytes [%d, %d) outside the file's %d bytes", t.Offset, t.Offset+t.Size, f.size)}
	}
	if _, done := m.checked.Load(t); !done {
		var cerr error
		if err := mf.guard(func(data []byte) { cerr = f.checkFinite(t, 0, data[t.Offset:t.Offset+t.Size]) }); err != nil {
			if errors.Is(err, os.ErrClosed) {
				return nil, false, &fileError{file: f.Path, tensor: t.Name, kind: ErrClosed, msg: "file is closed"}
			}
			return nil, false, &fileError{file: f.Path, tensor: t.Name, kind: io.ErrUnexpectedEOF, msg: "read: " + err.Error()}
		}
		if cerr != nil {
			return nil, false, cerr
		}
		m.checked.Store(t, struct{}{})
	}
	mf.mu.RLock()
	defer mf.mu.RUnlock()
	if mf.data == nil {
		return nil, false, &fileError{file: f.Path, tensor: t.Name, kind: ErrClosed, msg: "file is closed"}
	}
	return mf.data[t.Offset : t.Offset+t.Size : t.Offset+t.Size], true, nil
}

// MappedRegions returns the read-only mappings of the model's weight
// files (nil when none is mapped), for a backend to page-lock
// (tensor.HostRegistrar); Mapped's bytes lie in them. They are valid until
// Close.
func (m *Model) MappedRegions() [][]byte {
	var out [][]byte
	for _, name := range m.names {
		if mf, ok := m.files[name].r.(*mappedFile); ok {
			mf.mu.RLock()
			if mf.data != nil {
				out = append(out, mf.data)
			}
			mf.mu.RUnlock()
		}
	}
	return out
}
