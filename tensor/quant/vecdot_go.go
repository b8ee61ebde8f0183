package quant

import (
	"encoding/binary"
	"math"
)

// The Go kernels of the integer products: one row of weights times one
// row of quantized activations, in the order the package documentation
// defines (doc.go, "The integer product"). The operands are whole,
// matching blocks (checked by the callers); the number of blocks is taken
// from xq. Each product that feeds an add is converted to float32
// explicitly, which keeps the compiler from fusing the two (Go's
// specification allows fusing otherwise), so the result is the same on
// every architecture.

// hsum8 reduces the eight accumulators in the order every kernel uses.
func hsum8(a *[8]float32) float32 {
	return (float32(a[0]+a[4]) + float32(a[2]+a[6])) + (float32(a[1]+a[5]) + float32(a[3]+a[7]))
}

// addLanes adds the integer lanes of one block, scaled by dd, to acc.
func addLanes(acc *[8]float32, lane *[8]int32, dd float32) {
	for k := range acc {
		acc[k] += float32(float32(lane[k]) * dd)
	}
}

// signMul is the product of a Q8_0 weight quant w and an activation quant
// x as the sign trick computes it: |w| times x negated where w < 0, the
// negation wrapping in eight bits. It is w·x unless x = -128 and w < 0.
func signMul(w, x byte) int32 {
	a, s := int32(int8(w)), int8(x)
	if a < 0 {
		a, s = -a, -s
	}
	return a * int32(s)
}

func f32le(b []byte) float32 { return math.Float32frombits(binary.LittleEndian.Uint32(b)) }

// bsumQ8_K returns the stored sum of the 16 activation quants of group g of
// a Q8_K block.
func bsumQ8_K(y *[292]byte, g int) int32 { return int32(int16(le16(y[260+2*g:]))) }

// dotQ8_0Go: Q8_0 weights, Q8_0 activations.
func dotQ8_0Go(w, xq []byte) float32 {
	var acc [8]float32
	for i := range len(xq) / 34 {
		b := (*[34]byte)(w[34*i:])
		x := (*[34]byte)(xq[34*i:])
		dd := float32(halfToFloat(le16(b[:])) * halfToFloat(le16(x[:])))
		var lane [8]int32
		for k := range lane {
			e := 2 + 4*k
			lane[k] = int32(int8(b[e]))*int32(int8(x[e])) + int32(int8(b[e+1]))*int32(int8(x[e+1])) +
				int32(int8(b[e+2]))*int32(int8(x[e+2])) + int32(int8(b[e+3]))*int32(int8(x[e+3]))
		}
		addLanes(&acc, &lane, dd)
	}
	return hsum8(&acc)
}

// dotQ8_0SignGo is dotQ8_0Go for activations holding -128: every product
// by signMul.
func dotQ8_0SignGo(w, xq []byte) float32 {
	var acc [8]float32
	for i := range len(xq) / 34 {
		b := (*[34]byte)(w[34*i:])
		x := (*[34]byte)(xq[34*i:])
		dd := float32(halfToFloat(le16(b[:])) * halfToFloat(le16(x[:])))
		var lane [8]int32
		for k := range lane {
			e := 2 + 4*k
			lane[k] = signMul(b[e], x[e]) + signMul(b[e+1], x[e+1]) + signMul(b[e+2], x[e+2]) + signMul(b[e+3], x[e+3])
		}
		addLanes(&acc, &lane, dd)
	}
	return hsum8(&acc)
}

// gemvQ8_0Go is the Go kernel of Q8_0 weights: the plain products, unless
// an activation quant is -128 (which QuantizeRow never writes), where the
// sign trick's product differs.
func gemvQ8_0Go(out []float32, w, xq []byte) {
	dot := dotQ8_0Go
	for i := 0; i < len(xq); i += 34 {
		for _, q := range xq[i+2 : i+34] {
			if q == 0x80 {
				dot = dotQ8_0SignGo
			}
		}
	}
	rb := len(w) / len(out)
	for r := range out {
		out[r] = dot(w[r*rb:(r+1)*rb], xq)
	}
}

// nibbles32 unpacks the 16 bytes of a 32-element block's nibbles into the
// element order: byte j holds element j low and j+16 high.
func nibbles32(dst *[32]int32, q []byte) {
	q = q[:16]
	for j, v := range q {
		dst[j] = int32(v & 15)
		dst[j+16] = int32(v >> 4)
	}
}

