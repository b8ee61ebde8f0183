package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"sync"

	"github.com/strata-llm/strata/tensor"
)

// Reading the tensors of a GGUF model: the query and key rows of the
// llama architecture go back to Hugging Face's order as they are read, and
// the scales of quantized blocks are checked as float elements are.

// headScratch holds the copies of one head's rows that un-permuting takes.
var headScratch sync.Pool // of *[]byte

// readPermuted reads len(dst) bytes of t from offset off in Hugging Face's
// row order, t's rows being stored in llama.cpp's (UnpermuteQK). The
// permutation moves rows within a head, so the read covers the whole heads
// the range touches: straight into dst when the range is whole heads (a
// whole tensor), else into a buffer the range is copied out of. A
// non-finite element is reported at its place in Hugging Face's order.
func (f *File) readPermuted(ctx context.Context, t *TensorInfo, off int64, dst []byte, check bool) error {
	rows := int64(t.Shape[0])
	if off < 0 || off > t.Size || int64(len(dst)) > t.Size-off || len(dst) == 0 || rows == 0 {
		return f.readStored(ctx, t, off, dst, check) // it reports the bad range
	}
	rowBytes := t.Size / rows
	d := rows / int64(t.qkHeads)
	headBytes := d * rowBytes
	first, end := off/headBytes*headBytes, (off+int64(len(dst))+headBytes-1)/headBytes*headBytes
	buf, partial := dst, first != off || end != off+int64(len(dst))
	if partial {
		buf = make([]byte, end-first)
	}
	if err := f.readStored(ctx, t, first, buf, check); err != nil {
		var nf *NonFiniteError
		if errors.As(err, &nf) {
			cols := t.Shape.NumElements() / rows
			g := nf.Index / cols
			nf.Index = hfRow(g, d)*cols + nf.Index%cols
		}
		return err
	}
	sp, _ := headScratch.Get().(*[]byte)
	if sp == nil || int64(cap(*sp)) < headBytes {
		b := make([]byte, headBytes)
		sp = &b
	}
	scratch := (*sp)[:headBytes]
	for h := int64(0); h < int64(len(buf)); h += headBytes {
		head := buf[h : h+headBytes]
		copy(scratch, head)
		if err := UnpermuteQK(head, scratch, int(d), 1); err != nil {
			return err // not reached: Open checked the head size
		}
	}
	headScratch.Put(sp)
	if partial {
		copy(dst, buf[off-first:])
	}
	return nil
}

// hfRow is the Hugging Face row of stored row g of a permuted tensor whose
// heads are d rows.
func hfRow(g, d int64) int64 {
	h, r := g/d, g%d
	return h*d + r%2*d/2 + r/2
}

// scaleFields are the byte offsets of the F16 scales in a block of each
// quantized dtype (Q8_K's one scale is an F32 at 0).
var scaleFields = map[tensor.DType][]int{
	tensor.Q8_0: {0}, tensor.Q4_0: {0}, tensor.Q4_1: {0, 2}, tensor.Q5_0: {0}, tensor.Q5_1: {0, 2},
	tensor.Q4_K: {0, 2}, tensor.Q5_K: {0, 2}, tensor.Q6_K: {208}, tensor.Q8_K: {0},
}

// checkScales returns a *NonFiniteError when a block of the quantized
// tensor t that b, the tensor's bytes from offset at, holds whole has a
// scale that is a NaN or an infinity: every value of such a block is one.
func (f *File) checkScales(t *TensorInfo, at int64, b []byte) error {
	bb := int64(t.DType.BlockBytes())
	skip := (bb - at%bb) % bb
	if skip >= int64(len(b)) {
		return nil
	}
	b = b[skip:]
	fields := scaleFields[t.DType]
	for blk := int64(0); blk+bb <= int64(len(b)); blk += bb {
		for _, o := range fields {
			w := b[blk+int64(o):]
			var v float64
			var bits uint32
			if t.DType == tensor.Q8_K {
				bits = binary.LittleEndian.Uint32(w)
				v = float64(math.Float32frombits(bits))
			} else {
				bits = uint32(binary.LittleEndian.Uint16(w))
				v = float64(tensor.F16ToF32One(uint16(bits)))
			}
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return &NonFiniteError{File: f.Path, Tensor: t.Name, DType: t.DType,
					Index: (at + skip + blk) / bb * int64(t.DType.BlockSize()), Value: v, Bits: bits}
			}
		}
	}
	return nil
}
