package quant

import (
	"encoding/binary"
	"fmt"
	"math"
)

// The activations of the integer products: QuantizeRow's output. Each
// block of x (32 elements for the 32-element weight formats, 256 for the
// K formats: the weights' block) is stored as 16-bit integer quants q with
// one F32 scale d, x ≈ q·d, d = max|x|/ActMax and q = x·(ActMax/max|x|)
// rounded to the nearest integer, ties to even. A row of nb blocks of bs
// elements holds, in order:
//
//   - the quants of every block, nb·bs little-endian int16 values in the
//     order of the elements;
//   - for each block, its F32 scale d, followed for the K formats by eight
//     int32 sums: sum j is that of the quants of elements 32j..32j+31 (the
//     Q4_K and Q5_K weights' sub-block j, whose min multiplies it).
//
// Keeping the quants apart keeps a block's 64 or 512 bytes of them on whole
// cache lines of an aligned buffer.
//
// The rounding error of an activation is at most half a step, d/2 =
// max|x|/32766: 1/128 of that of ggml's 8-bit quants (Q8_0 and Q8_K round
// to steps of max|x|/127), which is what a product's error scales with.

// ActMax is the largest magnitude of an activation quant, 2^14-1. It
// leaves every integer sum of the kernels within int32: a lane of a Q6_K
// super-block adds 32 products of an activation quant and a weight of at
// most 32·128 (a level less its offset times a sub-block scale), and
// 32·4096·16383 < 2^31.
const ActMax = 1<<14 - 1

// actFormat describes the activations of one family of weight types.
type actFormat struct {
	block int  // elements per block
	sums  bool // each block's scale is followed by eight int32 sums
}

var (
	act32 = actFormat{block: 32}
	actK  = actFormat{block: 256, sums: true}
)

// tailBytes is the size of a block's scale and sums.
func (a actFormat) tailBytes() int {
	if a.sums {
		return 36
	}
	return 4
}

// blockBytes is the size of one block: its quants, scale and sums.
func (a actFormat) blockBytes() int { return 2*a.block + a.tailBytes() }

// actOf returns the activation format of weights of type t.
func actOf(t Type) (actFormat, bool) {
	switch t {
	case Q4_0, Q4_1, Q5_0, Q5_1, Q8_0:
		return act32, true
	case Q4_K, Q5_K, Q6_K:
		return actK, true
	}
	return actFormat{}, false
}

// IntegerProduct reports whether weights of type t have an integer
// product (QuantizeRow, VecDot, GEMV): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
// Q5_K and Q6_K. Multiply others with DotF32.
func IntegerProduct(t Type) bool {
	_, ok := actOf(t)
	return ok
}

// ActivationBytes returns the size of QuantizeRow's output for n
// activations multiplied with weights of type t: n must be a positive
// whole number of the weights' blocks.
func ActivationBytes(t Type, n int) (int, error) {
	a, ok := actOf(t)
	if !ok {
		return 0, noIntegerProduct("activation bytes", t)
	}
	if n <= 0 || n%a.block != 0 {
		return 0, fmt.Errorf("quant: activations for %v: %d elements is not a positive whole number of %d-element blocks: %w", t, n, a.block, ErrLength)
	}
	return n / a.block * a.blockBytes(), nil
}

// QuantizeRow quantizes the activations x for a product with weights of
// type t into xq (ActivationBytes(t, len(x)) bytes). Activations holding a
// NaN or an infinity are refused with an error wrapping ErrNotFinite, so
// that a product never hides them.
func QuantizeRow(t Type, xq []byte, x []float32) error {
	a, ok := actOf(t)
	if !ok {
		return noIntegerProduct("quantize row", t)
	}
	want, err := ActivationBytes(t, len(x))
	if err != nil {
		return err
	}
	if len(xq) != want {
		return fmt.Errorf("quant: quantize row for %v: %d elements need %d bytes, have %d: %w", t, len(x), want, len(xq), ErrLength)
	}
	if i := quantizeAct(a, xq, x); i >= 0 {
		return fmt.Errorf("quant: quantize row for %v: element %d is %v: %w", t, i, x[i], ErrNotFinite)
	}
	return nil
}

