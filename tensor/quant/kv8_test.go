package quant

import (
	"math"
	"testing"
)

// TestQ8B8 checks the KV cache's blocks of 8: the scale max|x|/127
// rounded to F16, each value within half a step of it, zeros exact, no
// -128, and values past 127 steps of a scale that F16 rounds down (a
// subnormal one) clamped to ±127 steps.
func TestQ8B8(t *testing.T) {
	for _, c := range []struct {
		name    string
		x       [QB8]float32
		clamped bool // the scale is a subnormal F16 that rounds down
	}{
		{"mixed", [QB8]float32{0.5, -1.25, 3, 0, -0.001, 2.9, -3.1, 1e-3}, false},
		{"zeros", [QB8]float32{}, false},
		{"one-large", [QB8]float32{0, 0, 0, 1000, 0, 0, 0, 1}, false},
		{"negative-max", [QB8]float32{-7, 1, 2, 3, 4, 5, 6, 6.999}, false},
		// 1.01/127 rounds down in F16: x/d is 127.05.
		{"scale-rounds-down", [QB8]float32{1.01, -0.1, 0, 0, 0, 0, 0, 0}, false},
		// 1e-5/127 is a subnormal F16, rounded to 2^-24: x/d is 168.
		{"subnormal-scale", [QB8]float32{1e-5, -1e-5, 0, 0, 0, 0, 0, 5e-6}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var b [BlockBytesQ8B8]byte
			QuantizeQ8B8(b[:], c.x[:])
			var y [QB8]float32
			DequantizeQ8B8(y[:], b[:])
			d := halfToFloat(le16(b[:]))
			var amax float32
			for _, v := range c.x {
				amax = max(amax, abs32(v))
			}
			if want := halfToFloat(floatToHalf(amax / 127)); d != want {
				t.Errorf("scale %g, want %g", d, want)
			}
			for i, v := range c.x {
				q := int8(b[2+i])
				e := math.Abs(float64(y[i] - v))
				switch {
				case q == -128:
					t.Errorf("value %d: -128 stored", i)
				case c.clamped && abs32(v) == amax && q != 127 && q != -127:
					t.Errorf("value %d: %g stored as %d steps of %g, want ±127", i, v, q, d)
				case !c.clamped && e > float64(d)*0.5001:
					t.Errorf("value %d: %g read back as %g (scale %g)", i, v, y[i], d)
				}
				if v == 0 && y[i] != 0 {
					t.Errorf("value %d: 0 read back as %g", i, y[i])
				}
			}
		})
	}
	// A whole row: blocks are independent; lengths that are not whole
	// blocks panic.
	x := make([]float32, 24)
	for i := range x {
		x[i] = float32(i - 12)
	}
	b := make([]byte, 30)
	QuantizeQ8B8(b, x)
	var one [BlockBytesQ8B8]byte
	QuantizeQ8B8(one[:], x[16:])
	if string(one[:]) != string(b[20:]) {
		t.Errorf("third block % x, alone % x", b[20:], one)
	}
	for _, f := range []func(){
		func() { QuantizeQ8B8(make([]byte, 10), make([]float32, 7)) },
		func() { DequantizeQ8B8(make([]float32, 8), make([]byte, 9)) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Error("lengths not whole blocks: no panic")
				}
			}()
			f()
		}()
	}
}
