package quant

import (
	"encoding/binary"
	"math"
)

// The K formats work on super-blocks of 256 elements split into sub-blocks
// with their own quantized scales:
//
//	Q4_K (144 bytes): d, dmin (F16); 12 bytes packing eight 6-bit scales
//	  and eight 6-bit mins; 128 bytes of nibbles. Sub-block j (32
//	  elements): x = d*sc[j]*q - dmin*m[j], q in 0..15.
//	Q5_K (176 bytes): as Q4_K, then 32 bytes of fifth bits before the
//	  nibbles; q in 0..31.
//	Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high bit
//	  pairs, sixteen signed 8-bit scales, d (F16). Sub-block j (16
//	  elements): x = d*sc[j]*(q-32), q in 0..63.
//	Q8_K (292 bytes): d (F32), 256 signed bytes, sixteen int16 sums of 16
//	  quants each. x = d*q. The activation format of ggml's K-quant
//	  integer dot products; files do not store it.
//
// Nibble order (Q4_K, Q5_K): the 256 elements are four groups of 64; group
// g's 32 bytes hold element 64g+l in the low nibble of byte l and 64g+32+l
// in the high nibble. The fifth bit of element 64g+l is bit 2g of qh[l],
// of 64g+32+l bit 2g+1. Q6_K: two halves of 128; in half h, ql[64h+l]
// holds elements 128h+l (low) and 128h+64+l (high), ql[64h+32+l] holds
// 128h+32+l and 128h+96+l, and qh[32h+l] holds their top two bits at bit
// offsets 0, 2, 4, 6 for 128h+l, +32, +64, +96.
//
// The 12 scale bytes of Q4_K and Q5_K: for j < 4, scale j is the low six
// bits of byte j and min j of byte j+4; for j >= 4, the low four bits of
// scale j and of min j are the low and high nibbles of byte j+4, and their
// top two bits are the top two bits of bytes j-4 and j.

const groupMaxEps = 1e-15

var (
	codecQ4_K = codec{DequantizeQ4_K, QuantizeQ4_K, DotQ4_KF32, func(b []byte) bool { return halfOK(b) && halfOK(b[2:]) }}
	codecQ5_K = codec{DequantizeQ5_K, QuantizeQ5_K, DotQ5_KF32, func(b []byte) bool { return halfOK(b) && halfOK(b[2:]) }}
	codecQ6_K = codec{DequantizeQ6_K, QuantizeQ6_K, DotQ6_KF32, func(b []byte) bool { return halfOK(b[208:]) }}
	codecQ8_K = codec{DequantizeQ8_K, QuantizeQ8_K, func(r []byte, x []float32) float32 { return dotVia(Q8_K, DequantizeQ8_K, r, x) },
		func(b []byte) bool { return b[3]&0x7f != 0x7f || b[2]&0x80 == 0 }}
)

// scaleMinK4 unpacks the 6-bit scale and min of sub-block j.
func scaleMinK4(j int, q *[12]byte) (sc, m uint8) {
	if j < 4 {
		return q[j] & 63, q[j+4] & 63
	}
	return q[j+4]&0xf | (q[j-4]>>6)<<4, q[j+4]>>4 | (q[j]>>6)<<4
}

// packScaleMinK4 stores the scales and mins the way scaleMinK4 reads them.
func packScaleMinK4(q *[12]byte, ls, lm *[8]uint8) {
	for j := range 8 {
		if j < 4 {
			q[j] = ls[j]
			q[j+4] = lm[j]
		} else {
			q[j+4] = ls[j]&0xf | (lm[j]&0xf)<<4
			q[j-4] |= (ls[j] >> 4) << 6
			q[j] |= (lm[j] >> 4) << 6
		}
	}
}

func sqrt32(x float32) float32 { return float32(math.Sqrt(float64(x))) }

