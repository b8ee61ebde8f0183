package tokenizer

import (
	"sort"
	"unicode"
	"unicode/utf8"
)

// addedToken is a token matched in the text as a whole before the model
// sees it: special tokens such as <s> and tokens added on top of the model.
type addedToken struct {
	id         int
	content    string
	special    bool
	singleWord bool
	lstrip     bool
	rstrip     bool
	normalized bool
}

// addedMatcher finds added tokens in text, leftmost first and longest among
// those starting at the same place, without overlaps.
type addedMatcher struct {
	tokens  []addedToken // patterns, by index
	pattern []string     // text matched for each token (normalized content for normalized tokens)
	byFirst [256][]int   // token indices by first byte, longest pattern first
}

func newAddedMatcher(tokens []addedToken, patterns []string) *addedMatcher {
	m := &addedMatcher{tokens: tokens, pattern: patterns}
	for i, p := range patterns {
		if p == "" {
			continue
		}
		m.byFirst[p[0]] = append(m.byFirst[p[0]], i)
	}
	for b := range m.byFirst {
		idx := m.byFirst[b]
		sort.SliceStable(idx, func(x, y int) bool { return len(patterns[idx[x]]) > len(patterns[idx[y]]) })
	}
	return m
}

// next returns the index of the token matching at the earliest position at
// or after from, and its byte range, or -1.
func (m *addedMatcher) next(s string, from int) (tok, start, end int) {
	for i := from; i < len(s); i++ {
		for _, k := range m.byFirst[s[i]] {
			p := m.pattern[k]
			if len(s)-i >= len(p) && s[i:i+len(p)] == p {
				return k, i, i + len(p)
			}
		}
	}
	return -1, 0, 0
}

// isWordChar is the \w class of Rust's regex: alphabetic, marks, decimal
// digits, connector punctuation and the joiners.
func isWordChar(r rune) bool {
	return unicode.IsLetter(r) || unicode.Is(unicode.Nl, r) || unicode.Is(unicode.Other_Alphabetic, r) ||
		unicode.IsMark(r) || unicode.Is(unicode.Nd, r) || unicode.Is(unicode.Pc, r) || r == 0x200C || r == 0x200D
}

// split cuts p into added tokens and the text between them, as the Hugging
// Face AddedVocabulary does: a single_word token must not touch word
// characters, lstrip/rstrip tokens swallow the whitespace beside them.
func (m *addedMatcher) split(p piece, out []piece) []piece {
	s := p.text
	if len(m.tokens) == 0 {
		return append(out, p)
	}
	emitted := 0 // end of the last piece appended
	text := func(start, end int) {
		if start < end {
			out = append(out, piece{text: s[start:end], id: -1, first: p.first && start == 0})
		}
	}
	for from := 0; from < len(s); {
		k, start, end := m.next(s, from)
		if k < 0 {
			break
		}
		from = end
		t := m.tokens[k]
		if t.singleWord {
			before, _ := utf8.DecodeLastRuneInString(s[:start])
			after, _ := utf8.DecodeRuneInString(s[end:])
			if (start > 0 && isWordChar(before)) || (end < len(s) && isWordChar(after)) {
				continue
			}
		}
		if t.lstrip {
			ns := start
			for ns > 0 {
				r, n := utf8.DecodeLastRuneInString(s[:ns])
				if !unicode.IsSpace(r) {
					break
				}
				ns -= n
			}
			start = max(ns, emitted)
		}
		if t.rstrip {
			for end < len(s) {
				r, n := utf8.DecodeRuneInString(s[end:])
				if !unicode.IsSpace(r) {
					break
				}
				end += n
			}
			from = end
		}
		text(emitted, start)
		out = append(out, piece{text: s[start:end], id: t.id, first: p.first && start == 0})
		emitted = end
	}
	text(emitted, len(s))
	return out
}
