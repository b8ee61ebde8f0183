package loader

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/tensor"
)

// MaxHeaderBytes caps the JSON header of a safetensors file. A larger
// declared length is rejected before anything is allocated.
const MaxHeaderBytes = 100 << 20

// readPiece is the largest single read; context cancellation is checked
// between pieces.
const readPiece = 16 << 20

// TensorInfo locates one tensor's bytes: Size bytes at absolute offset
// Offset of the weight file File (a base name inside the model directory).
type TensorInfo struct {
	Name   string
	DType  tensor.DType
	Shape  tensor.Shape
	File   string
	Offset int64
	Size   int64

	// qkHeads is set on the query and key projections of a GGUF file of
	// the llama architecture, whose rows are stored in llama.cpp's order:
	// the number of heads the rows are un-permuted in, 0 for none.
	qkHeads int
}

// String describes the tensor and where its bytes are.
func (t *TensorInfo) String() string {
	return fmt.Sprintf("%s %v %v (%s @%d+%d)", t.Name, t.DType, t.Shape, t.File, t.Offset, t.Size)
}

// File is an open safetensors file whose header has been read and
// validated. Tensor bytes are read on demand. A File is safe for concurrent
// use.
type File struct {
	Path     string
	Metadata map[string]string // the header's __metadata__, nil if none

	tensors []*TensorInfo // by offset
	byName  map[string]*TensorInfo
	r       readerAtCloser
	size    int64

	closeOnce sync.Once
	closeErr  error
	closed    chan struct{}
}

// readerAtCloser is what a File reads through: an *os.File, or a file of
// an fs.FS that has ReadAt (embed.FS's).
type readerAtCloser interface {
	io.ReaderAt
	io.Closer
}

// OpenSafetensors opens a safetensors file and validates its header: the
// header length, the JSON, every tensor's dtype and shape against its byte
// span, and that the spans lie inside the file without overlapping. A path
// that is not a regular file (a named pipe, a device, a directory) is
// refused before it is opened.
func OpenSafetensors(path string) (*File, error) {
	f, err := infile.Open(path)
	if err != nil {
		if errors.Is(err, infile.ErrNotRegular) {
			return nil, &fileError{file: path, kind: ErrNotRegular, msg: strings.TrimPrefix(err.Error(), path+": ")}
		}
		return nil, fmt.Errorf("loader: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("loader: %w", err)
	}
	return newFile(path, mapOrFile(f, st.Size()), st.Size())
}

// newFile validates the header of the safetensors file r of size bytes;
// it closes r when that fails.
func newFile(path string, r readerAtCloser, size int64) (*File, error) {
	tensors, meta, err := ReadHeader(r, size, path)
	if err != nil {
		r.Close()
		return nil, err
	}
	sf := &File{Path: path, Metadata: meta, tensors: tensors, byName: make(map[string]*TensorInfo, len(tensors)),
		r: r, size: size, closed: make(chan struct{})}
	for _, t := range tensors {
		sf.byName[t.Name] = t
	}
	return sf, nil
}

// ReadHeader reads and validates the header of a safetensors file of size
// bytes, read through r. name is used in error messages, and its base name
// is recorded as each TensorInfo's File. The tensors are returned in offset
// order with absolute offsets.
func ReadHeader(r io.ReaderAt, size int64, name string) ([]*TensorInfo, map[string]string, error) {
	bad := func(tensor, format string, args ...any) error {
		return &fileError{file: name, tensor: tensor, kind: ErrFormat, msg: fmt.Sprintf(format, args...)}
	}
	if size < 8 {
		return nil, nil, bad("", "file is %d bytes, too short for a safetensors header", size)
	}
	var lenBuf [8]byte
	if _, err := r.ReadAt(lenBuf[:], 0); err != nil {
		return nil, nil, &fileError{file: name, kind: err, msg: "reading header length: " + err.Error()}
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	switch {
	case n > uint64(size-8):
		return nil, nil, bad("", "header length %d runs past the end of the file (%d bytes)", n, size)
	case n > MaxHeaderBytes:
		return nil, nil, bad("", "header length %d exceeds the limit of %d bytes", n, MaxHeaderBytes)
	case n < 2:
		return nil, nil, bad("", "header length %d is too short for a JSON object", n)
	}
	hdr := make([]byte, n)
	if _, err := r.ReadAt(hdr, 8); err != nil {
		return nil, nil, &fileError{file: name, kind: err, msg: "reading header: " + err.Error()}
	}
	dataStart := 8 + int64(n)
	dataLen := size - dataStart
	base := filepath.Base(name)

	dec := json.NewDecoder(bytes.NewReader(hdr))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, nil, bad("", "header is not a JSON object")
	}
	var (
		meta    map[string]string
		tensors []*TensorInfo
		seen    = map[string]bool{}
	)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, bad("", "bad JSON in header: %v", err)
		}
		key := tok.(string) // object keys are always strings
		if seen[key] {
			return nil, nil, bad(key, "listed twice in the header")
		}
		seen[key] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, nil, bad("", "bad JSON in header: %v", err)
		}
		if key == "__metadata__" {
			if err := json.Unmarshal(raw, &meta); err != nil {
				return nil, nil, bad("", "__metadata__ is not a map of strings: %v", err)
			}
			continue
		}
		t, err := parseEntry(raw, dataStart, dataLen)
		if err != nil {
			return nil, nil, bad(key, "%v", err)
		}
		t.Name, t.File = key, base
		tensors = append(tensors, t)
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, nil, bad("", "bad JSON in header: object not closed")
	}
	if rest := bytes.TrimRight(hdr[dec.InputOffset():], " \t\r\n\x00"); len(rest) > 0 {
		return nil, nil, bad("", "bad JSON in header: %d bytes of trailing data", len(rest))
	}

	// Spans must not overlap. Sort by start; empty tensors overlap nothing.
	slices.SortStableFunc(tensors, func(a, b *TensorInfo) int {
		if a.Offset != b.Offset {
			return cmpInt64(a.Offset, b.Offset)
		}
		return cmpInt64(a.Size, b.Size)
	})
	var prev *TensorInfo
	for _, t := range tensors {
		if t.Size == 0 {
			continue
		}
		if prev != nil && t.Offset < prev.Offset+prev.Size {
			return nil, nil, bad(t.Name, "data_offsets [%d, %d] overlap tensor %s [%d, %d]",
				t.Offset-dataStart, t.Offset-dataStart+t.Size, prev.Name, prev.Offset-dataStart, prev.Offset-dataStart+prev.Size)
		}
		if prev == nil || t.Offset+t.Size > prev.Offset+prev.Size {
			prev = t
		}
	}
	return tensors, meta, nil
}

