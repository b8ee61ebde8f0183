package loader

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sync"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// GGUF files (llama.cpp's format): a header of typed metadata key-value
// pairs and tensor descriptions, then the tensor data, each tensor at an
// aligned offset. Versions 2 and 3 are read (they differ only in that v3
// allows big-endian files, which are refused here); version 1, with 32-bit
// lengths, is refused. Everything the header declares is checked before it
// is trusted: lengths and counts against the bytes left, the total header
// against MaxGGUFHeaderBytes, tensor types against the ggml table, element
// counts for overflow, every tensor's bytes inside the file, aligned and
// not overlapping another's.

// ggufMagic opens every GGUF file.
const ggufMagic = "GGUF"

// Limits of the GGUF reader.
const (
	// MaxGGUFHeaderBytes caps the metadata and tensor descriptions of a
	// GGUF file (a large vocabulary with merges takes a few tens of MB).
	// Every length is checked against what is left of it before anything
	// is allocated, so a hostile header costs at most a few times this.
	MaxGGUFHeaderBytes = 256 << 20
	// GGUFDefaultAlignment is the data alignment of a file without
	// general.alignment.
	GGUFDefaultAlignment = 32
	// ggufMaxDims is ggml's limit on tensor dimensions.
	ggufMaxDims = 4
	// ggufMaxNameBytes is the spec's limit on a tensor name.
	ggufMaxNameBytes = 64
	// ggufMaxKeyBytes is the spec's limit on a metadata key.
	ggufMaxKeyBytes = 65535
	// ggufMaxNesting bounds arrays of arrays.
	ggufMaxNesting = 8
)

// GGUFValueType is the type of a metadata value, numbered as in the file.
type GGUFValueType uint32

// The metadata value types.
const (
	GGUFTypeUint8 GGUFValueType = iota
	GGUFTypeInt8
	GGUFTypeUint16
	GGUFTypeInt16
	GGUFTypeUint32
	GGUFTypeInt32
	GGUFTypeFloat32
	GGUFTypeBool
	GGUFTypeString
	GGUFTypeArray
	GGUFTypeUint64
	GGUFTypeInt64
	GGUFTypeFloat64
)

var ggufTypeNames = [...]string{"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array", "uint64", "int64", "float64"}

func (t GGUFValueType) String() string {
	if int(t) < len(ggufTypeNames) {
		return ggufTypeNames[t]
	}
	return fmt.Sprintf("value type %d", uint32(t))
}

// size is the encoded size of a fixed-size value; 0 for strings and arrays.
func (t GGUFValueType) size() int {
	switch t {
	case GGUFTypeUint8, GGUFTypeInt8, GGUFTypeBool:
		return 1
	case GGUFTypeUint16, GGUFTypeInt16:
		return 2
	case GGUFTypeUint32, GGUFTypeInt32, GGUFTypeFloat32:
		return 4
	case GGUFTypeUint64, GGUFTypeInt64, GGUFTypeFloat64:
		return 8
	}
	return 0
}

// minSize is the fewest bytes one value of type t can take.
func (t GGUFValueType) minSize() int64 {
	switch t {
	case GGUFTypeString:
		return 8 // the length
	case GGUFTypeArray:
		return 12 // element type and length
	}
	return int64(t.size())
}

// GGUFArray is an array value. Values is a slice of the Go type of Elem:
// []uint8, []int8, []uint16, []int16, []uint32, []int32, []float32,
// []bool, []string, []GGUFArray (arrays of arrays), []uint64, []int64 or
// []float64.
type GGUFArray struct {
	Elem   GGUFValueType
	Values any
}

// Len is the number of elements.
func (a GGUFArray) Len() int {
	switch v := a.Values.(type) {
	case []uint8:
		return len(v)
	case []int8:
		return len(v)
	case []uint16:
		return len(v)
	case []int16:
		return len(v)
	case []uint32:
		return len(v)
	case []int32:
		return len(v)
	case []float32:
		return len(v)
	case []bool:
		return len(v)
	case []string:
		return len(v)
	case []GGUFArray:
		return len(v)
	case []uint64:
		return len(v)
	case []int64:
		return len(v)
	case []float64:
		return len(v)
	}
	return 0
}

// GGUFKV is one metadata pair. Value has the Go type of its GGUF type:
// uint8, int8, uint16, int16, uint32, int32, float32, bool, string,
// GGUFArray, uint64, int64 or float64.
type GGUFKV struct {
	Key   string
	Value any
}

