package quant

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"math"
	"testing"
)

// goldenQuant holds the SHA-256 of Quantize(weights(1<<16, 15)) for each
// type, computed by the reference C quantizers (ggml's quantize_row_*_ref,
// built without fused multiply-adds). Every byte must match.
var goldenQuant = map[Type]string{
	Q4_0: "5f52d59a4eaf422f11c539fc79a7b373e611438b68cf3e7a8df9865e7cc4d7dc",
	Q4_1: "ac67faa14cf0458e4cc97a941458028b69a701b2ae1251139d0f0c2b944a71f6",
	Q5_0: "58a4b40ccceeb9d01b68cbd72f54dd9fd6be780c48b6a871c408cb8a198750df",
	Q5_1: "d781df2f9ce0f0bdc16ad612be1f175329704ebad4f183728a33504051adc063",
	Q8_0: "73233239e72604154518eabc9f07e1133f6f77c626f587d308448c3cadbd2a5b",
	Q4_K: "3515a1f09a113878e92f86dcbff449f05afb7174d9401fab2303fbed0431983f",
	Q5_K: "e3bcc58b97dea83dd4cdef7ab2daee0b22fa7b0e6d03e504ad1f7b02a8bc2831",
	Q6_K: "924ce42cc73153263c80de1d47f98e5ec3283a8570a41db76a83a6fb510a76f8",
	Q8_K: "d4c3eefdfbdb166ceed4f03443713d91f637f0c608dc28c3f133fd5bebfbeacf",
}

func TestQuantizeGolden(t *testing.T) {
	x := weights(1<<16, 15)
	for typ, want := range goldenQuant {
		nb, _ := typ.Bytes(int64(len(x)))
		q := make([]byte, nb)
		if err := typ.Quantize(q, x); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(q)
		if got := hex.EncodeToString(sum[:]); got != want {
			t.Errorf("%v: quantized bytes hash to %s, the reference's to %s", typ, got, want)
		}
	}
}

func TestQuantizeHandBlocks(t *testing.T) {
	// Q8_0 with max |x| = 127: d = 1, and the quants are the values
	// rounded half away from zero.
	x := make([]float32, 32)
	want := []byte{0x00, 0x3c}
	for e := range x {
		x[e] = float32(e - 16)
	}
	x[0], x[1], x[2], x[3], x[4] = -127, 0.5, -0.5, 2.5, -126.5
	for e := range x {
		q := map[int]int8{0: -127, 1: 1, 2: -1, 3: 3, 4: -127}[e]
		if e > 4 {
			q = int8(e - 16)
		}
		want = append(want, byte(q))
	}
	got := make([]byte, 34)
	if err := Q8_0.Quantize(got, x); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("Q8_0:\n got % x\nwant % x", got, want)
	}

	// Q4_0 with the largest magnitude -8 first: d = 1, and the level is
	// trunc(x + 8.5) capped at 15, so ties go up.
	x = make([]float32, 32)
	x[0], x[1], x[2], x[3], x[4], x[5], x[6] = -8, 0, 7, 7.4, 8, 0.5, -0.5
	x[16], x[17] = -7.6, 3.2
	levels := make([]byte, 32)
	for e := range levels {
		levels[e] = 8 // zeros
	}
	levels[0], levels[2], levels[3], levels[4], levels[5], levels[6] = 0, 15, 15, 15, 9, 8
	levels[16], levels[17] = 0, 11
	want = []byte{0x00, 0x3c}
	for j := range 16 {
		want = append(want, levels[j]|levels[j+16]<<4)
	}
	got = make([]byte, 18)
	if err := Q4_0.Quantize(got, x); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("Q4_0:\n got % x\nwant % x", got, want)
	}

	// An all-zero super-block quantizes to blocks that decode to zeros
	// (Q4_0 and Q5_0 store d = 0/-8 = -0, as the reference does).
	for _, typ := range supported {
		n := typ.BlockSize() * (256 / typ.BlockSize())
		nb, _ := typ.Bytes(int64(n))
		q := make([]byte, nb)
		for i := range q {
			q[i] = 0xa5
		}
		if err := typ.Quantize(q, make([]float32, n)); err != nil {
			t.Fatal(err)
		}
		y := make([]float32, n)
		if err := typ.Dequantize(y, q); err != nil {
			t.Fatal(err)
		}
		for i, v := range y {
			if v != 0 {
				t.Errorf("%v: zeros quantize to % x, decoding element %d to %v", typ, q, i, v)
				break
			}
		}
	}
}

// TestRoundTripError bounds the relative RMS error of quantize then
// dequantize on normal data and on weight-shaped data (outliers, scales
// that change, zero blocks). The bounds are about 5% above what the
// reference quantizer gives on the same data, so a worse quantizer fails.
func TestRoundTripError(t *testing.T) {
	g := newGen(3)
	normal := make([]float32, 1<<16)
	for i := range normal {
		normal[i] = g.normal()
	}
	w := weights(1<<16, 9)
	cases := []struct {
		t          Type
		normal, wt float64
	}{
		{F32, 0, 0},
		{F16, 0.00025, 0.00025},
		{BF16, 0.0018, 0.0018},
		{Q8_0, 0.0054, 0.0096},
		{Q4_0, 0.086, 0.152},
		{Q4_1, 0.080, 0.106},
		{Q5_0, 0.043, 0.076},
		{Q5_1, 0.039, 0.051},
		{Q4_K, 0.073, 0.098},
		{Q5_K, 0.037, 0.049},
		{Q6_K, 0.018, 0.028},
		{Q8_K, 0.0066, 0.0205},
	}
	for _, c := range cases {
		for _, d := range []struct {
			name  string
			x     []float32
			bound float64
		}{{"normal", normal, c.normal}, {"weights", w, c.wt}} {
			got := relRMS(t, c.t, d.x)
			t.Logf("%-5v %-7s relative RMS error %.5f (bound %.5f)", c.t, d.name, got, d.bound)
			if got > d.bound {
				t.Errorf("%v on %s data: relative RMS error %.5f, want at most %.5f", c.t, d.name, got, d.bound)
			}
		}
	}
}

