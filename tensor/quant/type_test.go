package quant

import (
	"errors"
	"math"
	"testing"

	"github.com/x448/float16"
)

func TestTypeTable(t *testing.T) {
	// Sizes from the block layouts: scales, quants and extra fields in bytes.
	const h = 2 // an F16 field
	cases := []struct {
		t            Type
		name         string
		block, bytes int
	}{
		{F32, "F32", 1, 4}, {F16, "F16", 1, 2}, {BF16, "BF16", 1, 2},
		{Q4_0, "Q4_0", 32, h + 32/2}, {Q4_1, "Q4_1", 32, 2*h + 32/2},
		{Q5_0, "Q5_0", 32, h + 4 + 32/2}, {Q5_1, "Q5_1", 32, 2*h + 4 + 32/2},
		{Q8_0, "Q8_0", 32, h + 32}, {Q8_1, "Q8_1", 32, 2*h + 32},
		{Q2_K, "Q2_K", 256, 2*h + 256/16 + 256/4}, {Q3_K, "Q3_K", 256, h + 256/4 + 256/8 + 12},
		{Q4_K, "Q4_K", 256, 2*h + 12 + 256/2}, {Q5_K, "Q5_K", 256, 2*h + 12 + 256/2 + 256/8},
		{Q6_K, "Q6_K", 256, h + 256/16 + 3*256/4}, {Q8_K, "Q8_K", 256, 4 + 256 + 2*256/16},
		{IQ4_NL, "IQ4_NL", 32, h + 16}, {IQ4_XS, "IQ4_XS", 256, h + 2 + 256/64 + 256/2},
		{I8, "I8", 1, 1}, {I64, "I64", 1, 8}, {F64, "F64", 1, 8}, {MXFP4, "MXFP4", 32, 1 + 16},
	}
	for _, c := range cases {
		if c.t.String() != c.name || c.t.BlockSize() != c.block || c.t.BlockBytes() != c.bytes || !c.t.Known() {
			t.Errorf("%d: got %v, %d elements in %d bytes, known %v; want %s, %d in %d",
				uint32(c.t), c.t, c.t.BlockSize(), c.t.BlockBytes(), c.t.Known(), c.name, c.block, c.bytes)
		}
		if p, err := ParseType(c.name); err != nil || p != c.t {
			t.Errorf("ParseType(%q) = %v, %v", c.name, p, err)
		}
	}
	if p, err := ParseType("q4_k"); err != nil || p != Q4_K {
		t.Errorf("ParseType(q4_k) = %v, %v", p, err)
	}
	for _, n := range []Type{4, 5, 31, 32, 33, 36, 37, 38, 43, 1 << 31} {
		if n.Known() || n.BlockSize() != 0 || n.String() != "type("+itoa(int(n))+")" {
			t.Errorf("withdrawn or unassigned type %d: known %v, block %d, name %s", uint32(n), n.Known(), n.BlockSize(), n)
		}
		if _, err := n.Bytes(32); !errors.Is(err, ErrUnknownType) {
			t.Errorf("type %d: Bytes error %v, want ErrUnknownType", uint32(n), err)
		}
	}
	if _, err := ParseType("Q4_2"); !errors.Is(err, ErrUnknownType) {
		t.Errorf("ParseType(Q4_2): %v", err)
	}
}

func itoa(n int) string {
	if n < 0 {
		return "-" + itoa(-n)
	}
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + itoa(n%10)
}

func TestBytes(t *testing.T) {
	cases := []struct {
		t    Type
		n    int64
		want int64
		err  error
	}{
		{Q4_K, 4096, 4096 / 256 * 144, nil},
		{Q8_0, 32, 34, nil},
		{F16, 3, 6, nil},
		{Q4_K, 0, 0, nil},
		{Q8_0, 33, 0, ErrLength},
		{Q6_K, 128, 0, ErrLength},
		{F32, math.MaxInt64, 0, errors.New("overflow")},
	}
	for _, c := range cases {
		got, err := c.t.Bytes(c.n)
		if c.err == nil && (err != nil || got != c.want) {
			t.Errorf("%v.Bytes(%d) = %d, %v; want %d", c.t, c.n, got, err, c.want)
		}
		if c.err != nil && err == nil {
			t.Errorf("%v.Bytes(%d) = %d, want an error", c.t, c.n, got)
		}
		if c.err == ErrLength && !errors.Is(err, ErrLength) {
			t.Errorf("%v.Bytes(%d): %v, want ErrLength", c.t, c.n, err)
		}
	}
}

func TestHalfToFloatExhaustive(t *testing.T) {
	for h := range 1 << 16 {
		got := halfToFloat(uint16(h))
		want := float16.Frombits(uint16(h)).Float32()
		if math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("half %#04x: got %#08x, want %#08x", h, math.Float32bits(got), math.Float32bits(want))
		}
	}
}

func TestFloatToHalfRounding(t *testing.T) {
	cases := []struct {
		f    float32
		want uint16
	}{
		{1, 0x3c00}, {-2, 0xc000}, {65504, 0x7bff}, {65519.996, 0x7bff}, {65520, 0x7c00},
		{float32(math.Ldexp(1, -24)), 0x0001},     // smallest subnormal
		{float32(math.Ldexp(1, -25)), 0x0000},     // half of it: tie to even, zero
		{float32(math.Ldexp(3, -25)), 0x0002},     // 1.5 of it: tie to even, 2
		{1 + float32(math.Ldexp(1, -11)), 0x3c00}, // tie between 1 and next: even
		{1 + float32(math.Ldexp(3, -11)), 0x3c02}, // tie: up to even
	}
	for _, c := range cases {
		if got := floatToHalf(c.f); got != c.want {
			t.Errorf("floatToHalf(%v) = %#04x, want %#04x", c.f, got, c.want)
		}
	}
}

func TestNearestInt(t *testing.T) {
	g := newGen(11)
	for i := range 100000 {
		var f float32
		switch i % 3 {
		case 0:
			f = float32(int64(g.next()%(1<<23))-(1<<22)) / 2 // halves: the ties
		case 1:
			f = g.normal() * 1000
		default:
			f = g.normal() * 4
		}
		if math.Abs(float64(f)) > 4194303 {
			continue
		}
		if got, want := nearestInt(f), int(math.RoundToEven(float64(f))); got != want {
			t.Fatalf("nearestInt(%v) = %d, want %d", f, got, want)
		}
	}
}
