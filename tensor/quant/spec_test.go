package quant

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/x448/float16"
)

// A second, slow implementation of every format, written from the layout
// descriptions rather than from the fast code: each element's fields are
// found by bit offset in its block, one element at a time. The arithmetic
// is the formats' definition, each product rounded to float32.

// bits returns n bits of b starting at bit off, little-endian bit order
// (bit k of byte i is bit 8i+k of the stream).
func bits(b []byte, off, n int) int {
	v := 0
	for k := range n {
		p := off + k
		v |= int(b[p/8]>>(p%8)&1) << k
	}
	return v
}

func specHalf(b []byte) float32 { return float16.Frombits(binary.LittleEndian.Uint16(b)).Float32() }

// specBlock decodes one block of type t from b into y.
func specBlock(t Type, b []byte, y []float32) {
	switch t {
	case F32:
		y[0] = math.Float32frombits(binary.LittleEndian.Uint32(b))
	case F16:
		y[0] = specHalf(b)
	case BF16:
		y[0] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(b)) << 16)
	case Q8_0:
		d := specHalf(b)
		for e := range 32 {
			y[e] = float32(int8(bits(b, 16+8*e, 8))) * d
		}
	case Q4_0, Q4_1, Q5_0, Q5_1:
		d := specHalf(b)
		var m float32
		qs, qh := 16, -1 // bit offsets of the nibbles and of the fifth bits
		switch t {
		case Q4_1:
			m, qs = specHalf(b[2:]), 32
		case Q5_0:
			qh, qs = 16, 48
		case Q5_1:
			m, qh, qs = specHalf(b[2:]), 32, 64
		}
		for e := range 32 {
			q := bits(b, qs+8*(e%16)+4*(e/16), 4)
			if qh >= 0 {
				q |= bits(b, qh+e, 1) << 4
			}
			switch t {
			case Q4_0:
				y[e] = float32(q-8) * d
			case Q5_0:
				y[e] = float32(q-16) * d
			default:
				y[e] = float32(float32(q)*d) + m
			}
		}
	case Q4_K, Q5_K:
		d, dmin := specHalf(b), specHalf(b[2:])
		const sc = 32 // bit offset of the packed scales
		qh, qs := -1, 128
		if t == Q5_K {
			qh, qs = 128, 384
		}
		for e := range 256 {
			j := e / 32 // sub-block
			var s, m int
			if j < 4 {
				s, m = bits(b, sc+8*j, 6), bits(b, sc+8*(j+4), 6)
			} else {
				s = bits(b, sc+8*(j+4), 4) | bits(b, sc+8*(j-4)+6, 2)<<4
				m = bits(b, sc+8*(j+4)+4, 4) | bits(b, sc+8*j+6, 2)<<4
			}
			g, r := e/64, e%64
			q := bits(b, qs+8*(32*g+r%32)+4*(r/32), 4)
			if qh >= 0 {
				q |= bits(b, qh+8*(r%32)+2*g+r/32, 1) << 4
			}
			y[e] = float32(float32(d*float32(s))*float32(q)) - float32(dmin*float32(m))
		}
	case Q6_K:
		d := specHalf(b[208:])
		for e := range 256 {
			h, r := e/128, e%128
			quarter, l := r/32, r%32
			lowByte := 64*h + l + 32*(quarter%2)
			q := bits(b, 8*lowByte+4*(quarter/2), 4) | bits(b, 8*(128+32*h+l)+2*quarter, 2)<<4
			s := int8(b[192+e/16])
			y[e] = float32(d*float32(s)) * float32(q-32)
		}
	case Q8_K:
		d := math.Float32frombits(binary.LittleEndian.Uint32(b))
		for e := range 256 {
			y[e] = d * float32(int8(b[4+e]))
		}
	default:
		panic("no spec decoder for " + t.String())
	}
}

