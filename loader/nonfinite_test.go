package loader_test

import (
	"context"
	"errors"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// TestReadNonFiniteWeights writes NaNs and infinities of every kind into a
// weight of copies of both fixtures and reads it back: ReadTensor, ReadInto
// and a ReadRange holding the element fail with a *NonFiniteError naming
// the file, the tensor, the element and its value; other reads succeed.
func TestReadNonFiniteWeights(t *testing.T) {
	const block = "model.layers.1.mlp.up_proj.weight"
	f16, bf16 := fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16
	cases := []struct {
		name    string
		fixture string
		tensor  string
		index   int64
		bits    uint32
		nan     bool
		sign    int
	}{
		{"f16 quiet NaN", f16, block, 7, 0x7e00, true, 0},
		{"f16 NaN with a payload", f16, block, 100, 0x7c01, true, 0},
		{"f16 negative NaN", f16, block, 3, 0xfe00, true, 0},
		{"f16 +Inf", f16, block, 0, 0x7c00, false, 1},
		{"f16 -Inf", f16, block, 1, 0xfc00, false, -1},
		{"f16 NaN in the embedding", f16, "model.embed_tokens.weight", 4097, 0x7fff, true, 0},
		{"f16 NaN in a norm", f16, "model.layers.0.input_layernorm.weight", 63, 0x7e00, true, 0},
		{"bf16 quiet NaN", bf16, block, 7, 0x7fc0, true, 0},
		{"bf16 NaN with a payload", bf16, block, 9, 0x7f81, true, 0},
		{"bf16 +Inf", bf16, block, 11, 0x7f80, false, 1},
		{"bf16 -Inf", bf16, block, 12, 0xff80, false, -1},
		{"bf16 NaN in the last element of the head", bf16, "lm_head.weight", -1, 0xffc0, true, 0},
	}
	ctx := context.Background()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := fixturetest.Copy(t, c.fixture)
			m, err := loader.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			ti, ok := m.Tensor(c.tensor)
			m.Close()
			if !ok {
				t.Fatalf("no tensor %s", c.tensor)
			}
			index := c.index
			if index < 0 {
				index = ti.Size/int64(ti.DType.Size()) - 1
			}
			fixturetest.SetBits(t, dir, c.tensor, index, c.bits)

			m, err = loader.Open(dir) // headers only: opening succeeds
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			check := func(what string, err error) {
				t.Helper()
				var ne *loader.NonFiniteError
				if !errors.Is(err, loader.ErrNonFinite) || !errors.As(err, &ne) {
					t.Fatalf("%s: %v, want a *NonFiniteError", what, err)
				}
				if ne.Tensor != c.tensor || ne.Index != index || ne.File != filepath.Join(dir, ti.File) || ne.Bits != c.bits || ne.DType != ti.DType {
					t.Errorf("%s: %+v, want tensor %s element %d of %s, bits %#x", what, ne, c.tensor, index, ti.File, c.bits)
				}
				if math.IsNaN(ne.Value) != c.nan || (!c.nan && !math.IsInf(ne.Value, c.sign)) {
					t.Errorf("%s: value %v", what, ne.Value)
				}
				msg := err.Error()
				if strings.Contains(msg, "\n") || !strings.Contains(msg, c.tensor) || !strings.Contains(msg, ti.File) {
					t.Errorf("%s: message %q is not one line naming the tensor and the file", what, msg)
				}
			}
			_, err = m.ReadTensor(ctx, c.tensor)
			check("ReadTensor", err)
			check("ReadInto", m.ReadInto(ctx, ti, make([]byte, ti.Size)))
			size := int64(ti.DType.Size())
			at := index * size
			// A range holding the element whole, starting mid-element.
			lo := max(at-3, 0)
			hi := min(at+size+5, ti.Size)
			check("ReadRange", m.ReadRange(ctx, ti, lo, make([]byte, hi-lo)))
			// Ranges without it, or holding only part of it, read.
			if at > 0 {
				if err := m.ReadRange(ctx, ti, 0, make([]byte, at)); err != nil {
					t.Errorf("ReadRange before the element: %v", err)
				}
				if err := m.ReadRange(ctx, ti, 0, make([]byte, at+1)); err != nil {
					t.Errorf("ReadRange ending inside the element: %v", err)
				}
			}
			// Every other tensor reads.
			for _, l := range m.Layers() {
				for _, o := range l.Tensors {
					if o.Name == c.tensor {
						continue
					}
					if _, err := m.ReadTensor(ctx, o.Name); err != nil {
						t.Fatalf("%s: %v", o.Name, err)
					}
				}
			}
			// A File reads what is stored: it may hold more than weights.
			f, _ := m.File(ti.File)
			if err := f.ReadInto(ctx, ti, make([]byte, ti.Size)); err != nil {
				t.Errorf("File.ReadInto: %v", err)
			}
		})
	}
}

