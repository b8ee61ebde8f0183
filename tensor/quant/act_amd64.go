//go:build amd64 && !purego

package quant

import "unsafe"

// The activations' quantization in act_amd64.s, for blocks whose length
// is a multiple of 16 (every activation format's).

//go:noescape
func maxAbsBitsAVX2(x *float32, n int) uint32

//go:noescape
func roundActAVX2(q *byte, x *float32, n int, id float32)

//go:noescape
func groupSumsAVX2(q *byte, dst *byte, groups int)

// maxAbsBits returns the largest of x's bits with the sign cleared: as
// integers they order the magnitudes, and a NaN or an infinity is at
// least 0x7f800000.
func maxAbsBits(x []float32) uint32 {
	if hasAVX2 && len(x) > 0 && len(x)%16 == 0 {
		return maxAbsBitsAVX2(&x[0], len(x))
	}
	return maxAbsBitsGo(x)
}

// roundAct sets the int16 quants q to x[j]·id rounded to the nearest
// integer, ties to even; |x[j]·id| is at most ActMax plus rounding.
func roundAct(q []byte, x []float32, id float32) {
	if hasAVX2 && len(x) > 0 && len(x)%16 == 0 {
		_ = q[2*len(x)-1]
		roundActAVX2((*byte)(unsafe.Pointer(&q[0])), &x[0], len(x), id)
		return
	}
	roundActGo(q, x, id)
}

// groupSums writes to dst, as little-endian int32s, the sums of the int16
// quants of q by groups of 32.
func groupSums(dst, q []byte) {
	groups := len(q) / 64
	if hasAVX2 && groups > 0 {
		_, _ = q[64*groups-1], dst[4*groups-1]
		groupSumsAVX2(&q[0], &dst[0], groups)
		return
	}
	groupSumsGo(dst, q)
}
