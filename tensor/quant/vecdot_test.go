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
	nb, err := ActivationBytes(typ, len(x))
	if err != nil {
		t.Fatal(err)
	}
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

func TestIntegerProduct(t *testing.T) {
	for _, c := range []struct {
		w     Type
		ok    bool
		bytes int // ActivationBytes of 512 elements
	}{
		{Q4_0, true, 16 * 68}, {Q4_1, true, 16 * 68}, {Q5_0, true, 16 * 68}, {Q5_1, true, 16 * 68}, {Q8_0, true, 16 * 68},
		{Q4_K, true, 2 * 548}, {Q5_K, true, 2 * 548}, {Q6_K, true, 2 * 548},
		{F32, false, 0}, {F16, false, 0}, {BF16, false, 0}, {Q8_K, false, 0}, {Q2_K, false, 0}, {Type(99), false, 0},
	} {
		if got := IntegerProduct(c.w); got != c.ok {
			t.Errorf("IntegerProduct(%v) = %v, want %v", c.w, got, c.ok)
		}
		n, err := ActivationBytes(c.w, 512)
		if n != c.bytes || (err == nil) != c.ok {
			t.Errorf("ActivationBytes(%v, 512) = %d, %v; want %d", c.w, n, err, c.bytes)
		}
	}
	for _, n := range []int{0, -32, 48} {
		if _, err := ActivationBytes(Q8_0, n); !errors.Is(err, ErrLength) {
			t.Errorf("ActivationBytes(Q8_0, %d): error %v, want ErrLength", n, err)
		}
	}
	if _, err := ActivationBytes(Q4_K, 32); !errors.Is(err, ErrLength) {
		t.Errorf("ActivationBytes(Q4_K, 32): error %v, want ErrLength", err)
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
				xd := make([]float32, n)
				if err := DequantizeRow(typ, xd, xq); err != nil {
					t.Fatal(err)
				}
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
// values. Q8_0 quants include -128 when minus128 is set.
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
		}
	}
	return b
}

