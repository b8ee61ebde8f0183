package tensortest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// QuantWeightTypes returns the quantized types a weight may have: every
// quantized dtype but Q8_K, the activations' format of the K formats'
// products.
func QuantWeightTypes() []tensor.DType {
	return []tensor.DType{tensor.Q8_0, tensor.Q4_0, tensor.Q4_1, tensor.Q5_0, tensor.Q5_1, tensor.Q4_K, tensor.Q5_K, tensor.Q6_K}
}

// blockScales are the byte offsets of the F16 scale fields in a block of
// each quantized weight type, with a magnitude that makes the dequantized
// weights of order one.
var blockScales = map[tensor.DType][]struct {
	off int
	mag float32
}{
	tensor.Q8_0: {{0, 1.0 / 64}},
	tensor.Q4_0: {{0, 1.0 / 4}},
	tensor.Q4_1: {{0, 1.0 / 8}, {2, 1}},
	tensor.Q5_0: {{0, 1.0 / 8}},
	tensor.Q5_1: {{0, 1.0 / 16}, {2, 1}},
	tensor.Q4_K: {{0, 1.0 / 256}, {2, 1.0 / 64}},
	tensor.Q5_K: {{0, 1.0 / 512}, {2, 1.0 / 64}},
	tensor.Q6_K: {{208, 1.0 / 2048}},
}

// RandomBlocks returns n elements of the quantized weight type dt as random
// blocks: random bytes but for the F16 scales, finite, of either sign and
// about the size that makes the weights of order one. Every quant and
// sub-block scale pattern of the format occurs, not only those a
// quantizer writes.
func RandomBlocks(r *rand.Rand, dt tensor.DType, n int) ([]byte, error) {
	scales, ok := blockScales[dt]
	if !ok {
		return nil, fmt.Errorf("tensortest: no random blocks of %v", dt)
	}
	nb, err := dt.Bytes(int64(n))
	if err != nil {
		return nil, fmt.Errorf("tensortest: random blocks: %w", err)
	}
	b := make([]byte, nb)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	h := make([]uint16, 1)
	for blk := 0; blk < len(b); blk += dt.BlockBytes() {
		for _, sc := range scales {
			v := sc.mag * (0.5 + r.Float32())
			if r.IntN(2) == 0 {
				v = -v
			}
			tensor.F32ToF16(h, []float32{v})
			b[blk+sc.off], b[blk+sc.off+1] = byte(h[0]), byte(h[0]>>8)
		}
	}
	return b, nil
}

// putBlocks uploads random blocks of dt (RandomBlocks) as a tensor of
// shape, freed when the test ends, and returns it with its dequantized
// values.
func (s *suite) putBlocks(t *testing.T, r *rand.Rand, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, []float64) {
	t.Helper()
	b, err := RandomBlocks(r, dt, int(shape.NumElements()))
	if err != nil {
		t.Fatal(err)
	}
	x, err := s.b.Alloc(dt, shape)
	if err != nil {
		t.Fatalf("alloc %v %v: %v", dt, shape, err)
	}
	t.Cleanup(func() { s.b.Free(x) })
	if err := s.b.Upload(x, 0, b); err != nil {
		t.Fatalf("upload %v %v: %v", dt, shape, err)
	}
	v, err := Decode(dt, b)
	if err != nil {
		t.Fatal(err)
	}
	vals := make([]float64, len(v))
	for i, f := range v {
		vals[i] = float64(f)
	}
	return x, vals
}

