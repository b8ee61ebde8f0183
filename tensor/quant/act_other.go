//go:build !amd64 || purego

package quant

// maxAbsBits returns the largest of x's bits with the sign cleared: as
// integers they order the magnitudes, and a NaN or an infinity is at
// least 0x7f800000.
func maxAbsBits(x []float32) uint32 { return maxAbsBitsGo(x) }

// roundAct sets the int16 quants q to x[j]·id rounded to the nearest
// integer, ties to even; |x[j]·id| is at most ActMax plus rounding.
func roundAct(q []byte, x []float32, id float32) { roundActGo(q, x, id) }

// groupSums writes to dst, as little-endian int32s, the sums of the int16
// quants of q by groups of 32.
func groupSums(dst, q []byte) { groupSumsGo(dst, q) }