// ggufTypeOf returns the GGUF type of a Go value, or false.
func ggufTypeOf(v any) (GGUFValueType, bool) {
	switch v.(type) {
	case uint8:
		return GGUFTypeUint8, true
	case int8:
		return GGUFTypeInt8, true
	case uint16:
		return GGUFTypeUint16, true
	case int16:
		return GGUFTypeInt16, true
	case uint32:
		return GGUFTypeUint32, true
	case int32:
		return GGUFTypeInt32, true
	case float32:
		return GGUFTypeFloat32, true
	case bool:
		return GGUFTypeBool, true
	case string:
		return GGUFTypeString, true
	case GGUFArray:
		return GGUFTypeArray, true
	case uint64:
		return GGUFTypeUint64, true
	case int64:
		return GGUFTypeInt64, true
	case float64:
		return GGUFTypeFloat64, true
	}
	return 0, false
}

// GGUFMetadata holds a file's metadata in file order, with typed
// accessors whose errors name the file and the key. A missing key is an
// error wrapping ErrNoKey.
type GGUFMetadata struct {
	file  string
	kvs   []GGUFKV
	index map[string]int
}

// ErrNoKey is wrapped by the metadata accessors when the key is absent.
var ErrNoKey = errors.New("no such metadata key")

// Len is the number of pairs.
func (m *GGUFMetadata) Len() int { return len(m.kvs) }

// KVs returns the pairs in file order. Callers must not modify them.
func (m *GGUFMetadata) KVs() []GGUFKV { return m.kvs }

// Get returns the value of key.
func (m *GGUFMetadata) Get(key string) (any, bool) {
	i, ok := m.index[key]
	if !ok {
		return nil, false
	}
	return m.kvs[i].Value, true
}

func (m *GGUFMetadata) keyErr(key string, kind error, format string, args ...any) error {
	return &fileError{file: m.file, kind: kind, msg: fmt.Sprintf("metadata %s: ", key) + fmt.Sprintf(format, args...)}
}

func (m *GGUFMetadata) get(key string) (any, error) {
	v, ok := m.Get(key)
	if !ok {
		return nil, m.keyErr(key, ErrNoKey, "missing")
	}
	return v, nil
}

func (m *GGUFMetadata) typeErr(key string, v any, want string) error {
	t, _ := ggufTypeOf(v)
	if a, ok := v.(GGUFArray); ok {
		return m.keyErr(key, ErrFormat, "is an array of %v, want %s", a.Elem, want)
	}
	return m.keyErr(key, ErrFormat, "is a %v, want %s", t, want)
}

// String returns a string value.
func (m *GGUFMetadata) String(key string) (string, error) {
	v, err := m.get(key)
	if err != nil {
		return "", err
	}
	s, ok := v.(string)
	if !ok {
		return "", m.typeErr(key, v, "a string")
	}
	return s, nil
}

// Uint returns an integer value of any integer type that is not negative.
func (m *GGUFMetadata) Uint(key string) (uint64, error) {
	v, err := m.get(key)
	if err != nil {
		return 0, err
	}
	u, neg, ok := asInteger(v)
	if !ok {
		return 0, m.typeErr(key, v, "an unsigned integer")
	}
	if neg {
		return 0, m.keyErr(key, ErrFormat, "is %v, want an unsigned integer", v)
	}
	return u, nil
}

// Int returns an integer value of any integer type that fits int64.
func (m *GGUFMetadata) Int(key string) (int64, error) {
	v, err := m.get(key)
	if err != nil {
		return 0, err
	}
	u, neg, ok := asInteger(v)
	if !ok {
		return 0, m.typeErr(key, v, "an integer")
	}
	if neg {
		return -int64(u), nil
	}
	if u > math.MaxInt64 {
		return 0, m.keyErr(key, ErrFormat, "%d does not fit a signed 64-bit integer", u)
	}
	return int64(u), nil
}

// asInteger returns the magnitude and sign of an integer value.
func asInteger(v any) (mag uint64, neg, ok bool) {
	signed := func(x int64) (uint64, bool, bool) {
		if x < 0 {
			return uint64(-(x + 1)) + 1, true, true
		}
		return uint64(x), false, true
	}
	switch x := v.(type) {
	case uint8:
		return uint64(x), false, true
	case uint16:
		return uint64(x), false, true
	case uint32:
		return uint64(x), false, true
	case uint64:
		return x, false, true
	case int8:
		return signed(int64(x))
	case int16:
		return signed(int64(x))
	case int32:
		return signed(int64(x))
	case int64:
		return signed(x)
	}
	return 0, false, false
}