// fifthBits adds the fifth bits of a Q5 block (bit e of the little-endian
// word qh is the top bit of element e) to the nibbles in q.
func fifthBits(q *[32]int32, qh []byte) {
	h := binary.LittleEndian.Uint32(qh)
	for e := range q {
		q[e] |= int32(h>>e&1) << 4
	}
}

// lanes32 computes the integer lanes of one 32-element block from the
// weight levels q, less off, and the activation quants x.
func lanes32(lane *[8]int32, q *[32]int32, off int32, x *[32]byte) {
	for k := range lane {
		var p int32
		for e := 4 * k; e < 4*k+4; e++ {
			p += (q[e] - off) * int32(int8(x[e]))
		}
		lane[k] = p
	}
}

// xsums computes the sums of each four activation quants of a block.
func xsums(s *[8]int32, x *[32]byte) {
	for k := range s {
		s[k] = int32(int8(x[4*k])) + int32(int8(x[4*k+1])) + int32(int8(x[4*k+2])) + int32(int8(x[4*k+3]))
	}
}

// dotQ4_0Go: Q4_0 weights (level - 8), Q8_0 activations.
func dotQ4_0Go(w, xq []byte) float32 {
	var acc [8]float32
	var q [32]int32
	var lane [8]int32
	for i := range len(xq) / 34 {
		b := (*[18]byte)(w[18*i:])
		x := (*[34]byte)(xq[34*i:])
		nibbles32(&q, b[2:])
		lanes32(&lane, &q, 8, (*[32]byte)(x[2:]))
		addLanes(&acc, &lane, float32(halfToFloat(le16(b[:]))*halfToFloat(le16(x[:]))))
	}
	return hsum8(&acc)
}

// dotQ5_0Go: Q5_0 weights (level - 16), Q8_0 activations.
func dotQ5_0Go(w, xq []byte) float32 {
	var acc [8]float32
	var q [32]int32
	var lane [8]int32
	for i := range len(xq) / 34 {
		b := (*[22]byte)(w[22*i:])
		x := (*[34]byte)(xq[34*i:])
		nibbles32(&q, b[6:])
		fifthBits(&q, b[2:])
		lanes32(&lane, &q, 16, (*[32]byte)(x[2:]))
		addLanes(&acc, &lane, float32(halfToFloat(le16(b[:]))*halfToFloat(le16(x[:]))))
	}
	return hsum8(&acc)
}

// addLanesMin adds one block of a format with a min: the scaled lanes,
// then the activation sums times m·dx.
func addLanesMin(acc *[8]float32, lane, s *[8]int32, dd, md float32) {
	for k := range acc {
		acc[k] = acc[k] + float32(float32(lane[k])*dd) + float32(float32(s[k])*md)
	}
}

// dotQ4_1Go: Q4_1 weights (d·level + m), Q8_0 activations.
func dotQ4_1Go(w, xq []byte) float32 {
	var acc [8]float32
	var q [32]int32
	var lane, s [8]int32
	for i := range len(xq) / 34 {
		b := (*[20]byte)(w[20*i:])
		x := (*[34]byte)(xq[34*i:])
		nibbles32(&q, b[4:])
		lanes32(&lane, &q, 0, (*[32]byte)(x[2:]))
		xsums(&s, (*[32]byte)(x[2:]))
		dx := halfToFloat(le16(x[:]))
		addLanesMin(&acc, &lane, &s, float32(halfToFloat(le16(b[0:]))*dx), float32(halfToFloat(le16(b[2:]))*dx))
	}
	return hsum8(&acc)
}

// dotQ5_1Go: Q5_1 weights (d·level + m), Q8_0 activations.
func dotQ5_1Go(w, xq []byte) float32 {
	var acc [8]float32
	var q [32]int32
	var lane, s [8]int32
	for i := range len(xq) / 34 {
		b := (*[24]byte)(w[24*i:])
		x := (*[34]byte)(xq[34*i:])
		nibbles32(&q, b[8:])
		fifthBits(&q, b[4:])
		lanes32(&lane, &q, 0, (*[32]byte)(x[2:]))
		xsums(&s, (*[32]byte)(x[2:]))
		dx := halfToFloat(le16(x[:]))
		addLanesMin(&acc, &lane, &s, float32(halfToFloat(le16(b[0:]))*dx), float32(halfToFloat(le16(b[2:]))*dx))
	}
	return hsum8(&acc)
}

