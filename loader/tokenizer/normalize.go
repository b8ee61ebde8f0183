package tokenizer

import (
	"golang.org/x/text/unicode/norm"
	"regexp"
	"strings"
	"unicode"
)

// normalizer rewrites the text of one piece (the text between added tokens)
// before pre-tokenization.
type normalizer interface {
	normalize(s string) string
}

type normalizerSeq []normalizer

func (n normalizerSeq) normalize(s string) string {
	for _, m := range n {
		s = m.normalize(s)
	}
	return s
}

// prependNormalizer puts a string in front of non-empty text.
type prependNormalizer string

func (p prependNormalizer) normalize(s string) string {
	if s == "" {
		return s
	}
	return string(p) + s
}

// replacer replaces every non-overlapping match of a literal or a regular
// expression, left to right; used by the Replace normalizer and decoder.
type replacer struct {
	literal string
	re      *regexp.Regexp
	content string
}

func (r replacer) replace(s string) string {
	if r.re != nil {
		return r.re.ReplaceAllLiteralString(s, r.content)
	}
	if r.literal == "" {
		return s
	}
	return strings.ReplaceAll(s, r.literal, r.content)
}

type replaceNormalizer struct{ replacer }

func (r replaceNormalizer) normalize(s string) string { return r.replace(s) }

// stripNormalizer removes whitespace from the left and/or right.
type stripNormalizer struct{ left, right bool }

func (n stripNormalizer) normalize(s string) string {
	if n.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if n.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s
}

// unicodeNormalizer applies one of the Unicode normalization forms (Qwen2's
// tokenizer.json asks for NFC).
type unicodeNormalizer struct{ form norm.Form }

func (n unicodeNormalizer) normalize(s string) string { return n.form.String(s) }
