package tokenizer

import (
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
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
	re      *onigRegexp
	content string
}

func (r replacer) replace(s string) string {
	if r.re != nil {
		return r.re.replaceAll(s, r.content)
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

// cgj is U+034F COMBINING GRAPHEME JOINER, which golang.org/x/text's
// normalizer inserts after 30 non-starters in a row (the stream-safe text
// format of UAX #15). Hugging Face's normalizers do not, so where one was
// inserted the text is normalized again by exactNormalize.
const cgj = "\u034f"

func (n unicodeNormalizer) normalize(s string) string {
	out := n.form.String(s)
	// Normalization neither removes nor creates a U+034F of the text (it is
	// a starter without decomposition, and composes with nothing): more of
	// them means some were inserted.
	if strings.Contains(out, cgj) && strings.Count(out, cgj) > strings.Count(s, cgj) {
		return exactNormalize(n.form, s)
	}
	return out
}

// exactNormalize is the normalization algorithm of UAX #15 without the
// stream-safe limit: the full decomposition of each character, canonical
// ordering of every run of non-starters however long, then (NFC, NFKC)
// canonical composition. It takes the per-character data from x/text, on
// strings too short for its limit to apply.
func exactNormalize(form norm.Form, s string) string {
	decomp, compose := norm.NFD, false
	switch form {
	case norm.NFC:
		compose = true
	case norm.NFKC:
		decomp, compose = norm.NFKD, true
	case norm.NFKD:
		decomp = norm.NFKD
	}
	// Decompose each character on its own (one character's decomposition
	// holds at most a few non-starters).
	rs := make([]rune, 0, len(s))
	for _, r := range s {
		if r < utf8.RuneSelf {
			rs = append(rs, r)
			continue
		}
		for _, d := range decomp.String(string(r)) {
			rs = append(rs, d)
		}
	}
	// Canonical ordering: a stable sort of each run of non-starters by
	// combining class.
	for i := 0; i < len(rs); {
		if ccc(rs[i]) == 0 {
			i++
			continue
		}
		j := i
		for j < len(rs) && ccc(rs[j]) != 0 {
			j++
		}
		slices.SortStableFunc(rs[i:j], func(a, b rune) int { return int(ccc(a)) - int(ccc(b)) })
		i = j
	}
	if compose {
		rs = canonicalCompose(rs)
	}
	return string(rs)
}

// ccc returns the canonical combining class of r.
func ccc(r rune) uint8 {
	if r < 0x300 {
		return 0 // no combining marks below U+0300
	}
	var b [utf8.UTFMax]byte
	return norm.NFD.Properties(b[:utf8.EncodeRune(b[:], r)]).CCC()
}

// canonicalCompose composes canonically ordered, decomposed text: each
// character joins the last starter when nothing between them blocks it (a
// character left between them of class 0 or of a class not lower than its
// own) and the two have a primary composite.
func canonicalCompose(rs []rune) []rune {
	out := rs[:0]
	starter := -1 // index in out of the last starter
	for _, r := range rs {
		c := ccc(r)
		if starter >= 0 {
			last := len(out) - 1
			if last == starter || ccc(out[last]) < c {
				if p, ok := primaryComposite(out[starter], r); ok {
					out[starter] = p
					continue
				}
			}
		}
		if c == 0 {
			starter = len(out)
		}
		out = append(out, r)
	}
	return out
}

// primaryComposite returns the character that a and b compose to. a is a
// starter that is either decomposed or itself a composite, and b does not
// sort before the marks a is made of, so NFC of the pair is one character
// exactly when they compose (Hangul syllables included).
func primaryComposite(a, b rune) (rune, bool) {
	if b < 0x300 {
		return 0, false // every composition adds a character from U+0300 on
	}
	c := norm.NFC.String(string([]rune{a, b}))
	r, n := utf8.DecodeRuneInString(c)
	if n != len(c) || r == a {
		return 0, false
	}
	return r, true
}
