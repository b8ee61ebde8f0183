package tensor

import (
	"math"

	"github.com/x448/float16"
)

// F16ToF32 converts IEEE half-precision words to float32. len(dst) >= len(src).
func F16ToF32(dst []float32, src []uint16) {
	for i, h := range src {
		dst[i] = f16ToF32Table[h]
	}
}

// F32ToF16 converts float32 to IEEE half precision, rounding to nearest even
// (with F16C instructions where the processor has them).
func F32ToF16(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	m := 0
	if hasAVX2 { // F16C comes with the AVX2 kernels
		m = len(src) &^ 7
		if m > 0 {
			cvtF32ToF16AVX2(&dst[0], &src[0], m)
		}
	}
	f32ToF16Go(dst[m:], src[m:])
}

// f32ToF16Go is the portable F32ToF16.
func f32ToF16Go(dst []uint16, src []float32) {
	for i, f := range src {
		dst[i] = uint16(float16.Fromfloat32(f))
	}
}

// BF16ToF32 converts bfloat16 words to float32 (exact: a 16-bit shift).
func BF16ToF32(dst []float32, src []uint16) {
	for i, h := range src {
		dst[i] = math.Float32frombits(uint32(h) << 16)
	}
}

// F32ToBF16 converts float32 to bfloat16, rounding to nearest even; NaN stays NaN.
func F32ToBF16(dst []uint16, src []float32) {
	for i, f := range src {
		dst[i] = BF16FromF32(f)
	}
}

// BF16FromF32 converts one float32 to bfloat16, rounding to nearest even.
func BF16FromF32(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it quiet and NaN
		return uint16(b>>16) | 0x40
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// F16FromF32 converts one float32 to IEEE half precision.
func F16FromF32(f float32) uint16 { return uint16(float16.Fromfloat32(f)) }

// F16ToF32One converts one IEEE half-precision word to float32.
func F16ToF32One(h uint16) float32 { return f16ToF32Table[h] }

// f16ToF32Table maps every half-precision word to its float32 value: 256 KiB
// that turn the conversion in the matrix-product inner loop into one load.
var f16ToF32Table = func() *[1 << 16]float32 {
	var t [1 << 16]float32
	for i := range t {
		t[i] = float16.Frombits(uint16(i)).Float32()
	}
	return &t
}()