// Float returns a float32 or float64 value.
func (m *GGUFMetadata) Float(key string) (float64, error) {
	v, err := m.get(key)
	if err != nil {
		return 0, err
	}
	switch f := v.(type) {
	case float32:
		return float64(f), nil
	case float64:
		return f, nil
	}
	return 0, m.typeErr(key, v, "a float")
}

// Bool returns a bool value.
func (m *GGUFMetadata) Bool(key string) (bool, error) {
	v, err := m.get(key)
	if err != nil {
		return false, err
	}
	b, ok := v.(bool)
	if !ok {
		return false, m.typeErr(key, v, "a bool")
	}
	return b, nil
}

// Array returns an array value.
func (m *GGUFMetadata) Array(key string) (GGUFArray, error) {
	v, err := m.get(key)
	if err != nil {
		return GGUFArray{}, err
	}
	a, ok := v.(GGUFArray)
	if !ok {
		return GGUFArray{}, m.typeErr(key, v, "an array")
	}
	return a, nil
}

// Strings returns an array of strings (tokenizer.ggml.tokens, merges).
func (m *GGUFMetadata) Strings(key string) ([]string, error) {
	a, err := m.Array(key)
	if err != nil {
		return nil, err
	}
	s, ok := a.Values.([]string)
	if !ok {
		return nil, m.typeErr(key, a, "an array of strings")
	}
	return s, nil
}

// Float32s returns an array of float32 (tokenizer.ggml.scores).
func (m *GGUFMetadata) Float32s(key string) ([]float32, error) {
	a, err := m.Array(key)
	if err != nil {
		return nil, err
	}
	f, ok := a.Values.([]float32)
	if !ok {
		return nil, m.typeErr(key, a, "an array of float32")
	}
	return f, nil
}

// Ints returns an array of any integer type as int64
// (tokenizer.ggml.token_type is int32); a uint64 element beyond int64 is
// an error.
func (m *GGUFMetadata) Ints(key string) ([]int64, error) {
	a, err := m.Array(key)
	if err != nil {
		return nil, err
	}
	conv := func(n int, at func(i int) any) ([]int64, error) {
		out := make([]int64, n)
		for i := range out {
			u, neg, _ := asInteger(at(i))
			switch {
			case neg:
				out[i] = -int64(u)
			case u > math.MaxInt64:
				return nil, m.keyErr(key, ErrFormat, "element %d is %d, beyond a signed 64-bit integer", i, u)
			default:
				out[i] = int64(u)
			}
		}
		return out, nil
	}
	switch v := a.Values.(type) {
	case []uint8:
		return conv(len(v), func(i int) any { return v[i] })
	case []int8:
		return conv(len(v), func(i int) any { return v[i] })
	case []uint16:
		return conv(len(v), func(i int) any { return v[i] })
	case []int16:
		return conv(len(v), func(i int) any { return v[i] })
	case []uint32:
		return conv(len(v), func(i int) any { return v[i] })
	case []int32:
		return conv(len(v), func(i int) any { return v[i] })
	case []uint64:
		return conv(len(v), func(i int) any { return v[i] })
	case []int64:
		return conv(len(v), func(i int) any { return v[i] })
	}
	return nil, m.typeErr(key, a, "an array of integers")
}

// GGUFTensor describes one tensor of a GGUF file.
type GGUFTensor struct {
	Name string
	Type quant.Type
	// Dims in ggml order: Dims[0] is the innermost, contiguous dimension
	// (a linear layer's input features), the reverse of Shape.
	Dims   []int64
	Offset int64 // absolute offset of the first byte in the file
	Size   int64 // bytes
}

// Shape is the tensor's shape in row-major order, outermost first, as
// safetensors and strata write it: [out_features, in_features] for a
// linear weight.
func (t *GGUFTensor) Shape() tensor.Shape {
	s := make(tensor.Shape, len(t.Dims))
	for i, d := range t.Dims {
		s[len(s)-1-i] = int(d)
	}
	return s
}

// NumElements is the product of the dimensions.
func (t *GGUFTensor) NumElements() int64 {
	n := int64(1)
	for _, d := range t.Dims {
		n *= d
	}
	return n
}

