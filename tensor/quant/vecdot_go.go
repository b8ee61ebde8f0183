package quant

import "encoding/binary"

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

// chunkLanes adds to lane the products of the 32 weight levels w of one
// chunk with its 32 activation quants at x (64 bytes), the first 16
// products times sa and the last 16 times sb: lane k receives elements 2k,
// 2k+1, 16+2k and 17+2k. The arithmetic is int32's, wrapping as the
// kernels' does (on QuantizeRow's output nothing wraps).
func chunkLanes(lane *[8]int32, w *[32]int32, x []byte, sa, sb int32) {
	c := (*[64]byte)(x)
	for k := range 8 {
		lo, hi := c[4*k:4*k+4], c[32+4*k:32+4*k+4]
		a := w[2*k]*int32(int16(uint16(lo[0])|uint16(lo[1])<<8)) + w[2*k+1]*int32(int16(uint16(lo[2])|uint16(lo[3])<<8))
		b := w[16+2*k]*int32(int16(uint16(hi[0])|uint16(hi[1])<<8)) + w[17+2*k]*int32(int16(uint16(hi[2])|uint16(hi[3])<<8))
		lane[k] += sa*a + sb*b
	}
}

// chunkSums sets s[k] to the sum of the activation quants of lane k of
// one chunk.
func chunkSums(s *[8]int32, x []byte) {
	c := (*[64]byte)(x)
	for k := range 8 {
		lo, hi := c[4*k:4*k+4], c[32+4*k:32+4*k+4]
		s[k] = int32(int16(uint16(lo[0])|uint16(lo[1])<<8)) + int32(int16(uint16(lo[2])|uint16(lo[3])<<8)) +
			int32(int16(uint16(hi[0])|uint16(hi[1])<<8)) + int32(int16(uint16(hi[2])|uint16(hi[3])<<8))
	}
}

// actBlocks returns the number of blocks of a row of activations xq in
// format a.
func actBlocks(a actFormat, xq []byte) int { return len(xq) / a.blockBytes() }

// dotQ8_0Go: Q8_0 weights. A block's 32 products are summed into one
// int32 (exact: at most 32·128·32768 in magnitude), which goes as a whole
// to accumulator i mod 8 of block i (doc.go).
func dotQ8_0Go(w, xq []byte) float32 {
	var acc [8]float32
	nb := actBlocks(act32, xq)
	for i := range nb {
		b := (*[34]byte)(w[34*i:])
		c := (*[64]byte)(xq[64*i:])
		var t int32
		for e := range 32 {
			t += int32(int8(b[2+e])) * int32(int16(uint16(c[2*e])|uint16(c[2*e+1])<<8))
		}
		dd := float32(halfToFloat(le16(b[:])) * actScale(act32, xq, nb, i))
		acc[i%8] += float32(float32(t) * dd)
	}
	return hsum8(&acc)
}

// nibbles32 unpacks the 16 bytes of a 32-element block's nibbles into the
// element order (byte j holds element j low and j+16 high), less off.
func nibbles32(dst *[32]int32, q []byte, off int32) {
	q = q[:16]
	for j, v := range q {
		dst[j] = int32(v&15) - off
		dst[j+16] = int32(v>>4) - off
	}
}

// fifthBits adds the fifth bits of a Q5 block (bit e of the little-endian
// word qh is the top bit of element e) to the levels in q.
func fifthBits(q *[32]int32, qh []byte) {
	h := binary.LittleEndian.Uint32(qh)
	for e := range q {
		q[e] += int32(h>>e&1) << 4
	}
}

// dotQ4_0Go: Q4_0 weights (level - 8).
func dotQ4_0Go(w, xq []byte) float32 {
	var acc [8]float32
	var q [32]int32
	nb := actBlocks(act32, xq)
	for i := range nb {
		b := (*[18]byte)(w[18*i:])
		nibbles32(&q, b[2:], 8)
		var lane [8]int32
		chunkLanes(&lane, &q, xq[64*i:], 1, 1)
		addLanes(&acc, &lane, float32(halfToFloat(le16(b[:]))*actScale(act32, xq, nb, i)))
	}
	return hsum8(&acc)
}

