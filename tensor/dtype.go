package tensor

import (
	"fmt"
	"strings"

	"github.com/strata-llm/strata/tensor/quant"
)

// DType is the element type of a tensor.
type DType uint8

// The element types strata reads, stores and computes with. The quantized
// types are ggml's block formats (package quant): a row of a quantized
// tensor is whole blocks of BlockSize elements stored in BlockBytes bytes,
// and such tensors are weights only, read by the kernels in their stored
// bytes. Q8_B8 is strata's own block format of a KV cache (quant.Q8B8:
// blocks of 8 int8 values and an F16 scale, 10 bytes), not a ggml type:
// not IsQuantized, a cache dtype only (IsCacheDType).
const (
	Invalid DType = iota
	F32
	F16
	BF16
	I32
	I64
	Q8_0
	Q4_0
	Q4_1
	Q5_0
	Q5_1
	Q4_K
	Q5_K
	Q6_K
	Q8_K
	Q8_B8
	numDTypes
)

var dtypeNames = [...]string{Invalid: "invalid", F32: "F32", F16: "F16", BF16: "BF16", I32: "I32", I64: "I64",
	Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", Q8_K: "Q8_K",
	Q8_B8: "Q8_B8"}

// quantTypes maps the quantized dtypes to package quant's types.
var quantTypes = [...]quant.Type{Q8_0: quant.Q8_0, Q4_0: quant.Q4_0, Q4_1: quant.Q4_1, Q5_0: quant.Q5_0, Q5_1: quant.Q5_1,
	Q4_K: quant.Q4_K, Q5_K: quant.Q5_K, Q6_K: quant.Q6_K, Q8_K: quant.Q8_K}

// String returns the safetensors name of the type ("F32", "F16", ...), or
// ggml's for a quantized one ("Q4_K").
func (d DType) String() string {
	if int(d) < len(dtypeNames) {
		return dtypeNames[d]
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size is the number of bytes of one element; 0 for Invalid and for the
// quantized types, whose elements share their blocks' bytes (see
// BlockBytes and Bytes).
func (d DType) Size() int {
	switch d {
	case F32, I32:
		return 4
	case F16, BF16:
		return 2
	case I64:
		return 8
	}
	return 0
}

// IsQuantized reports whether d is one of ggml's block formats.
func (d DType) IsQuantized() bool { return d >= Q8_0 && d <= Q8_K }

// Quant returns the quant package's type of a quantized dtype (and
// quant.F32, quant.F16, quant.BF16 for those), or false.
func (d DType) Quant() (quant.Type, bool) {
	switch d {
	case F32:
		return quant.F32, true
	case F16:
		return quant.F16, true
	case BF16:
		return quant.BF16, true
	}
	if d.IsQuantized() {
		return quantTypes[d], true
	}
	return 0, false
}

// FromQuant returns the dtype of one of the quant package's types, or
// false for a type strata does not store.
func FromQuant(t quant.Type) (DType, bool) {
	switch t {
	case quant.F32:
		return F32, true
	case quant.F16:
		return F16, true
	case quant.BF16:
		return BF16, true
	}
	for d := Q8_0; d <= Q8_K; d++ {
		if quantTypes[d] == t {
			return d, true
		}
	}
	return Invalid, false
}

// BlockSize is the elements of one block: 1 for the plain types, 32 or
// 256 for the quantized ones, 8 for Q8_B8, 0 for Invalid.
func (d DType) BlockSize() int {
	if d == Q8_B8 {
		return quant.QB8
	}
	if q, ok := d.Quant(); ok && d.IsQuantized() {
		return q.BlockSize()
	}
	if d.Size() > 0 {
		return 1
	}
	return 0
}

// BlockBytes is the bytes of one block (Size for the plain types).
func (d DType) BlockBytes() int {
	if d == Q8_B8 {
		return quant.BlockBytesQ8B8
	}
	if q, ok := d.Quant(); ok && d.IsQuantized() {
		return q.BlockBytes()
	}
	return d.Size()
}

// Bytes is the storage of n elements of d. For a quantized type n must be
// whole blocks; a negative n, an overflow or an Invalid type is an error.
func (d DType) Bytes(n int64) (int64, error) {
	bs, bb := int64(d.BlockSize()), int64(d.BlockBytes())
	switch {
	case bs == 0 || bb == 0:
		return 0, fmt.Errorf("tensor: no storage size for dtype %v", d)
	case n < 0:
		return 0, fmt.Errorf("tensor: %d elements of %v", n, d)
	case n%bs != 0:
		return 0, fmt.Errorf("tensor: %d elements of %v are not whole blocks of %d", n, d, bs)
	case n/bs > (1<<62)/bb:
		return 0, fmt.Errorf("tensor: %d elements of %v overflow", n, d)
	}
	return n / bs * bb, nil
}

// ShapeBytes is the storage of a tensor of dtype d and shape: for a
// block type (quantized, Q8_B8) each row (the last dimension) must be
// whole blocks.
func (d DType) ShapeBytes(shape Shape) (int64, error) {
	n := shape.NumElements()
	if n < 0 {
		return 0, fmt.Errorf("tensor: invalid shape %v", shape)
	}
	if d.BlockSize() > 1 {
		if len(shape) == 0 || shape[len(shape)-1]%d.BlockSize() != 0 {
			return 0, fmt.Errorf("tensor: %v %v: a row is not whole blocks of %d", d, shape, d.BlockSize())
		}
	}
	return d.Bytes(n)
}

// IsFloat reports whether d is one of the floating-point types.
func (d DType) IsFloat() bool { return d == F32 || d == F16 || d == BF16 }

// ParseDType accepts the safetensors names (F32, F16, BF16, I32, I64), the
// Hugging Face config spellings (float32, float16, bfloat16, with or without
// a "torch." prefix) and ggml's names of the quantized types (q8_0, Q4_K,
// ...).
func ParseDType(s string) (DType, error) {
	switch strings.TrimPrefix(strings.ToLower(s), "torch.") {
	case "f32", "float32", "float":
		return F32, nil
	case "f16", "float16", "half", "fp16":
		return F16, nil
	case "bf16", "bfloat16":
		return BF16, nil
	case "i32", "int32":
		return I32, nil
	case "i64", "int64":
		return I64, nil
	}
	for d := Q8_0; d <= Q8_K; d++ {
		if strings.EqualFold(s, dtypeNames[d]) {
			return d, nil
		}
	}
	return Invalid, fmt.Errorf("tensor: unknown dtype %q", s)
}