// RowBytes is the size of one innermost row (Dims[0] elements); the rows
// of a tensor are whole blocks of its type.
func (t *GGUFTensor) RowBytes() int64 {
	if len(t.Dims) == 0 {
		return t.Size
	}
	n, _ := t.Type.Bytes(t.Dims[0])
	return n
}

func (t *GGUFTensor) String() string {
	return fmt.Sprintf("%s %v %v (@%d+%d)", t.Name, t.Type, t.Shape(), t.Offset, t.Size)
}

// GGUFFile is a GGUF file whose header has been read and validated.
// Tensor bytes are read on demand. It is safe for concurrent use.
type GGUFFile struct {
	Path       string
	Version    uint32
	Alignment  int64
	DataOffset int64 // absolute offset of the data section
	Metadata   *GGUFMetadata

	tensors []*GGUFTensor // in file order
	byName  map[string]*GGUFTensor
	r       io.ReaderAt
	size    int64

	closer    io.Closer
	closeOnce sync.Once
	closeErr  error
	closed    chan struct{}
}

// OpenGGUF opens a GGUF file and validates its header. Only regular files
// are read (a directory, device or pipe is refused before it is opened).
func OpenGGUF(path string) (*GGUFFile, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("loader: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, &fileError{file: path, kind: ErrFormat, msg: "not a regular file (" + fileKind(st.Mode()) + ")"}
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("loader: %w", err)
	}
	st, err = f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = &fileError{file: path, kind: ErrFormat, msg: "not a regular file (" + fileKind(st.Mode()) + ")"}
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	g, err := ParseGGUF(f, st.Size(), path)
	if err != nil {
		f.Close()
		return nil, err
	}
	g.closer = f
	return g, nil
}

func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&os.ModeNamedPipe != 0:
		return "a named pipe"
	case m&os.ModeSocket != 0:
		return "a socket"
	case m&os.ModeDevice != 0:
		return "a device"
	}
	return m.Type().String()
}

// ParseGGUF reads and validates the header of a GGUF file of size bytes
// read through r; name is used in errors. Tensor bytes are read through r
// later, so r must stay valid while the result is used.
func ParseGGUF(r io.ReaderAt, size int64, name string) (*GGUFFile, error) {
	p := &ggufParser{name: name, size: size, limit: min(size, MaxGGUFHeaderBytes),
		br: bufio.NewReaderSize(io.NewSectionReader(r, 0, size), 1<<16)}
	g, err := p.parse()
	if err != nil {
		return nil, err
	}
	g.Path, g.r, g.size, g.closed = name, r, size, make(chan struct{})
	return g, nil
}

// ggufParser reads a header front to back, counting what it has read.
type ggufParser struct {
	name  string
	br    *bufio.Reader
	pos   int64 // bytes read
	size  int64 // of the file
	limit int64 // the header must end here: min(size, MaxGGUFHeaderBytes)
	buf   [8]byte
}

func (p *ggufParser) bad(tensor, format string, args ...any) error {
	return &fileError{file: p.name, tensor: tensor, kind: ErrFormat, msg: fmt.Sprintf(format, args...)}
}

// need checks that n more bytes of header exist before they are read or
// allocated for.
func (p *ggufParser) need(n int64, what string) error {
	left := p.limit - p.pos
	if n <= left {
		return nil
	}
	if p.limit < p.size {
		return p.bad("", "%s at byte %d: %d bytes would take the header past its limit of %d bytes", what, p.pos, n, int64(MaxGGUFHeaderBytes))
	}
	return p.bad("", "%s at byte %d: %d bytes run past the end of the file (%d bytes)", what, p.pos, n, p.size)
}

func (p *ggufParser) read(b []byte, what string) error {
	if err := p.need(int64(len(b)), what); err != nil {
		return err
	}
	if _, err := io.ReadFull(p.br, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return &fileError{file: p.name, kind: err, msg: fmt.Sprintf("reading %s at byte %d: %v", what, p.pos, err)}
	}
	p.pos += int64(len(b))
	return nil
}

func (p *ggufParser) u32(what string) (uint32, error) {
	err := p.read(p.buf[:4], what)
	return binary.LittleEndian.Uint32(p.buf[:4]), err
}

func (p *ggufParser) u64(what string) (uint64, error) {
	err := p.read(p.buf[:8], what)
	return binary.LittleEndian.Uint64(p.buf[:8]), err
}