// DequantizeQ4_K decodes Q4_K super-blocks.
func DequantizeQ4_K(dst []float32, src []byte) {
	nb := mustBlocks(Q4_K, len(dst), len(src))
	for i := range nb {
		b := (*[144]byte)(src[144*i:])
		y := (*[256]float32)(dst[256*i:])
		d, dmin := halfToFloat(le16(b[0:])), halfToFloat(le16(b[2:]))
		sc := (*[12]byte)(b[4:])
		for g := range 4 {
			s1, m1 := scaleMinK4(2*g, sc)
			s2, m2 := scaleMinK4(2*g+1, sc)
			d1, dm1 := d*float32(s1), dmin*float32(m1)
			d2, dm2 := d*float32(s2), dmin*float32(m2)
			q := (*[32]byte)(b[16+32*g:])
			yy := (*[64]float32)(y[64*g:])
			for l, v := range q {
				n := &nibFloat[v]
				yy[l] = float32(d1*n[0]) - dm1
				yy[32+l] = float32(d2*n[1]) - dm2
			}
		}
	}
}

// makeQKX2 chooses a scale and a min for one sub-block of n elements with
// levels 0..nmax, minimising the weighted squared error: the reference's
// make_qkx2_quants with its search over nstep+1 trial scales. It fills L
// with the levels and returns the scale and the (positive) min. Every
// product is rounded to float32 before it is added, as the reference
// computes without fused multiply-adds.
func makeQKX2(nmax int, x, weights []float32, L, Laux []uint8, rmin, rdelta float32, nstep int) (scale, theMin float32) {
	n := len(x)
	weights, L, Laux = weights[:n], L[:n], Laux[:n]
	lo, hi := x[0], x[0]
	sumW := weights[0]
	sumX := float32(sumW * x[0])
	for i := 1; i < n; i++ {
		if x[i] < lo {
			lo = x[i]
		}
		if x[i] > hi {
			hi = x[i]
		}
		w := weights[i]
		sumW += w
		sumX += float32(w * x[i])
	}
	if lo > 0 {
		lo = 0
	}
	if hi == lo {
		clear(L)
		return 0, -lo
	}
	fmax := float32(nmax)
	iscale := fmax / (hi - lo)
	scale = 1 / iscale
	var bestErr float32
	for i, v := range x {
		l := nearestInt(float32(iscale * (v - lo)))
		L[i] = uint8(max(0, min(nmax, l)))
		diff := float32(float32(scale*float32(L[i]))+lo) - v
		bestErr += float32(weights[i] * float32(diff*diff))
	}
	if nstep < 1 {
		return scale, -lo
	}
	for is := 0; is <= nstep; is++ {
		iscale = (rmin + float32(rdelta*float32(is)) + fmax) / (hi - lo)
		var sumL, sumL2, sumXL float32
		for i, v := range x {
			l := max(0, min(nmax, nearestInt(float32(iscale*(v-lo)))))
			Laux[i] = uint8(l)
			fl := float32(l)
			wl := float32(weights[i] * fl)
			sumL += wl
			sumL2 += float32(wl * fl)
			sumXL += float32(wl * v)
		}
		D := float32(sumW*sumL2) - float32(sumL*sumL)
		if D > 0 {
			thisScale := (float32(sumW*sumXL) - float32(sumX*sumL)) / D
			thisMin := (float32(sumL2*sumX) - float32(sumL*sumXL)) / D
			if thisMin > 0 {
				thisMin = 0
				thisScale = sumXL / sumL2
			}
			var curErr float32
			for i, v := range x {
				diff := float32(float32(thisScale*float32(Laux[i]))+thisMin) - v
				curErr += float32(weights[i] * float32(diff*diff))
			}
			if curErr < bestErr {
				copy(L, Laux)
				bestErr = curErr
				scale, lo = thisScale, thisMin
			}
		}
	}
	return scale, -lo
}

