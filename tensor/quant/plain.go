package quant

import (
	"encoding/binary"
	"math"
)

// The plain types of the GGUF table: one element per "block", stored
// little-endian. Dequantize widens them exactly; Quantize rounds to nearest
// even (F16 overflows to infinity, which the checked Quantize refuses).

var (
	codecF32  = codec{DequantizeF32, QuantizeF32, dotF32Bytes, nil}
	codecF16  = codec{DequantizeF16, QuantizeF16, func(r []byte, x []float32) float32 { return dotVia(F16, DequantizeF16, r, x) }, halfOK}
	codecBF16 = codec{DequantizeBF16, QuantizeBF16, func(r []byte, x []float32) float32 { return dotVia(BF16, DequantizeBF16, r, x) }, bf16OK}
)

// DequantizeF32 decodes little-endian float32 bytes.
func DequantizeF32(dst []float32, src []byte) {
	n := mustBlocks(F32, len(dst), len(src))
	for i := range n {
		dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
	}
}

// QuantizeF32 encodes float32 values as little-endian bytes.
func QuantizeF32(dst []byte, src []float32) {
	n := mustBlocks(F32, len(src), len(dst))
	for i := range n {
		binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(src[i]))
	}
}

// DequantizeF16 widens little-endian half-precision words.
func DequantizeF16(dst []float32, src []byte) {
	n := mustBlocks(F16, len(dst), len(src))
	for i := range n {
		dst[i] = halfToFloat(le16(src[2*i:]))
	}
}

// QuantizeF16 rounds float32 values to half precision.
func QuantizeF16(dst []byte, src []float32) {
	n := mustBlocks(F16, len(src), len(dst))
	for i := range n {
		put16(dst[2*i:], floatToHalf(src[i]))
	}
}

// DequantizeBF16 widens little-endian bfloat16 words.
func DequantizeBF16(dst []float32, src []byte) {
	n := mustBlocks(BF16, len(dst), len(src))
	for i := range n {
		dst[i] = bf16ToFloat(le16(src[2*i:]))
	}
}

// QuantizeBF16 rounds float32 values to bfloat16.
func QuantizeBF16(dst []byte, src []float32) {
	n := mustBlocks(BF16, len(src), len(dst))
	for i := range n {
		put16(dst[2*i:], floatToBF16(src[i]))
	}
}

// bf16OK reports whether the bfloat16 word at b[0:2] is finite.
func bf16OK(b []byte) bool { return le16(b)&0x7f80 != 0x7f80 }

func dotF32Bytes(row []byte, x []float32) float32 {
	n := mustBlocks(F32, len(x), len(row))
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= n; i += 4 {
		b := (*[16]byte)(row[4*i:])
		s0 += math.Float32frombits(binary.LittleEndian.Uint32(b[0:])) * x[i]
		s1 += math.Float32frombits(binary.LittleEndian.Uint32(b[4:])) * x[i+1]
		s2 += math.Float32frombits(binary.LittleEndian.Uint32(b[8:])) * x[i+2]
		s3 += math.Float32frombits(binary.LittleEndian.Uint32(b[12:])) * x[i+3]
	}
	for ; i < n; i++ {
		s0 += math.Float32frombits(binary.LittleEndian.Uint32(row[4*i:])) * x[i]
	}
	return (s0 + s1) + (s2 + s3)
}

// dotVia is the dot product of any supported type by way of dequantizing
// one block at a time (or 256 elements of a plain type).
func dotVia(t Type, dequantize func([]float32, []byte), row []byte, x []float32) float32 {
	bs, bb := t.BlockSize(), t.BlockBytes()
	step := QKK / bs // elements per chunk: 256 for every supported type
	if step < 1 {
		step = 1
	}
	n := mustBlocks(t, len(x), len(row))
	var buf [QKK]float32
	var sum float32
	for b := 0; b < n; b += step {
		k := min(step, n-b)
		w := buf[:k*bs]
		dequantize(w, row[b*bb:(b+k)*bb])
		sum += dot32(w, x[b*bs:(b+k)*bs])
	}
	return sum
}

// dot32 is the float32 dot product of a and b[:len(a)].
func dot32(a, b []float32) float32 {
	b = b[:len(a)]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(a); i += 4 {
		s0 += a[i] * b[i]
		s1 += a[i+1] * b[i+1]
		s2 += a[i+2] * b[i+2]
		s3 += a[i+3] * b[i+3]
	}
	for ; i < len(a); i++ {
		s0 += a[i] * b[i]
	}
	return (s0 + s1) + (s2 + s3)
}