// str reads a length-prefixed string of at most limit bytes.
func (p *ggufParser) str(what string, limit int64) (string, error) {
	n, err := p.u64(what + " length")
	if err != nil {
		return "", err
	}
	if n > uint64(limit) {
		return "", p.bad("", "%s at byte %d is %d bytes long, more than the %d allowed", what, p.pos-8, n, limit)
	}
	if err := p.need(int64(n), what); err != nil {
		return "", err
	}
	b := make([]byte, n)
	if err := p.read(b, what); err != nil {
		return "", err
	}
	return string(b), nil
}

func (p *ggufParser) parse() (*GGUFFile, error) {
	var magic [4]byte
	if p.size < 4 {
		return nil, p.bad("", "file is %d bytes, too short for a GGUF header", p.size)
	}
	if err := p.read(magic[:], "magic"); err != nil {
		return nil, err
	}
	if string(magic[:]) != ggufMagic {
		return nil, p.bad("", "not a GGUF file (starts with %q, want %q)", magic[:], ggufMagic)
	}
	version, err := p.u32("version")
	if err != nil {
		return nil, err
	}
	switch {
	case version == 2 || version == 3:
	case version == 1:
		return nil, p.bad("", "GGUF version 1 is not supported (only 2 and 3); convert the model again with a current llama.cpp")
	case version&0xffff == 0 && version != 0:
		return nil, p.bad("", "version field reads %#08x, which is version %d byte-swapped: a big-endian GGUF file; only little-endian files are supported",
			version, binary.BigEndian.Uint32(binary.LittleEndian.AppendUint32(nil, version)))
	default:
		return nil, p.bad("", "GGUF version %d is not supported (only 2 and 3)", version)
	}
	nTensors, err := p.u64("tensor count")
	if err != nil {
		return nil, err
	}
	nKV, err := p.u64("metadata count")
	if err != nil {
		return nil, err
	}
	// The smallest pair is a one-byte key, a type and a one-byte value; the
	// smallest tensor description a one-byte name, no dimensions, a type
	// and an offset.
	const minKV, minTensor = 8 + 1 + 4 + 1, 8 + 1 + 4 + 4 + 8
	if left := p.limit - p.pos; nKV > uint64(left/minKV) {
		return nil, p.bad("", "header declares %d metadata pairs; the %d bytes left hold at most %d", nKV, left, left/minKV)
	}
	if left := p.limit - p.pos; nTensors > uint64(left/minTensor) {
		return nil, p.bad("", "header declares %d tensors; the %d bytes left hold at most %d", nTensors, left, left/minTensor)
	}

	// Slices grow with what is read, not with what the header declares.
	const hint = 1024
	meta := &GGUFMetadata{file: p.name, kvs: make([]GGUFKV, 0, min(nKV, hint)), index: make(map[string]int, min(nKV, hint))}
	for i := range nKV {
		key, err := p.str(fmt.Sprintf("metadata key %d", i), ggufMaxKeyBytes)
		if err != nil {
			return nil, err
		}
		if key == "" {
			return nil, p.bad("", "metadata key %d is empty", i)
		}
		if _, dup := meta.index[key]; dup {
			return nil, p.bad("", "metadata key %s appears twice", key)
		}
		t, err := p.u32("metadata " + key + " type")
		if err != nil {
			return nil, err
		}
		v, err := p.value(GGUFValueType(t), key, 0)
		if err != nil {
			return nil, err
		}
		meta.index[key] = len(meta.kvs)
		meta.kvs = append(meta.kvs, GGUFKV{key, v})
	}

	align := int64(GGUFDefaultAlignment)
	if v, ok := meta.Get("general.alignment"); ok {
		a, isU32 := v.(uint32)
		if !isU32 {
			t, _ := ggufTypeOf(v)
			return nil, p.bad("", "metadata general.alignment is a %v, want uint32", t)
		}
		if a == 0 || a&(a-1) != 0 {
			return nil, p.bad("", "metadata general.alignment is %d, not a power of two", a)
		}
		align = int64(a)
	}

	tensors := make([]*GGUFTensor, 0, min(nTensors, hint))
	byName := make(map[string]*GGUFTensor, min(nTensors, hint))
	for i := range nTensors {
		t, err := p.tensorInfo(i)
		if err != nil {
			return nil, err
		}
		if _, dup := byName[t.Name]; dup {
			return nil, p.bad(t.Name, "listed twice")
		}
		byName[t.Name] = t
		tensors = append(tensors, t)
	}

	dataStart := p.pos
	if r := dataStart % align; r != 0 {
		dataStart += align - r
	}
	if len(tensors) > 0 && dataStart > p.size {
		return nil, p.bad("", "data section would start at byte %d (the header ends at %d, aligned to %d), past the end of the file (%d bytes)", dataStart, p.pos, align, p.size)
	}
	dataLen := max(0, p.size-dataStart)
	for _, t := range tensors {
		rel := t.Offset // relative to the data section until now
		if rel%align != 0 {
			return nil, p.bad(t.Name, "data offset %d is not a multiple of the alignment %d", rel, align)
		}
		if rel > dataLen || t.Size > dataLen-rel {
			return nil, p.bad(t.Name, "bytes [%d, %d) of the data section run past its end (%d bytes after byte %d)", rel, uint64(rel)+uint64(t.Size), dataLen, dataStart)
		}
		t.Offset = dataStart + rel
	}
	byOffset := slices.Clone(tensors)
	slices.SortStableFunc(byOffset, func(a, b *GGUFTensor) int { return cmpInt64(a.Offset, b.Offset) })
	var prev *GGUFTensor
	for _, t := range byOffset {
		if t.Size == 0 {
			continue
		}
		if prev != nil && t.Offset < prev.Offset+prev.Size {
			return nil, p.bad(t.Name, "bytes [%d, %d) of the data section overlap tensor %s [%d, %d)",
				t.Offset-dataStart, t.Offset-dataStart+t.Size, prev.Name, prev.Offset-dataStart, prev.Offset-dataStart+prev.Size)
		}
		if prev == nil || t.Offset+t.Size > prev.Offset+prev.Size {
			prev = t
		}
	}
	return &GGUFFile{Version: version, Alignment: align, DataOffset: dataStart, Metadata: meta, tensors: tensors, byName: byName}, nil
}

