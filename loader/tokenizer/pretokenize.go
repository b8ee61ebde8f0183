package tokenizer

import (
	"strings"
	"unicode"
)

// piece is a part of the text on its way to the model: either an added token
// already resolved to id, or text (id -1) still to be split and encoded.
type piece struct {
	text string
	id   int
	// first is set on the piece that starts the input text, for Metaspace's
	// prepend_scheme "first".
	first bool
	// byteLevel says the text still has to be written in the byte-level
	// alphabet before the model sees it (done late, to spare allocations).
	byteLevel bool
}

// preTokenizer splits a text piece into words, passing each to emit in
// order.
type preTokenizer interface {
	preTokenize(p piece, emit func(piece))
}

// sub returns the part [start, end) of p.
func (p piece) sub(start, end int) piece {
	return piece{text: p.text[start:end], id: -1, first: p.first && start == 0, byteLevel: p.byteLevel}
}

// emitSpans passes the non-empty kept spans of p to emit.
func emitSpans(p piece, spans []span, emit func(piece)) {
	for _, sp := range spans {
		if sp.start < sp.end {
			emit(p.sub(sp.start, sp.end))
		}
	}
}

// materialized returns p with pending byte-level text written out.
func (p piece) materialized() piece {
	if p.byteLevel {
		p.text = string(appendByteLevel(nil, p.text))
		p.byteLevel = false
	}
	return p
}

type preTokenizerSeq []preTokenizer

func (s preTokenizerSeq) preTokenize(p piece, emit func(piece)) {
	// Chain the steps back to front: step i hands its words to step i+1.
	next := emit
	for i := len(s) - 1; i >= 0; i-- {
		step, after := s[i], next
		next = func(q piece) { step.preTokenize(q.materialized(), after) }
	}
	next(p)
}

// splitPreTokenizer splits on a pattern with one of the five behaviours.
type splitPreTokenizer struct {
	m        matcher
	behavior splitBehavior
	invert   bool
	regex    string // the expression m matches, for a Regex pattern
}

func (sp splitPreTokenizer) preTokenize(p piece, emit func(piece)) {
	if scan, ok := sp.m.(scanMatcher); ok && sp.behavior == splitIsolated {
		scanEmit(p, scan, emit) // every part is kept as it is
		return
	}
	emitSpans(p, applyBehavior(cover(p.text, sp.m.matches(p.text), sp.invert), sp.behavior), emit)
}

// scanEmit passes each match of a scanning pattern to emit.
func scanEmit(p piece, next scanMatcher, emit func(piece)) {
	for i := 0; i < len(p.text); {
		end := next(p.text, i)
		emit(p.sub(i, end))
		i = end
	}
}

// byteLevelPreTokenizer optionally adds a leading space, splits with the
// GPT-2 expression, and rewrites every byte as its alphabet character.
type byteLevelPreTokenizer struct {
	addPrefixSpace bool
	useRegex       bool
}

func (b byteLevelPreTokenizer) preTokenize(p piece, emit func(piece)) {
	if b.addPrefixSpace && !strings.HasPrefix(p.text, " ") {
		p.text = " " + p.text
	}
	p.byteLevel = true
	if !b.useRegex {
		emit(p)
		return
	}
	scanEmit(p, gpt2Next, emit)
}

// prependScheme says when Metaspace puts the replacement in front of a piece.
type prependScheme int

const (
	prependAlways prependScheme = iota
	prependFirst
	prependNever
)

// metaspacePreTokenizer replaces spaces with a visible character (▁),
// optionally prepends it, and optionally splits before each one.
type metaspacePreTokenizer struct {
	replacement string
	prepend     prependScheme
	split       bool
}

func (m metaspacePreTokenizer) preTokenize(p piece, emit func(piece)) {
	t := strings.ReplaceAll(p.text, " ", m.replacement)
	if !strings.HasPrefix(t, m.replacement) {
		if m.prepend == prependAlways || (m.prepend == prependFirst && p.first) {
			t = m.replacement + t
		}
	}
	p.text = t
	if !m.split {
		emit(p)
		return
	}
	emitSpans(p, applyBehavior(cover(t, literalMatcher(m.replacement).matches(t), false), splitMergedWithNext), emit)
}

// digitsPreTokenizer isolates numbers, each digit alone or in runs.
type digitsPreTokenizer struct{ individual bool }

func (d digitsPreTokenizer) preTokenize(p piece, emit func(piece)) {
	b := splitContiguous
	if d.individual {
		b = splitIsolated
	}
	splitPreTokenizer{m: funcMatcher(unicode.IsNumber), behavior: b}.preTokenize(p, emit)
}

// isPunctuation is Rust's char::is_ascii_punctuation or Unicode category P.
func isPunctuation(r rune) bool {
	if r < 0x80 {
		return unicode.IsPunct(r) || unicode.IsSymbol(r)
	}
	return unicode.IsPunct(r)
}
