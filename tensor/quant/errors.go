package quant

import "errors"

// Sentinel errors, wrapped by the errors of the checked functions; test with
// errors.Is.
var (
	// ErrUnknownType: the number or name is not in the ggml type table.
	ErrUnknownType = errors.New("unknown ggml type")
	// ErrUnsupported: the type is known but this package cannot encode or
	// decode it.
	ErrUnsupported = errors.New("type not supported")
	// ErrLength: a length is not a whole number of blocks, or the source
	// and destination do not hold the same number of elements.
	ErrLength = errors.New("bad length")
	// ErrNotFinite: quantization input holds a NaN or an infinity, or values
	// so large that a block's scale does not fit its F16 field.
	ErrNotFinite = errors.New("value out of range")
)