// value reads one metadata value of type t for key; depth counts the
// arrays around it.
func (p *ggufParser) value(t GGUFValueType, key string, depth int) (any, error) {
	what := "metadata " + key
	if sz := t.size(); sz > 0 {
		b := p.buf[:sz]
		if err := p.read(b, what); err != nil {
			return nil, err
		}
		return decodeFixed(t, b, func() error { return p.bad("", "%s: bool value %d is neither 0 nor 1", what, b[0]) })
	}
	switch t {
	case GGUFTypeString:
		return p.str(what, MaxGGUFHeaderBytes)
	case GGUFTypeArray:
		if depth >= ggufMaxNesting {
			return nil, p.bad("", "%s: arrays nested more than %d deep", what, ggufMaxNesting)
		}
		et, err := p.u32(what + " element type")
		if err != nil {
			return nil, err
		}
		elem := GGUFValueType(et)
		if elem.minSize() == 0 {
			return nil, p.bad("", "%s: array of unknown %v", what, elem)
		}
		n, err := p.u64(what + " array length")
		if err != nil {
			return nil, err
		}
		if left := p.limit - p.pos; n > uint64(left/elem.minSize()) {
			return nil, p.bad("", "%s: array of %d %v needs at least %d bytes per element; %d bytes are left", what, n, elem, elem.minSize(), left)
		}
		return p.array(elem, int(n), key, depth)
	}
	return nil, p.bad("", "%s: unknown %v", what, t)
}

// array reads n elements of type elem (n already checked against the
// bytes left).
func (p *ggufParser) array(elem GGUFValueType, n int, key string, depth int) (GGUFArray, error) {
	what := "metadata " + key
	if sz := elem.size(); sz > 0 {
		raw := make([]byte, n*sz)
		if err := p.read(raw, what); err != nil {
			return GGUFArray{}, err
		}
		vals, err := decodeFixedArray(elem, raw, func(i int) error {
			return p.bad("", "%s: element %d: bool value %d is neither 0 nor 1", what, i, raw[i])
		})
		return GGUFArray{Elem: elem, Values: vals}, err
	}
	switch elem {
	case GGUFTypeString:
		// Grown as elements are read: a string's Go header is larger than
		// its 8-byte length in the file.
		out := make([]string, 0, min(n, 1<<16))
		for range n {
			s, err := p.str(what, MaxGGUFHeaderBytes)
			if err != nil {
				return GGUFArray{}, err
			}
			out = append(out, s)
		}
		return GGUFArray{Elem: elem, Values: out}, nil
	default: // GGUFArray
		out := make([]GGUFArray, 0, min(n, 1<<12))
		for range n {
			v, err := p.value(GGUFTypeArray, key, depth+1)
			if err != nil {
				return GGUFArray{}, err
			}
			out = append(out, v.(GGUFArray))
		}
		return GGUFArray{Elem: elem, Values: out}, nil
	}
}