// DequantizeRow decodes QuantizeRow's output xq for weights of type t into
// x: the activations exactly as the integer product multiplies them.
func DequantizeRow(t Type, x []float32, xq []byte) error {
	a, ok := actOf(t)
	if !ok {
		return noIntegerProduct("dequantize row", t)
	}
	want, err := ActivationBytes(t, len(x))
	if err != nil {
		return err
	}
	if len(xq) != want {
		return fmt.Errorf("quant: dequantize row for %v: %d elements need %d bytes, have %d: %w", t, len(x), want, len(xq), ErrLength)
	}
	nb := len(x) / a.block
	for i := range nb {
		d := actScale(a, xq, nb, i)
		for e := i * a.block; e < (i+1)*a.block; e++ {
			x[e] = float32(actQuant(xq, e)) * d
		}
	}
	return nil
}

// actQuant returns quant e of a row.
func actQuant(xq []byte, e int) int16 { return int16(le16(xq[2*e:])) }

// actTail returns the scale and sums of block i of a row of nb blocks.
func actTail(a actFormat, xq []byte, nb, i int) []byte {
	off := 2*a.block*nb + a.tailBytes()*i
	return xq[off : off+a.tailBytes()]
}

// actScale returns the scale of block i of a row of nb blocks.
func actScale(a actFormat, xq []byte, nb, i int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(actTail(a, xq, nb, i)))
}

// actSum returns sum j of block i of a row of nb K-format blocks.
func actSum(xq []byte, nb, i, j int) int32 {
	return int32(binary.LittleEndian.Uint32(actTail(actK, xq, nb, i)[4+4*j:]))
}

// roundMagic is 1.5·2^23: for |p| < 2^22, float32(p + roundMagic) -
// roundMagic is p rounded to an integer, ties to even.
const roundMagic = 12582912

// tinyAmax is the smallest block maximum whose ActMax/amax is finite in
// float32 (ActMax/MaxFloat32 rounded up); a block below it is scaled in
// float64.
var tinyAmax = float32(ActMax / math.MaxFloat32 * (1 + 1e-6))

// quantizeAct writes the blocks of x in format a to xq, whose length the
// caller checked. It returns -1, or the index of the first element that
// is a NaN or an infinity, leaving xq partly written.
func quantizeAct(a actFormat, xq []byte, x []float32) int {
	nb := len(x) / a.block
	for i := range nb {
		blk := x[i*a.block : (i+1)*a.block]
		mbits := maxAbsBits(blk) // the largest magnitude's bits: integer order is float order
		if mbits >= 0x7f800000 { // an exponent of all ones: a NaN or an infinity
			for j, v := range blk {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					return i*a.block + j
				}
			}
		}
		amax := math.Float32frombits(mbits)
		q := xq[2*i*a.block : 2*(i+1)*a.block]
		switch {
		case amax == 0:
			clear(q)
		case amax < tinyAmax:
			id := ActMax / float64(amax)
			for j, v := range blk {
				r := int16(math.RoundToEven(float64(v) * id))
				q[2*j], q[2*j+1] = byte(r), byte(uint16(r)>>8)
			}
		default:
			roundAct(q, blk, ActMax/amax)
		}
		tail := actTail(a, xq, nb, i)
		binary.LittleEndian.PutUint32(tail, math.Float32bits(amax/ActMax))
		if a.sums {
			groupSums(tail[4:36], q)
		}
	}
	return -1
}

// groupSumsGo is groupSums in Go.
func groupSumsGo(dst, q []byte) {
	for j := range len(q) / 64 {
		var s int32
		for e := 32 * j; e < 32*j+32; e++ {
			s += int32(int16(le16(q[2*e:])))
		}
		binary.LittleEndian.PutUint32(dst[4*j:], uint32(s))
	}
}

// maxAbsBitsGo is maxAbsBits in Go.
func maxAbsBitsGo(x []float32) uint32 {
	var mbits uint32
	for _, v := range x {
		mbits = max(mbits, math.Float32bits(v)&0x7fffffff)
	}
	return mbits
}

// roundActGo is roundAct in Go: it sets the int16 quants q to x[j]·id
// rounded to the nearest integer, ties to even; |x[j]·id| is at most
// ActMax plus rounding.
func roundActGo(q []byte, x []float32, id float32) {
	q = q[:2*len(x)]
	for j, v := range x {
		r := int16(float32(float32(v*id)+roundMagic) - roundMagic)
		q[2*j], q[2*j+1] = byte(r), byte(uint16(r)>>8)
	}
}