func cmpInt64(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

type entryJSON struct {
	DType       *string `json:"dtype"`
	Shape       []int64 `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

// parseEntry checks one tensor's header entry against the data region.
func parseEntry(raw json.RawMessage, dataStart, dataLen int64) (*TensorInfo, error) {
	var e entryJSON
	if err := json.Unmarshal(raw, &e); err != nil {
		return nil, fmt.Errorf("bad header entry: %v", err)
	}
	if e.DType == nil {
		return nil, errors.New("header entry has no dtype")
	}
	dt, ok := safetensorsDTypes[*e.DType]
	if !ok {
		return nil, fmt.Errorf("unsupported dtype %q (supported: F32, F16, BF16, I32, I64)", *e.DType)
	}
	if e.Shape == nil {
		return nil, errors.New("header entry has no shape")
	}
	shape := make(tensor.Shape, len(e.Shape))
	for i, d := range e.Shape {
		if d < 0 || d > math.MaxInt32 {
			return nil, fmt.Errorf("bad dimension %d in shape %v", d, e.Shape)
		}
		shape[i] = int(d)
	}
	if len(e.DataOffsets) != 2 {
		return nil, fmt.Errorf("data_offsets must be [begin, end], got %v", e.DataOffsets)
	}
	begin, end := e.DataOffsets[0], e.DataOffsets[1]
	if begin < 0 || end < begin {
		return nil, fmt.Errorf("bad data_offsets [%d, %d]", begin, end)
	}
	if end > dataLen {
		return nil, fmt.Errorf("data_offsets [%d, %d] run past the end of the data (%d bytes after the header)", begin, end, dataLen)
	}
	elems := shape.NumElements()
	if elems < 0 || elems > math.MaxInt64/int64(dt.Size()) {
		return nil, fmt.Errorf("shape %v is too large", shape)
	}
	if want := elems * int64(dt.Size()); want != end-begin {
		return nil, fmt.Errorf("shape %v of %v needs %d bytes but data_offsets [%d, %d] span %d", shape, dt, want, begin, end, end-begin)
	}
	return &TensorInfo{DType: dt, Shape: shape, Offset: dataStart + begin, Size: end - begin}, nil
}

var safetensorsDTypes = map[string]tensor.DType{
	"F32": tensor.F32, "F16": tensor.F16, "BF16": tensor.BF16, "I32": tensor.I32, "I64": tensor.I64,
}

// Tensors returns the file's tensors in offset order. Callers must not
// modify them.
func (f *File) Tensors() []*TensorInfo { return f.tensors }

// Tensor returns the named tensor's location.
func (f *File) Tensor(name string) (*TensorInfo, bool) {
	t, ok := f.byName[name]
	return t, ok
}

// ReadInto reads t's bytes into dst, which must be exactly t.Size long.
// The bytes are returned as stored: a File may hold values other than
// weights (reference logits, gradients), where infinities can be right.
// Model's reads check that weights are finite.
func (f *File) ReadInto(ctx context.Context, t *TensorInfo, dst []byte) error {
	return f.readInto(ctx, t, dst, false)
}

func (f *File) readInto(ctx context.Context, t *TensorInfo, dst []byte, check bool) error {
	if int64(len(dst)) != t.Size {
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("destination is %d bytes, tensor is %d", len(dst), t.Size)}
	}
	return f.readRange(ctx, t, 0, dst, check)
}

// ReadRange reads len(dst) bytes of t starting off bytes into the tensor.
func (f *File) ReadRange(ctx context.Context, t *TensorInfo, off int64, dst []byte) error {
	return f.readRange(ctx, t, off, dst, false)
}

// readRange reads len(dst) bytes of t from offset off, in Hugging Face's
// row order (see readPermuted). With check, an element of a float tensor
// that the range holds whole and that is a NaN or an infinity, or a block
// of a quantized tensor whose scale is, is an error (a *NonFiniteError).
func (f *File) readRange(ctx context.Context, t *TensorInfo, off int64, dst []byte, check bool) error {
	if t.qkHeads > 0 {
		return f.readPermuted(ctx, t, off, dst, check)
	}
	return f.readStored(ctx, t, off, dst, check)
}

// readStored is readRange of the bytes as the file stores them.
func (f *File) readStored(ctx context.Context, t *TensorInfo, off int64, dst []byte, check bool) error {
	select {
	case <-f.closed:
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrClosed, msg: "file is closed"}
	default:
	}
	if off < 0 || off > t.Size || int64(len(dst)) > t.Size-off { // no off+len: it can overflow
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("range [%d, %d) outside the tensor's %d bytes", off, off+int64(len(dst)), t.Size)}
	}
	if t.Offset < 0 || t.Offset+t.Size > f.size {
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("bytes [%d, %d) outside the file's %d bytes", t.Offset, t.Offset+t.Size, f.size)}
	}
	size := int64(max(t.DType.BlockBytes(), 1))
	for done := 0; done < len(dst); {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Pieces after the first start on an element (a block) of the
		// tensor, so that the check below sees every one the range holds
		// whole.
		n := min(readPiece-int((off+int64(done))%size), len(dst)-done)
		if _, err := f.r.ReadAt(dst[done:done+n], t.Offset+off+int64(done)); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			select {
			case <-f.closed:
				return &fileError{file: f.Path, tensor: t.Name, kind: ErrClosed, msg: "file is closed"}
			default:
			}
			return &fileError{file: f.Path, tensor: t.Name, kind: err, msg: "read: " + err.Error()}
		}
		if check {
			if err := f.checkFinite(t, off+int64(done), dst[done:done+n]); err != nil {
				return err
			}
		}
		done += n
	}
	return nil
}

// checkFinite returns a *NonFiniteError when one of the elements of t that
// b, the tensor's bytes from offset at, holds whole is a NaN or an
// infinity. readRange runs it on each piece right after reading it.
func (f *File) checkFinite(t *TensorInfo, at int64, b []byte) error {
	if t.DType.IsQuantized() {
		return f.checkScales(t, at, b)
	}
	if !t.DType.IsFloat() {
		return nil
	}
	size := int64(t.DType.Size())
	skip := (size - at%size) % size // bytes of an element begun before b
	if skip >= int64(len(b)) {
		return nil
	}
	b = b[skip:]
	i := tensor.FirstNonFinite(t.DType, b)
	if i < 0 {
		return nil
	}
	var bits uint32
	for k := range size {
		bits |= uint32(b[int64(i)*size+k]) << (8 * k)
	}
	return &NonFiniteError{File: f.Path, Tensor: t.Name, DType: t.DType,
		Index: (at+skip)/size + int64(i), Value: tensor.ElementF64(t.DType, b, i), Bits: bits}
}

// ReadTensor reads the named tensor into a new host tensor of its stored
// dtype.
func (f *File) ReadTensor(ctx context.Context, name string) (*tensor.Tensor, error) {
	t, ok := f.byName[name]
	if !ok {
		return nil, &fileError{file: f.Path, tensor: name, kind: ErrMismatch, msg: "no such tensor"}
	}
	out := tensor.New(t.DType, t.Shape)
	if err := f.ReadInto(ctx, t, out.Bytes()); err != nil {
		return nil, err
	}
	return out, nil
}

// Close closes the file. It is safe to call more than once; reads after
// Close return an error wrapping ErrClosed.
func (f *File) Close() error {
	f.closeOnce.Do(func() {
		close(f.closed)
		f.closeErr = f.r.Close()
	})
	return f.closeErr
}
