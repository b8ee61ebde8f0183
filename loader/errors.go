package loader

import (
	"errors"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/internal/oneline"
)

// Sentinel errors, wrapped by the errors this package returns; test with
// errors.Is.
var (
	// ErrConfig: config.json is malformed or describes a model strata
	// cannot run.
	ErrConfig = errors.New("bad config")
	// ErrFormat: a safetensors file or the shard index is malformed.
	ErrFormat = errors.New("bad safetensors file")
	// ErrMismatch: the tensors do not match what the config needs (missing,
	// wrong shape, wrong dtype).
	ErrMismatch = errors.New("tensors do not match the config")
	// ErrClosed: the model or file was closed.
	ErrClosed = errors.New("closed")
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
