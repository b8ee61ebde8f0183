package loader

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/tensor"
)

// Sentinel errors, wrapped by the errors this package returns; test with
// errors.Is.
var (
	// ErrConfig: config.json is malformed or describes a model strata
	// cannot run (arch.ErrConfig: the same error).
	ErrConfig = arch.ErrConfig
	// ErrFormat: a safetensors file or the shard index is malformed.
	ErrFormat = errors.New("bad safetensors file")
	// ErrMismatch: the tensors do not match what the config needs (missing,
	// wrong shape, wrong dtype).
	ErrMismatch = errors.New("tensors do not match the config")
	// ErrClosed: the model or file was closed.
	ErrClosed = errors.New("closed")
	// ErrNonFinite: a weight read through a Model holds a NaN or an
	// infinity. The error is a *NonFiniteError.
	ErrNonFinite = errors.New("non-finite weight")
	// ErrNotRegular: a file of the model is not a regular file (a named
	// pipe, a device, a directory); it is refused before it is opened.
	ErrNotRegular = infile.ErrNotRegular
)

// fileError names the file (and tensor, if any) a problem was found in.
type fileError struct {
	file   string
	tensor string
	kind   error
	msg    string
}

func (e *fileError) Error() string {
	s := "loader: " + quoteOdd(e.file)
	if e.tensor != "" {
		s += ": tensor " + quoteOdd(e.tensor)
	}
	return s + ": " + oneline.String(e.msg)
}

// quoteOdd quotes a name read from a file or the command line when it has
// characters that would not print as themselves on one line (a line break,
// a control character).
func quoteOdd(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0 || !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	return s
}

func (e *fileError) Unwrap() error { return e.kind }

// NonFiniteError reports the first element of a tensor, in the bytes a
// read returned, that is a NaN or an infinity. It wraps ErrNonFinite.
type NonFiniteError struct {
	File   string // the weight file's path
	Tensor string
	DType  tensor.DType
	// Index is the element, counted row-major from the tensor's start;
	// for a quantized tensor, the first element of the block whose scale
	// is not finite.
	Index int64
	Value float64 // NaN, +Inf or -Inf
	Bits  uint32  // the element's bit pattern in DType (a quantized block's scale's)
}

func (e *NonFiniteError) Error() string {
	if e.DType.IsQuantized() {
		scale := "F16"
		if e.DType == tensor.Q8_K {
			scale = "F32"
		}
		return fmt.Sprintf("loader: %s: tensor %s: the %v block at element %d has a scale of %v (%s bits %#x); weights must be finite",
			quoteOdd(e.File), quoteOdd(e.Tensor), e.DType, e.Index, e.Value, scale, e.Bits)
	}
	return fmt.Sprintf("loader: %s: tensor %s: element %d is %v (%v bits %#0*x); weights must be finite",
		quoteOdd(e.File), quoteOdd(e.Tensor), e.Index, e.Value, e.DType, 2*e.DType.Size(), e.Bits)
}

func (e *NonFiniteError) Unwrap() error { return ErrNonFinite }