// quantizeKScaleMin is the part Q4_K and Q5_K share: per sub-block scales
// and mins by makeQKX2, quantized to six bits against the largest of each,
// then the levels recomputed from the quantized scales. It writes d, dmin
// and the 12 scale bytes of block b and leaves the levels in L.
func quantizeKScaleMin(b []byte, x *[256]float32, L *[256]uint8, nmax int, rmin float32, nstep int) {
	var weights [32]float32
	var Laux [32]uint8
	var scales, mins [8]float32
	var maxScale, maxMin float32
	for j := range 8 {
		xs := x[32*j : 32*j+32]
		var sumX2 float32
		for _, v := range xs {
			sumX2 += float32(v * v)
		}
		av := sqrt32(sumX2 / 32)
		for l, v := range xs {
			weights[l] = av + abs32(v)
		}
		scales[j], mins[j] = makeQKX2(nmax, xs, weights[:], L[32*j:32*j+32], Laux[:], rmin, 0.1, nstep)
		if scales[j] > maxScale {
			maxScale = scales[j]
		}
		if mins[j] > maxMin {
			maxMin = mins[j]
		}
	}
	var invScale, invMin float32
	if maxScale > 0 {
		invScale = 63 / maxScale
	}
	if maxMin > 0 {
		invMin = 63 / maxMin
	}
	var ls, lm [8]uint8
	for j := range 8 {
		ls[j] = min(63, uint8(nearestInt(float32(invScale*scales[j]))))
		lm[j] = min(63, uint8(nearestInt(float32(invMin*mins[j]))))
	}
	sc := (*[12]byte)(b[4:])
	packScaleMinK4(sc, &ls, &lm)
	put16(b[0:], floatToHalf(maxScale/63))
	put16(b[2:], floatToHalf(maxMin/63))
	d, dmin := halfToFloat(le16(b[0:])), halfToFloat(le16(b[2:]))
	for j := range 8 {
		s, m := scaleMinK4(j, sc)
		dj := d * float32(s)
		if dj == 0 {
			continue
		}
		dm := dmin * float32(m)
		for ii := range 32 {
			l := nearestInt((x[32*j+ii] + dm) / dj)
			L[32*j+ii] = uint8(max(0, min(nmax, l)))
		}
	}
}

// QuantizeQ4_K encodes Q4_K super-blocks.
func QuantizeQ4_K(dst []byte, src []float32) {
	nb := mustBlocks(Q4_K, len(src), len(dst))
	var L [256]uint8
	for i := range nb {
		x := (*[256]float32)(src[256*i:])
		b := (*[144]byte)(dst[144*i:])
		quantizeKScaleMin(b[:], x, &L, 15, -1, 20)
		for g := range 4 {
			q := (*[32]byte)(b[16+32*g:])
			for l := range q {
				q[l] = L[64*g+l] | L[64*g+32+l]<<4
			}
		}
	}
}

// DequantizeQ5_K decodes Q5_K super-blocks.
func DequantizeQ5_K(dst []float32, src []byte) {
	nb := mustBlocks(Q5_K, len(dst), len(src))
	for i := range nb {
		b := (*[176]byte)(src[176*i:])
		y := (*[256]float32)(dst[256*i:])
		d, dmin := halfToFloat(le16(b[0:])), halfToFloat(le16(b[2:]))
		sc := (*[12]byte)(b[4:])
		qh := (*[32]byte)(b[16:])
		for g := range 4 {
			s1, m1 := scaleMinK4(2*g, sc)
			s2, m2 := scaleMinK4(2*g+1, sc)
			d1, dm1 := d*float32(s1), dmin*float32(m1)
			d2, dm2 := d*float32(s2), dmin*float32(m2)
			q := (*[32]byte)(b[48+32*g:])
			yy := (*[64]float32)(y[64*g:])
			sh := uint(2 * g)
			for l, v := range q {
				h := qh[l] >> sh
				yy[l] = float32(d1*q6Float[32+(v&0xf|(h&1)<<4)]) - dm1 // q6Float[32+q] is q
				yy[32+l] = float32(d2*q6Float[32+(v>>4|(h&2)<<3)]) - dm2
			}
		}
	}
}

