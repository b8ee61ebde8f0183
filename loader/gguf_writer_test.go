package loader

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// sampleMetadata has a value of every type, empty and nested arrays.
func sampleMetadata() []GGUFKV {
	return []GGUFKV{
		{"general.architecture", "llama"},
		{"general.alignment", uint32(64)},
		{"t.u8", uint8(200)}, {"t.i8", int8(-100)}, {"t.u16", uint16(60000)}, {"t.i16", int16(-30000)},
		{"t.u32", uint32(4000000000)}, {"t.i32", int32(-2000000000)}, {"t.f32", float32(1.5)},
		{"t.bool", true}, {"t.false", false}, {"t.str", "héllo"}, {"t.empty", ""},
		{"t.u64", uint64(math.MaxUint64)}, {"t.i64", int64(math.MinInt64)}, {"t.f64", math.Pi},
		{"t.tokens", GGUFArray{GGUFTypeString, []string{"<s>", "", "▁the"}}},
		{"t.scores", GGUFArray{GGUFTypeFloat32, []float32{0, -1.25, 3}}},
		{"t.types", GGUFArray{GGUFTypeInt32, []int32{1, 3, 6}}},
		{"t.bytes", GGUFArray{GGUFTypeUint8, []uint8{1, 2, 3}}},
		{"t.bools", GGUFArray{GGUFTypeBool, []bool{true, false}}},
		{"t.u64s", GGUFArray{GGUFTypeUint64, []uint64{1, math.MaxUint64}}},
		{"t.i64s", GGUFArray{GGUFTypeInt64, []int64{-1}}},
		{"t.f64s", GGUFArray{GGUFTypeFloat64, []float64{2.5}}},
		{"t.i8s", GGUFArray{GGUFTypeInt8, []int8{-8}}},
		{"t.u16s", GGUFArray{GGUFTypeUint16, []uint16{65535}}},
		{"t.i16s", GGUFArray{GGUFTypeInt16, []int16{-2}}},
		{"t.u32s", GGUFArray{GGUFTypeUint32, []uint32{7}}},
		{"t.none", GGUFArray{GGUFTypeFloat32, []float32{}}},
		{"t.nested", GGUFArray{GGUFTypeArray, []GGUFArray{
			{GGUFTypeString, []string{"a", "b"}},
			{GGUFTypeArray, []GGUFArray{{GGUFTypeInt8, []int8{}}}},
		}}},
	}
}

// sampleTensors quantizes a few tensors; iq is a known type this package
// cannot decode, stored as opaque bytes.
func sampleTensors(t *testing.T) []GGUFWriteTensor {
	t.Helper()
	mk := func(name string, typ quant.Type, dims ...int64) GGUFWriteTensor {
		n := int64(1)
		for _, d := range dims {
			n *= d
		}
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(math.Sin(float64(i)*0.37)) * 0.1
		}
		size, err := typ.Bytes(n)
		if err != nil {
			t.Fatal(err)
		}
		data := make([]byte, size)
		if typ.Supported() {
			if err := typ.Quantize(data, x); err != nil {
				t.Fatal(err)
			}
		} else {
			for i := range data {
				data[i] = byte(i * 7)
			}
		}
		return GGUFWriteTensor{Name: name, Type: typ, Dims: dims, Data: data}
	}
	return []GGUFWriteTensor{
		mk("token_embd.weight", quant.Q4_K, 256, 3),
		mk("blk.0.attn_norm.weight", quant.F32, 5),
		mk("blk.0.attn_q.weight", quant.Q8_0, 64, 4),
		mk("blk.0.ffn_down.weight", quant.Q6_K, 512, 2),
		mk("blk.0.ffn_up.weight", quant.F16, 3, 2, 2),
		mk("blk.0.iq", quant.IQ4_XS, 256, 1),
		mk("empty", quant.BF16, 0, 4),
		mk("output.weight", quant.Q5_K, 256, 2),
	}
}

func TestGGUFRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.gguf")
	meta, tensors := sampleMetadata(), sampleTensors(t)
	if err := WriteGGUF(path, meta, tensors); err != nil {
		t.Fatal(err)
	}
	f, err := OpenGGUF(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Version != 3 || f.Alignment != 64 || f.DataOffset%64 != 0 {
		t.Errorf("version %d, alignment %d, data at %d", f.Version, f.Alignment, f.DataOffset)
	}
	if !reflect.DeepEqual(f.Metadata.KVs(), meta) {
		t.Errorf("metadata:\n got %#v\nwant %#v", f.Metadata.KVs(), meta)
	}
	if len(f.Tensors()) != len(tensors) {
		t.Fatalf("%d tensors, want %d", len(f.Tensors()), len(tensors))
	}
	for i, w := range tensors {
		g := f.Tensors()[i]
		if g.Name != w.Name || g.Type != w.Type || !reflect.DeepEqual(g.Dims, w.Dims) || g.Size != int64(len(w.Data)) || g.Offset%64 != 0 {
			t.Errorf("tensor %d: got %v dims %v, want %s %v %v (%d bytes)", i, g, g.Dims, w.Name, w.Type, w.Dims, len(w.Data))
		}
		got := make([]byte, g.Size)
		if err := f.ReadTensorBytes(context.Background(), g.Name, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, w.Data) {
			t.Errorf("tensor %s: bytes differ", g.Name)
		}
	}
	q, _ := f.Tensor("blk.0.attn_q.weight")
	if !q.Shape().Equal(tensor.Shape{4, 64}) || q.RowBytes() != 2*34 || q.NumElements() != 256 {
		t.Errorf("attn_q: shape %v, row bytes %d, elements %d; want [4, 64], 68, 256", q.Shape(), q.RowBytes(), q.NumElements())
	}
	up, _ := f.Tensor("blk.0.ffn_up.weight")
	if !up.Shape().Equal(tensor.Shape{2, 2, 3}) {
		t.Errorf("ffn_up shape %v, want [2, 2, 3] (ggml dims reversed)", up.Shape())
	}
}

// TestGGUFWriterLayout parses a written file by hand, field by field, and
// checks the spec's layout: header, pairs, descriptions, padding, data at
// aligned offsets.
func TestGGUFWriterLayout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "l.gguf")
	data := bytes.Repeat([]byte{0xab}, 34)
	err := WriteGGUF(path, []GGUFKV{{"k", uint32(7)}}, []GGUFWriteTensor{
		{Name: "w", Type: quant.Q8_0, Dims: []int64{32}, Data: data},
		{Name: "v", Type: quant.F32, Dims: []int64{1}, Data: []byte{1, 2, 3, 4}},
	})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := (&gb{}).header(3, 2, 1).str("k").u32(uint32(GGUFTypeUint32)).u32(7)
	want.info("w", quant.Q8_0, 0, 32).info("v", quant.F32, 64, 1).pad(32)
	dataStart := len(want.b)
	want.raw(data...).pad(32).raw(1, 2, 3, 4).pad(32)
	if !bytes.Equal(b, want.b) {
		t.Fatalf("layout:\n got % x\nwant % x", b, want.b)
	}
	if dataStart != 128 { // 24 header + 17 pair + 2*33 descriptions = 107, aligned
		t.Fatalf("hand layout puts the data at %d, want 128", dataStart)
	}
}

func TestGGUFMetadataAccessors(t *testing.T) {
	f, err := parseBytes(func() []byte {
		path := filepath.Join(t.TempDir(), "m.gguf")
		if err := WriteGGUF(path, sampleMetadata(), nil); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(path)
		return b
	}())
	if err != nil {
		t.Fatal(err)
	}
	m := f.Metadata
	if s, err := m.String("general.architecture"); s != "llama" || err != nil {
		t.Errorf("String = %q, %v", s, err)
	}
	if u, err := m.Uint("t.u16"); u != 60000 || err != nil {
		t.Errorf("Uint(u16) = %d, %v", u, err)
	}
	if u, err := m.Uint("t.u64"); u != math.MaxUint64 || err != nil {
		t.Errorf("Uint(u64) = %d, %v", u, err)
	}
	if i, err := m.Int("t.i64"); i != math.MinInt64 || err != nil {
		t.Errorf("Int(i64) = %d, %v", i, err)
	}
	if i, err := m.Int("t.u8"); i != 200 || err != nil {
		t.Errorf("Int(u8) = %d, %v", i, err)
	}
	if f, err := m.Float("t.f32"); f != 1.5 || err != nil {
		t.Errorf("Float(f32) = %v, %v", f, err)
	}
	if b, err := m.Bool("t.bool"); !b || err != nil {
		t.Errorf("Bool = %v, %v", b, err)
	}
	if s, err := m.Strings("t.tokens"); len(s) != 3 || s[2] != "▁the" || err != nil {
		t.Errorf("Strings = %q, %v", s, err)
	}
	if f, err := m.Float32s("t.scores"); len(f) != 3 || f[1] != -1.25 || err != nil {
		t.Errorf("Float32s = %v, %v", f, err)
	}
	if i, err := m.Ints("t.types"); !reflect.DeepEqual(i, []int64{1, 3, 6}) || err != nil {
		t.Errorf("Ints = %v, %v", i, err)
	}
	errCases := []struct {
		name string
		err  error
		want string
		run  func() error
	}{
		{"missing", ErrNoKey, "metadata llama.block_count: missing", func() error { _, err := m.Uint("llama.block_count"); return err }},
		{"string as uint", ErrFormat, "metadata general.architecture: is a string, want an unsigned integer", func() error { _, err := m.Uint("general.architecture"); return err }},
		{"negative as uint", ErrFormat, "metadata t.i8: is -100, want an unsigned integer", func() error { _, err := m.Uint("t.i8"); return err }},
		{"u64 as int", ErrFormat, "does not fit", func() error { _, err := m.Int("t.u64"); return err }},
		{"float as string", ErrFormat, "metadata t.f64: is a float64, want a string", func() error { _, err := m.String("t.f64"); return err }},
		{"int array as strings", ErrFormat, "metadata t.types: is an array of int32, want an array of strings", func() error { _, err := m.Strings("t.types"); return err }},
		{"u64 array as ints", ErrFormat, "element 1", func() error { _, err := m.Ints("t.u64s"); return err }},
		{"bool as float", ErrFormat, "want a float", func() error { _, err := m.Float("t.bool"); return err }},
	}
	for _, c := range errCases {
		err := c.run()
		if !errors.Is(err, c.err) || err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "test.gguf") {
			t.Errorf("%s: error %v, want %v containing %q and the file name", c.name, err, c.err, c.want)
		}
	}
}

