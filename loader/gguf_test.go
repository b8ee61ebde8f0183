package loader

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/strata-llm/strata/tensor/quant"
)

// gb builds GGUF bytes field by field, valid or not, independently of the
// writer: the tests use it for hand-made headers and to check the writer's
// layout.
type gb struct{ b []byte }

func (g *gb) u8(v uint8) *gb   { g.b = append(g.b, v); return g }
func (g *gb) u32(v uint32) *gb { g.b = binary.LittleEndian.AppendUint32(g.b, v); return g }
func (g *gb) u64(v uint64) *gb { g.b = binary.LittleEndian.AppendUint64(g.b, v); return g }
func (g *gb) str(s string) *gb { g.u64(uint64(len(s))); g.b = append(g.b, s...); return g }
func (g *gb) raw(b ...byte) *gb {
	g.b = append(g.b, b...)
	return g
}

// header writes magic, version and counts.
func (g *gb) header(version uint32, tensors, kvs uint64) *gb {
	return g.raw('G', 'G', 'U', 'F').u32(version).u64(tensors).u64(kvs)
}

// kvStr writes a string pair.
func (g *gb) kvStr(key, val string) *gb { return g.str(key).u32(uint32(GGUFTypeString)).str(val) }

// info writes a tensor description.
func (g *gb) info(name string, typ quant.Type, off uint64, dims ...uint64) *gb {
	g.str(name).u32(uint32(len(dims)))
	for _, d := range dims {
		g.u64(d)
	}
	return g.u32(uint32(typ)).u64(off)
}

// pad aligns to align bytes with zeros.
func (g *gb) pad(align int) *gb {
	for len(g.b)%align != 0 {
		g.b = append(g.b, 0)
	}
	return g
}

// validGGUF is a small well-formed file: one pair, tensors a (F32 [4]) and
// b (Q8_0 [32, 2]) at offsets 0 and 32.
func validGGUF() []byte {
	g := (&gb{}).header(3, 2, 1).kvStr("general.architecture", "llama")
	g.info("a", quant.F32, 0, 4).info("b", quant.Q8_0, 32, 32, 2).pad(32)
	g.raw(make([]byte, 32+68)...)
	return g.b
}

func parseBytes(b []byte) (*GGUFFile, error) {
	return ParseGGUF(bytes.NewReader(b), int64(len(b)), "test.gguf")
}

