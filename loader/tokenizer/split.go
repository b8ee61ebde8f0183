package tokenizer

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// The split expressions that byte-level tokenizers declare most. They use a
// negative lookahead, which Go's regexp package does not have; rather than
// through regexp2, each is matched by a hand-written scanner (four times
// faster: BenchmarkSplit) that follows the expression's alternatives in
// order, as a backtracking engine would.
const (
	// gpt2Pattern is the expression of the ByteLevel pre-tokenizer (GPT-2).
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	// llama3Pattern is the Split expression of Llama 3 (and GPT-4's cl100k).
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// qwen2Pattern is llama3Pattern with single digits, as Qwen2 writes it.
	qwen2Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// span is a byte range [start, end) of a string; match tells whether a
// pattern matched it.
type span struct {
	start, end int
	match      bool
}

// matcher finds the non-overlapping matches of a split pattern, left to right.
type matcher interface {
	matches(s string) []span
}

// newRegexMatcher returns the matcher for a Split pre-tokenizer's Regex
// pattern: a scanner for the known lookahead expressions (faster than an
// engine), compileOnig's for the rest. Expressions neither Go's regexp nor
// regexp2 can run are an error.
func newRegexMatcher(expr string) (matcher, error) {
	switch expr {
	case gpt2Pattern:
		return scanMatcher(gpt2Next), nil
	case llama3Pattern:
		return scanMatcher(func(s string, i int) int { return cl100kNext(s, i, 3) }), nil
	case qwen2Pattern:
		return scanMatcher(func(s string, i int) int { return cl100kNext(s, i, 1) }), nil
	}
	re, err := compileOnig(expr)
	if err != nil {
		return nil, err
	}
	return re, nil
}

// literalMatcher matches a fixed string; an empty one matches nothing.
type literalMatcher string

func (m literalMatcher) matches(s string) []span {
	if m == "" {
		return nil
	}
	var out []span
	for i := 0; ; {
		j := strings.Index(s[i:], string(m))
		if j < 0 {
			return out
		}
		j += i
		out = append(out, span{j, j + len(m), true})
		i = j + len(m)
	}
}

// funcMatcher matches every single character for which the function is true.
type funcMatcher func(rune) bool

func (f funcMatcher) matches(s string) []span {
	var out []span
	for i, r := range s {
		if f(r) {
			out = append(out, span{i, i + utf8.RuneLen(r), true})
		}
	}
	return out
}

// scanMatcher is a pattern that matches everywhere: given a position it
// returns where the match starting there ends (always past the position).
type scanMatcher func(s string, i int) int

func (f scanMatcher) matches(s string) []span {
	out := make([]span, 0, len(s)/4+1)
	for i := 0; i < len(s); {
		end := f(s, i)
		out = append(out, span{i, end, true})
		i = end
	}
	return out
}

func isLetter(r rune) bool { return unicode.IsLetter(r) }
func isNumber(r rune) bool { return unicode.IsNumber(r) }
func isSpace(r rune) bool  { return unicode.IsSpace(r) }
func isCRLF(r rune) bool   { return r == '\r' || r == '\n' }

// isOther is [^\s\p{L}\p{N}].
func isOther(r rune) bool { return !unicode.IsSpace(r) && !unicode.IsLetter(r) && !unicode.IsNumber(r) }

func runeAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return -1, 0
	}
	return utf8.DecodeRuneInString(s[i:])
}

// runEnd returns the end of the run of characters in class starting at i.
func runEnd(s string, i int, class func(rune) bool) int {
	for i < len(s) {
		r, n := runeAt(s, i)
		if !class(r) {
			break
		}
		i += n
	}
	return i
}

// contractionEnd matches s|t|re|ve|m|ll|d at i (after an apostrophe) and
// returns the end, or -1. With fold set, letters match in either case, and
// the long s (U+017F) matches s, as Unicode case folding has it.
func contractionEnd(s string, i int, fold bool) int {
	is := func(j int, c rune) bool {
		r, _ := runeAt(s, j)
		if r == c {
			return true
		}
		if !fold {
			return false
		}
		return r == unicode.ToUpper(c) || (c == 's' && r == 0x17F)
	}
	r, n := runeAt(s, i)
	if r < 0 {
		return -1
	}
	switch {
	case is(i, 's'), is(i, 't'), is(i, 'm'), is(i, 'd'):
		return i + n
	case is(i, 'r') && is(i+1, 'e'), is(i, 'v') && is(i+1, 'e'), is(i, 'l') && is(i+1, 'l'):
		return i + 2
	}
	return -1
}

// spaceEnd matches \s+(?!\S)|\s+ at i, where s[i] is whitespace: the whole
// run when it ends the text or is one character long, otherwise the run
// without its last character (which then joins the word after it).
func spaceEnd(s string, i int) int {
	end, last := i, i
	for end < len(s) {
		r, n := runeAt(s, end)
		if !isSpace(r) {
			break
		}
		last = end
		end += n
	}
	if end == len(s) || last == i {
		return end
	}
	return last
}

