package tensor

import (
	"encoding/binary"
	"math"
)

// FirstNonFinite returns the index of the first element of data, read as
// little-endian values of dt, that is a NaN or an infinity, or -1 when there
// is none. Integer dtypes have no such values and give -1; a trailing
// partial element is ignored.
//
// It runs at memory speed: eight bytes at a time, the exponent field of
// every element in the word tested at once (an element is not finite
// exactly when its exponent bits are all set), falling back to one element
// at a time only to place a hit and for the last few bytes.
func FirstNonFinite(dt DType, data []byte) int {
	var k swarMask
	switch dt {
	case F16:
		k = f16Mask
	case BF16:
		k = bf16Mask
	case F32:
		k = f32Mask
	default:
		return -1
	}
	size := dt.Size()
	data = data[:len(data)/size*size]
	start := k.firstBlock(data)
	for i := start; i+size <= len(data); i += size {
		if k.scalar(data[i:]) {
			return i / size
		}
	}
	return -1
}

// IsNonFinite reports whether the element at data[0:dt.Size()] is a NaN or
// an infinity; integer dtypes never are.
func IsNonFinite(dt DType, data []byte) bool {
	switch dt {
	case F16:
		return f16Mask.scalar(data)
	case BF16:
		return bf16Mask.scalar(data)
	case F32:
		return f32Mask.scalar(data)
	}
	return false
}

// ElementF64 returns element i of data, read as little-endian values of the
// float dtype dt, as a float64 (NaN payloads are not kept). It panics for
// other dtypes.
func ElementF64(dt DType, data []byte, i int) float64 {
	switch dt {
	case F16:
		return float64(F16ToF32One(binary.LittleEndian.Uint16(data[2*i:])))
	case BF16:
		return float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(data[2*i:])) << 16))
	case F32:
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:])))
	}
	panic("tensor: ElementF64 of " + dt.String())
}

// swarMask holds, for one float format, the exponent field repeated in
// every lane of a 64-bit word (exp), the lowest exponent bit of every lane
// (inc) and every lane's top bit (top). For a lane holding e = x & exp,
// e + inc reaches the lane's top bit exactly when every exponent bit is set,
// and never carries into the next lane, so
//
//	((x & exp) + inc) & top != 0
//
// says that some element of the word is not finite. The exponent field
// ends just below the sign bit in each format, which makes this work.
type swarMask struct {
	exp, inc, top uint64
	lane          int // bytes per element
}

var (
	f16Mask  = swarMask{exp: 0x7c00_7c00_7c00_7c00, inc: 0x0400_0400_0400_0400, top: 0x8000_8000_8000_8000, lane: 2}
	bf16Mask = swarMask{exp: 0x7f80_7f80_7f80_7f80, inc: 0x0080_0080_0080_0080, top: 0x8000_8000_8000_8000, lane: 2}
	f32Mask  = swarMask{exp: 0x7f800000_7f800000, inc: 0x00800000_00800000, top: 0x80000000_80000000, lane: 4}
)

// firstBlock returns the offset of the first 64-byte block of data that
// holds a non-finite element, the offset of the tail shorter than a block
// when no full block does, or len(data) when data is a whole number of
// clean blocks. Blocks start at multiples of 64, so at element boundaries.
func (k swarMask) firstBlock(data []byte) int {
	exp, inc, top := k.exp, k.inc, k.top
	off := 0
	for b := data; len(b) >= 64; b = b[64:] {
		_ = b[63]
		w := (binary.LittleEndian.Uint64(b[0:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[8:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[16:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[24:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[32:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[40:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[48:])&exp + inc) |
			(binary.LittleEndian.Uint64(b[56:])&exp + inc)
		if w&top != 0 {
			return off
		}
		off += 64
	}
	return off
}

// scalar tests the one element at the start of b.
func (k swarMask) scalar(b []byte) bool {
	if k.lane == 2 {
		e := uint16(k.exp)
		return binary.LittleEndian.Uint16(b)&e == e
	}
	e := uint32(k.exp)
	return binary.LittleEndian.Uint32(b)&e == e
}