// kScales returns a Q4_K or Q5_K super-block's scales d·dx and dmin·dx.
func kScales(b []byte, y *[292]byte) (dd, dm float32) {
	dx := f32le(y[0:])
	return float32(halfToFloat(le16(b[0:])) * dx), float32(halfToFloat(le16(b[2:])) * dx)
}

// addLanesK adds one Q4_K or Q5_K super-block's lanes and takes its min
// terms away: acc[k] = (acc[k] + lane[k]·dd) - mlane[k]·dm.
func addLanesK(acc *[8]float32, lane, mlane *[8]int32, dd, dm float32) {
	for k := range acc {
		acc[k] = acc[k] + float32(float32(lane[k])*dd) - float32(float32(mlane[k])*dm)
	}
}

// minLanesK sets mlane[j] to min_j times the activation sums of
// sub-block j, and returns the eight scales.
func minLanesK(mlane *[8]int32, sc *[12]byte, y *[292]byte) (s [8]int32) {
	for j := range mlane {
		sj, mj := scaleMinK4(j, sc)
		s[j] = int32(sj)
		mlane[j] = int32(mj) * (bsumQ8_K(y, 2*j) + bsumQ8_K(y, 2*j+1))
	}
	return s
}

// mulLo4 and mulHi4 are the products of the low or high nibbles of q[e:e+4]
// with the activation quants x[e:e+4], summed.
func mulLo4(q, x *[32]byte, e int) int32 {
	return int32(q[e]&15)*int32(int8(x[e])) + int32(q[e+1]&15)*int32(int8(x[e+1])) +
		int32(q[e+2]&15)*int32(int8(x[e+2])) + int32(q[e+3]&15)*int32(int8(x[e+3]))
}

func mulHi4(q, x *[32]byte, e int) int32 {
	return int32(q[e]>>4)*int32(int8(x[e])) + int32(q[e+1]>>4)*int32(int8(x[e+1])) +
		int32(q[e+2]>>4)*int32(int8(x[e+2])) + int32(q[e+3]>>4)*int32(int8(x[e+3]))
}

// dotQ4_KGo: Q4_K weights, Q8_K activations.
func dotQ4_KGo(w, xq []byte) float32 {
	var acc [8]float32
	for i := range len(xq) / 292 {
		b := (*[144]byte)(w[144*i:])
		y := (*[292]byte)(xq[292*i:])
		dd, dm := kScales(b[:], y)
		var lane, mlane [8]int32
		s := minLanesK(&mlane, (*[12]byte)(b[4:]), y)
		for g := range 4 {
			q := (*[32]byte)(b[16+32*g:])
			xl := (*[32]byte)(y[4+64*g:])
			xh := (*[32]byte)(y[36+64*g:])
			s0, s1 := s[2*g], s[2*g+1]
			for k := range lane {
				lane[k] += s0*mulLo4(q, xl, 4*k) + s1*mulHi4(q, xh, 4*k)
			}
		}
		addLanesK(&acc, &lane, &mlane, dd, dm)
	}
	return hsum8(&acc)
}

// dotQ5_KGo: Q5_K weights, Q8_K activations. The fifth bit of element
// 64g+l is bit 2g of qh[l], of 64g+32+l bit 2g+1.
func dotQ5_KGo(w, xq []byte) float32 {
	var acc [8]float32
	for i := range len(xq) / 292 {
		b := (*[176]byte)(w[176*i:])
		y := (*[292]byte)(xq[292*i:])
		dd, dm := kScales(b[:], y)
		var lane, mlane [8]int32
		s := minLanesK(&mlane, (*[12]byte)(b[4:]), y)
		qh := (*[32]byte)(b[16:])
		for g := range 4 {
			q := (*[32]byte)(b[48+32*g:])
			xl := (*[32]byte)(y[4+64*g:])
			xh := (*[32]byte)(y[36+64*g:])
			s0, s1 := s[2*g], s[2*g+1]
			sh := uint(2 * g)
			for k := range lane {
				var hl, hh int32 // the fifth bits' part: 16 times the activations with the bit set
				for e := 4 * k; e < 4*k+4; e++ {
					h := qh[e] >> sh
					hl += int32(h&1) * int32(int8(xl[e]))
					hh += int32(h>>1&1) * int32(int8(xh[e]))
				}
				lane[k] += s0*(mulLo4(q, xl, 4*k)+16*hl) + s1*(mulHi4(q, xh, 4*k)+16*hh)
			}
		}
		addLanesK(&acc, &lane, &mlane, dd, dm)
	}
	return hsum8(&acc)
}