// gpt2Next returns the end of the gpt2Pattern match that starts at i.
func gpt2Next(s string, i int) int {
	r, n := runeAt(s, i)
	if r == '\'' {
		if e := contractionEnd(s, i+n, false); e > 0 {
			return e
		}
	}
	for _, class := range [...]func(rune) bool{isLetter, isNumber, isOther} {
		if r == ' ' {
			if r2, _ := runeAt(s, i+n); r2 >= 0 && class(r2) {
				return runEnd(s, i+n, class)
			}
		}
		if class(r) {
			return runEnd(s, i, class)
		}
	}
	return spaceEnd(s, i)
}

// cl100kNext returns the end of the llama3Pattern match that starts at i,
// with at most maxDigits digits in a number (qwen2Pattern: 1).
func cl100kNext(s string, i, maxDigits int) int {
	r, n := runeAt(s, i)
	if r == '\'' {
		if e := contractionEnd(s, i+n, true); e > 0 {
			return e
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if !isCRLF(r) && !isLetter(r) && !isNumber(r) {
		if r2, _ := runeAt(s, i+n); r2 >= 0 && isLetter(r2) {
			return runEnd(s, i+n, isLetter)
		}
	}
	if isLetter(r) {
		return runEnd(s, i, isLetter)
	}
	// \p{N}{1,maxDigits}
	if isNumber(r) {
		end := i
		for k := 0; k < maxDigits; k++ {
			r, n := runeAt(s, end)
			if r < 0 || !isNumber(r) {
				break
			}
			end += n
		}
		return end
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	j := -1
	if r == ' ' {
		if r2, _ := runeAt(s, i+n); r2 >= 0 && isOther(r2) {
			j = i + n
		}
	}
	if j < 0 && isOther(r) {
		j = i
	}
	if j >= 0 {
		return runEnd(s, runEnd(s, j, isOther), isCRLF)
	}
	// \s*[\r\n]+ : whitespace up to and including the run's last line break.
	lastBreak := -1
	for k := i; k < len(s); {
		r, n := runeAt(s, k)
		if !isSpace(r) {
			break
		}
		if isCRLF(r) {
			lastBreak = k + n
		}
		k += n
	}
	if lastBreak > 0 {
		return lastBreak
	}
	return spaceEnd(s, i)
}

// splitBehavior says what happens to the matched parts when a string is split.
type splitBehavior int

const (
	splitRemoved splitBehavior = iota
	splitIsolated
	splitMergedWithPrevious
	splitMergedWithNext
	splitContiguous
)

var splitBehaviors = map[string]splitBehavior{
	"Removed":            splitRemoved,
	"Isolated":           splitIsolated,
	"MergedWithPrevious": splitMergedWithPrevious,
	"MergedWithNext":     splitMergedWithNext,
	"Contiguous":         splitContiguous,
}

// cover turns the matches in s into spans covering all of s, in order.
func cover(s string, ms []span, invert bool) []span {
	out := make([]span, 0, 2*len(ms)+1)
	prev := 0
	for _, m := range ms {
		if prev < m.start {
			out = append(out, span{prev, m.start, invert})
		}
		out = append(out, span{m.start, m.end, !invert})
		prev = m.end
	}
	if prev < len(s) || len(out) == 0 {
		out = append(out, span{prev, len(s), invert})
	}
	return out
}

// applyBehavior returns the pieces kept by a split, given spans covering the
// string; empty pieces are dropped by the caller.
func applyBehavior(spans []span, b splitBehavior) []span {
	var out []span
	switch b {
	case splitRemoved:
		for _, sp := range spans {
			if !sp.match {
				out = append(out, sp)
			}
		}
	case splitIsolated:
		out = spans
	case splitContiguous:
		prev := false
		for _, sp := range spans {
			if len(out) > 0 && sp.match == prev {
				out[len(out)-1].end = sp.end
			} else {
				out = append(out, span{sp.start, sp.end, false})
			}
			prev = sp.match
		}
	case splitMergedWithPrevious:
		prev := false
		for _, sp := range spans {
			if len(out) > 0 && sp.match && !prev {
				out[len(out)-1].end = sp.end
			} else {
				out = append(out, span{sp.start, sp.end, false})
			}
			prev = sp.match
		}
	case splitMergedWithNext:
		prev := false
		for k := len(spans) - 1; k >= 0; k-- {
			sp := spans[k]
			if len(out) > 0 && sp.match && !prev {
				out[len(out)-1].start = sp.start
			} else {
				out = append(out, span{sp.start, sp.end, false})
			}
			prev = sp.match
		}
		for a, b := 0, len(out)-1; a < b; a, b = a+1, b-1 {
			out[a], out[b] = out[b], out[a]
		}
	}
	return out
}
