package quant

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"testing"
)

// vecTypes are the weight types with an integer product.
var vecTypes = []Type{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K}

// quantized returns x quantized as t.
func quantized(t testing.TB, typ Type, x []float32) []byte {
	t.Helper()
	nb, err := typ.Bytes(int64(len(x)))
	if err != nil {
		t.Fatal(err)
	}
	q := make([]byte, nb)
	if err := typ.Quantize(q, x); err != nil {
		t.Fatal(err)
	}
	return q
}

// activations returns x quantized for a product with weights of type t.
func activations(t testing.TB, typ Type, x []float32) []byte {
	t.Helper()
	nb, _ := VecDotType(typ).Bytes(int64(len(x)))
	xq := make([]byte, nb)
	if err := QuantizeRow(typ, xq, x); err != nil {
		t.Fatal(err)
	}
	return xq
}

// gemvWith runs one kernel table's product of rows rows.
func gemvWith(k *vecKernels, typ Type, w, xq []byte, rows int) []float32 {
	out := make([]float32, rows)
	for i := range out {
		out[i] = float32(math.NaN()) // a row the kernel skips shows
	}
	if rows > 0 {
		k.gemv[typ](out, w, xq)
	}
	return out
}

func TestVecDotType(t *testing.T) {
	for _, c := range []struct{ w, x Type }{
		{Q4_0, Q8_0}, {Q4_1, Q8_0}, {Q5_0, Q8_0}, {Q5_1, Q8_0}, {Q8_0, Q8_0},
		{Q4_K, Q8_K}, {Q5_K, Q8_K}, {Q6_K, Q8_K},
		{F32, F32}, {F16, F32}, {BF16, F32}, {Q8_K, F32}, {Q2_K, F32}, {Type(99), F32},
	} {
		if got := VecDotType(c.w); got != c.x {
			t.Errorf("VecDotType(%v) = %v, want %v", c.w, got, c.x)
		}
	}
}

// TestVecDotMatchesFloat64 checks every kernel table against a float64
// product of the weights and the activations, both decoded by the spec
// decoder of spec_test.go: within 1e-5 of the sum of the absolute
// products, which a wrong element, scale or min misses by orders of
// magnitude.
func TestVecDotMatchesFloat64(t *testing.T) {
	for _, k := range allKernels() {
		for _, typ := range vecTypes {
			for _, n := range []int{256, 2048, 256 * 11} {
				const rows = 7
				w := quantized(t, typ, weights(rows*n, uint64(n)))
				x := weights(n, uint64(n)+1)
				xq := activations(t, typ, x)
				xd := specDequantize(VecDotType(typ), xq)
				got := gemvWith(k, typ, w, xq, rows)
				rb := len(w) / rows
				for r := range rows {
					wd := specDequantize(typ, w[r*rb:(r+1)*rb])
					var ref, mag float64
					for i := range wd {
						ref += float64(wd[i]) * float64(xd[i])
						mag += math.Abs(float64(wd[i]) * float64(xd[i]))
					}
					if diff := math.Abs(float64(got[r]) - ref); !(diff <= 1e-5*mag) {
						t.Errorf("%s %v n=%d row %d: %g, float64 reference %g: error %g is more than 1e-5 of %g", k.name, typ, n, r, got[r], ref, diff, mag)
					}
				}
				one, err := VecDot(typ, w[:rb], xq, n)
				if err != nil {
					t.Fatal(err)
				}
				if all := gemvWith(active, typ, w, xq, rows); math.Float32bits(one) != math.Float32bits(all[0]) {
					t.Errorf("%v n=%d: VecDot %g, GEMV's first row %g", typ, n, one, all[0])
				}
			}
		}
	}
}

// The special scales: zeros, the smallest and largest subnormals, the
// smallest normal, the largest finite value, infinities and a NaN.
var (
	specialF16 = []uint16{0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00}
	specialF32 = []uint32{0x00000000, 0x80000000, 0x00000001, 0x007fffff, 0x00800000, 0x7f7fffff, 0xff7fffff, 0x7f800000, 0x7fc00000}
)