// decodeFixed decodes one fixed-size little-endian value.
func decodeFixed(t GGUFValueType, b []byte, badBool func() error) (any, error) {
	le := binary.LittleEndian
	switch t {
	case GGUFTypeUint8:
		return b[0], nil
	case GGUFTypeInt8:
		return int8(b[0]), nil
	case GGUFTypeBool:
		if b[0] > 1 {
			return nil, badBool()
		}
		return b[0] == 1, nil
	case GGUFTypeUint16:
		return le.Uint16(b), nil
	case GGUFTypeInt16:
		return int16(le.Uint16(b)), nil
	case GGUFTypeUint32:
		return le.Uint32(b), nil
	case GGUFTypeInt32:
		return int32(le.Uint32(b)), nil
	case GGUFTypeFloat32:
		return math.Float32frombits(le.Uint32(b)), nil
	case GGUFTypeUint64:
		return le.Uint64(b), nil
	case GGUFTypeInt64:
		return int64(le.Uint64(b)), nil
	case GGUFTypeFloat64:
		return math.Float64frombits(le.Uint64(b)), nil
	}
	panic("unreachable")
}

// decodeFixedArray decodes len(raw)/size elements into a typed slice.
func decodeFixedArray(t GGUFValueType, raw []byte, badBool func(i int) error) (any, error) {
	le := binary.LittleEndian
	switch t {
	case GGUFTypeUint8:
		return raw, nil
	case GGUFTypeInt8:
		out := make([]int8, len(raw))
		for i, b := range raw {
			out[i] = int8(b)
		}
		return out, nil
	case GGUFTypeBool:
		out := make([]bool, len(raw))
		for i, b := range raw {
			if b > 1 {
				return nil, badBool(i)
			}
			out[i] = b == 1
		}
		return out, nil
	case GGUFTypeUint16, GGUFTypeInt16:
		u := make([]uint16, len(raw)/2)
		for i := range u {
			u[i] = le.Uint16(raw[2*i:])
		}
		if t == GGUFTypeUint16 {
			return u, nil
		}
		out := make([]int16, len(u))
		for i, v := range u {
			out[i] = int16(v)
		}
		return out, nil
	case GGUFTypeUint32, GGUFTypeInt32, GGUFTypeFloat32:
		switch t {
		case GGUFTypeUint32:
			out := make([]uint32, len(raw)/4)
			for i := range out {
				out[i] = le.Uint32(raw[4*i:])
			}
			return out, nil
		case GGUFTypeInt32:
			out := make([]int32, len(raw)/4)
			for i := range out {
				out[i] = int32(le.Uint32(raw[4*i:]))
			}
			return out, nil
		}
		out := make([]float32, len(raw)/4)
		for i := range out {
			out[i] = math.Float32frombits(le.Uint32(raw[4*i:]))
		}
		return out, nil
	case GGUFTypeUint64:
		out := make([]uint64, len(raw)/8)
		for i := range out {
			out[i] = le.Uint64(raw[8*i:])
		}
		return out, nil
	case GGUFTypeInt64:
		out := make([]int64, len(raw)/8)
		for i := range out {
			out[i] = int64(le.Uint64(raw[8*i:]))
		}
		return out, nil
	case GGUFTypeFloat64:
		out := make([]float64, len(raw)/8)
		for i := range out {
			out[i] = math.Float64frombits(le.Uint64(raw[8*i:]))
		}
		return out, nil
	}
	panic("unreachable")
}

