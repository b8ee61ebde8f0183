package tensortest

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// Encode returns the little-endian bytes of v stored as dt (F32, F16 or
// BF16, which round to nearest even; or a quantized type or Q8_B8, whole
// blocks that quant's reference quantizer writes).
func Encode(dt tensor.DType, v []float32) ([]byte, error) {
	if dt == tensor.Q8_B8 {
		n, err := dt.Bytes(int64(len(v)))
		if err != nil {
			return nil, fmt.Errorf("tensortest: encode %d values as %v: %w", len(v), dt, err)
		}
		b := make([]byte, n)
		quant.QuantizeQ8B8(b, v)
		return b, nil
	}
	if dt.IsQuantized() {
		q, _ := dt.Quant()
		n, err := q.Bytes(int64(len(v)))
		if err != nil {
			return nil, fmt.Errorf("tensortest: encode %d values as %v: %w", len(v), dt, err)
		}
		b := make([]byte, n)
		if err := q.Quantize(b, v); err != nil {
			return nil, fmt.Errorf("tensortest: encode as %v: %w", dt, err)
		}
		return b, nil
	}
	switch dt {
	case tensor.F32:
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		return b, nil
	case tensor.F16, tensor.BF16:
		h := make([]uint16, len(v))
		if dt == tensor.F16 {
			tensor.F32ToF16(h, v)
		} else {
			tensor.F32ToBF16(h, v)
		}
		b := make([]byte, 2*len(v))
		for i, x := range h {
			binary.LittleEndian.PutUint16(b[2*i:], x)
		}
		return b, nil
	}
	return nil, fmt.Errorf("tensortest: cannot encode %v", dt)
}

// Decode converts the little-endian bytes of values of float type dt to
// float32, or dequantizes whole blocks of a quantized type or Q8_B8.
func Decode(dt tensor.DType, b []byte) ([]float32, error) {
	if dt == tensor.Q8_B8 {
		if len(b)%quant.BlockBytesQ8B8 != 0 {
			return nil, fmt.Errorf("tensortest: decode %v: %d bytes are not whole blocks", dt, len(b))
		}
		out := make([]float32, len(b)/quant.BlockBytesQ8B8*quant.QB8)
		quant.DequantizeQ8B8(out, b)
		return out, nil
	}
	if dt.IsQuantized() {
		q, _ := dt.Quant()
		out := make([]float32, len(b)/q.BlockBytes()*q.BlockSize())
		if err := q.Dequantize(out, b); err != nil {
			return nil, fmt.Errorf("tensortest: decode %v: %w", dt, err)
		}
		return out, nil
	}
	switch dt {
	case tensor.F32:
		out := make([]float32, len(b)/4)
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
		return out, nil
	case tensor.F16, tensor.BF16:
		h := make([]uint16, len(b)/2)
		for i := range h {
			h[i] = binary.LittleEndian.Uint16(b[2*i:])
		}
		out := make([]float32, len(h))
		if dt == tensor.F16 {
			tensor.F16ToF32(out, h)
		} else {
			tensor.BF16ToF32(out, h)
		}
		return out, nil
	}
	return nil, fmt.Errorf("tensortest: cannot decode %v", dt)
}

// Stored returns the values v takes once stored as dt, in float64: what a
// backend reads back, and so what a reference must compute with (for a
// quantized type, the dequantized values).
func Stored(dt tensor.DType, v []float32) ([]float64, error) {
	b, err := Encode(dt, v)
	if err != nil {
		return nil, err
	}
	f, err := Decode(dt, b)
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(f))
	for i, x := range f {
		out[i] = float64(x)
	}
	return out, nil
}

// FromF32 allocates a tensor of dt and shape on b and uploads v into it,
// converted (or quantized) to dt.
func FromF32(b tensor.Backend, dt tensor.DType, shape tensor.Shape, v []float32) (*tensor.Tensor, error) {
	if int64(len(v)) != shape.NumElements() {
		return nil, fmt.Errorf("tensortest: %d values for shape %v", len(v), shape)
	}
	bytes, err := Encode(dt, v)
	if err != nil {
		return nil, err
	}
	t, err := b.Alloc(dt, shape)
	if err != nil {
		return nil, err
	}
	if err := b.Upload(t, 0, bytes); err != nil {
		b.Free(t)
		return nil, err
	}
	return t, nil
}

// ToF32 downloads a float tensor from b and converts it to float32 (a
// quantized one is dequantized).
func ToF32(b tensor.Backend, t *tensor.Tensor) ([]float32, error) {
	buf := make([]byte, t.NumBytes())
	if err := b.Download(buf, t); err != nil {
		return nil, err
	}
	return Decode(t.DType(), buf)
}
