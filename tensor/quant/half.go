package quant

import (
	"math"

	"github.com/x448/float16"
)

// halfToFloat converts an IEEE half-precision word to float32 exactly,
// without touching float32 subnormals (slow on some processors): a normal
// half moves into the float32 fields and is rescaled by 2^-112, the
// difference of the exponent biases (which leaves infinities and NaNs as
// they are, NaNs quieted); a subnormal half m*2^-24 is read as the float
// 0.5 + m*2^-24 and 0.5 is taken away.
func halfToFloat(h uint16) float32 {
	w := uint32(h) << 17 // exponent and mantissa at the top, no sign
	var mag float32
	if w >= 1<<27 {
		mag = math.Float32frombits(w>>4+0x70000000) * 0x1p-112
	} else {
		mag = math.Float32frombits(w>>17|0x3f000000) - 0.5
	}
	return math.Float32frombits(uint32(h&0x8000)<<16 | math.Float32bits(mag))
}

// floatToHalf converts float32 to half precision, rounding to nearest even;
// values beyond the half range become infinities.
func floatToHalf(f float32) uint16 { return uint16(float16.Fromfloat32(f)) }

// bf16ToFloat widens a bfloat16 word (exact).
func bf16ToFloat(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// floatToBF16 rounds float32 to bfloat16, to nearest even; a NaN stays a
// (quiet) NaN.
func floatToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

func abs32(x float32) float32 { return math.Float32frombits(math.Float32bits(x) &^ (1 << 31)) }

// nearestInt rounds to the nearest integer, ties to even, by the float
// trick the reference quantizers use: adding 1.5*2^23 leaves the integer in
// the low mantissa bits. Valid for |f| <= 2^22-1; outside that (and for NaN)
// the result is what the reference computes: some integer, which callers
// clamp.
func nearestInt(f float32) int {
	v := float32(f) + 12582912 // the conversion keeps a caller's product from fusing into this add
	return int(math.Float32bits(v)&0x007fffff) - 0x00400000
}