// TestGGUFTruncated cuts a real file at every length: each prefix is an
// error, never a panic, and never a tensor outside the bytes given.
func TestGGUFTruncated(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := WriteGGUF(path, sampleMetadata(), sampleTensors(t)); err != nil {
		t.Fatal(err)
	}
	full, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	f, err := parseBytes(full)
	if err != nil {
		t.Fatal(err)
	}
	last := f.Tensors()[len(f.Tensors())-1]
	end := last.Offset + last.Size // the file goes on with padding
	for n := range len(full) {
		_, err := parseBytes(full[:n])
		if int64(n) >= end {
			if err != nil {
				t.Fatalf("prefix of %d bytes (every tensor inside): %v", n, err)
			}
			continue
		}
		if err == nil {
			t.Fatalf("prefix of %d of %d bytes accepted", n, len(full))
		}
	}
}

func TestGGUFReads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.gguf")
	if err := WriteGGUF(path, nil, sampleTensors(t)); err != nil {
		t.Fatal(err)
	}
	f, err := OpenGGUF(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	q, _ := f.Tensor("blk.0.attn_q.weight")
	whole := make([]byte, q.Size)
	if err := f.ReadTensorBytes(ctx, q.Name, whole); err != nil {
		t.Fatal(err)
	}
	part := make([]byte, q.RowBytes())
	if err := f.ReadTensorRange(ctx, q, q.RowBytes(), part); err != nil || !bytes.Equal(part, whole[q.RowBytes():2*q.RowBytes()]) {
		t.Errorf("second row: %v", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	cases := []struct {
		name string
		err  error
		run  func() error
	}{
		{"no such tensor", ErrMismatch, func() error { return f.ReadTensorBytes(ctx, "nope", nil) }},
		{"short destination", ErrMismatch, func() error { return f.ReadTensorBytes(ctx, q.Name, whole[1:]) }},
		{"range past the end", ErrMismatch, func() error { return f.ReadTensorRange(ctx, q, q.Size-1, part) }},
		{"negative offset", ErrMismatch, func() error { return f.ReadTensorRange(ctx, q, -1, part) }},
		{"cancelled", context.Canceled, func() error { return f.ReadTensorBytes(cancelled, q.Name, whole) }},
		{"closed", ErrClosed, func() error { f.Close(); return f.ReadTensorBytes(ctx, q.Name, whole) }},
	}
	for _, c := range cases {
		if err := c.run(); !errors.Is(err, c.err) {
			t.Errorf("%s: %v, want %v", c.name, err, c.err)
		}
	}
	if err := f.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestWriteGGUFRefuses(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "out.gguf")
	if err := os.WriteFile(path, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	ok := GGUFWriteTensor{Name: "a", Type: quant.F32, Dims: []int64{2}, Data: make([]byte, 8)}
	with := func(f func(*GGUFWriteTensor)) []GGUFWriteTensor { t := ok; f(&t); return []GGUFWriteTensor{t} }
	cases := []struct {
		name    string
		meta    []GGUFKV
		tensors []GGUFWriteTensor
		want    string
	}{
		{"int value", []GGUFKV{{"k", 3}}, nil, "Go type int has no GGUF type"},
		{"empty key", []GGUFKV{{"", "x"}}, nil, `metadata key "": empty`},
		{"duplicate key", []GGUFKV{{"k", "x"}, {"k", "y"}}, nil, "metadata key k given twice"},
		{"array type mismatch", []GGUFKV{{"k", GGUFArray{GGUFTypeInt32, []float32{1}}}}, nil, "array of int32 holds []float32"},
		{"alignment type", []GGUFKV{{"general.alignment", uint64(32)}}, nil, "general.alignment must be a uint32 power of two"},
		{"alignment value", []GGUFKV{{"general.alignment", uint32(24)}}, nil, "general.alignment must be a uint32 power of two"},
		{"duplicate tensor", nil, []GGUFWriteTensor{ok, ok}, "tensor a given twice"},
		{"long name", nil, with(func(t *GGUFWriteTensor) { t.Name = strings.Repeat("x", 64) }), "longer than 63 bytes"},
		{"unknown type", nil, with(func(t *GGUFWriteTensor) { t.Type = 5 }), "unknown ggml type 5"},
		{"data size", nil, with(func(t *GGUFWriteTensor) { t.Data = make([]byte, 7) }), "7 bytes of data, F32 [2] needs 8"},
		{"partial block", nil, with(func(t *GGUFWriteTensor) { t.Type, t.Dims = quant.Q8_0, []int64{16} }), "not whole 32-element blocks"},
		{"no data", nil, with(func(t *GGUFWriteTensor) { t.Data = nil }), "neither data nor a fill function"},
		{"fill fails", nil, with(func(t *GGUFWriteTensor) {
			t.Data, t.Fill = nil, func([]byte, int64) error { return errors.New("disk on fire") }
		}), "tensor a: disk on fire"},
	}
	for _, c := range cases {
		err := WriteGGUF(path, c.meta, c.tensors)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	if b, _ := os.ReadFile(path); string(b) != "keep me" {
		t.Errorf("a refused write changed the file: %q", b)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("a refused write left files behind: %v", ents)
	}
}

// TestWriteGGUFFill streams a tensor larger than the fill chunk through
// Fill.
func TestWriteGGUFFill(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big.gguf")
	n := int64(ggufWriteChunk/4 + 8) // F32 elements: one chunk and a bit
	fill := func(dst []byte, off int64) error {
		for i := range dst {
			dst[i] = byte((off + int64(i)) % 251)
		}
		return nil
	}
	if err := WriteGGUF(path, nil, []GGUFWriteTensor{{Name: "big", Type: quant.F32, Dims: []int64{n}, Fill: fill}}); err != nil {
		t.Fatal(err)
	}
	f, err := OpenGGUF(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, 4*n)
	if err := f.ReadTensorBytes(context.Background(), "big", got); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 4*n)
	fill(want, 0)
	if !bytes.Equal(got, want) {
		t.Error("filled bytes differ")
	}
}

// TestWriteGGUFMatchesGGML writes what a small program linked with ggml's
// gguf writer (gguf_set_val_*, gguf_add_tensor, gguf_write_to_file) wrote
// for the same pairs and tensors; the SHA-256 is of that program's file.
func TestWriteGGUFMatchesGGML(t *testing.T) {
	a, b, c := make([]byte, 432), make([]byte, 28), make([]byte, 408)
	for i := range a {
		a[i] = byte(i * 13)
	}
	for i := range 7 {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(i)*0.5))
	}
	for i := range c {
		c[i] = byte(i*7 + 1)
	}
	meta := []GGUFKV{
		{"general.architecture", "llama"}, {"llama.block_count", uint32(2)}, {"llama.rope.freq_base", float32(500000)},
		{"tokenizer.ggml.add_bos_token", true}, {"x.i64", int64(-5)}, {"x.u64", uint64(1 << 40)}, {"x.f64", 0.25}, {"x.i8", int8(-3)},
		{"tokenizer.ggml.tokens", GGUFArray{GGUFTypeString, []string{"<s>", "</s>", "hello"}}},
		{"tokenizer.ggml.scores", GGUFArray{GGUFTypeFloat32, []float32{0, -1, 2.5}}},
		{"tokenizer.ggml.token_type", GGUFArray{GGUFTypeInt32, []int32{3, 3, 1}}},
	}
	path := filepath.Join(t.TempDir(), "ggml.gguf")
	err := WriteGGUF(path, meta, []GGUFWriteTensor{
		{Name: "blk.0.attn_q.weight", Type: quant.Q4_K, Dims: []int64{256, 3}, Data: a},
		{Name: "output_norm.weight", Type: quant.F32, Dims: []int64{7}, Data: b},
		{Name: "c", Type: quant.Q8_0, Dims: []int64{64, 2, 3}, Data: c},
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	const want = "0efa78a5294995e0672a89a8de3452c12b43b3adde1cc21fa85f72430de884e6"
	if sum := sha256.Sum256(got); hex.EncodeToString(sum[:]) != want {
		t.Errorf("%d bytes hashing to %x, not the file ggml writes (1536 bytes, %s)", len(got), sum, want)
	}
}