// specDequantize decodes whole blocks with specBlock.
func specDequantize(t Type, src []byte) []float32 {
	bs, bb := t.BlockSize(), t.BlockBytes()
	out := make([]float32, len(src)/bb*bs)
	for i := 0; i < len(src)/bb; i++ {
		specBlock(t, src[i*bb:(i+1)*bb], out[i*bs:(i+1)*bs])
	}
	return out
}

// supported lists the types with codecs, for table-driven tests.
var supported = []Type{F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q8_K}

// sameBits reports the first index where a and b differ bit for bit, or -1.
func sameBits(a, b []float32) int {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i
		}
	}
	return -1
}

func h16(f float32) []byte {
	return binary.LittleEndian.AppendUint16(nil, uint16(float16.Fromfloat32(f)))
}

// handBlocks are blocks built from the layout descriptions with known
// scales, mins and quants, and the values they must decode to, worked out
// by hand (every value is exact in float32).
func handBlocks() []struct {
	name string
	t    Type
	b    []byte
	want func(e int) float32
} {
	type hb = struct {
		name string
		t    Type
		b    []byte
		want func(e int) float32
	}
	var out []hb

	// Q8_0: d = 0.5, q_e = e-16.
	b := h16(0.5)
	for e := range 32 {
		b = append(b, byte(int8(e-16)))
	}
	out = append(out, hb{"q8_0 ramp", Q8_0, b, func(e int) float32 { return 0.5 * float32(e-16) }})

	// Q4_0: d = -0.25, element e has level e%16: low nibbles hold 0..15,
	// high nibbles 15..0 for elements 16..31.
	b = h16(-0.25)
	for j := range 16 {
		b = append(b, byte(j)|byte(15-j)<<4)
	}
	out = append(out, hb{"q4_0 levels", Q4_0, b, func(e int) float32 {
		q := e
		if e >= 16 {
			q = 15 - (e - 16)
		}
		return -0.25 * float32(q-8)
	}})

	// Q4_1: d = 2, m = -3, level (3e)%16.
	b = append(h16(2), h16(-3)...)
	lv := func(e int) int { return (3 * e) % 16 }
	for j := range 16 {
		b = append(b, byte(lv(j))|byte(lv(j+16))<<4)
	}
	out = append(out, hb{"q4_1 levels", Q4_1, b, func(e int) float32 { return 2*float32(lv(e)) - 3 }})

	// Q5_0 and Q5_1: level e (0..31), so the fifth bit is set exactly for
	// elements 16..31: qh = 0xffff0000.
	for _, t := range []Type{Q5_0, Q5_1} {
		b = h16(0.125)
		if t == Q5_1 {
			b = append(b, h16(1)...)
		}
		b = append(b, 0, 0, 0xff, 0xff)
		for j := range 16 {
			b = append(b, byte(j)|byte(j)<<4) // element j+16 has low bits j too
		}
		tt := t
		out = append(out, hb{tt.String() + " levels", tt, b, func(e int) float32 {
			if tt == Q5_0 {
				return 0.125 * float32(e-16)
			}
			return 0.125*float32(e) + 1
		}})
	}

	// Q4_K and Q5_K: d = 0.5, dmin = 0.25, sub-block j has scale 40+j and
	// min 63-j (six bits, so the j >= 4 entries use the top-bit fields),
	// element e has level e%16 (Q4_K) or e%32 (Q5_K).
	for _, t := range []Type{Q4_K, Q5_K} {
		b = append(h16(0.5), h16(0.25)...)
		var sc [12]byte
		for j := range 8 {
			s, m := byte(40+j), byte(63-j)
			if j < 4 {
				sc[j] |= s
				sc[j+4] |= m
			} else {
				sc[j+4] = s&15 | (m&15)<<4
				sc[j-4] |= s >> 4 << 6
				sc[j] |= m >> 4 << 6
			}
		}
		b = append(b, sc[:]...)
		levels := 16
		if t == Q5_K {
			levels = 32
			qh := make([]byte, 32)
			for e := range 256 {
				if e%32 >= 16 {
					g, r := e/64, e%64
					qh[r%32] |= 1 << (2*g + r/32)
				}
			}
			b = append(b, qh...)
		}
		for g := range 4 {
			for l := range 32 {
				lo, hi := (64*g+l)%16, (64*g+32+l)%16
				b = append(b, byte(lo)|byte(hi)<<4)
			}
		}
		n := levels
		out = append(out, hb{t.String() + " scales", t, b, func(e int) float32 {
			j := e / 32
			return 0.5*float32(40+j)*float32(e%n) - 0.25*float32(63-j)
		}})
	}

	// Q6_K: d = 0.125, scale of sub-block j (16 elements) is j-8 (signed),
	// element e has level (5e)%64.
	lv6 := func(e int) int { return (5 * e) % 64 }
	b = make([]byte, 210)
	for e := range 256 {
		h, r := e/128, e%128
		quarter, l := r/32, r%32
		q := lv6(e)
		b[64*h+l+32*(quarter%2)] |= byte(q&15) << (4 * (quarter / 2))
		b[128+32*h+l] |= byte(q>>4) << (2 * quarter)
	}
	for j := range 16 {
		b[192+j] = byte(int8(j - 8))
	}
	copy(b[208:], h16(0.125))
	out = append(out, hb{"q6_k scales", Q6_K, b, func(e int) float32 { return 0.125 * float32(e/16-8) * float32(lv6(e)-32) }})

	// Q8_K: d = 0.25, q_e = e-128 (the sums are not read).
	b = binary.LittleEndian.AppendUint32(nil, math.Float32bits(0.25))
	for e := range 256 {
		b = append(b, byte(int8(e-128)))
	}
	b = append(b, make([]byte, 32)...)
	out = append(out, hb{"q8_k ramp", Q8_K, b, func(e int) float32 { return 0.25 * float32(e-128) }})

	// The plain types.
	out = append(out, hb{"f16 one", F16, h16(-1.5), func(int) float32 { return -1.5 }})
	out = append(out, hb{"bf16 one", BF16, []byte{0xc0, 0x3f}, func(int) float32 { return 1.5 }})
	out = append(out, hb{"f32 one", F32, binary.LittleEndian.AppendUint32(nil, math.Float32bits(3.25)), func(int) float32 { return 3.25 }})
	return out
}

