package loader_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"unsafe"

	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
)

// TestMappedTensors: a mapped model gives every tensor's stored bytes in
// place (Mapped), equal to what ReadTensor reads and lying in one of its
// MappedRegions, except where reading reorders the rows; a model read with
// pread gives none; a tensor holding a NaN is refused by Mapped as by
// ReadTensor; after Close, Mapped fails with ErrClosed.
func TestMappedTensors(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name    string
		fixture string
		mmap    string
	}{
		{"f16 sharded", fixtures.TinyLlamaF16Sharded, ""},
		{"bf16", fixtures.TinyLlamaBF16, ""},
		{"pread", fixtures.TinyLlamaBF16, "0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(loader.MmapEnv, c.mmap)
			dir := fixturetest.Copy(t, c.fixture)
			const bad = "model.layers.1.mlp.up_proj.weight"
			fixturetest.SetBits(t, dir, bad, 5, 0x7fff)
			m, err := loader.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			regions := m.MappedRegions()
			if (len(regions) > 0) != (c.mmap == "") {
				t.Fatalf("%d mapped regions with %s=%q", len(regions), loader.MmapEnv, c.mmap)
			}
			within := func(b []byte) bool {
				p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
				for _, r := range regions {
					base := uintptr(unsafe.Pointer(unsafe.SliceData(r)))
					if p >= base && p+uintptr(len(b)) <= base+uintptr(len(r)) {
						return true
					}
				}
				return false
			}
			given := 0
			for _, l := range m.Layers() {
				for _, ti := range l.Tensors {
					b, ok, err := m.Mapped(ti)
					if ti.Name == bad {
						if !errors.Is(err, loader.ErrNonFinite) && c.mmap == "" {
							t.Errorf("Mapped(%s) holding a NaN: %v, want ErrNonFinite", ti.Name, err)
						}
						continue
					}
					if err != nil {
						t.Fatalf("Mapped(%s): %v", ti.Name, err)
					}
					if !ok {
						continue
					}
					given++
					want, err := m.ReadTensor(ctx, ti.Name)
					if err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(b, want.Bytes()) || !within(b) {
						t.Fatalf("Mapped(%s): %d bytes, equal to the read %v, in a region %v", ti.Name, len(b), bytes.Equal(b, want.Bytes()), within(b))
					}
				}
			}
			if (given > 0) != (c.mmap == "") {
				t.Errorf("%d tensors given in place with %s=%q", given, loader.MmapEnv, c.mmap)
			}
			ti, _ := m.Tensor("model.layers.0.mlp.up_proj.weight")
			m.Close()
			if _, _, err := m.Mapped(ti); c.mmap == "" && (!errors.Is(err, loader.ErrClosed) || !strings.HasPrefix(err.Error(), "loader: ")) {
				t.Errorf("Mapped after Close: %v, want ErrClosed", err)
			}
		})
	}
}