func relRMS(t *testing.T, typ Type, x []float32) float64 {
	t.Helper()
	nb, _ := typ.Bytes(int64(len(x)))
	q := make([]byte, nb)
	if err := typ.Quantize(q, x); err != nil {
		t.Fatal(err)
	}
	y := make([]float32, len(x))
	if err := typ.Dequantize(y, q); err != nil {
		t.Fatal(err)
	}
	var e2, x2 float64
	for i := range x {
		d := float64(y[i]) - float64(x[i])
		e2 += d * d
		x2 += float64(x[i]) * float64(x[i])
	}
	return math.Sqrt(e2 / x2)
}

func TestQ8_0ElementError(t *testing.T) {
	// Each element is within half a step (d/2) of its value, plus the
	// rounding of d to F16 (relative 2^-11) times the largest quant, 127.
	x := weights(1<<14, 5)
	q := make([]byte, len(x)/32*34)
	if err := Q8_0.Quantize(q, x); err != nil {
		t.Fatal(err)
	}
	y := make([]float32, len(x))
	DequantizeQ8_0(y, q)
	for b := range len(x) / 32 {
		d := float64(halfToFloat(le16(q[34*b:])))
		for e := 32 * b; e < 32*b+32; e++ {
			if err := math.Abs(float64(y[e] - x[e])); err > d*(0.5+127.0/2048) {
				t.Fatalf("element %d: %v decodes to %v, error %g > d/2 = %g", e, x[e], y[e], err, d/2)
			}
		}
	}
}

func TestCheckedErrors(t *testing.T) {
	big := make([]float32, 32)
	big[3] = 1e9 // d = 1e9/127 does not fit F16
	nan := make([]float32, 32)
	nan[7] = float32(math.NaN())
	inf := make([]float32, 256)
	inf[200] = float32(math.Inf(-1))
	cases := []struct {
		name string
		err  error
		run  func() error
	}{
		{"quantize NaN", ErrNotFinite, func() error { return Q8_0.Quantize(make([]byte, 34), nan) }},
		{"quantize -Inf", ErrNotFinite, func() error { return Q4_K.Quantize(make([]byte, 144), inf) }},
		{"quantize F16 scale overflow", ErrNotFinite, func() error { return Q8_0.Quantize(make([]byte, 34), big) }},
		{"quantize F16 overflow", ErrNotFinite, func() error { return F16.Quantize(make([]byte, 64), big) }},
		{"quantize short dst", ErrLength, func() error { return Q8_0.Quantize(make([]byte, 33), nan) }},
		{"dequantize partial block", ErrLength, func() error { return Q4_K.Dequantize(make([]float32, 255), make([]byte, 144)) }},
		{"dequantize wrong bytes", ErrLength, func() error { return Q6_K.Dequantize(make([]float32, 256), make([]byte, 211)) }},
		{"dot wrong length", ErrLength, func() error { _, err := Q8_0.DotF32(make([]byte, 34), make([]float32, 64)); return err }},
		{"unsupported", ErrUnsupported, func() error { return Q2_K.Dequantize(make([]float32, 256), make([]byte, 84)) }},
		{"unknown", ErrUnknownType, func() error { return Type(4).Dequantize(nil, nil) }},
	}
	for _, c := range cases {
		if err := c.run(); !errors.Is(err, c.err) {
			t.Errorf("%s: error %v, want %v", c.name, err, c.err)
		}
	}
	if err := Q8_0.Quantize(make([]byte, 34), big); err == nil || !contains(err.Error(), "block 0") {
		t.Errorf("overflow error does not name the block: %v", err)
	}
	if err := Q8_0.Quantize(make([]byte, 34), nan); err == nil || !contains(err.Error(), "element 7") {
		t.Errorf("NaN error does not name the element: %v", err)
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

func TestUncheckedPanicsOnLength(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("DequantizeQ4_K with a partial block did not panic")
		}
	}()
	DequantizeQ4_K(make([]float32, 100), make([]byte, 144))
}

// TestDot checks every format's dot product against a float64 product
// over the dequantized row: within 1e-5 of the sum of the absolute
// products (the accuracy target for quantized products).
func TestDot(t *testing.T) {
	for _, typ := range supported {
		for _, n := range []int{256, 4096, 256 * 11} {
			w := weights(n, uint64(n))
			x := weights(n, uint64(n)+1)
			nb, _ := typ.Bytes(int64(n))
			q := make([]byte, nb)
			if err := typ.Quantize(q, w); err != nil {
				t.Fatal(err)
			}
			deq := make([]float32, n)
			if err := typ.Dequantize(deq, q); err != nil {
				t.Fatal(err)
			}
			var ref, mag float64
			for i := range deq {
				ref += float64(deq[i]) * float64(x[i])
				mag += math.Abs(float64(deq[i]) * float64(x[i]))
			}
			got, err := typ.DotF32(q, x)
			if err != nil {
				t.Fatal(err)
			}
			if diff := math.Abs(float64(got) - ref); diff > 1e-5*mag {
				t.Errorf("%v n=%d: dot %g, float64 reference %g: error %g is more than 1e-5 of %g", typ, n, got, ref, diff, mag)
			}
		}
	}
}