// QuantizeQ5_K encodes Q5_K super-blocks.
func QuantizeQ5_K(dst []byte, src []float32) {
	nb := mustBlocks(Q5_K, len(src), len(dst))
	var L [256]uint8
	for i := range nb {
		x := (*[256]float32)(src[256*i:])
		b := (*[176]byte)(dst[176*i:])
		quantizeKScaleMin(b[:], x, &L, 31, -0.5, 15)
		qh := (*[32]byte)(b[16:])
		clear(qh[:])
		for g := range 4 {
			q := (*[32]byte)(b[48+32*g:])
			for l := range q {
				l1, l2 := L[64*g+l], L[64*g+32+l]
				if l1 > 15 {
					l1 -= 16
					qh[l] |= 1 << (2 * g)
				}
				if l2 > 15 {
					l2 -= 16
					qh[l] |= 2 << (2 * g)
				}
				q[l] = l1 | l2<<4
			}
		}
	}
}

// DequantizeQ6_K decodes Q6_K super-blocks.
func DequantizeQ6_K(dst []float32, src []byte) {
	nb := mustBlocks(Q6_K, len(dst), len(src))
	for i := range nb {
		b := (*[210]byte)(src[210*i:])
		y := (*[256]float32)(dst[256*i:])
		d := halfToFloat(le16(b[208:]))
		for h := range 2 {
			ql := (*[64]byte)(b[64*h:])
			qh := (*[32]byte)(b[128+32*h:])
			sc := (*[8]byte)(b[192+8*h:])
			yy := (*[128]float32)(y[128*h:])
			for l := range 32 {
				is := l / 16
				q1 := q6Float[ql[l]&0xf|(qh[l]&3)<<4]
				q2 := q6Float[ql[l+32]&0xf|(qh[l]>>2&3)<<4]
				q3 := q6Float[ql[l]>>4|(qh[l]>>4&3)<<4]
				q4 := q6Float[ql[l+32]>>4|(qh[l]>>6&3)<<4]
				yy[l] = float32(d*i8Float[sc[is]]) * q1
				yy[l+32] = float32(d*i8Float[sc[is+2]]) * q2
				yy[l+64] = float32(d*i8Float[sc[is+4]]) * q3
				yy[l+96] = float32(d*i8Float[sc[is+6]]) * q4
			}
		}
	}
}

// makeQX chooses the scale of one sub-block with signed levels -nmax..nmax-1
// weighted by x², searching 18 trial scales around nmax/max|x|: the
// reference's make_qx_quants with rmse_type 1 and no importance weights.
// L receives the levels offset by nmax.
func makeQX(nmax int, x []float32, L []uint8) float32 {
	L = L[:len(x)]
	var mx, amax float32
	for _, v := range x {
		if a := abs32(v); a > amax {
			amax, mx = a, v
		}
	}
	if amax < groupMaxEps {
		clear(L)
		return 0
	}
	fmax := float32(nmax)
	level := func(iscale, v float32) int { return max(-nmax, min(nmax-1, nearestInt(float32(iscale*v)))) }
	sums := func(iscale float32) (sumlx, suml2 float32) {
		for _, v := range x {
			fl := float32(level(iscale, v))
			w := float32(v * v)
			sumlx += float32(float32(w*v) * fl)
			suml2 += float32(float32(w*fl) * fl)
		}
		return sumlx, suml2
	}
	iscale := -fmax / mx
	for i, v := range x {
		L[i] = uint8(level(iscale, v) + nmax)
	}
	sumlx, suml2 := sums(iscale)
	var scale float32
	if suml2 != 0 {
		scale = sumlx / suml2
	}
	best := float32(scale * sumlx)
	for is := -9; is <= 9; is++ {
		if is == 0 {
			continue
		}
		iscale = -(fmax + float32(float32(0.1)*float32(is))) / mx
		sumlx, suml2 = sums(iscale)
		if suml2 > 0 && float32(sumlx*sumlx) > float32(best*suml2) {
			for i, v := range x {
				L[i] = uint8(level(iscale, v) + nmax)
			}
			scale = sumlx / suml2
			best = float32(scale * sumlx)
		}
	}
	return scale
}

