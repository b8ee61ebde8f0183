package loader

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math"

	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/tensor/quant"
)

// GGUFWriteTensor is a tensor for WriteGGUF: its stored bytes are Data, or,
// when Data is nil, what Fill produces (called for consecutive ranges, so
// a large model can be converted without holding it in memory).
type GGUFWriteTensor struct {
	Name string
	Type quant.Type
	Dims []int64 // ggml order: Dims[0] is the innermost dimension
	Data []byte
	Fill FillFunc
}

// ggufWriteChunk is the range Fill is asked for at a time.
const ggufWriteChunk = 4 << 20

// ggufMaxWriteName is ggml's limit on a tensor name (64 bytes with the
// terminating NUL), stricter than the spec's 64 so that llama.cpp reads
// what strata writes.
const ggufMaxWriteName = 63

// WriteGGUF writes a GGUF version 3 file: the metadata pairs in the order
// given, then the tensors in the order given, each at an offset aligned to
// general.alignment when the metadata sets it (a uint32 power of two) or
// to 32. Values must have the Go types GGUFKV lists (int and uint are
// refused: say uint32 or uint64). The file is written through a temporary
// file and renamed into place, so a failed write leaves path as it was.
func WriteGGUF(path string, metadata []GGUFKV, tensors []GGUFWriteTensor) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("loader: write %s: %s", path, fmt.Sprintf(format, args...))
	}
	align := uint64(GGUFDefaultAlignment)
	keys := make(map[string]bool, len(metadata))
	for _, kv := range metadata {
		if kv.Key == "" || len(kv.Key) > ggufMaxKeyBytes {
			return bad("metadata key %q: empty or longer than %d bytes", kv.Key, ggufMaxKeyBytes)
		}
		if keys[kv.Key] {
			return bad("metadata key %s given twice", kv.Key)
		}
		keys[kv.Key] = true
		if err := checkGGUFValue(kv.Value, 0); err != nil {
			return bad("metadata %s: %v", kv.Key, err)
		}
		if kv.Key == "general.alignment" {
			a, ok := kv.Value.(uint32)
			if !ok || a == 0 || a&(a-1) != 0 {
				return bad("metadata general.alignment must be a uint32 power of two, got %T %v", kv.Value, kv.Value)
			}
			align = uint64(a)
		}
	}
	pad := func(n uint64) uint64 { return (n + align - 1) / align * align }

	names := make(map[string]bool, len(tensors))
	sizes := make([]uint64, len(tensors))
	var dataLen uint64
	for i, t := range tensors {
		switch {
		case t.Name == "" || len(t.Name) > ggufMaxWriteName:
			return bad("tensor %q: name empty or longer than %d bytes", t.Name, ggufMaxWriteName)
		case names[t.Name]:
			return bad("tensor %s given twice", t.Name)
		case len(t.Dims) > ggufMaxDims:
			return bad("tensor %s: %d dimensions, more than %d", t.Name, len(t.Dims), ggufMaxDims)
		case !t.Type.Known():
			return bad("tensor %s: unknown ggml type %d", t.Name, uint32(t.Type))
		}
		names[t.Name] = true
		n := int64(1)
		for _, d := range t.Dims {
			if d < 0 || (d != 0 && n > math.MaxInt64/d) {
				return bad("tensor %s: bad dimensions %v", t.Name, t.Dims)
			}
			n *= d
		}
		if len(t.Dims) > 0 && t.Dims[0]%int64(t.Type.BlockSize()) != 0 {
			return bad("tensor %s: rows of %d elements are not whole %d-element blocks of %v", t.Name, t.Dims[0], t.Type.BlockSize(), t.Type)
		}
		size, err := t.Type.Bytes(n)
		if err != nil {
			return bad("tensor %s: %v", t.Name, err)
		}
		if t.Data == nil && t.Fill == nil && size > 0 {
			return bad("tensor %s: neither data nor a fill function", t.Name)
		}
		if t.Data != nil && int64(len(t.Data)) != size {
			return bad("tensor %s: %d bytes of data, %v %v needs %d", t.Name, len(t.Data), t.Type, t.Dims, size)
		}
		sizes[i] = uint64(size)
		dataLen = pad(dataLen) + uint64(size)
		if dataLen > math.MaxInt64/2 {
			return bad("tensor %s: data section too large", t.Name)
		}
	}

	err := atomicfile.Write(path, func(f io.Writer) error {
		w := &ggufWriter{w: bufio.NewWriterSize(f, 1<<20)}
		w.raw([]byte(ggufMagic))
		w.u32(3)
		w.u64(uint64(len(tensors)))
		w.u64(uint64(len(metadata)))
		for _, kv := range metadata {
			w.str(kv.Key)
			t, _ := ggufTypeOf(kv.Value)
			w.u32(uint32(t))
			w.value(kv.Value)
		}
		var off uint64
		for i, t := range tensors {
			w.str(t.Name)
			w.u32(uint32(len(t.Dims)))
			for _, d := range t.Dims {
				w.u64(uint64(d))
			}
			w.u32(uint32(t.Type))
			off = pad(off)
			w.u64(off)
			off += sizes[i]
		}
		w.zeros(pad(w.n) - w.n)
		var buf []byte
		for i, t := range tensors {
			if w.err != nil {
				return w.err
			}
			if t.Data != nil {
				w.raw(t.Data)
			} else {
				for done := uint64(0); done < sizes[i] && w.err == nil; {
					k := min(ggufWriteChunk, sizes[i]-done)
					if buf == nil {
						buf = make([]byte, ggufWriteChunk)
					}
					if err := t.Fill(buf[:k], int64(done)); err != nil {
						return fmt.Errorf("tensor %s: %w", t.Name, err)
					}
					w.raw(buf[:k])
					done += k
				}
			}
			w.zeros(pad(w.n) - w.n)
		}
		if w.err != nil {
			return w.err
		}
		return w.w.Flush()
	})
	if err != nil {
		return fmt.Errorf("loader: write %s: %w", path, err)
	}
	return nil
}