// tensorInfo reads the description of tensor i; Offset is left relative to
// the data section.
func (p *ggufParser) tensorInfo(i uint64) (*GGUFTensor, error) {
	name, err := p.str(fmt.Sprintf("tensor %d name", i), ggufMaxNameBytes)
	if err != nil {
		return nil, err
	}
	if name == "" {
		return nil, p.bad("", "tensor %d has an empty name", i)
	}
	nd, err := p.u32("tensor " + name + " dimension count")
	if err != nil {
		return nil, err
	}
	if nd > ggufMaxDims {
		return nil, p.bad(name, "%d dimensions, more than ggml's %d", nd, ggufMaxDims)
	}
	t := &GGUFTensor{Name: name, Dims: make([]int64, nd)}
	elems := uint64(1)
	overflow, zero := false, false
	for j := range t.Dims {
		d, err := p.u64("tensor " + name + " dimensions")
		if err != nil {
			return nil, err
		}
		if d > math.MaxInt64 {
			return nil, p.bad(name, "dimension %d is %d, beyond a signed 64-bit count", j, d)
		}
		t.Dims[j] = int64(d)
		switch {
		case d == 0:
			zero = true
		case elems > math.MaxInt64/d:
			overflow = true
		default:
			elems *= d
		}
	}
	if zero {
		elems = 0
	} else if overflow {
		return nil, p.bad(name, "dimensions %v overflow a 64-bit element count", t.Dims)
	}
	typ, err := p.u32("tensor " + name + " type")
	if err != nil {
		return nil, err
	}
	t.Type = quant.Type(typ)
	if !t.Type.Known() {
		return nil, p.bad(name, "unknown ggml type %d", typ)
	}
	if bs := int64(t.Type.BlockSize()); nd > 0 && t.Dims[0]%bs != 0 {
		return nil, p.bad(name, "rows of %d elements are not whole %d-element blocks of %v", t.Dims[0], bs, t.Type)
	}
	if t.Size, err = t.Type.Bytes(int64(elems)); err != nil {
		return nil, p.bad(name, "dimensions %v of %v: %v", t.Dims, t.Type, err)
	}
	off, err := p.u64("tensor " + name + " offset")
	if err != nil {
		return nil, err
	}
	if off > math.MaxInt64 {
		return nil, p.bad(name, "data offset %d is beyond a signed 64-bit offset", off)
	}
	t.Offset = int64(off)
	return t, nil
}

// Tensors returns the file's tensors in file order. Callers must not
// modify them.
func (f *GGUFFile) Tensors() []*GGUFTensor { return f.tensors }

// Tensor returns the named tensor.
func (f *GGUFFile) Tensor(name string) (*GGUFTensor, bool) {
	t, ok := f.byName[name]
	return t, ok
}

// ReadTensorBytes reads the named tensor's stored bytes (quantized as
// stored) into dst, which must be exactly the tensor's Size.
func (f *GGUFFile) ReadTensorBytes(ctx context.Context, name string, dst []byte) error {
	t, ok := f.byName[name]
	if !ok {
		return &fileError{file: f.Path, tensor: name, kind: ErrMismatch, msg: "no such tensor"}
	}
	if int64(len(dst)) != t.Size {
		return &fileError{file: f.Path, tensor: name, kind: ErrMismatch, msg: fmt.Sprintf("destination is %d bytes, tensor is %d", len(dst), t.Size)}
	}
	return f.ReadTensorRange(ctx, t, 0, dst)
}

// ReadTensorRange reads len(dst) bytes of t starting off bytes into it.
func (f *GGUFFile) ReadTensorRange(ctx context.Context, t *GGUFTensor, off int64, dst []byte) error {
	if f.isClosed() {
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrClosed, msg: "file is closed"}
	}
	if off < 0 || off > t.Size || int64(len(dst)) > t.Size-off {
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("range [%d, %d) outside the tensor's %d bytes", off, off+int64(len(dst)), t.Size)}
	}
	if t.Offset < 0 || t.Offset > f.size || t.Size > f.size-t.Offset {
		return &fileError{file: f.Path, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("bytes [%d, %d) outside the file's %d bytes", t.Offset, t.Offset+t.Size, f.size)}
	}
	for done := 0; done < len(dst); {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := min(readPiece, len(dst)-done)
		if _, err := f.r.ReadAt(dst[done:done+n], t.Offset+off+int64(done)); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			if f.isClosed() {
				return &fileError{file: f.Path, tensor: t.Name, kind: ErrClosed, msg: "file is closed"}
			}
			return &fileError{file: f.Path, tensor: t.Name, kind: err, msg: "read: " + err.Error()}
		}
		done += n
	}
	return nil
}

func (f *GGUFFile) isClosed() bool {
	select {
	case <-f.closed:
		return true
	default:
		return false
	}
}

// Close closes the file (when OpenGGUF opened it). It is safe to call more
// than once; reads after Close return an error wrapping ErrClosed.
func (f *GGUFFile) Close() error {
	f.closeOnce.Do(func() {
		close(f.closed)
		if f.closer != nil {
			f.closeErr = f.closer.Close()
		}
	})
	return f.closeErr
}
