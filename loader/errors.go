package loader

import "errors"

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
)

// fileError names the file (and tensor, if any) a problem was found in.
type fileError struct {
	file   string
	tensor string
	kind   error
	msg    string
}

func (e *fileError) Error() string {
	s := "loader: " + e.file
	if e.tensor != "" {
		s += ": tensor " + e.tensor
	}
	return s + ": " + e.msg
}

func (e *fileError) Unwrap() error { return e.kind }
