package quant

import "math"

// Q8B8 is strata's 8-bit format of a KV cache (tensor.Q8_B8), not a ggml
// type: blocks of QB8 values, each block an F16 scale d and QB8 int8
// values q (BlockBytesQ8B8 bytes), a value being d*q. Blocks of 8 rather
// than Q8_0's 32 follow each head's values more closely: on the
// synthesised TinyLlama-1.1B shape the logits' relative RMS error against
// an F16 cache is 0.89% where Q8_0 gives 1.23% (the error is the values',
// which an absmax of 8 Gaussian values keeps smaller than one of 32).
const (
	QB8            = 8
	BlockBytesQ8B8 = 2 + QB8
)

// QuantizeQ8B8 encodes len(src)/QB8 blocks into dst (BlockBytesQ8B8 a
// block): d = max|x|/127 rounded to F16, q = round(x/d) with the
// reciprocal of the rounded d (ties away from zero, clamped to
// [-127, 127], a NaN to -127); a block of zeros has d = 0 and q = 0. It panics unless
// src is whole blocks and dst their bytes.
func QuantizeQ8B8(dst []byte, src []float32) {
	nb := len(src) / QB8
	if len(src)%QB8 != 0 || len(dst) != nb*BlockBytesQ8B8 {
		panic("quant: QuantizeQ8B8: lengths are not matching whole blocks")
	}
	for i := range nb {
		x := (*[QB8]float32)(src[QB8*i:])
		b := (*[BlockBytesQ8B8]byte)(dst[BlockBytesQ8B8*i:])
		var amax float32
		for _, v := range x {
			if a := abs32(v); !(amax > a) {
				amax = a
			}
		}
		h := floatToHalf(amax / 127)
		put16(b[:], h)
		var id float32
		if d := halfToFloat(h); d != 0 {
			id = 1 / d
		}
		for j, v := range x {
			// Clamped as the CUDA append's fminf(fmaxf(q, -127), 127)
			// does, a NaN to -127.
			q := math.Round(float64(v * id))
			if !(q >= -127) {
				q = -127
			} else if q > 127 {
				q = 127
			}
			b[2+j] = byte(int8(q))
		}
	}
}

// DequantizeQ8B8 decodes the blocks of src into dst (QB8 values a block).
// It panics unless they are matching whole blocks.
func DequantizeQ8B8(dst []float32, src []byte) {
	nb := len(dst) / QB8
	if len(dst)%QB8 != 0 || len(src) != nb*BlockBytesQ8B8 {
		panic("quant: DequantizeQ8B8: lengths are not matching whole blocks")
	}
	for i := range nb {
		b := (*[BlockBytesQ8B8]byte)(src[BlockBytesQ8B8*i:])
		y := (*[QB8]float32)(dst[QB8*i:])
		d := halfToFloat(le16(b[:]))
		for j := range y {
			y[j] = i8Float[b[2+j]] * d
		}
	}
}