// randomBlocks returns nb blocks of type t with random quants and scales
// that are ordinary (F16 values between about 1e-3 and 0.1, activation
// scales near 0.01) or, with probability pSpecial, one of the special
// values. Activation quants include -128 when minus128 is set.
func randomBlocks(g *gen, t Type, nb int, pSpecial float64, minus128 bool) []byte {
	bb := t.BlockBytes()
	b := make([]byte, nb*bb)
	for i := range b {
		b[i] = byte(g.next())
	}
	special := func() bool { return float64(g.next()>>11)/(1<<53) < pSpecial }
	half := func(p []byte) {
		h := uint16(0x1400 + g.next()%0x1800) // about 1e-3 to 0.1, either sign
		if special() {
			h = specialF16[g.next()%uint64(len(specialF16))]
		}
		h |= uint16(g.next()&1) << 15
		binary.LittleEndian.PutUint16(p, h)
	}
	for i := range nb {
		blk := b[i*bb : (i+1)*bb]
		switch t {
		case Q8_0:
			half(blk)
			if !minus128 {
				for e := 2; e < 34; e++ {
					if blk[e] == 0x80 {
						blk[e] = 0x81
					}
				}
			}
		case Q4_0, Q5_0:
			half(blk)
		case Q4_1, Q5_1, Q4_K, Q5_K:
			half(blk)
			half(blk[2:])
		case Q6_K:
			half(blk[208:])
		case Q8_K:
			f := math.Float32bits(0.01 * (1 + float32(g.next()%1000)/1000))
			if special() {
				f = specialF32[g.next()%uint64(len(specialF32))]
			}
			binary.LittleEndian.PutUint32(blk, f|uint32(g.next()&1)<<31)
			if !minus128 {
				for e := 4; e < 260; e++ {
					if blk[e] == 0x80 {
						blk[e] = 0x81
					}
				}
			}
		}
	}
	return b
}

// sameFloat reports whether a and b are the same float32, any NaN matching
// any NaN.
func sameFloat(a, b float32) bool {
	if a != a || b != b {
		return a != a && b != b
	}
	return math.Float32bits(a) == math.Float32bits(b)
}

// checkBitExact compares every kernel table with the Go kernels on rows
// rows of weights w and activations xq.
func checkBitExact(t *testing.T, typ Type, w, xq []byte, rows int, what string) {
	t.Helper()
	want := gemvWith(&goKernels, typ, w, xq, rows)
	for _, k := range archKernels() {
		got := gemvWith(k, typ, w, xq, rows)
		for r := range got {
			if !sameFloat(got[r], want[r]) {
				t.Fatalf("%s %v %s: row %d of %d: %g (%#08x), Go kernel %g (%#08x)", k.name, typ, what, r, rows, got[r], math.Float32bits(got[r]), want[r], math.Float32bits(want[r]))
			}
		}
	}
}

// TestVecDotKernelsBitExact holds every assembly kernel to the Go
// kernels, bit for bit: on random blocks with ordinary scales (where a
// different order of the float operations shows in the low bits), with
// special scales, with activation quants of -128, and on quantized
// weight-like data, for row counts that exercise each kernel's row
// blocking and its tail.
func TestVecDotKernelsBitExact(t *testing.T) {
	if len(archKernels()) == 0 {
		t.Skip("no assembly kernels on this machine")
	}
	g := newGen(21)
	for _, typ := range vecTypes {
		at := VecDotType(typ)
		for _, c := range []struct {
			name     string
			nb       int // activation blocks
			rows     int
			pSpecial float64
			minus128 bool
		}{
			{"ordinary", 64, 9, 0, false},
			{"one block", 1, 5, 0, false},
			{"three blocks", 3, 3, 0, false},
			{"special scales", 8, 13, 0.2, false},
			{"minus128", 16, 6, 0, true},
			{"everything", 24, 11, 0.3, true},
		} {
			for rep := range 20 {
				xq := randomBlocks(g, at, c.nb, c.pSpecial, c.minus128)
				n := c.nb * at.BlockSize()
				w := randomBlocks(g, typ, c.rows*n/typ.BlockSize(), c.pSpecial, true)
				checkBitExact(t, typ, w, xq, c.rows, fmt.Sprintf("%s rep %d", c.name, rep))
			}
		}
		for _, n := range []int{256, 2048, 5632} {
			rows := 6
			w := quantized(t, typ, weights(rows*n, uint64(n)+7))
			xq := activations(t, typ, weights(n, uint64(n)+8))
			checkBitExact(t, typ, w, xq, rows, fmt.Sprintf("weights n=%d", n))
		}
	}
}