// normal returns n standard normal values: the activations of the
// quantized tests, whose error depends on the spread of each block.
func normal(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

// RoundActivations returns the m rows of k activations x as a backend that
// quantizes them for weights of dt sees them: each row quantized by
// quant.QuantizeRow and dequantized (quant.DequantizeRow), in float64.
func RoundActivations(dt tensor.DType, x []float32, m, k int) ([]float64, error) {
	typ, ok := dt.Quant()
	if !ok || !quant.IntegerProduct(typ) {
		return nil, fmt.Errorf("tensortest: %v has no integer product", dt)
	}
	nb, err := quant.ActivationBytes(typ, k)
	if err != nil {
		return nil, fmt.Errorf("tensortest: round activations for %v: %w", dt, err)
	}
	xq, row, out := make([]byte, nb), make([]float32, k), make([]float64, 0, m*k)
	for i := range m {
		if err := quant.QuantizeRow(typ, xq, x[i*k:(i+1)*k]); err != nil {
			return nil, err
		}
		if err := quant.DequantizeRow(typ, row, xq); err != nil {
			return nil, err
		}
		for _, v := range row {
			out = append(out, float64(v))
		}
	}
	return out, nil
}

// testQuant checks the operations that take quantized operands, MatMul's
// weights and Embed's tables, in every quantized type the backend computes
// with, and that every other operand is refused when quantized.
func (s *suite) testQuant(t *testing.T) {
	t.Run("MatMul", s.testQuantMatMul)
	t.Run("Embed", s.testQuantEmbed)
	t.Run("Unsupported", s.testQuantUnsupported)
	t.Run("Refused", s.testQuantRefused)
}

// quantMatMulCases are the shapes of the quantized products for a block
// size bs, with the bias type of each (Invalid: none): one row (decode)
// and from a few to many (prefill; the CPU changes its method at 32 and
// 128 rows), inner dimensions of one block and of many. The
// error of rounding activations varies from one draw of x to the next, the
// more so with few blocks of x and with random K-format blocks, whose
// sub-blocks have large means (mins unrelated to the scales): with 8-bit
// activations it reached 0.75% for the 32-element formats and 1.8% for
// the K formats over 300 draws of each case, so every product has several
// rows of x or at least four blocks of activations; with QuantizeRow's
// 16-bit quants it stays below 1e-4.
func quantMatMulCases(bs int) []struct {
	m, n, k int
	bias    tensor.DType
} {
	return []struct {
		m, n, k int
		bias    tensor.DType
	}{
		{1, 513, 4 * bs, tensor.Invalid}, {1, 300, 2048, tensor.F32}, {12, 96, 3 * bs, tensor.F16}, {33, 130, 4 * bs, tensor.Invalid},
		{2, 64, 2048, tensor.F32}, {5, 40, bs, tensor.BF16}, {1, 2048, 4 * bs, tensor.Invalid},
		{70, 48, 2 * bs, tensor.F16}, {130, 40, 2 * bs, tensor.Invalid},
	}
}

func (s *suite) testQuantMatMul(t *testing.T) {
	for _, dt := range s.cfg.quantTypes {
		for _, c := range quantMatMulCases(dt.BlockSize()) {
			name := fmt.Sprintf("%v/M%d_N%d_K%d", dt, c.m, c.n, c.k)
			if c.bias != tensor.Invalid {
				name += "/bias_" + c.bias.String()
			}
			t.Run(name, func(t *testing.T) {
				s.quantMatMul(t, dt, c.m, c.n, c.k, c.bias)
			})
		}
	}
}

// quantMatMul checks one product with quantized weights of dt (and a bias
// of biasType unless Invalid).
func (s *suite) quantMatMul(t *testing.T, dt tensor.DType, m, n, k int, biasType tensor.DType) {
	t.Helper()
	r := rng(t)
	xs := normal(r, m*k)
	x, xv := s.put(t, tensor.F32, tensor.Shape{m, k}, xs)
	w, wv := s.putBlocks(t, r, dt, tensor.Shape{n, k})
	var bias *tensor.Tensor
	var bv []float64
	if biasType != tensor.Invalid {
		bias, bv = s.put(t, biasType, tensor.Shape{n}, normal(r, n))
	}
	out := s.poisoned(t, tensor.Shape{m, n})
	if err := s.b.MatMul(out, x, w, bias); err != nil {
		t.Fatal(err)
	}
	got := s.get(t, out)
	want := RefMatMul(xv, wv, bv, m, n, k)
	compare(t, s.cfg.quantTol, "MatMul against the dequantized weights", got, want)
	t.Logf("relative error against the dequantized weights: %.5f", RelErr(got, want))
	if s.cfg.quantizesX && RelErr(got, want) > s.cfg.tol {
		xr, err := RoundActivations(dt, xs, m, k)
		if err != nil {
			t.Fatal(err)
		}
		rounded := RefMatMul(xr, wv, bv, m, n, k)
		compare(t, s.cfg.tol, "MatMul against the dequantized weights and rounded activations", got, rounded)
		t.Logf("relative error against the rounded activations: %.3g", RelErr(got, rounded))
	}
}

func (s *suite) testQuantEmbed(t *testing.T) {
	for _, dt := range s.cfg.quantTypes {
		bs := dt.BlockSize()
		for _, c := range []struct {
			v, d int
			ids  []int32
		}{
			{50, bs, []int32{0, 49, 7, 7, 3}},
			{37, 3 * bs, []int32{36, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}},
			{1, bs, []int32{0}},
		} {
			t.Run(fmt.Sprintf("%v/V%d_D%d_T%d", dt, c.v, c.d, len(c.ids)), func(t *testing.T) {
				s.quantEmbed(t, dt, c.v, c.d, c.ids)
			})
		}
	}
}

// quantEmbed checks that Embed gathers the dequantized rows, exactly.
func (s *suite) quantEmbed(t *testing.T, dt tensor.DType, v, d int, ids []int32) {
	t.Helper()
	r := rng(t)
	table, tv := s.putBlocks(t, r, dt, tensor.Shape{v, d})
	out := s.poisoned(t, tensor.Shape{len(ids), d})
	if err := s.b.Embed(out, table, ids); err != nil {
		t.Fatal(err)
	}
	got := s.get(t, out)
	want := RefEmbed(tv, d, ids)
	for i := range got {
		if float64(got[i]) != want[i] {
			t.Fatalf("element %d (row %d): got %v, want %v", i, i/d, got[i], want[i])
		}
	}
}

// testQuantUnsupported checks the quantized weight types the backend does
// not compute with (QuantTypes): MatMul and Embed either return an error
// or compute the right result.
func (s *suite) testQuantUnsupported(t *testing.T) {
	for _, dt := range QuantWeightTypes() {
		if slices.Contains(s.cfg.quantTypes, dt) {
			continue
		}
		t.Run(dt.String(), func(t *testing.T) {
			r := rng(t)
			k := 2 * dt.BlockSize()
			x, xv := s.put(t, tensor.F32, tensor.Shape{3, k}, normal(r, 3*k))
			w, wv := s.putBlocks(t, r, dt, tensor.Shape{40, k})
			out := s.poisoned(t, tensor.Shape{3, 40})
			if err := s.b.MatMul(out, x, w, nil); err != nil {
				t.Logf("MatMul: %v", err)
			} else {
				compare(t, s.cfg.quantTol, "MatMul with weights the backend does not list", s.get(t, out), RefMatMul(xv, wv, nil, 3, 40, k))
			}
			ids := []int32{39, 0, 5}
			emb := s.poisoned(t, tensor.Shape{len(ids), k})
			if err := s.b.Embed(emb, w, ids); err != nil {
				t.Logf("Embed: %v", err)
				return
			}
			got, want := s.get(t, emb), RefEmbed(wv, k, ids)
			for i := range got {
				if float64(got[i]) != want[i] {
					t.Fatalf("Embed from a table the backend does not list: element %d: got %v, want %v", i, got[i], want[i])
				}
			}
		})
	}
}

// testQuantRefused checks that every operand but MatMul's w and Embed's
// table is refused when quantized, with an error wrapping
// tensor.ErrQuantized, and that Q8_K, a format of activations, is refused
// as a weight.
func (s *suite) testQuantRefused(t *testing.T) {
	mk := func(dt tensor.DType) func(shape ...int) *tensor.Tensor {
		return func(shape ...int) *tensor.Tensor {
			x, _ := s.put(t, dt, shape, make([]float32, tensor.Shape(shape).NumElements()))
			return x
		}
	}
	f32s, q8s, q8k := mk(tensor.F32), mk(tensor.Q8_0), mk(tensor.Q8_K)
	b := s.b
	x, w, sq := f32s(2, 32), f32s(3, 32), f32s(32, 32)
	cos, sin := f32s(8, 16), f32s(8, 16)
	ids := []int32{1, 2}
	for _, c := range []struct {
		name      string
		call      func() error
		quantized bool // the error wraps tensor.ErrQuantized
	}{
		{"MatMul/x", func() error { return b.MatMul(f32s(2, 3), q8s(2, 32), w, nil) }, true},
		{"MatMul/out", func() error { return b.MatMul(q8s(2, 32), x, sq, nil) }, true},
		{"MatMul/bias", func() error { return b.MatMul(f32s(2, 32), x, sq, q8s(32)) }, true},
		{"MatMul/Q8_K w", func() error { return b.MatMul(f32s(2, 3), f32s(2, 256), q8k(3, 256), nil) }, false},
		{"RMSNorm/w", func() error { return b.RMSNorm(f32s(2, 32), x, q8s(32), 1e-5) }, true},
		{"RMSNorm/x", func() error { return b.RMSNorm(f32s(2, 32), q8s(2, 32), f32s(32), 1e-5) }, true},
		{"Rope/x", func() error { return b.Rope(q8s(2, 32), tensor.Rotary{Cos: cos, Sin: sin, Heads: 1, HeadDim: 32}) }, true},
		{"Rope/cos", func() error {
			return b.Rope(f32s(2, 64), tensor.Rotary{Cos: q8s(8, 32), Sin: f32s(8, 32), Heads: 1, HeadDim: 64})
		}, true},
		{"SiLUMul/gate", func() error { return b.SiLUMul(f32s(2, 32), q8s(2, 32), x) }, true},
		{"SiLUMul/out", func() error { return b.SiLUMul(q8s(2, 32), x, f32s(2, 32)) }, true},
		{"Add/b", func() error { return b.Add(f32s(2, 32), x, q8s(2, 32)) }, true},
		{"Embed/out", func() error { return b.Embed(q8s(2, 32), f32s(10, 32), ids) }, true},
		{"Embed/Q8_K table", func() error { return b.Embed(f32s(2, 256), q8k(4, 256), ids) }, false},
		{"CopyRows", func() error { return b.CopyRows(q8s(4, 32), 0, q8s(2, 32), 0, 1) }, true},
		{"Attention/q", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q8s(2, 64), K: f32s(8, 32), V: f32s(8, 32), Heads: 2, KVHeads: 1, HeadDim: 32, Scale: 1})
		}, true},
		{"Attention/k", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: f32s(2, 64), K: q8s(8, 32), V: q8s(8, 32), Heads: 2, KVHeads: 1, HeadDim: 32, Scale: 1})
		}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("panicked instead of returning an error: %v", p)
				}
			}()
			err := c.call()
			switch {
			case err == nil:
				t.Fatal("no error")
			case c.quantized && !errors.Is(err, tensor.ErrQuantized):
				t.Fatalf("error %v, want one wrapping tensor.ErrQuantized", err)
			}
			t.Logf("error: %v", err)
		})
	}
}