func TestDequantizeHandBlocks(t *testing.T) {
	for _, c := range handBlocks() {
		t.Run(c.name, func(t *testing.T) {
			if len(c.b) != c.t.BlockBytes() {
				t.Fatalf("test block is %d bytes, %v blocks are %d", len(c.b), c.t, c.t.BlockBytes())
			}
			got := make([]float32, c.t.BlockSize())
			if err := c.t.Dequantize(got, c.b); err != nil {
				t.Fatal(err)
			}
			spec := specDequantize(c.t, c.b)
			for e := range got {
				if w := c.want(e); got[e] != w || spec[e] != w {
					t.Fatalf("element %d: Dequantize %v, spec decoder %v, want %v", e, got[e], spec[e], w)
				}
			}
		})
	}
}

// TestDequantizeMatchesSpec decodes random bytes (finite scales and any
// scales, NaN and infinities included) with both implementations.
func TestDequantizeMatchesSpec(t *testing.T) {
	r := newGen(7)
	for _, typ := range supported {
		t.Run(typ.String(), func(t *testing.T) {
			for trial := range 50 {
				src := make([]byte, typ.BlockBytes()*(1+trial%9)*(256/typ.BlockSize()))
				for i := range src {
					src[i] = byte(r.next())
				}
				got := make([]float32, len(src)/typ.BlockBytes()*typ.BlockSize())
				if err := typ.Dequantize(got, src); err != nil {
					t.Fatal(err)
				}
				if i := sameBits(got, specDequantize(typ, src)); i >= 0 {
					t.Fatalf("trial %d: element %d: Dequantize %v, spec decoder %v", trial, i, got[i], specDequantize(typ, src)[i])
				}
			}
		})
	}
}
