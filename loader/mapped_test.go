package loader

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor/quant"
)

// ggufOf writes the F16 GGUF file of a fixture into dir.
func ggufOf(t *testing.T, fixture, dir string) string {
	t.Helper()
	ctx := context.Background()
	src, err := Open(fixtures.Dir(fixture))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	types, _, err := GGUFTensorTypes(src.Config, quant.F16)
	if err != nil {
		t.Fatal(err)
	}
	tok, _ := src.Tokenizer()
	v, err := tok.GGUFVocab(src.Config.VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "model.gguf")
	err = WriteGGUFModel(ctx, path, GGUFModel{Config: src.Config, Vocab: v, Name: "tiny", Types: types, FileType: GGUFFileType(quant.F16),
		Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
			ti, _ := src.Tensor(spec.Name)
			return src.ReadRows(ctx, ti, r0, r1, dst)
		}})
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// TestMappedReads: Open reads weight files (safetensors shards, a GGUF
// file) through a read-only mapping, or with STRATA_MMAP=0 through pread,
// and both read the same bytes of every tensor, whole and in ranges. A
// mapped file truncated under the reader fails the read with an error
// wrapping io.ErrUnexpectedEOF instead of crashing the process, and a read
// before the cut still reads; Close waits for the reads under way, and
// reads after it fail with ErrClosed.
func TestMappedReads(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		path func(t *testing.T) string
	}{
		{"safetensors shards", func(t *testing.T) string {
			dir, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			return dir
		}},
		{"safetensors bf16", func(t *testing.T) string {
			dir, err := fixtures.Extract(fixtures.TinyLlamaBF16, t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			return dir
		}},
		{"gguf f16", func(t *testing.T) string { return ggufOf(t, fixtures.TinyLlamaF16Sharded, t.TempDir()) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := c.path(t)
			open := func(mmap bool) *Model {
				t.Helper()
				if !mmap {
					t.Setenv(MmapEnv, "0")
				} else {
					t.Setenv(MmapEnv, "")
				}
				m, err := Open(path)
				if err != nil {
					t.Fatal(err)
				}
				for name, f := range m.files {
					if _, mapped := f.r.(*mappedFile); mapped != mmap {
						t.Fatalf("%s=%v: file %s mapped %v", MmapEnv, mmap, name, mapped)
					}
				}
				return m
			}
			plain, mapped := open(false), open(true)
			defer plain.Close()
			var big *TensorInfo
			for name, ti := range mapped.tensors {
				want, err := plain.ReadTensor(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				got, err := mapped.ReadTensor(ctx, name)
				if err != nil {
					t.Fatalf("%s mapped: %v", name, err)
				}
				if !bytes.Equal(got.Bytes(), want.Bytes()) {
					t.Fatalf("%s: the mapped read differs from pread's", name)
				}
				part := make([]byte, ti.Size/3)
				if err := mapped.ReadRange(ctx, ti, ti.Size-int64(len(part)), part); err != nil || !bytes.Equal(part, want.Bytes()[ti.Size-int64(len(part)):]) {
					t.Fatalf("%s: mapped range: %v", name, err)
				}
				if big == nil || ti.Size > big.Size {
					big = ti
				}
			}

			// In place: every tensor but those whose rows are reordered on
			// reading (a GGUF llama's query and key projections).
			permuted := 0
			for name, ti := range mapped.tensors {
				_, ok, err := mapped.Mapped(ti)
				if err != nil {
					t.Fatalf("Mapped(%s): %v", name, err)
				}
				if ok == (ti.qkHeads > 0) {
					t.Errorf("Mapped(%s): in place %v, rows reordered %v", name, ok, ti.qkHeads > 0)
				}
				if ti.qkHeads > 0 {
					permuted++
				}
			}
			if (permuted > 0) != (filepath.Ext(path) == ".gguf") {
				t.Errorf("%d tensors with rows reordered", permuted)
			}

			// Truncated under the mapping: an error, not a crash.
			file := filepath.Join(path, big.File)
			if filepath.Ext(path) == ".gguf" {
				file = path
			}
			st, err := os.Stat(file)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(file, 0o644); err != nil {
				t.Fatal(err)
			}
			// Cut a page after the tensor's first: the mapping faults
			// past the page the cut falls in.
			cut := (big.Offset + 4096 + 4095) &^ 4095
			if cut+4096 >= big.Offset+big.Size {
				t.Skipf("tensor %s (%d bytes) too small to cut after a page", big.Name, big.Size)
			}
			if err := os.Truncate(file, cut); err != nil {
				t.Fatal(err)
			}
			err = mapped.ReadInto(ctx, big, make([]byte, big.Size))
			if !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Errorf("read of %s truncated under the mapping: %v, want io.ErrUnexpectedEOF", big.Name, err)
			}
			if err := mapped.ReadRange(ctx, big, 0, make([]byte, 64)); err != nil {
				t.Errorf("range before the cut: %v", err)
			}
			if err := os.Truncate(file, st.Size()); err != nil {
				t.Fatal(err)
			}

			// Close under reads.
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range 8 {
						errs <- mapped.ReadRange(ctx, big, 0, make([]byte, big.Size))
					}
				}()
			}
			if err := mapped.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, os.ErrClosed) {
					t.Errorf("a read racing Close: %v, want success or ErrClosed", err)
				}
			}
			if _, err := mapped.ReadTensor(ctx, big.Name); !errors.Is(err, ErrClosed) {
				t.Errorf("read after Close: %v, want ErrClosed", err)
			}
		})
	}
}
