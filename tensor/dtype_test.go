package tensor

import (
	"testing"

	"github.com/strata-llm/strata/tensor/quant"
)

// TestQuantizedDTypes: the block formats' storage sizes are quant's, rows
// must be whole blocks, names parse both ways, and every quantized dtype
// maps to a quant type and back.
func TestQuantizedDTypes(t *testing.T) {
	for _, tc := range []struct {
		dt          DType
		block, size int
	}{{Q8_0, 32, 34}, {Q4_0, 32, 18}, {Q4_K, 256, 144}, {Q5_K, 256, 176}, {Q6_K, 256, 210}, {F16, 1, 2}} {
		if tc.dt.BlockSize() != tc.block || tc.dt.BlockBytes() != tc.size {
			t.Errorf("%v: block %d of %d bytes, want %d of %d", tc.dt, tc.dt.BlockSize(), tc.dt.BlockBytes(), tc.block, tc.size)
		}
		n, err := tc.dt.ShapeBytes(Shape{3, 2 * tc.block})
		if err != nil || n != int64(6*tc.size) {
			t.Errorf("%v [3, %d]: %d bytes, %v", tc.dt, 2*tc.block, n, err)
		}
		if back, err := ParseDType(tc.dt.String()); err != nil || back != tc.dt {
			t.Errorf("ParseDType(%q) = %v, %v", tc.dt.String(), back, err)
		}
	}
	if _, err := Q4_K.ShapeBytes(Shape{4, 100}); err == nil {
		t.Error("a Q4_K row of 100 elements was accepted")
	}
	for d := Q8_0; d <= Q8_K; d++ {
		q, ok := d.Quant()
		if !ok || q.BlockSize() != d.BlockSize() {
			t.Errorf("%v: quant type %v, %v", d, q, ok)
		}
		if back, ok := FromQuant(q); !ok || back != d {
			t.Errorf("FromQuant(%v) = %v, %v", q, back, ok)
		}
	}
	if _, ok := FromQuant(quant.IQ2_XS); ok {
		t.Error("IQ2_XS maps to a dtype")
	}
	// Q8_B8, strata's cache format: blocks of 8 in 10 bytes, no ggml type,
	// not a dtype of weights.
	if Q8_B8.BlockSize() != 8 || Q8_B8.BlockBytes() != 10 || Q8_B8.IsQuantized() || Q8_B8.IsFloat() {
		t.Errorf("Q8_B8: block %d of %d bytes, quantized %v", Q8_B8.BlockSize(), Q8_B8.BlockBytes(), Q8_B8.IsQuantized())
	}
	if _, ok := Q8_B8.Quant(); ok {
		t.Error("Q8_B8 maps to a ggml type")
	}
	if n, err := Q8_B8.ShapeBytes(Shape{3, 24}); err != nil || n != 90 {
		t.Errorf("Q8_B8 [3, 24]: %d bytes, %v", n, err)
	}
	if _, err := Q8_B8.ShapeBytes(Shape{3, 20}); err == nil {
		t.Error("a Q8_B8 row of 20 elements was accepted")
	}
	if _, err := New(Q8_B8, Shape{2, 16}).Reshape(Shape{4, 8}); err != nil {
		t.Errorf("Q8_B8 [2, 16] as [4, 8]: %v", err)
	}
	if _, err := New(Q8_B8, Shape{2, 16}).Reshape(Shape{8, 4}); err == nil {
		t.Error("Q8_B8 [2, 16] reshaped to rows of 4")
	}
	if d, err := ParseDType("q8_b8"); err == nil {
		t.Errorf("ParseDType(q8_b8) = %v, a dtype of weights", d)
	}
	if Q8_0.Size() != 0 || !Q8_0.IsQuantized() || F16.IsQuantized() || Q8_0.IsFloat() {
		t.Error("quantized dtypes pass for plain ones")
	}
	x := New(Q4_K, Shape{2, 512})
	if x.NumBytes() != 4*144 || x.Len() != 1024 {
		t.Errorf("a [2, 512] Q4_K tensor: %d bytes, %d elements", x.NumBytes(), x.Len())
	}
	r, err := x.Rows(1, 1)
	if err != nil || r.NumBytes() != 2*144 {
		t.Errorf("its second row: %v, %v", r, err)
	}
}

func TestParseCacheDType(t *testing.T) {
	for _, c := range []struct {
		in   string
		want DType
		ok   bool
	}{
		{"", F32, true}, {"f32", F32, true}, {"F16", F16, true}, {" bf16 ", BF16, true}, {"Q8_0", Q8_0, true}, {"q8_b8", Q8_B8, true},
		{"Q8_B8", Q8_B8, true}, {"q8_8", Invalid, false}, {"q4_0", Invalid, false}, {"int8", Invalid, false}, {"f64", Invalid, false},
	} {
		got, err := ParseCacheDType(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("ParseCacheDType(%q) = %v, %v; want %v (ok %v)", c.in, got, err, c.want, c.ok)
		}
		if err == nil && !IsCacheDType(got) {
			t.Errorf("ParseCacheDType(%q) = %v, which IsCacheDType refuses", c.in, got)
		}
	}
}