// TestGGUFBadFiles feeds hand-made headers, one defect each, and checks
// the one-line error names it.
func TestGGUFBadFiles(t *testing.T) {
	hdr := func(version uint32, nt, nkv uint64) *gb { return (&gb{}).header(version, nt, nkv) }
	withData := func(g *gb, n int) []byte { return g.pad(32).raw(make([]byte, n)...).b }
	cases := []struct {
		name string
		file []byte
		want string
	}{
		{"empty", nil, "too short"},
		{"not gguf", []byte("PK\x03\x04 a zip file"), "not a GGUF file"},
		{"version 1", hdr(1, 0, 0).b, "version 1 is not supported"},
		{"version 4", hdr(4, 0, 0).b, "version 4 is not supported"},
		{"version 0", hdr(0, 0, 0).b, "version 0 is not supported"},
		{"big-endian v3", (&gb{}).raw('G', 'G', 'U', 'F', 0, 0, 0, 3).u64(0).u64(0).b, "big-endian"},
		{"truncated counts", hdr(3, 0, 0).b[:12], "run past the end of the file"},
		{"absurd kv count", hdr(3, 0, 1<<62).b, "declares 4611686018427387904 metadata pairs"},
		{"absurd tensor count", hdr(3, math.MaxUint64, 0).b, "declares 18446744073709551615 tensors"},
		{"absurd key length", hdr(3, 0, 1).u64(1 << 40).raw(make([]byte, 20)...).b, "more than the 65535 allowed"},
		{"key past end", hdr(3, 0, 1).u64(100).raw(make([]byte, 20)...).b, "run past the end of the file"},
		{"empty key", hdr(3, 0, 1).str("").u32(0).u8(0).u8(0).b, "metadata key 0 is empty"},
		{"duplicate key", hdr(3, 0, 2).kvStr("a", "x").kvStr("a", "y").b, "metadata key a appears twice"},
		{"unknown value type", hdr(3, 0, 1).str("k").u32(13).u64(0).b, "metadata k: unknown value type 13"},
		{"bad bool", hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeBool)).u8(2).b, "bool value 2 is neither 0 nor 1"},
		{"bad bool in array", hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeArray)).u32(uint32(GGUFTypeBool)).u64(2).u8(1).u8(7).b, "element 1: bool value 7"},
		{"absurd string length", hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeString)).u64(1 << 50).b, "more than the 268435456 allowed"},
		{"absurd array length", hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeArray)).u32(uint32(GGUFTypeUint32)).u64(1 << 61).u64(0).b, "array of 2305843009213693952 uint32"},
		{"absurd string array", hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeArray)).u32(uint32(GGUFTypeString)).u64(1000).u64(0).b, "array of 1000 string"},
		{"array of unknown", hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeArray)).u32(99).u64(0).b, "array of unknown value type 99"},
		{"nested too deep", func() []byte {
			g := hdr(3, 0, 1).str("k").u32(uint32(GGUFTypeArray))
			for range 9 {
				g.u32(uint32(GGUFTypeArray)).u64(1)
			}
			return g.u32(uint32(GGUFTypeUint8)).u64(0).b
		}(), "nested more than 8 deep"},
		{"alignment not uint32", hdr(3, 0, 1).str("general.alignment").u32(uint32(GGUFTypeUint64)).u64(32).b, "general.alignment is a uint64, want uint32"},
		{"alignment not power of two", hdr(3, 0, 1).str("general.alignment").u32(uint32(GGUFTypeUint32)).u32(48).b, "general.alignment is 48, not a power of two"},
		{"duplicate tensor", withData(hdr(3, 2, 0).info("a", quant.F32, 0, 4).info("a", quant.F32, 32, 4), 64), "tensor a: listed twice"},
		{"empty tensor name", withData(hdr(3, 1, 0).info("", quant.F32, 0, 4), 16), "tensor 0 has an empty name"},
		{"long tensor name", withData(hdr(3, 1, 0).info(strings.Repeat("n", 65), quant.F32, 0, 4), 16), "65 bytes long, more than the 64 allowed"},
		{"too many dims", withData(hdr(3, 1, 0).info("a", quant.F32, 0, 1, 1, 1, 1, 1), 4), "tensor a: 5 dimensions"},
		{"unknown ggml type", withData(hdr(3, 1, 0).info("a", quant.Type(99), 0, 4), 16), "tensor a: unknown ggml type 99"},
		{"withdrawn ggml type", withData(hdr(3, 1, 0).info("a", quant.Type(4), 0, 32), 32), "tensor a: unknown ggml type 4"},
		{"row not whole blocks", withData(hdr(3, 1, 0).info("a", quant.Q4_K, 0, 128, 2), 144), "rows of 128 elements are not whole 256-element blocks of Q4_K"},
		{"element count overflow", withData(hdr(3, 1, 0).info("a", quant.F32, 0, 1<<32, 1<<32), 16), "overflow a 64-bit element count"},
		{"byte count overflow", withData(hdr(3, 1, 0).info("a", quant.F64, 0, 1<<31, 1<<31), 16), "overflow a 64-bit byte count"},
		{"dimension beyond int64", withData(hdr(3, 1, 0).info("a", quant.F32, 0, 1<<63), 16), "beyond a signed 64-bit count"},
		{"offset beyond int64", withData(hdr(3, 1, 0).info("a", quant.F32, 1<<63, 4), 16), "beyond a signed 64-bit offset"},
		{"misaligned offset", withData(hdr(3, 1, 0).info("a", quant.F32, 4, 4), 32), "data offset 4 is not a multiple of the alignment 32"},
		{"past the end", withData(hdr(3, 1, 0).info("a", quant.F32, 0, 8), 16), "bytes [0, 32) of the data section run past its end (16 bytes"},
		{"offset past the end", withData(hdr(3, 1, 0).info("a", quant.F32, 64, 4), 16), "run past its end"},
		{"overlap", withData(hdr(3, 2, 0).info("a", quant.F32, 0, 16).info("b", quant.F32, 32, 16), 128), "tensor b: bytes [32, 96) of the data section overlap tensor a [0, 64)"},
		{"no data section", hdr(3, 1, 0).info("a", quant.F32, 0, 4).b, "past the end of the file"},
		{"truncated tensor info", hdr(3, 1, 0).str("a").u32(2).u64(4).u64(4).b, "tensor a type at byte 53: 4 bytes run past the end of the file"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseBytes(c.file)
			if err == nil {
				t.Fatal("accepted")
			}
			msg := err.Error()
			if !strings.Contains(msg, c.want) || !strings.HasPrefix(msg, "loader: test.gguf: ") || strings.Contains(msg, "\n") {
				t.Errorf("error %q, want one line starting with the file name and containing %q", msg, c.want)
			}
			if !errors.Is(err, ErrFormat) {
				t.Errorf("error %v does not wrap ErrFormat", err)
			}
		})
	}
	// The file the defects were made from is good.
	if _, err := parseBytes(validGGUF()); err != nil {
		t.Fatal(err)
	}
}

func TestGGUFNotRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "pipe.gguf")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("cannot make a named pipe here: %v", err)
	}
	for _, c := range []struct{ path, want string }{
		{dir, "not a regular file (a directory)"},
		{fifo, "not a regular file (a named pipe)"}, // would block in open
	} {
		_, err := OpenGGUF(c.path)
		if err == nil || !strings.Contains(err.Error(), c.want) || !errors.Is(err, ErrFormat) {
			t.Errorf("OpenGGUF(%s): %v, want %q", c.path, err, c.want)
		}
	}
	if _, err := OpenGGUF(filepath.Join(dir, "missing.gguf")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}