func TestVecDotErrors(t *testing.T) {
	x := make([]float32, 256)
	xq8 := make([]byte, 8*34)
	xqK := make([]byte, 292)
	w := make([]byte, 2*144)
	out := make([]float32, 2)
	nan := make([]float32, 64)
	nan[40] = float32(math.NaN())
	big := make([]float32, 32)
	big[5] = 1e10
	cases := []struct {
		name string
		err  error
		run  func() error
	}{
		{"quantize row F16", ErrUnsupported, func() error { return QuantizeRow(F16, make([]byte, 512), x) }},
		{"quantize row unknown", ErrUnknownType, func() error { return QuantizeRow(Type(5), xq8, x) }},
		{"quantize row short", ErrLength, func() error { return QuantizeRow(Q4_K, xqK[:291], x) }},
		{"quantize row NaN", ErrNotFinite, func() error { return QuantizeRow(Q8_0, xq8[:68], nan) }},
		{"quantize row F16 scale overflow", ErrNotFinite, func() error { return QuantizeRow(Q4_0, xq8[:34], big) }},
		{"vec dot Q8_K weights", ErrUnsupported, func() error { _, err := VecDot(Q8_K, make([]byte, 292), xqK, 256); return err }},
		{"vec dot short weights", ErrLength, func() error { _, err := VecDot(Q4_K, w[:143], xqK, 256); return err }},
		{"vec dot long activations", ErrLength, func() error { _, err := VecDot(Q4_K, w[:144], make([]byte, 293), 256); return err }},
		{"vec dot partial block", ErrLength, func() error { _, err := VecDot(Q8_0, xq8[:34], xq8[:34], 31); return err }},
		{"vec dot zero length", ErrLength, func() error { _, err := VecDot(Q8_0, nil, nil, 0); return err }},
		{"gemv rows and outputs", ErrLength, func() error { return GEMV(Q4_K, out[:1], w, 2, 256, xqK) }},
		{"gemv weight bytes", ErrLength, func() error { return GEMV(Q4_K, out, w[:287], 2, 256, xqK) }},
		{"gemv activation type", ErrLength, func() error { return GEMV(Q4_K, out, w, 2, 256, xq8) }},
		{"gemv negative rows", ErrLength, func() error { return GEMV(Q4_K, out[:0], w[:0], -1, 256, xqK) }},
		{"gemv F32", ErrUnsupported, func() error { return GEMV(F32, out, make([]byte, 2048), 2, 256, xqK) }},
	}
	for _, c := range cases {
		if err := c.run(); !errors.Is(err, c.err) {
			t.Errorf("%s: error %v, want %v", c.name, err, c.err)
		}
	}
	if err := GEMV(Q4_K, out[:0], nil, 0, 256, xqK); err != nil {
		t.Errorf("gemv of no rows: %v", err)
	}
	if err := GEMV(Q4_K, out, w, 2, 256, xq8); err == nil || !contains(err.Error(), "Q8_K activations") {
		t.Errorf("activation length error does not name the format: %v", err)
	}
}

// TestQuantizeRowNoMinus128 checks the promise the Q8_0 kernels' sign
// trick relies on: QuantizeRow never writes a quant of -128, whatever the
// finite input (blocks whose largest magnitude is negative, tiny and
// subnormal values, values near the scale limit).
func TestQuantizeRowNoMinus128(t *testing.T) {
	g := newGen(5)
	for _, typ := range []Type{Q8_0, Q4_K} {
		for _, mag := range []float32{1, 1e-3, 1e-30, 1e-38, 1e-44, 2e6} {
			x := make([]float32, 4096)
			for i := range x {
				x[i] = g.normal() * mag
				if i%32 == 7 {
					x[i] = -3.5 * mag // the block's largest magnitude, negative
				}
			}
			xq := activations(t, typ, x)
			at := VecDotType(typ)
			bb := at.BlockBytes()
			off := 2
			if at == Q8_K {
				off = 4
			}
			for b := 0; b < len(xq); b += bb {
				for e := b + off; e < b+off+at.BlockSize(); e++ {
					if xq[e] == 0x80 {
						t.Fatalf("%v scale %g: block %d holds -128", at, mag, b/bb)
					}
				}
			}
		}
	}
}