// checkGGUFValue checks that v has a GGUF type and, for an array, that its
// slice matches its element type.
func checkGGUFValue(v any, depth int) error {
	t, ok := ggufTypeOf(v)
	if !ok {
		return fmt.Errorf("value of Go type %T has no GGUF type", v)
	}
	if t != GGUFTypeArray {
		return nil
	}
	if depth >= ggufMaxNesting {
		return fmt.Errorf("arrays nested more than %d deep", ggufMaxNesting)
	}
	a := v.(GGUFArray)
	want := map[GGUFValueType]string{
		GGUFTypeUint8: "[]uint8", GGUFTypeInt8: "[]int8", GGUFTypeUint16: "[]uint16", GGUFTypeInt16: "[]int16",
		GGUFTypeUint32: "[]uint32", GGUFTypeInt32: "[]int32", GGUFTypeFloat32: "[]float32", GGUFTypeBool: "[]bool",
		GGUFTypeString: "[]string", GGUFTypeArray: "[]loader.GGUFArray", GGUFTypeUint64: "[]uint64",
		GGUFTypeInt64: "[]int64", GGUFTypeFloat64: "[]float64",
	}[a.Elem]
	if got := fmt.Sprintf("%T", a.Values); got != want {
		return fmt.Errorf("array of %v holds %s, want %s", a.Elem, got, want)
	}
	if inner, ok := a.Values.([]GGUFArray); ok {
		for i, x := range inner {
			if err := checkGGUFValue(x, depth+1); err != nil {
				return fmt.Errorf("element %d: %w", i, err)
			}
		}
	}
	return nil
}

// ggufWriter encodes little-endian values, keeping the first error and
// counting the bytes written.
type ggufWriter struct {
	w   *bufio.Writer
	n   uint64
	err error
	b   [8]byte
}

func (w *ggufWriter) raw(b []byte) {
	if w.err != nil {
		return
	}
	_, w.err = w.w.Write(b)
	w.n += uint64(len(b))
}

func (w *ggufWriter) zeros(n uint64) {
	var z [64]byte
	for n > 0 {
		k := min(n, uint64(len(z)))
		w.raw(z[:k])
		n -= k
	}
}

func (w *ggufWriter) u8(v uint8)   { w.raw([]byte{v}) }
func (w *ggufWriter) u16(v uint16) { w.raw(binary.LittleEndian.AppendUint16(w.b[:0], v)) }
func (w *ggufWriter) u32(v uint32) { w.raw(binary.LittleEndian.AppendUint32(w.b[:0], v)) }
func (w *ggufWriter) u64(v uint64) { w.raw(binary.LittleEndian.AppendUint64(w.b[:0], v)) }
func (w *ggufWriter) str(s string) { w.u64(uint64(len(s))); w.raw([]byte(s)) }

func (w *ggufWriter) value(v any) {
	switch x := v.(type) {
	case uint8:
		w.u8(x)
	case int8:
		w.u8(uint8(x))
	case bool:
		if x {
			w.u8(1)
		} else {
			w.u8(0)
		}
	case uint16:
		w.u16(x)
	case int16:
		w.u16(uint16(x))
	case uint32:
		w.u32(x)
	case int32:
		w.u32(uint32(x))
	case float32:
		w.u32(math.Float32bits(x))
	case uint64:
		w.u64(x)
	case int64:
		w.u64(uint64(x))
	case float64:
		w.u64(math.Float64bits(x))
	case string:
		w.str(x)
	case GGUFArray:
		w.u32(uint32(x.Elem))
		w.u64(uint64(x.Len()))
		switch s := x.Values.(type) {
		case []uint8:
			w.raw(s)
		default:
			eachGGUF(x, w.value)
		}
	}
}

// eachGGUF calls f with every element of a, as a value of its Go type.
func eachGGUF(a GGUFArray, f func(any)) {
	switch s := a.Values.(type) {
	case []uint8:
		for _, v := range s {
			f(v)
		}
	case []int8:
		for _, v := range s {
			f(v)
		}
	case []uint16:
		for _, v := range s {
			f(v)
		}
	case []int16:
		for _, v := range s {
			f(v)
		}
	case []uint32:
		for _, v := range s {
			f(v)
		}
	case []int32:
		for _, v := range s {
			f(v)
		}
	case []float32:
		for _, v := range s {
			f(v)
		}
	case []bool:
		for _, v := range s {
			f(v)
		}
	case []string:
		for _, v := range s {
			f(v)
		}
	case []GGUFArray:
		for _, v := range s {
			f(v)
		}
	case []uint64:
		for _, v := range s {
			f(v)
		}
	case []int64:
		for _, v := range s {
			f(v)
		}
	case []float64:
		for _, v := range s {
			f(v)
		}
	}
}
