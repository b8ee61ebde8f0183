package quant

import "math"

// The 32-element block formats. Each block stores an F16 scale d (and, for
// the _1 formats, an F16 offset m) followed by the quants:
//
//	Q4_0 (18 bytes): d, 16 bytes of nibbles; x = d*(q-8), q in 0..15
//	Q4_1 (20 bytes): d, m, 16 bytes of nibbles; x = d*q + m
//	Q5_0 (22 bytes): d, 4 bytes of fifth bits, 16 bytes of nibbles; x = d*(q-16)
//	Q5_1 (24 bytes): d, m, 4 bytes of fifth bits, 16 bytes of nibbles; x = d*q + m
//	Q8_0 (34 bytes): d, 32 signed bytes; x = d*q
//
// Nibbles: byte j holds element j in its low half and element j+16 in its
// high half. Fifth bits: bit j of the little-endian 32-bit word is the high
// bit of element j.

var (
	codecQ4_0 = codec{DequantizeQ4_0, QuantizeQ4_0, DotQ4_0F32, halfOK}
	codecQ4_1 = codec{DequantizeQ4_1, QuantizeQ4_1, DotQ4_1F32, func(b []byte) bool { return halfOK(b) && halfOK(b[2:]) }}
	codecQ5_0 = codec{DequantizeQ5_0, QuantizeQ5_0, func(r []byte, x []float32) float32 { return dotVia(Q5_0, DequantizeQ5_0, r, x) }, halfOK}
	codecQ5_1 = codec{DequantizeQ5_1, QuantizeQ5_1, func(r []byte, x []float32) float32 { return dotVia(Q5_1, DequantizeQ5_1, r, x) }, func(b []byte) bool { return halfOK(b) && halfOK(b[2:]) }}
	codecQ8_0 = codec{DequantizeQ8_0, QuantizeQ8_0, DotQ8_0F32, halfOK}
)

// The functions below panic when len(dst) and len(src) are not matching
// whole blocks; Type.Dequantize, Type.Quantize and Type.DotF32 check first.

// DequantizeQ8_0 decodes Q8_0 blocks.
func DequantizeQ8_0(dst []float32, src []byte) {
	nb := mustBlocks(Q8_0, len(dst), len(src))
	for i := range nb {
		b := (*[34]byte)(src[34*i:])
		y := (*[32]float32)(dst[32*i:])
		d := halfToFloat(le16(b[:]))
		for j := range y {
			y[j] = i8Float[b[2+j]] * d
		}
	}
}

// QuantizeQ8_0 encodes Q8_0 blocks: d = max|x|/127, q = round(x/d), ties
// away from zero.
func QuantizeQ8_0(dst []byte, src []float32) {
	nb := mustBlocks(Q8_0, len(src), len(dst))
	for i := range nb {
		x := (*[32]float32)(src[32*i:])
		b := (*[34]byte)(dst[34*i:])
		var amax float32
		for _, v := range x {
			if a := abs32(v); !(amax > a) {
				amax = a
			}
		}
		d := amax / 127
		var id float32
		if d != 0 {
			id = 1 / d
		}
		put16(b[:], floatToHalf(d))
		for j, v := range x {
			b[2+j] = byte(int8(math.Round(float64(float32(v * id)))))
		}
	}
}

// DequantizeQ4_0 decodes Q4_0 blocks.
func DequantizeQ4_0(dst []float32, src []byte) {
	nb := mustBlocks(Q4_0, len(dst), len(src))
	for i := range nb {
		b := (*[18]byte)(src[18*i:])
		y := (*[32]float32)(dst[32*i:])
		d := halfToFloat(le16(b[:]))
		for j := range 16 {
			q := &nibFloat8[b[2+j]]
			y[j] = q[0] * d
			y[j+16] = q[1] * d
		}
	}
}

// absMaxSigned returns the largest magnitude in x and the value that has it
// (the first of equal magnitudes).
func absMaxSigned(x []float32) (amax, max float32) {
	for _, v := range x {
		if a := abs32(v); amax < a {
			amax, max = a, v
		}
	}
	return amax, max
}

// QuantizeQ4_0 encodes Q4_0 blocks: d = -m/8 for the value m of largest
// magnitude, so that m itself maps to q = 0.
func QuantizeQ4_0(dst []byte, src []float32) {
	nb := mustBlocks(Q4_0, len(src), len(dst))
	for i := range nb {
		x := (*[32]float32)(src[32*i:])
		b := (*[18]byte)(dst[18*i:])
		_, mx := absMaxSigned(x[:])
		d := mx / -8
		var id float32
		if d != 0 {
			id = 1 / d
		}
		put16(b[:], floatToHalf(d))
		for j := range 16 {
			x0 := float32(x[j] * id)
			x1 := float32(x[j+16] * id)
			b[2+j] = truncMin(x0+8.5, 15) | truncMin(x1+8.5, 15)<<4
		}
	}
}