// TestReadFiniteEdges: subnormals, zeros and the largest finite values of
// each dtype are weights like any other.
func TestReadFiniteEdges(t *testing.T) {
	const name = "model.layers.0.self_attn.q_proj.weight"
	for _, c := range []struct {
		fixture string
		bits    []uint32
	}{
		{fixtures.TinyLlamaF16Sharded, []uint32{0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff, 0x8000}},
		{fixtures.TinyLlamaBF16, []uint32{0x0001, 0x8001, 0x007f, 0x7f7f, 0xff7f, 0x8000}},
	} {
		dir := fixturetest.Copy(t, c.fixture)
		for i, b := range c.bits {
			fixturetest.SetBits(t, dir, name, int64(i), b)
		}
		m, err := loader.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		x, err := m.ReadTensor(context.Background(), name)
		m.Close()
		if err != nil {
			t.Fatalf("%s: %v", c.fixture, err)
		}
		if u := x.U16(); u[3] != uint16(c.bits[3]) {
			t.Errorf("%s: element 3 is %#x", c.fixture, u[3])
		}
	}
}

// TestReadNonFiniteF32Weight: an F32 weight is checked too.
func TestReadNonFiniteF32Weight(t *testing.T) {
	const name = "model.norm.weight"
	dir := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
	fixturetest.Replace(t, dir, name, tensor.F32, func(i int, v float32) float32 {
		if i == 5 {
			return float32(math.Inf(-1))
		}
		return v
	})
	m, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	_, err = m.ReadTensor(context.Background(), name)
	var ne *loader.NonFiniteError
	if !errors.As(err, &ne) || ne.Index != 5 || ne.DType != tensor.F32 || !math.IsInf(ne.Value, -1) {
		t.Fatalf("%v, want element 5 of an F32 tensor, -Inf", err)
	}
}

// TestReadCheckedOnce: a tensor read whole and found finite is not checked
// again, so a pager re-reading a layer every token pays for the check once.
// The test changes the file under the open model: the second read returns
// the new bytes unchecked.
func TestReadCheckedOnce(t *testing.T) {
	const name = "model.layers.1.mlp.up_proj.weight"
	dir := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
	m, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx := context.Background()
	if _, err := m.ReadTensor(ctx, name); err != nil {
		t.Fatal(err)
	}
	fixturetest.SetBits(t, dir, name, 5, 0x7fc0)
	got, err := m.ReadTensor(ctx, name)
	if err != nil {
		t.Fatalf("second read checked again: %v", err)
	}
	if got.U16()[5] != 0x7fc0 {
		t.Skip("the file was replaced, not rewritten in place: the open model does not see the change")
	}
	m2, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	if _, err := m2.ReadTensor(ctx, name); !errors.Is(err, loader.ErrNonFinite) {
		t.Fatalf("a fresh model's first read: %v, want ErrNonFinite", err)
	}
}

// TestReadRangeCheckedOnce: ReadRange checks a large range once, as
// ReadInto checks a tensor once: a NaN written into the file after a range
// was read and found finite is not seen by a read of that range again, nor
// of a range within it from the same offset, nor by any range of a tensor
// read whole before; it is seen by a range reaching past the one checked,
// by a range from another offset, by a small range (rows are not
// remembered), and by a model opened afresh.
func TestReadRangeCheckedOnce(t *testing.T) {
	const name = "model.layers.1.mlp.up_proj.weight"
	ctx := context.Background()
	for _, fx := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16} {
		t.Run(filepath.Base(fx), func(t *testing.T) {
			dir := fixturetest.Copy(t, fx)
			m, err := loader.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			ti, ok := m.Tensor(name)
			if !ok {
				t.Fatalf("no tensor %s", name)
			}
			size := int64(ti.DType.Size())
			half := ti.Size / 2 / size * size
			other, ok := m.Tensor("model.layers.0.mlp.up_proj.weight")
			if !ok {
				t.Fatal("no layer 0 up_proj")
			}
			// Read before the NaN is written: half of the tensor, and all
			// of another one.
			if err := m.ReadRange(ctx, ti, 0, make([]byte, half)); err != nil {
				t.Fatal(err)
			}
			if err := m.ReadInto(ctx, other, make([]byte, other.Size)); err != nil {
				t.Fatal(err)
			}
			at := half/size/2 - 1 // an element in the first half, not at its start
			fixturetest.SetBits(t, dir, name, at, 0x7fff)
			fixturetest.SetBits(t, dir, other.Name, at, 0x7fff)
			fresh, err := loader.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer fresh.Close()
			fti, _ := fresh.Tensor(name)
			for _, c := range []struct {
				what    string
				m       *loader.Model
				ti      *loader.TensorInfo
				off, n  int64
				checked bool
			}{
				{"the range read before", m, ti, 0, half, false},
				{"a range within it from its offset", m, ti, 0, (at + 1) * size, false},
				{"a range past it", m, ti, 0, half + size, true},
				{"a range from another offset", m, ti, size, half - size, true},
				{"a small range", m, ti, at * size, size, true},
				{"a range of a tensor read whole", m, other, 0, half, false},
				{"the range in a model opened afresh", fresh, fti, 0, half, true},
			} {
				err := c.m.ReadRange(ctx, c.ti, c.off, make([]byte, c.n))
				if c.checked && !errors.Is(err, loader.ErrNonFinite) {
					t.Errorf("%s: %v, want the NaN found", c.what, err)
				}
				if !c.checked && err != nil {
					t.Errorf("%s: %v, want no check (found finite before)", c.what, err)
				}
			}
		})
	}
}
