package quant

import (
	"fmt"
	"math"
)

// codec holds one format's functions. Each panics when the lengths do not
// match (the checked Type methods test them first).
type codec struct {
	dequantize func(dst []float32, src []byte)
	quantize   func(dst []byte, src []float32)
	dot        func(row []byte, x []float32) float32
	// scaleOK reports whether the scales of the encoded block b are finite.
	scaleOK func(b []byte) bool
}

func (t Type) codec() *codec {
	switch t {
	case F32:
		return &codecF32
	case F16:
		return &codecF16
	case BF16:
		return &codecBF16
	case Q4_0:
		return &codecQ4_0
	case Q4_1:
		return &codecQ4_1
	case Q5_0:
		return &codecQ5_0
	case Q5_1:
		return &codecQ5_1
	case Q8_0:
		return &codecQ8_0
	case Q4_K:
		return &codecQ4_K
	case Q5_K:
		return &codecQ5_K
	case Q6_K:
		return &codecQ6_K
	case Q8_K:
		return &codecQ8_K
	}
	return nil
}

// check returns the codec of t after checking that n elements and nb bytes
// are whole, matching blocks.
func (t Type) check(op string, n, nb int) (*codec, error) {
	c := t.codec()
	if c == nil {
		if !t.Known() {
			return nil, fmt.Errorf("quant: %s: %w: %v", op, ErrUnknownType, t)
		}
		return nil, fmt.Errorf("quant: %s: %w: %v", op, ErrUnsupported, t)
	}
	want, err := t.Bytes(int64(n))
	if err != nil {
		return nil, fmt.Errorf("quant: %s: %v: %d elements is not a whole number of %d-element blocks: %w", op, t, n, t.BlockSize(), ErrLength)
	}
	if int64(nb) != want {
		return nil, fmt.Errorf("quant: %s: %v: %d elements need %d bytes, have %d: %w", op, t, n, want, nb, ErrLength)
	}
	return c, nil
}

// Dequantize decodes src, whole blocks of type t, into dst: len(dst)
// elements from exactly the bytes they occupy. The result is bit-exact with
// the format's reference definition (ggml's dequantize_row_* functions, each
// product and sum rounded to float32 as written, no fused multiply-adds).
// Any bytes decode without error; NaN or infinite scales give NaN or
// infinite values as the definition does.
func (t Type) Dequantize(dst []float32, src []byte) error {
	c, err := t.check("dequantize", len(dst), len(src))
	if err != nil {
		return err
	}
	c.dequantize(dst, src)
	return nil
}

// Quantize encodes src into dst, whole blocks of type t, producing the
// bytes the reference quantizer produces (ggml's quantize_row_*_ref: what
// llama.cpp's quantize tool writes without an importance matrix). Input with
// a NaN or an infinity, or with magnitudes so large that a block's scale
// overflows its F16 field, is refused with an error wrapping ErrNotFinite;
// dst may then hold partial output.
func (t Type) Quantize(dst []byte, src []float32) error {
	c, err := t.check("quantize", len(src), len(dst))
	if err != nil {
		return err
	}
	for i, v := range src {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return fmt.Errorf("quant: quantize %v: element %d is %v: %w", t, i, v, ErrNotFinite)
		}
	}
	c.quantize(dst, src)
	if c.scaleOK != nil {
		bs := t.BlockBytes()
		for b := 0; b < len(dst); b += bs {
			if !c.scaleOK(dst[b : b+bs]) {
				blk := b / bs
				n := t.BlockSize()
				return fmt.Errorf("quant: quantize %v: block %d (elements %d to %d): values up to %g overflow the block's F16 scale: %w",
					t, blk, blk*n, blk*n+n-1, maxAbs(src[blk*n:blk*n+n]), ErrNotFinite)
			}
		}
	}
	return nil
}

// DotF32 returns the dot product of row, whole blocks of type t, with x:
// the F32 product over the row's dequantized values, computed block by
// block from the quantized bytes (the order of the additions differs from
// dequantizing first; the difference is within float32 rounding of the sum
// of the absolute products).
func (t Type) DotF32(row []byte, x []float32) (float32, error) {
	c, err := t.check("dot", len(x), len(row))
	if err != nil {
		return 0, err
	}
	return c.dot(row, x), nil
}

func maxAbs(x []float32) float32 {
	var m float32
	for _, v := range x {
		m = max(m, abs32(v))
	}
	return m
}

// halfOK reports whether the F16 word at b[0:2] is finite.
func halfOK(b []byte) bool { return b[1]&0x7c != 0x7c }

func le16(b []byte) uint16 { return uint16(b[0]) | uint16(b[1])<<8 }

func put16(b []byte, v uint16) { b[0], b[1] = byte(v), byte(v>>8) }

// mustBlocks panics unless dst holds whole blocks of n elements and src the
// matching bytes; it returns the number of blocks.
func mustBlocks(t Type, elems, nbytes int) int {
	bs, bb := t.BlockSize(), t.BlockBytes()
	nb := elems / bs
	if elems%bs != 0 || nbytes != nb*bb {
		panic(fmt.Sprintf("quant: %v: %d elements and %d bytes are not matching whole blocks", t, elems, nbytes))
	}
	return nb
}
