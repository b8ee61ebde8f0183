package tensor

import (
	"fmt"
	"strings"
)

// DType is the element type of a tensor.
type DType uint8

// The element types strata reads, stores and computes with.
const (
	Invalid DType = iota
	F32
	F16
	BF16
	I32
	I64
)

var dtypeNames = [...]string{Invalid: "invalid", F32: "F32", F16: "F16", BF16: "BF16", I32: "I32", I64: "I64"}

// String returns the safetensors name of the type ("F32", "F16", ...).
func (d DType) String() string {
	if int(d) < len(dtypeNames) {
		return dtypeNames[d]
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size is the number of bytes of one element; 0 for Invalid.
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

// IsFloat reports whether d is one of the floating-point types.
func (d DType) IsFloat() bool { return d == F32 || d == F16 || d == BF16 }

// ParseDType accepts the safetensors names (F32, F16, BF16, I32, I64) and the
// Hugging Face config spellings (float32, float16, bfloat16, with or without
// a "torch." prefix).
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
	return Invalid, fmt.Errorf("tensor: unknown dtype %q", s)
}