// QuantizeQ6_K encodes Q6_K super-blocks.
func QuantizeQ6_K(dst []byte, src []float32) {
	nb := mustBlocks(Q6_K, len(src), len(dst))
	var L [256]uint8
	var scales [16]float32
	for i := range nb {
		x := (*[256]float32)(src[256*i:])
		b := (*[210]byte)(dst[210*i:])
		var maxScale, maxAbs float32
		for ib := range 16 {
			s := makeQX(32, x[16*ib:16*ib+16], L[16*ib:16*ib+16])
			scales[ib] = s
			if a := abs32(s); a > maxAbs {
				maxAbs, maxScale = a, s
			}
		}
		if maxAbs < groupMaxEps {
			clear(b[:])
			continue
		}
		iscale := -128 / maxScale
		put16(b[208:], floatToHalf(1/iscale))
		for ib := range 16 {
			b[192+ib] = byte(min(127, nearestInt(float32(iscale*scales[ib]))))
		}
		d := halfToFloat(le16(b[208:]))
		for j := range 16 {
			dj := d * float32(int8(b[192+j]))
			if dj == 0 {
				continue
			}
			for ii := range 16 {
				l := nearestInt(x[16*j+ii] / dj)
				L[16*j+ii] = uint8(max(-32, min(31, l)) + 32)
			}
		}
		for h := range 2 {
			ql := (*[64]byte)(b[64*h:])
			qh := (*[32]byte)(b[128+32*h:])
			Lh := (*[128]uint8)(L[128*h:])
			for l := range 32 {
				q1, q2, q3, q4 := Lh[l], Lh[l+32], Lh[l+64], Lh[l+96]
				ql[l] = q1&0xf | (q3&0xf)<<4
				ql[l+32] = q2&0xf | (q4&0xf)<<4
				qh[l] = q1>>4 | (q2>>4)<<2 | (q3>>4)<<4 | (q4>>4)<<6
			}
		}
	}
}

// DequantizeQ8_K decodes Q8_K super-blocks (the sums are not read).
func DequantizeQ8_K(dst []float32, src []byte) {
	nb := mustBlocks(Q8_K, len(dst), len(src))
	for i := range nb {
		b := (*[292]byte)(src[292*i:])
		y := (*[256]float32)(dst[256*i:])
		d := math.Float32frombits(binary.LittleEndian.Uint32(b[0:]))
		for j := range y {
			y[j] = d * i8Float[b[4+j]]
		}
	}
}

// QuantizeQ8_K encodes Q8_K super-blocks: d = -m/127 for the value m of
// largest magnitude, and the sums of each 16 quants.
func QuantizeQ8_K(dst []byte, src []float32) {
	nb := mustBlocks(Q8_K, len(src), len(dst))
	for i := range nb {
		x := (*[256]float32)(src[256*i:])
		b := (*[292]byte)(dst[292*i:])
		var mx, amax float32
		for _, v := range x {
			if a := abs32(v); a > amax {
				amax, mx = a, v
			}
		}
		if amax == 0 {
			clear(b[:])
			continue
		}
		iscale := -127 / mx
		for j, v := range x {
			b[4+j] = byte(int8(min(127, nearestInt(float32(iscale*v)))))
		}
		for g := range 16 {
			var s int
			for _, q := range b[4+16*g : 4+16*g+16] {
				s += int(int8(q))
			}
			binary.LittleEndian.PutUint16(b[260+2*g:], uint16(int16(s)))
		}
		binary.LittleEndian.PutUint32(b[0:], math.Float32bits(1/iscale))
	}
}