// truncMin is the reference's MIN(limit, (int8_t)v) stored in a byte.
func truncMin(v float32, limit int) byte {
	return byte(min(limit, int(int8(v))))
}

// DequantizeQ4_1 decodes Q4_1 blocks.
func DequantizeQ4_1(dst []float32, src []byte) {
	nb := mustBlocks(Q4_1, len(dst), len(src))
	for i := range nb {
		b := (*[20]byte)(src[20*i:])
		y := (*[32]float32)(dst[32*i:])
		d := halfToFloat(le16(b[0:]))
		m := halfToFloat(le16(b[2:]))
		for j := range 16 {
			q := &nibFloat[b[4+j]]
			y[j] = float32(q[0]*d) + m
			y[j+16] = float32(q[1]*d) + m
		}
	}
}

// minMax returns the smallest and largest of x as the reference finds them
// (starting from the extremes of float32).
func minMax(x []float32) (lo, hi float32) {
	lo, hi = math.MaxFloat32, -math.MaxFloat32
	for _, v := range x {
		if v < lo {
			lo = v
		}
		if v > hi {
			hi = v
		}
	}
	return lo, hi
}

// QuantizeQ4_1 encodes Q4_1 blocks: m = min(x), d = (max(x)-m)/15.
func QuantizeQ4_1(dst []byte, src []float32) {
	nb := mustBlocks(Q4_1, len(src), len(dst))
	for i := range nb {
		x := (*[32]float32)(src[32*i:])
		b := (*[20]byte)(dst[20*i:])
		lo, hi := minMax(x[:])
		d := (hi - lo) / 15
		var id float32
		if d != 0 {
			id = 1 / d
		}
		put16(b[0:], floatToHalf(d))
		put16(b[2:], floatToHalf(lo))
		for j := range 16 {
			x0 := float32((x[j] - lo) * id)
			x1 := float32((x[j+16] - lo) * id)
			b[4+j] = truncMin(x0+0.5, 15) | truncMin(x1+0.5, 15)<<4
		}
	}
}

// DequantizeQ5_0 decodes Q5_0 blocks.
func DequantizeQ5_0(dst []float32, src []byte) {
	nb := mustBlocks(Q5_0, len(dst), len(src))
	for i := range nb {
		b := (*[22]byte)(src[22*i:])
		y := (*[32]float32)(dst[32*i:])
		d := halfToFloat(le16(b[0:]))
		qh := uint32(b[2]) | uint32(b[3])<<8 | uint32(b[4])<<16 | uint32(b[5])<<24
		for j := range 16 {
			q := b[6+j]
			h0 := (qh >> j << 4) & 0x10
			h1 := (qh >> (j + 12)) & 0x10
			y[j] = float32(int(uint32(q&0xf)|h0)-16) * d
			y[j+16] = float32(int(uint32(q>>4)|h1)-16) * d
		}
	}
}

// QuantizeQ5_0 encodes Q5_0 blocks: d = -m/16 for the value m of largest
// magnitude.
func QuantizeQ5_0(dst []byte, src []float32) {
	nb := mustBlocks(Q5_0, len(src), len(dst))
	for i := range nb {
		x := (*[32]float32)(src[32*i:])
		b := (*[22]byte)(dst[22*i:])
		_, mx := absMaxSigned(x[:])
		d := mx / -16
		var id float32
		if d != 0 {
			id = 1 / d
		}
		put16(b[0:], floatToHalf(d))
		var qh uint32
		for j := range 16 {
			x0 := float32(x[j] * id)
			x1 := float32(x[j+16] * id)
			q0, q1 := truncMin(x0+16.5, 31), truncMin(x1+16.5, 31)
			b[6+j] = q0&0xf | (q1&0xf)<<4
			qh |= uint32(q0>>4&1)<<j | uint32(q1>>4&1)<<(j+16)
		}
		b[2], b[3], b[4], b[5] = byte(qh), byte(qh>>8), byte(qh>>16), byte(qh>>24)
	}
}