// randomActs returns a row of nb activation blocks for weights of type t:
// random quants of the whole int16 range (and random sums for the K
// formats), scales near 0.01 or, with probability pSpecial, one of the
// special values.
func randomActs(g *gen, t Type, nb int, pSpecial float64) []byte {
	a, _ := actOf(t)
	b := make([]byte, nb*a.blockBytes())
	for i := range b {
		b[i] = byte(g.next())
	}
	for i := range nb {
		f := math.Float32bits(0.01 * (1 + float32(g.next()%1000)/1000))
		if float64(g.next()>>11)/(1<<53) < pSpecial {
			f = specialF32[g.next()%uint64(len(specialF32))]
		}
		binary.LittleEndian.PutUint32(actTail(a, b, nb, i), f|uint32(g.next()&1)<<31)
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
// special scales, with any activation quants and sums, and on quantized
// weight-like data, for row counts that exercise each kernel's row
// blocking and its tail.
func TestVecDotKernelsBitExact(t *testing.T) {
	if len(archKernels()) == 0 {
		t.Skip("no assembly kernels on this machine")
	}
	g := newGen(21)
	for _, typ := range vecTypes {
		a, _ := actOf(typ)
		for _, c := range []struct {
			name     string
			nb       int // activation blocks
			rows     int
			pSpecial float64
			minus128 bool // in Q8_0 weights
		}{
			{"ordinary", 64, 9, 0, false},
			{"one block", 1, 5, 0, false},
			{"three blocks", 3, 3, 0, false},
			{"special scales", 8, 13, 0.2, false},
			{"minus128", 16, 6, 0, true},
			{"everything", 24, 11, 0.3, true},
			{"groups and a tail", 29, 7, 0.1, true},
		} {
			for rep := range 20 {
				xq := randomActs(g, typ, c.nb, c.pSpecial)
				n := c.nb * a.block
				w := randomBlocks(g, typ, c.rows*n/typ.BlockSize(), c.pSpecial, c.minus128)
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
	xq8 := make([]byte, 8*68)
	xqK := make([]byte, 548)
	w := make([]byte, 2*144)
	out := make([]float32, 2)
	nan := make([]float32, 64)
	nan[40] = float32(math.NaN())
	inf := make([]float32, 32)
	inf[5] = float32(math.Inf(-1))
	cases := []struct {
		name string
		err  error
		run  func() error
	}{
		{"quantize row F16", ErrUnsupported, func() error { return QuantizeRow(F16, make([]byte, 512), x) }},
		{"quantize row unknown", ErrUnknownType, func() error { return QuantizeRow(Type(5), xq8, x) }},
		{"quantize row short", ErrLength, func() error { return QuantizeRow(Q4_K, xqK[:547], x) }},
		{"quantize row partial block", ErrLength, func() error { return QuantizeRow(Q4_K, xqK, x[:255]) }},
		{"quantize row NaN", ErrNotFinite, func() error { return QuantizeRow(Q8_0, xq8[:136], nan) }},
		{"quantize row infinity", ErrNotFinite, func() error { return QuantizeRow(Q4_0, xq8[:68], inf) }},
		{"dequantize row Q8_K", ErrUnsupported, func() error { return DequantizeRow(Q8_K, x, xqK) }},
		{"dequantize row short", ErrLength, func() error { return DequantizeRow(Q4_K, x, xqK[:547]) }},
		{"vec dot Q8_K weights", ErrUnsupported, func() error { _, err := VecDot(Q8_K, make([]byte, 292), xqK, 256); return err }},
		{"vec dot short weights", ErrLength, func() error { _, err := VecDot(Q4_K, w[:143], xqK, 256); return err }},
		{"vec dot long activations", ErrLength, func() error { _, err := VecDot(Q4_K, w[:144], make([]byte, 549), 256); return err }},
		{"vec dot partial block", ErrLength, func() error { _, err := VecDot(Q8_0, w[:34], xq8[:68], 31); return err }},
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
	if err := GEMV(Q4_K, out, w, 2, 256, xq8); err == nil || !contains(err.Error(), "548 bytes of activations") {
		t.Errorf("activation length error does not name the format: %v", err)
	}
}

// refQuantizeRow is QuantizeRow as act.go defines it, element by element
// in float64 where the scaling allows: each block's largest magnitude
// amax, q = x·(ActMax/amax) rounded to the nearest integer, ties to even
// (in float32 where ActMax/amax is finite in float32, as the definition
// rounds it), the scale amax/ActMax and, for the K formats, the sums of
// each 32 quants.
func refQuantizeRow(t Type, x []float32) []byte {
	a, _ := actOf(t)
	nb := len(x) / a.block
	xq := make([]byte, nb*a.blockBytes())
	for i := range nb {
		blk := x[i*a.block : (i+1)*a.block]
		var amax float32
		for _, v := range blk {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		for j, v := range blk {
			var q float64
			if id := float32(ActMax / amax); amax != 0 && !math.IsInf(float64(id), 0) {
				q = math.RoundToEven(float64(v * id))
			} else if amax != 0 {
				q = math.RoundToEven(float64(v) * (ActMax / float64(amax)))
			}
			binary.LittleEndian.PutUint16(xq[2*(i*a.block+j):], uint16(int16(q)))
		}
		tail := actTail(a, xq, nb, i)
		binary.LittleEndian.PutUint32(tail, math.Float32bits(amax/ActMax))
		if a.sums {
			for j := range 8 {
				var s int32
				for e := i*a.block + 32*j; e < i*a.block+32*j+32; e++ {
					s += int32(actQuant(xq, e))
				}
				binary.LittleEndian.PutUint32(tail[4+4*j:], uint32(s))
			}
		}
	}
	return xq
}

// TestQuantizeRow holds QuantizeRow to refQuantizeRow byte for byte, and
// its output to the promises the kernels rely on: every quant within
// ±ActMax, each activation within half a step of its value (and the
// rounding of a subnormal scale). The inputs
// include values at rounding ties, blocks of zeros, tiny and subnormal
// values (where ActMax/amax overflows float32), and the largest floats.
func TestQuantizeRow(t *testing.T) {
	g := newGen(9)
	ties := make([]float32, 4096)
	for i := range ties {
		ties[i] = float32(i%(2*ActMax+1)-ActMax) + 0.5 // halves of a step of 1
		if i%32 == 0 {
			ties[i] = ActMax
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
		"large":    scaled(1e37),
		"mixed":    append(append(scaled(1e-40)[:2048], scaled(3)[:1024]...), make([]float32, 1024)...),
		"extremes": append(scaled(1)[:4000], 3e38, -3e38, 1e-45, -1e-45, 0, 0, 1, -1, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5),
	}
	for _, typ := range []Type{Q8_0, Q4_K} {
		a, _ := actOf(typ)
		for name, x := range inputs {
			x = append(x, make([]float32, 4096-len(x))...)
			want := refQuantizeRow(typ, x)
			got := activations(t, typ, x)
			for i := range got {
				if got[i] != want[i] {
					t.Fatalf("%v %s: byte %d of %d is %#02x, the definition gives %#02x", typ, name, i, len(got), got[i], want[i])
				}
			}
			back := make([]float32, len(x))
			if err := DequantizeRow(typ, back, got); err != nil {
				t.Fatal(err)
			}
			nb := len(x) / a.block
			for e := range x {
				d := float64(actScale(a, got, nb, e/a.block))
				if q := actQuant(got, e); q > ActMax || q < -ActMax {
					t.Fatalf("%v %s: quant %d is %d, beyond ±%d", typ, name, e, q, ActMax)
				}
				// Half a step (and float32 rounding: 2^-9 of a step at ActMax), and
				// the scale's rounding where it is subnormal.
				if diff := math.Abs(float64(back[e]) - float64(x[e])); diff > d*0.502+ActMax*math.SmallestNonzeroFloat32 {
					t.Fatalf("%v %s: element %d is %g, dequantized %g: off by %g steps of %g", typ, name, e, x[e], back[e], diff/d, d)
				}
			}
		}
		for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
			x := scaled(1)
			x[777] = bad
			xq := make([]byte, len(refQuantizeRow(typ, x)))
			err := QuantizeRow(typ, xq, x)
			if !errors.Is(err, ErrNotFinite) || !contains(err.Error(), "element 777") {
				t.Errorf("%v with %v: error %v, want ErrNotFinite naming element 777", typ, bad, err)
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