// DotQ4_KF32 is the dot product of a row of Q4_K super-blocks with x.
func DotQ4_KF32(row []byte, x []float32) float32 {
	nb := mustBlocks(Q4_K, len(x), len(row))
	var sum float32
	for i := range nb {
		b := (*[144]byte)(row[144*i:])
		v := (*[256]float32)(x[256*i:])
		d, dmin := halfToFloat(le16(b[0:])), halfToFloat(le16(b[2:]))
		sc := (*[12]byte)(b[4:])
		for g := range 4 {
			s1, m1 := scaleMinK4(2*g, sc)
			s2, m2 := scaleMinK4(2*g+1, sc)
			q := (*[32]byte)(b[16+32*g:])
			lo := (*[32]float32)(v[64*g:])
			hi := (*[32]float32)(v[64*g+32:])
			var a0, a1, a2, a3, t0, t1 float32
			for l := 0; l < 32; l += 2 {
				q0, q1 := &nibFloat[q[l]], &nibFloat[q[l+1]]
				a0 += q0[0] * lo[l]
				a1 += q1[0] * lo[l+1]
				a2 += q0[1] * hi[l]
				a3 += q1[1] * hi[l+1]
				t0 += lo[l] + lo[l+1]
				t1 += hi[l] + hi[l+1]
			}
			sum += d*(float32(s1)*(a0+a1)+float32(s2)*(a2+a3)) - dmin*(float32(m1)*t0+float32(m2)*t1)
		}
	}
	return sum
}

// DotQ5_KF32 is the dot product of a row of Q5_K super-blocks with x.
func DotQ5_KF32(row []byte, x []float32) float32 {
	nb := mustBlocks(Q5_K, len(x), len(row))
	var sum float32
	for i := range nb {
		b := (*[176]byte)(row[176*i:])
		v := (*[256]float32)(x[256*i:])
		d, dmin := halfToFloat(le16(b[0:])), halfToFloat(le16(b[2:]))
		sc := (*[12]byte)(b[4:])
		qh := (*[32]byte)(b[16:])
		for g := range 4 {
			s1, m1 := scaleMinK4(2*g, sc)
			s2, m2 := scaleMinK4(2*g+1, sc)
			q := (*[32]byte)(b[48+32*g:])
			lo := (*[32]float32)(v[64*g:])
			hi := (*[32]float32)(v[64*g+32:])
			sh := uint(2 * g)
			var a0, a1, t0, t1 float32
			for l := range 32 {
				h := qh[l] >> sh
				a0 += q6Float[32+(q[l]&0xf|(h&1)<<4)] * lo[l]
				a1 += q6Float[32+(q[l]>>4|(h&2)<<3)] * hi[l]
				t0 += lo[l]
				t1 += hi[l]
			}
			sum += d*(float32(s1)*a0+float32(s2)*a1) - dmin*(float32(m1)*t0+float32(m2)*t1)
		}
	}
	return sum
}

// DotQ6_KF32 is the dot product of a row of Q6_K super-blocks with x.
func DotQ6_KF32(row []byte, x []float32) float32 {
	nb := mustBlocks(Q6_K, len(x), len(row))
	var sum float32
	for i := range nb {
		b := (*[210]byte)(row[210*i:])
		d := halfToFloat(le16(b[208:]))
		var block float32
		for h := range 2 {
			ql := (*[64]byte)(b[64*h:])
			qh := (*[32]byte)(b[128+32*h:])
			sc := (*[8]byte)(b[192+8*h:])
			v := (*[128]float32)(x[256*i+128*h:])
			for half := range 2 { // elements l in [16*half, 16*half+16) share scales
				var a1, a2, a3, a4 float32
				for l := 16 * half; l < 16*half+16; l++ {
					a1 += q6Float[ql[l]&0xf|(qh[l]&3)<<4] * v[l]
					a2 += q6Float[ql[l+32]&0xf|(qh[l]>>2&3)<<4] * v[l+32]
					a3 += q6Float[ql[l]>>4|(qh[l]>>4&3)<<4] * v[l+64]
					a4 += q6Float[ql[l+32]>>4|(qh[l]>>6&3)<<4] * v[l+96]
				}
				block += i8Float[sc[half]]*a1 + i8Float[sc[half+2]]*a2 +
					i8Float[sc[half+4]]*a3 + i8Float[sc[half+6]]*a4
			}
		}
		sum += d * block
	}
	return sum
}
