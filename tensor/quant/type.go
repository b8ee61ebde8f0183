package quant

import (
	"fmt"
	"math"
	"strings"
)

// Type is a ggml tensor type, numbered as in GGUF files (the ggml_type
// enumeration). The table covers every type a GGUF file may name, so that a
// reader can size any tensor; Supported says which ones this package can
// decode.
type Type uint32

// The ggml types. Numbers 4, 5 and 31 to 33, 36 to 38 were used by
// formats that have been withdrawn; they are not valid in a file.
const (
	F32     Type = 0
	F16     Type = 1
	Q4_0    Type = 2
	Q4_1    Type = 3
	Q5_0    Type = 6
	Q5_1    Type = 7
	Q8_0    Type = 8
	Q8_1    Type = 9
	Q2_K    Type = 10
	Q3_K    Type = 11
	Q4_K    Type = 12
	Q5_K    Type = 13
	Q6_K    Type = 14
	Q8_K    Type = 15
	IQ2_XXS Type = 16
	IQ2_XS  Type = 17
	IQ3_XXS Type = 18
	IQ1_S   Type = 19
	IQ4_NL  Type = 20
	IQ3_S   Type = 21
	IQ2_S   Type = 22
	IQ4_XS  Type = 23
	I8      Type = 24
	I16     Type = 25
	I32     Type = 26
	I64     Type = 27
	F64     Type = 28
	IQ1_M   Type = 29
	BF16    Type = 30
	TQ1_0   Type = 34
	TQ2_0   Type = 35
	MXFP4   Type = 39
	NVFP4   Type = 40
	Q1_0    Type = 41
	Q2_0    Type = 42
)

// QK is the number of elements in a block of the 32-element formats (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0); QKK in a super-block of the K formats.
const (
	QK  = 32
	QKK = 256
)

type typeInfo struct {
	name  string
	block int // elements per block
	bytes int // bytes per block
}

// types is indexed by Type; a zero entry is a number no format uses.
var types = [...]typeInfo{
	F32:     {"F32", 1, 4},
	F16:     {"F16", 1, 2},
	Q4_0:    {"Q4_0", 32, 18},
	Q4_1:    {"Q4_1", 32, 20},
	Q5_0:    {"Q5_0", 32, 22},
	Q5_1:    {"Q5_1", 32, 24},
	Q8_0:    {"Q8_0", 32, 34},
	Q8_1:    {"Q8_1", 32, 36},
	Q2_K:    {"Q2_K", 256, 84},
	Q3_K:    {"Q3_K", 256, 110},
	Q4_K:    {"Q4_K", 256, 144},
	Q5_K:    {"Q5_K", 256, 176},
	Q6_K:    {"Q6_K", 256, 210},
	Q8_K:    {"Q8_K", 256, 292},
	IQ2_XXS: {"IQ2_XXS", 256, 66},
	IQ2_XS:  {"IQ2_XS", 256, 74},
	IQ3_XXS: {"IQ3_XXS", 256, 98},
	IQ1_S:   {"IQ1_S", 256, 50},
	IQ4_NL:  {"IQ4_NL", 32, 18},
	IQ3_S:   {"IQ3_S", 256, 110},
	IQ2_S:   {"IQ2_S", 256, 82},
	IQ4_XS:  {"IQ4_XS", 256, 136},
	I8:      {"I8", 1, 1},
	I16:     {"I16", 1, 2},
	I32:     {"I32", 1, 4},
	I64:     {"I64", 1, 8},
	F64:     {"F64", 1, 8},
	IQ1_M:   {"IQ1_M", 256, 56},
	BF16:    {"BF16", 1, 2},
	TQ1_0:   {"TQ1_0", 256, 54},
	TQ2_0:   {"TQ2_0", 256, 66},
	MXFP4:   {"MXFP4", 32, 17},
	NVFP4:   {"NVFP4", 64, 36},
	Q1_0:    {"Q1_0", 128, 18},
	Q2_0:    {"Q2_0", 64, 18},
}

func (t Type) info() typeInfo {
	if uint64(t) < uint64(len(types)) {
		return types[t]
	}
	return typeInfo{}
}

// Known reports whether t is a type of the ggml table (whether or not this
// package can decode it).
func (t Type) Known() bool { return t.info().block != 0 }

// String returns ggml's name of the type in upper case ("Q4_K"), or
// "type(N)" for a number the table does not know.
func (t Type) String() string {
	if i := t.info(); i.block != 0 {
		return i.name
	}
	return fmt.Sprintf("type(%d)", uint32(t))
}

// BlockSize is the number of elements in one block; 0 for an unknown type.
func (t Type) BlockSize() int { return t.info().block }

// BlockBytes is the size of one block in bytes; 0 for an unknown type.
func (t Type) BlockBytes() int { return t.info().bytes }

// Bytes returns the size in bytes of n elements of type t. n must be a
// multiple of the block size; an unknown type, a negative or misaligned n,
// or a size beyond int64 is an error.
func (t Type) Bytes(n int64) (int64, error) {
	i := t.info()
	switch {
	case i.block == 0:
		return 0, fmt.Errorf("quant: %w: %v", ErrUnknownType, t)
	case n < 0:
		return 0, fmt.Errorf("quant: %v: negative element count %d", t, n)
	case n%int64(i.block) != 0:
		return 0, fmt.Errorf("quant: %v: %d elements is not a whole number of %d-element blocks: %w", t, n, i.block, ErrLength)
	case n/int64(i.block) > math.MaxInt64/int64(i.bytes):
		return 0, fmt.Errorf("quant: %v: %d elements overflow a 64-bit byte count", t, n)
	}
	return n / int64(i.block) * int64(i.bytes), nil
}

// Supported reports whether this package can dequantize and quantize t.
func (t Type) Supported() bool {
	switch t {
	case F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q8_K:
		return true
	}
	return false
}

// ParseType accepts a type name in any case ("q4_k", "Q8_0", "bf16").
func ParseType(s string) (Type, error) {
	for t, i := range types {
		if i.block != 0 && strings.EqualFold(i.name, s) {
			return Type(t), nil
		}
	}
	return 0, fmt.Errorf("quant: %w %q", ErrUnknownType, s)
}