// TestQuantizeRowMatchesQuantize holds QuantizeRow's fast quantizers to
// the reference ones byte for byte: on normal and weight-like data, on
// values at rounding ties (k+0.5 steps, and just below 0.5 of a step), on
// blocks of zeros, of tiny and subnormal values (where 1/d overflows), and
// near the largest scale F16 holds; and to their errors on input they
// refuse.
func TestQuantizeRowMatchesQuantize(t *testing.T) {
	g := newGen(9)
	ties := make([]float32, 4096)
	for i := range ties {
		ties[i] = (float32(i%255) - 127) / 2 // halves: ties of round(x·127/127)
		if i%32 == 0 {
			ties[i] = 127
		}
		if i%7 == 0 {
			ties[i] = math.Nextafter32(0.5, 0) * float32(1+i%3)
		}
	}
	scaled := func(scale float32) []float32 {
		x := make([]float32, 4096)
		for i := range x {
			x[i] = g.normal() * scale
		}
		return x
	}
	inputs := map[string][]float32{
		"normal":   scaled(1),
		"weights":  weights(4096, 3),
		"ties":     ties,
		"zeros":    make([]float32, 4096),
		"tiny":     scaled(1e-37),
		"subnorm":  scaled(1e-42),
		"large":    scaled(2e6),
		"mixed":    append(append(scaled(1e-40)[:2048], scaled(3)[:1024]...), make([]float32, 1024)...),
		"extremes": append(scaled(1)[:4000], 8.3e6, -8.3e6, 1e-45, -1e-45, 0, 0, 1, -1, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3, 4, 126.5, -126.5, 127, -127),
	}
	for _, typ := range []Type{Q8_0, Q4_K} {
		at := VecDotType(typ)
		for name, x := range inputs {
			x = append(x, make([]float32, 4096-len(x))...)
			nb, _ := at.Bytes(int64(len(x)))
			want := make([]byte, nb)
			werr := at.Quantize(want, x)
			got := make([]byte, nb)
			err := QuantizeRow(typ, got, x)
			if (err == nil) != (werr == nil) {
				t.Fatalf("%v %s: QuantizeRow error %v, Quantize error %v", at, name, err, werr)
			}
			if err == nil && string(got) != string(want) {
				for i := range got {
					if got[i] != want[i] {
						t.Fatalf("%v %s: byte %d (block %d) is %#02x, Quantize writes %#02x", at, name, i, i/at.BlockBytes(), got[i], want[i])
					}
				}
			}
		}
		for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 1e10} {
			x := scaled(1)
			x[777] = bad
			nb, _ := at.Bytes(int64(len(x)))
			err := QuantizeRow(typ, make([]byte, nb), x)
			werr := at.Quantize(make([]byte, nb), x)
			if (werr == nil) != (err == nil) || (err != nil && err.Error() != werr.Error()) {
				t.Errorf("%v with %v: QuantizeRow error %v, Quantize error %v", at, bad, err, werr)
			}
			if bad != 1e10 && !errors.Is(err, ErrNotFinite) {
				t.Errorf("%v with %v: error %v, want ErrNotFinite", at, bad, err)
			}
		}
	}
}

// TestKernelsNamed checks the choice KernelsEnv makes: a name picks that
// table or the best one below it this machine runs; empty or unknown picks
// the fastest.
func TestKernelsNamed(t *testing.T) {
	all := allKernels()
	has := map[string]bool{}
	for _, k := range all {
		has[k.name] = true
	}
	below := func(names ...string) string {
		for _, n := range names {
			if has[n] {
				return n
			}
		}
		return "go"
	}
	for _, c := range []struct{ env, want string }{
		{"", all[0].name},
		{"bogus", all[0].name},
		{"go", "go"},
		{" GO ", "go"},
		{"avx2", below("avx2")},
		{"avx512", below("avx512", "avx2")},
	} {
		if got := kernelsNamed(c.env); got.name != c.want {
			t.Errorf("kernelsNamed(%q) = %s, want %s", c.env, got.name, c.want)
		}
	}
	if all[len(all)-1] != &goKernels {
		t.Errorf("the Go kernels are not the last table")
	}
	for _, k := range all {
		for _, typ := range vecTypes {
			if k.gemv[typ] == nil {
				t.Errorf("%s has no kernel for %v", k.name, typ)
			}
		}
	}
}