// dotQ6_KGo: Q6_K weights (level - 32), Q8_K activations. In half h of a
// super-block, element l of chunk 4h+c (l < 32) has its low four bits in
// ql[64h+l] (c = 0, low nibble), ql[64h+32+l] (c = 1), ql[64h+l] (c = 2,
// high nibble) or ql[64h+32+l] (c = 3), and its top two bits at offset 2c
// of qh[32h+l]; chunk 4h+c's two 16-element scales are sc[8h+2c] and
// sc[8h+2c+1].
func dotQ6_KGo(w, xq []byte) float32 {
	var acc [8]float32
	for i := range len(xq) / 292 {
		b := (*[210]byte)(w[210*i:])
		y := (*[292]byte)(xq[292*i:])
		dd := float32(halfToFloat(le16(b[208:])) * f32le(y[0:]))
		var lane [8]int32
		for h := range 2 {
			ql := (*[64]byte)(b[64*h:])
			qh := (*[32]byte)(b[128+32*h:])
			sc := (*[8]byte)(b[192+8*h:])
			x := (*[128]byte)(y[4+128*h:])
			for k := range lane {
				var p0, p1, p2, p3 int32
				for l := 4 * k; l < 4*k+4; l++ {
					lo, hi, top := ql[l], ql[32+l], qh[l]
					p0 += (int32(lo&15|top&3<<4) - 32) * int32(int8(x[l]))
					p1 += (int32(hi&15|top>>2&3<<4) - 32) * int32(int8(x[32+l]))
					p2 += (int32(lo>>4|top>>4&3<<4) - 32) * int32(int8(x[64+l]))
					p3 += (int32(hi>>4|top>>6<<4) - 32) * int32(int8(x[96+l]))
				}
				s := k / 4
				lane[k] += int32(int8(sc[s]))*p0 + int32(int8(sc[2+s]))*p1 + int32(int8(sc[4+s]))*p2 + int32(int8(sc[6+s]))*p3
			}
		}
		addLanes(&acc, &lane, dd)
	}
	return hsum8(&acc)
}

// quantizeActQ8_0 writes the bytes QuantizeQ8_0 writes for finite x whose
// block scales fit F16, with the checks in its first pass over a block and
// without math.Round: for |p| >= 0.5, float32 |p| + 0.5 is rounded
// without crossing an integer, so its truncation is |p| rounded half away
// from zero; below 0.5 the result is 0. It reports false, leaving xq
// partly written, when x holds a NaN or an infinity or a scale overflows.
func quantizeActQ8_0(dst []byte, src []float32) bool {
	for i := range len(src) / 32 {
		x := (*[32]float32)(src[32*i:])
		var mbits uint32 // the largest magnitude's bits: integer order is float order
		var inf uint32   // bit 31 set by an exponent of all ones: a NaN or an infinity
		for _, v := range x {
			b := math.Float32bits(v)
			inf |= b&0x7f800000 + 0x00800000
			mbits = max(mbits, b&0x7fffffff)
		}
		if inf>>31 != 0 {
			return false
		}
		d := math.Float32frombits(mbits) / 127
		h := floatToHalf(d)
		if h&0x7c00 == 0x7c00 {
			return false
		}
		var id float32
		if d != 0 {
			id = 1 / d
		}
		if id > math.MaxFloat32 { // a tiny block: the reference's conversions of infinities
			QuantizeQ8_0(dst[34*i:34*i+34], src[32*i:32*i+32])
			continue
		}
		b := (*[34]byte)(dst[34*i:])
		put16(b[:], h)
		roundQ8_0((*[32]byte)(b[2:]), x, id)
	}
	return true
}

// roundQ8_0 sets q[j] to x[j]·id rounded half away from zero.
func roundQ8_0(q *[32]byte, x *[32]float32, id float32) {
	for j, v := range x {
		p := float32(v * id)
		a := abs32(p)
		r := int32(a + 0.5)
		if a < 0.5 {
			r = 0
		}
		s := int32(math.Float32bits(p)) >> 31 // 0, or -1 for a negative p
		q[j] = byte((r ^ s) - s)
	}
}

// quantizeActQ8_K is QuantizeQ8_K after a quick check for a NaN or an
// infinity (it reports false if there is one).
func quantizeActQ8_K(dst []byte, src []float32) bool {
	var inf uint32 // as in quantizeActQ8_0
	for _, v := range src {
		inf |= math.Float32bits(v)&0x7f800000 + 0x00800000
	}
	if inf>>31 != 0 {
		return false
	}
	QuantizeQ8_K(dst, src)
	return true
}
