// Package oneline puts error text on one line, as the commands promise to
// print it: wrapped errors from other libraries (yaml lists one problem per
// line) and quoted pieces of input files (JSON spread over lines) would
// otherwise break it.
package oneline

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"unicode/utf8"
)

// String returns s on one line: each line break, with the spaces around
// it, becomes "; " (or a space after a line ending in ':'); blank lines are
// dropped.
func String(s string) string {
	if !strings.ContainsAny(s, "\r\n") {
		return s
	}
	var b strings.Builder
	for _, line := range strings.FieldsFunc(s, func(r rune) bool { return r == '\n' || r == '\r' }) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if b.Len() > 0 {
			if strings.HasSuffix(b.String(), ":") {
				b.WriteByte(' ')
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(line)
	}
	return b.String()
}

// Error returns err with its text on one line (String), still wrapping err
// for errors.Is and errors.As; err itself when its text is one line
// already.
func Error(err error) error {
	if err == nil || !strings.ContainsAny(err.Error(), "\r\n") {
		return err
	}
	return &lineError{err}
}

type lineError struct{ err error }

func (e *lineError) Error() string { return String(e.err.Error()) }
func (e *lineError) Unwrap() error { return e.err }

// maxJSON is the most bytes of a JSON value JSON quotes.
const maxJSON = 64

// JSON returns a JSON value from an input file for an error message:
// compacted onto one line and cut to its first 64 bytes (with "..." after
// them). Text that is not valid JSON is quoted instead.
func JSON(raw []byte) string {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return cut(strings.TrimSpace(string(raw)), true)
	}
	return cut(b.String(), false)
}

// cut shortens s to maxJSON bytes on a character boundary, and quotes it
// when asked.
func cut(s string, quote bool) string {
	long := len(s) > maxJSON
	if long {
		n := maxJSON
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	if quote {
		s = strconv.Quote(s)
	}
	if long {
		s += "..."
	}
	return s
}