// dotQ5_0Go: Q5_0 weights (level - 16).
func dotQ5_0Go(w, xq []byte) float32 {
	var acc [8]float32
	var q [32]int32
	nb := actBlocks(act32, xq)
	for i := range nb {
		b := (*[22]byte)(w[22*i:])
		nibbles32(&q, b[6:], 16)
		fifthBits(&q, b[2:])
		var lane [8]int32
		chunkLanes(&lane, &q, xq[64*i:], 1, 1)
		addLanes(&acc, &lane, float32(halfToFloat(le16(b[:]))*actScale(act32, xq, nb, i)))
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

// dotMinGo is the product of Q4_1 or Q5_1 weights (d·level + m): blocks
// of bb bytes, the nibbles in their last 16 bytes and, for Q5_1 (fifth),
// the fifth bits from byte 4.
func dotMinGo(w, xq []byte, bb int, fifth bool) float32 {
	var acc [8]float32
	var q [32]int32
	var s [8]int32
	nb := actBlocks(act32, xq)
	for i := range nb {
		b := w[bb*i : bb*(i+1)]
		nibbles32(&q, b[bb-16:], 0)
		if fifth {
			fifthBits(&q, b[4:])
		}
		var lane [8]int32
		chunkLanes(&lane, &q, xq[64*i:], 1, 1)
		chunkSums(&s, xq[64*i:])
		dx := actScale(act32, xq, nb, i)
		addLanesMin(&acc, &lane, &s, float32(halfToFloat(le16(b[0:]))*dx), float32(halfToFloat(le16(b[2:]))*dx))
	}
	return hsum8(&acc)
}

func dotQ4_1Go(w, xq []byte) float32 { return dotMinGo(w, xq, 20, false) }

func dotQ5_1Go(w, xq []byte) float32 { return dotMinGo(w, xq, 24, true) }

// kScales returns a Q4_K or Q5_K super-block's scales d·dx and dmin·dx.
func kScales(b []byte, dx float32) (dd, dm float32) {
	return float32(halfToFloat(le16(b[0:])) * dx), float32(halfToFloat(le16(b[2:])) * dx)
}

// addLanesK adds one Q4_K or Q5_K super-block's lanes and takes its min
// terms away: acc[k] = (acc[k] + lane[k]·dd) - mlane[k]·dm.
func addLanesK(acc *[8]float32, lane, mlane *[8]int32, dd, dm float32) {
	for k := range acc {
		acc[k] = acc[k] + float32(float32(lane[k])*dd) - float32(float32(mlane[k])*dm)
	}
}

// dotQ45_KGo is the product of Q4_K or Q5_K weights (super-blocks of bb
// bytes, 4-bit levels from byte 16+qoff on, the fifth bits at 16 for
// Q5_K): sub-block j's lanes times its 6-bit scale, and mlane[j] its
// 6-bit min times the activation sum of sub-block j. Group g of 32 bytes
// holds sub-block 2g in its low nibbles and 2g+1 in its high; the fifth
// bit of element l of sub-block j is bit j of qh[l].
func dotQ45_KGo(w, xq []byte, bb, qoff int, fifth bool) float32 {
	var acc [8]float32
	var q0, q1 [32]int32
	nb := actBlocks(actK, xq)
	for i := range nb {
		b := w[bb*i : bb*(i+1)]
		dd, dm := kScales(b, actScale(actK, xq, nb, i))
		sc := (*[12]byte)(b[4:])
		qh := (*[32]byte)(b[16:])
		var lane, mlane [8]int32
		for g := range 4 {
			qs := (*[32]byte)(b[16+qoff+32*g:])
			for l, v := range qs {
				q0[l], q1[l] = int32(v&15), int32(v>>4)
			}
			if fifth {
				for l, h := range qh {
					q0[l] += int32(h>>(2*g)&1) << 4
					q1[l] += int32(h>>(2*g+1)&1) << 4
				}
			}
			s0, m0 := scaleMinK4(2*g, sc)
			s1, m1 := scaleMinK4(2*g+1, sc)
			mlane[2*g] = int32(m0) * actSum(xq, nb, i, 2*g)
			mlane[2*g+1] = int32(m1) * actSum(xq, nb, i, 2*g+1)
			x := xq[2*(256*i+64*g):]
			chunkLanes(&lane, &q0, x, int32(s0), int32(s0))
			chunkLanes(&lane, &q1, x[64:], int32(s1), int32(s1))
		}
		addLanesK(&acc, &lane, &mlane, dd, dm)
	}
	return hsum8(&acc)
}

func dotQ4_KGo(w, xq []byte) float32 { return dotQ45_KGo(w, xq, 144, 0, false) }

func dotQ5_KGo(w, xq []byte) float32 { return dotQ45_KGo(w, xq, 176, 32, true) }

// dotQ6_KGo: Q6_K weights (level - 32). In half h of a super-block,
// element l of chunk 4h+c (l < 32) has its low four bits in ql[64h+l]
// (c = 0, low nibble), ql[64h+32+l] (c = 1), ql[64h+l] (c = 2, high
// nibble) or ql[64h+32+l] (c = 3), and its top two bits at offset 2c of
// qh[32h+l]; element i of the super-block has the signed scale sc[i/16].
func dotQ6_KGo(w, xq []byte) float32 {
	var acc [8]float32
	var q [4][32]int32
	nb := actBlocks(actK, xq)
	for i := range nb {
		b := (*[210]byte)(w[210*i:])
		dd := float32(halfToFloat(le16(b[208:])) * actScale(actK, xq, nb, i))
		var lane [8]int32
		for h := range 2 {
			ql := (*[64]byte)(b[64*h:])
			qh := (*[32]byte)(b[128+32*h:])
			for l, t := range qh {
				lo, hi := ql[l], ql[32+l]
				q[0][l] = int32(lo&15|t&3<<4) - 32
				q[1][l] = int32(hi&15|t>>2&3<<4) - 32
				q[2][l] = int32(lo>>4|t>>4&3<<4) - 32
				q[3][l] = int32(hi>>4|t>>6<<4) - 32
			}
			for c := range 4 {
				ch := 4*h + c
				sa, sb := int32(int8(b[192+2*ch])), int32(int8(b[192+2*ch+1]))
				chunkLanes(&lane, &q[c], xq[2*(256*i+32*ch):], sa, sb)
			}
		}
		addLanes(&acc, &lane, dd)
	}
	return hsum8(&acc)
}
