package quant

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"
)

// FuzzDequantize decodes arbitrary bytes as each supported type: it must
// never panic, must agree bit for bit with the spec decoder (NaN and
// infinite scales included), and the dot product must not panic either.
// A length that is not whole blocks is an ErrLength error.
func FuzzDequantize(f *testing.F) {
	for _, c := range handBlocks() {
		for i, t := range supported {
			if t == c.t {
				f.Add(uint8(i), c.b)
			}
		}
	}
	f.Add(uint8(8), []byte{0xff, 0x7c}) // Q4_K, short
	nan := make([]byte, 144)
	nan[0], nan[1] = 0xff, 0x7f // Q4_K with a NaN d
	f.Add(uint8(8), nan)
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		typ := supported[int(which)%len(supported)]
		bb, bs := typ.BlockBytes(), typ.BlockSize()
		n := len(data) / bb * bs
		if len(data)%bb != 0 {
			if err := typ.Dequantize(make([]float32, n), data); !errors.Is(err, ErrLength) {
				t.Fatalf("%v: %d bytes: error %v, want ErrLength", typ, len(data), err)
			}
			data = data[:len(data)/bb*bb]
		}
		got := make([]float32, n)
		if err := typ.Dequantize(got, data); err != nil {
			t.Fatal(err)
		}
		want := specDequantize(typ, data)
		if i := sameBits(got, want); i >= 0 {
			t.Fatalf("%v: element %d: Dequantize %v (%#x), spec %v (%#x)", typ, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
		}
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(i%7) - 3
		}
		if _, err := typ.DotF32(data, x); err != nil {
			t.Fatal(err)
		}
	})
}

// FuzzQuantize quantizes arbitrary float32 bit patterns. The unchecked
// encoders must not panic on any input (NaN and infinities included). The
// checked Quantize must refuse non-finite input and scale overflow with
// ErrNotFinite; what it accepts must decode to finite values within the
// block's range of its input.
func FuzzQuantize(f *testing.F) {
	seed := func(x []float32) []byte {
		b := make([]byte, 4*len(x))
		for i, v := range x {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
		}
		return b
	}
	for i := range supported {
		f.Add(uint8(i), seed(weights(256, uint64(i))))
	}
	f.Add(uint8(3), seed([]float32{float32(math.NaN()), 1, 2}))
	f.Add(uint8(8), seed([]float32{float32(math.Inf(1)), -1}))
	f.Add(uint8(10), seed([]float32{3e38, -3e38, 1e-40}))
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		typ := supported[int(which)%len(supported)]
		bs := typ.BlockSize()
		// Repeat the input to fill whole blocks of at least 256 elements.
		if len(data) < 4 {
			return
		}
		n := max(256, (len(data)/4+bs-1)/bs*bs)
		x := make([]float32, n)
		for i := range x {
			off := 4 * i % (len(data) / 4 * 4)
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[off:]))
		}
		nb, _ := typ.Bytes(int64(n))
		q := make([]byte, nb)
		typ.codec().quantize(q, x) // must not panic, whatever x holds

		err := typ.Quantize(q, x)
		finite := true
		for _, v := range x {
			finite = finite && !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0)
		}
		switch {
		case !finite && !errors.Is(err, ErrNotFinite):
			t.Fatalf("%v: non-finite input: error %v, want ErrNotFinite", typ, err)
		case err != nil && !errors.Is(err, ErrNotFinite):
			t.Fatalf("%v: %v", typ, err)
		case err != nil:
			return
		}
		y := make([]float32, n)
		if err := typ.Dequantize(y, q); err != nil {
			t.Fatal(err)
		}
		for b := 0; b < n; b += bs {
			lo, hi := float64(0), float64(0)
			for _, v := range x[b : b+bs] {
				lo, hi = min(lo, float64(v)), max(hi, float64(v))
			}
			span := hi - lo
			for e := b; e < b+bs; e++ {
				if math.IsNaN(float64(y[e])) || math.IsInf(float64(y[e]), 0) {
					t.Fatalf("%v: element %d: %v decodes to %v", typ, e, x[e], y[e])
				}
				// Within the block's span (with 0 included) of its value,
				// allowing for F16 scale rounding and F16 subnormal flushes.
				if d := math.Abs(float64(y[e]) - float64(x[e])); d > 1.01*span+1e-4 {
					t.Fatalf("%v: element %d: %v decodes to %v, off by %g; block span %g", typ, e, x[e], y[e], d, span)
				}
			}
		}
	})
}

// FuzzVecDot runs the integer products on arbitrary weight and activation
// bytes (any scale bit pattern, any quant or sum) and holds every
// assembly kernel to the Go kernels bit for bit, NaN matching NaN; the
// checked VecDot must agree with the first row.
func FuzzVecDot(f *testing.F) {
	g := newGen(77)
	for i, typ := range vecTypes {
		a, _ := actOf(typ)
		for _, p := range []float64{0, 0.5} {
			nb := 1 + i%3
			f.Add(uint8(i), randomBlocks(g, typ, 3*nb*a.block/typ.BlockSize(), p, true), randomActs(g, typ, nb, p))
		}
	}
	f.Fuzz(func(t *testing.T, which uint8, w, xq []byte) {
		typ := vecTypes[int(which)%len(vecTypes)]
		a, _ := actOf(typ)
		nb := min(len(xq)/a.blockBytes(), 64)
		if nb == 0 {
			return
		}
		xq = xq[:nb*a.blockBytes()]
		n := nb * a.block
		rowBytes := n / typ.BlockSize() * typ.BlockBytes()
		rows := min(len(w)/rowBytes, 9)
		if rows == 0 {
			return
		}
		w = w[:rows*rowBytes]
		checkBitExact(t, typ, w, xq, rows, "fuzz")
		one, err := VecDot(typ, w[:rowBytes], xq, n)
		if err != nil {
			t.Fatal(err)
		}
		if want := gemvWith(&goKernels, typ, w[:rowBytes], xq, 1)[0]; !sameFloat(one, want) {
			t.Fatalf("%v: VecDot %g, Go kernel %g", typ, one, want)
		}
	})
}
