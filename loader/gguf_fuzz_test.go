package loader

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/tensor/quant"
)

// FuzzGGUF parses arbitrary bytes as a GGUF file. Bad input must be an
// error, never a panic. What is accepted is checked without the parser:
// the declared counts, every tensor's size from its type and dimensions
// (in big integers), its bytes aligned, inside the file and overlapping no
// other's, names unique; every tensor reads without leaving the file; and
// writing the header back out reproduces the same metadata and tensors.
func FuzzGGUF(f *testing.F) {
	f.Add(validGGUF())
	dir := f.TempDir()
	path := filepath.Join(dir, "seed.gguf")
	tensors := []GGUFWriteTensor{
		{Name: "token_embd.weight", Type: quant.Q8_0, Dims: []int64{32, 2}, Data: make([]byte, 68)},
		{Name: "output_norm.weight", Type: quant.F32, Dims: []int64{3}, Data: []byte{0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64}},
	}
	meta := []GGUFKV{
		{"general.architecture", "llama"}, {"llama.block_count", uint32(1)},
		{"tokenizer.ggml.tokens", GGUFArray{GGUFTypeString, []string{"a", "b"}}},
		{"nested", GGUFArray{GGUFTypeArray, []GGUFArray{{GGUFTypeBool, []bool{true}}}}},
		{"general.alignment", uint32(16)},
	}
	if err := WriteGGUF(path, meta, tensors); err != nil {
		f.Fatal(err)
	}
	seed, err := os.ReadFile(path)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(seed)
	f.Add((&gb{}).header(3, 0, 1).str("k").u32(uint32(GGUFTypeArray)).u32(uint32(GGUFTypeArray)).u64(2).
		u32(uint32(GGUFTypeFloat64)).u64(1).u64(0).u32(uint32(GGUFTypeString)).u64(1).str("s").b)
	f.Add((&gb{}).header(2, 1, 0).info("z", quant.Q4_K, 0, 0, 7).b)

	f.Fuzz(func(t *testing.T, data []byte) {
		r := &spanReader{b: data}
		g, err := ParseGGUF(r, int64(len(data)), "fuzz.gguf")
		if r.negative {
			t.Fatal("read at a negative offset")
		}
		if r.maxEnd > int64(len(data)) && err == nil {
			t.Fatalf("read to byte %d of a %d-byte file and accepted it", r.maxEnd, len(data))
		}
		if err != nil {
			return
		}
		checkGGUF(t, g, data)
		ctx := context.Background()
		var out []GGUFWriteTensor
		for _, tt := range g.Tensors() {
			buf := make([]byte, tt.Size)
			if err := g.ReadTensorBytes(ctx, tt.Name, buf); err != nil {
				t.Fatalf("tensor %s: %v", tt.Name, err)
			}
			if r.maxEnd > int64(len(data)) {
				t.Fatalf("tensor %s: read to byte %d of %d", tt.Name, r.maxEnd, len(data))
			}
			out = append(out, GGUFWriteTensor{Name: tt.Name, Type: tt.Type, Dims: tt.Dims, Data: buf})
		}
		// Write it back and read it again. Names up to 64 bytes are read
		// but only up to 63 written (ggml's limit), so longer ones are
		// left out of this part.
		for _, tt := range g.Tensors() {
			if len(tt.Name) > ggufMaxWriteName {
				return
			}
		}
		path := filepath.Join(t.TempDir(), "again.gguf")
		if err := WriteGGUF(path, g.Metadata.KVs(), out); err != nil {
			t.Fatalf("writing back what was read: %v", err)
		}
		h, err := OpenGGUF(path)
		if err != nil {
			t.Fatalf("reading back what was written: %v", err)
		}
		defer h.Close()
		if a, b := fmt.Sprintf("%#v", g.Metadata.KVs()), fmt.Sprintf("%#v", h.Metadata.KVs()); a != b {
			t.Fatalf("metadata changed in the round trip:\n%s\n%s", a, b)
		}
		for i, tt := range h.Tensors() {
			o := g.Tensors()[i]
			if tt.Name != o.Name || tt.Type != o.Type || fmt.Sprint(tt.Dims) != fmt.Sprint(o.Dims) || tt.Size != o.Size {
				t.Fatalf("tensor %d changed in the round trip: %v, was %v", i, tt, o)
			}
			buf := make([]byte, tt.Size)
			if err := h.ReadTensorBytes(ctx, tt.Name, buf); err != nil || !bytes.Equal(buf, out[i].Data) {
				t.Fatalf("tensor %s bytes changed in the round trip (%v)", tt.Name, err)
			}
		}
	})
}

// checkGGUF verifies an accepted header against the raw bytes.
func checkGGUF(t *testing.T, g *GGUFFile, data []byte) {
	t.Helper()
	le := binary.LittleEndian
	if nt, nkv := le.Uint64(data[8:]), le.Uint64(data[16:]); nt != uint64(len(g.Tensors())) || nkv != uint64(g.Metadata.Len()) {
		t.Fatalf("file declares %d tensors and %d pairs; parsed %d and %d", nt, nkv, len(g.Tensors()), g.Metadata.Len())
	}
	if g.Alignment <= 0 || g.Alignment&(g.Alignment-1) != 0 || g.DataOffset%g.Alignment != 0 || g.DataOffset < 24 {
		t.Fatalf("alignment %d, data offset %d", g.Alignment, g.DataOffset)
	}
	names := map[string]bool{}
	for i, tt := range g.Tensors() {
		if names[tt.Name] || tt.Name == "" {
			t.Fatalf("tensor %d: name %q empty or repeated", i, tt.Name)
		}
		names[tt.Name] = true
		elems := big.NewInt(1)
		for _, d := range tt.Dims {
			elems.Mul(elems, big.NewInt(d))
		}
		bs, bb := big.NewInt(int64(tt.Type.BlockSize())), big.NewInt(int64(tt.Type.BlockBytes()))
		if bs.Sign() == 0 {
			t.Fatalf("tensor %s: accepted unknown type %d", tt.Name, uint32(tt.Type))
		}
		q, rem := new(big.Int).QuoRem(elems, bs, new(big.Int))
		if rem.Sign() != 0 || new(big.Int).Mul(q, bb).Cmp(big.NewInt(tt.Size)) != 0 {
			t.Fatalf("tensor %s: %v %v is %d bytes, want %v elements in %v-element blocks of %v bytes", tt.Name, tt.Type, tt.Dims, tt.Size, elems, bs, bb)
		}
		if tt.Offset < g.DataOffset || (tt.Offset-g.DataOffset)%g.Alignment != 0 || tt.Size < 0 || tt.Offset+tt.Size > int64(len(data)) {
			t.Fatalf("tensor %s: bytes [%d, %d) misplaced (data at %d, alignment %d, file %d bytes)", tt.Name, tt.Offset, tt.Offset+tt.Size, g.DataOffset, g.Alignment, len(data))
		}
		for _, o := range g.Tensors()[:i] {
			if tt.Size > 0 && o.Size > 0 && tt.Offset < o.Offset+o.Size && o.Offset < tt.Offset+tt.Size {
				t.Fatalf("tensors %s and %s overlap", tt.Name, o.Name)
			}
		}
	}
}