// DequantizeQ5_1 decodes Q5_1 blocks.
func DequantizeQ5_1(dst []float32, src []byte) {
	nb := mustBlocks(Q5_1, len(dst), len(src))
	for i := range nb {
		b := (*[24]byte)(src[24*i:])
		y := (*[32]float32)(dst[32*i:])
		d := halfToFloat(le16(b[0:]))
		m := halfToFloat(le16(b[2:]))
		qh := uint32(b[4]) | uint32(b[5])<<8 | uint32(b[6])<<16 | uint32(b[7])<<24
		for j := range 16 {
			q := b[8+j]
			h0 := (qh >> j << 4) & 0x10
			h1 := (qh >> (j + 12)) & 0x10
			y[j] = float32(float32(uint32(q&0xf)|h0)*d) + m
			y[j+16] = float32(float32(uint32(q>>4)|h1)*d) + m
		}
	}
}

// QuantizeQ5_1 encodes Q5_1 blocks: m = min(x), d = (max(x)-m)/31.
func QuantizeQ5_1(dst []byte, src []float32) {
	nb := mustBlocks(Q5_1, len(src), len(dst))
	for i := range nb {
		x := (*[32]float32)(src[32*i:])
		b := (*[24]byte)(dst[24*i:])
		lo, hi := minMax(x[:])
		d := (hi - lo) / 31
		var id float32
		if d != 0 {
			id = 1 / d
		}
		put16(b[0:], floatToHalf(d))
		put16(b[2:], floatToHalf(lo))
		var qh uint32
		for j := range 16 {
			x0 := float32((x[j] - lo) * id)
			x1 := float32((x[j+16] - lo) * id)
			// The reference converts without a clamp; x0 is at most 31 plus
			// rounding, so the truncation lands in 0..31.
			q0, q1 := byte(int32(x0+0.5)), byte(int32(x1+0.5))
			b[8+j] = q0&0xf | (q1&0xf)<<4
			qh |= uint32(q0>>4&1)<<j | uint32(q1>>4&1)<<(j+16)
		}
		b[4], b[5], b[6], b[7] = byte(qh), byte(qh>>8), byte(qh>>16), byte(qh>>24)
	}
}

// DotQ8_0F32 is the dot product of a row of Q8_0 blocks with x.
func DotQ8_0F32(row []byte, x []float32) float32 {
	nb := mustBlocks(Q8_0, len(x), len(row))
	var sum float32
	for i := range nb {
		b := (*[34]byte)(row[34*i:])
		v := (*[32]float32)(x[32*i:])
		d := halfToFloat(le16(b[:]))
		var s0, s1, s2, s3 float32
		for j := 0; j < 32; j += 4 {
			s0 += i8Float[b[2+j]] * v[j]
			s1 += i8Float[b[3+j]] * v[j+1]
			s2 += i8Float[b[4+j]] * v[j+2]
			s3 += i8Float[b[5+j]] * v[j+3]
		}
		sum += d * ((s0 + s1) + (s2 + s3))
	}
	return sum
}

// DotQ4_0F32 is the dot product of a row of Q4_0 blocks with x.
func DotQ4_0F32(row []byte, x []float32) float32 {
	nb := mustBlocks(Q4_0, len(x), len(row))
	var sum float32
	for i := range nb {
		b := (*[18]byte)(row[18*i:])
		v := (*[32]float32)(x[32*i:])
		d := halfToFloat(le16(b[:]))
		var s0, s1, s2, s3 float32
		for j := 0; j < 16; j += 2 {
			q0, q1 := &nibFloat8[b[2+j]], &nibFloat8[b[3+j]]
			s0 += q0[0] * v[j]
			s1 += q0[1] * v[j+16]
			s2 += q1[0] * v[j+1]
			s3 += q1[1] * v[j+17]
		}
		sum += d * ((s0 + s1) + (s2 + s3))
	}
	return sum
}

// DotQ4_1F32 is the dot product of a row of Q4_1 blocks with x.
func DotQ4_1F32(row []byte, x []float32) float32 {
	nb := mustBlocks(Q4_1, len(x), len(row))
	var sum float32
	for i := range nb {
		b := (*[20]byte)(row[20*i:])
		v := (*[32]float32)(x[32*i:])
		d, m := halfToFloat(le16(b[0:])), halfToFloat(le16(b[2:]))
		var s0, s1, t0, t1 float32
		for j := range 16 {
			q := &nibFloat[b[4+j]]
			s0 += q[0] * v[j]
			s1 += q[1] * v[j+16]
			t0 += v[j]
			t1 += v[j+16]
		}
		sum += d*(s0+s1) + m*(t0+t1)
	}
	return sum
}
