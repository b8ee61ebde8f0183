package quant

import (
	"encoding/binary"
	"math"
)

// The Go kernels of the integer products: one row of weights times one
// row of quantized activations, in the order vecdot.go defines. The
// operands are whole, matching blocks (checked by the callers); the
// number of blocks is taken from xq. Each product that feeds an add is
// converted to float32 explicitly, which keeps the compiler from fusing
// the two (Go's specification allows fusing otherwise), so the result is
// the same on every architecture.

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
			lane[k] = signMul(b[e], x[e]) + signMul(b[e+1], x[e+1]) + signMul(b[e+2], x[e+2]) + signMul(b[e+3], x[e+3])
		}
		addLanes(&acc, &lane, dd)
	}
	return hsum8(&acc)
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

// dotQ4_KGo: Q4_K weights, Q8_K activations.
func dotQ4_KGo(w, xq []byte) float32 { return dotQ45_KGo(w, xq, false) }

// dotQ5_KGo: Q5_K weights, Q8_K activations.
func dotQ5_KGo(w, xq []byte) float32 { return dotQ45_KGo(w, xq, true) }

// dotQ45_KGo is the product of Q4_K (five = false) or Q5_K weights.
func dotQ45_KGo(w, xq []byte, five bool) float32 {
	bb, qs := 144, 16
	if five {
		bb, qs = 176, 48
	}
	var acc [8]float32
	for i := range len(xq) / 292 {
		b := w[bb*i : bb*(i+1)]
		y := (*[292]byte)(xq[292*i:])
		dx := f32le(y[0:])
		dd := float32(halfToFloat(le16(b[0:])) * dx)
		dm := float32(halfToFloat(le16(b[2:])) * dx)
		sc := (*[12]byte)(b[4:])
		var lane, mlane [8]int32
		for j := range 8 {
			s, m := scaleMinK4(j, sc)
			q := (*[32]byte)(b[qs+32*(j/2):])
			sh := 4 * uint(j&1)
			x := (*[32]byte)(y[4+32*j:])
			for k := range lane {
				var p int32
				for e := 4 * k; e < 4*k+4; e++ {
					l := int32(q[e] >> sh & 15)
					if five {
						l |= int32(b[16+e]>>j&1) << 4
					}
					p += l * int32(int8(x[e]))
				}
				lane[k] += int32(s) * p
			}
			mlane[j] = int32(m) * (bsumQ8_K(y, 2*j) + bsumQ8_K(y, 2*j+1))
		}
		for k := range acc {
			acc[k] = acc[k] + float32(float32(lane[k])*dd) - float32(float32(mlane[k])*dm)
		}
	}
	return hsum8(&acc)
}

// dotQ6_KGo: Q6_K weights (level - 32), Q8_K activations. Chunk c holds
// elements 32c..32c+31: in half h = c/4, group g = c%4, the low nibbles
// (g < 2) or high nibbles of ql[64h+32(g&1):], and bits 2g, 2g+1 of
// qh[32h:].
func dotQ6_KGo(w, xq []byte) float32 {
	var acc [8]float32
	for i := range len(xq) / 292 {
		b := (*[210]byte)(w[210*i:])
		y := (*[292]byte)(xq[292*i:])
		dd := float32(halfToFloat(le16(b[208:])) * f32le(y[0:]))
		var lane [8]int32
		for c := range 8 {
			h, g := c/4, c%4
			ql := (*[32]byte)(b[64*h+32*(g&1):])
			qh := (*[32]byte)(b[128+32*h:])
			nsh, hsh := 4*uint(g/2), 2*uint(g)
			x := (*[32]byte)(y[4+32*c:])
			for k := range lane {
				var p int32
				for e := 4 * k; e < 4*k+4; e++ {
					l := int32(ql[e]>>nsh&15|(qh[e]>>hsh&3)<<4) - 32
					p += l * int32(int8(x[e]))
				}
				lane[k] += int32(int8(b[192+2*c+k/4])) * p
			}
		}
		addLanes(&acc, &lane, dd)
	}
	return hsum8(&acc)
}
