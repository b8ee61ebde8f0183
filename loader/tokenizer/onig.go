package tokenizer

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/dlclark/regexp2/v2"
)

// Hugging Face compiles split and replace expressions with Oniguruma (Ruby
// syntax). compileOnig runs them with Go's regexp where it can, for its
// guarantee of time linear in the text (though regexp2 is often faster on
// these expressions), and with regexp2, a backtracking engine of .NET
// syntax, where they need what Go's lacks (lookaround, backreferences,
// atomic groups, possessive quantifiers, Unicode word boundaries).
// translateOnig gives \s, \d and \w the Unicode meaning they have in
// Oniguruma.
const (
	onigSpace = `\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}`
	onigWord  = `\p{L}\p{M}\p{Nd}\p{Pc}`
)

// onigEngine is the engine an expression is translated for.
type onigEngine int

const (
	engineGo      onigEngine = iota // Go's regexp
	engineRegexp2                   // github.com/dlclark/regexp2
)

// onigRegexp is a compiled Oniguruma expression: one of re and re2 is set.
type onigRegexp struct {
	re  *regexp.Regexp
	re2 *regexp2.Regexp
}

// compileOnig compiles an Oniguruma expression with Go's regexp, or with
// regexp2 when Go's cannot run it.
func compileOnig(expr string) (*onigRegexp, error) {
	if t, err := translateOnig(expr, engineGo); err == nil {
		if re, err := regexp.Compile(t); err == nil {
			return &onigRegexp{re: re}, nil
		}
	}
	t, err := translateOnig(expr, engineRegexp2)
	if err != nil {
		return nil, err
	}
	// Without a backtracking limit or a timeout, regexp2 reports no match
	// errors: a long run of spaces under \s+(?!\S) needs a deep stack.
	re2, err := regexp2.Compile(t, regexp2.OptionMaxBacktrackingStackSize(-1))
	if err != nil {
		return nil, err
	}
	return &onigRegexp{re2: re2}, nil
}

// matches returns the successive non-overlapping matches in s.
func (r *onigRegexp) matches(s string) []span {
	if r.re != nil {
		idx := r.re.FindAllStringIndex(s, -1)
		out := make([]span, len(idx))
		for i, p := range idx {
			out[i] = span{p[0], p[1], true}
		}
		return out
	}
	// regexp2 matches runes and reports rune indexes; the byte offsets are
	// found walking s forward (an invalid byte is one rune, U+FFFD, in both).
	rs := []rune(s)
	ri, bi := 0, 0
	byteAt := func(i int) int {
		for ri < i {
			_, n := utf8.DecodeRuneInString(s[bi:])
			bi += n
			ri++
		}
		return bi
	}
	var out []span
	// The error is always nil (see compileOnig); were it not, the text
	// after the last match would stay unmatched.
	_ = r.re2.FindRunesMatches(rs, 0, func(v regexp2.MatchView) bool {
		i, n, _ := v.GroupRange(0)
		start := byteAt(i)
		out = append(out, span{start, byteAt(i + n), true})
		return true
	})
	return out
}

// replaceAll replaces every match in s with content, taken literally.
func (r *onigRegexp) replaceAll(s, content string) string {
	if r.re != nil {
		return r.re.ReplaceAllLiteralString(s, content)
	}
	ms := r.matches(s)
	if len(ms) == 0 {
		return s
	}
	var b strings.Builder
	prev := 0
	for _, m := range ms {
		b.WriteString(s[prev:m.start])
		b.WriteString(content)
		prev = m.end
	}
	b.WriteString(s[prev:])
	return b.String()
}

// translateOnig rewrites an Oniguruma expression for the engine: \s \S \d
// \D \w \W as Unicode classes inside and outside brackets, \b and \B
// (regexp2 only) as lookarounds on word characters. What has no equivalent
// is an error: negated classes inside brackets (but \D), POSIX brackets,
// class intersection and nested classes, and for Go's regexp the word
// boundaries.
func translateOnig(expr string, engine onigEngine) (string, error) {
	var b strings.Builder
	inClass := false
	rs := []rune(expr)
	for i := 0; i < len(rs); i++ {
		c := rs[i]
		switch {
		case c == '\\' && i+1 < len(rs):
			i++
			e := rs[i]
			switch {
			case inClass && (e == 's' || e == 'd' || e == 'w'):
				b.WriteString(map[rune]string{'s': onigSpace, 'd': `\p{Nd}`, 'w': onigWord}[e])
			case inClass && e == 'D':
				b.WriteString(`\P{Nd}`)
			case inClass && (e == 'S' || e == 'W'):
				return "", fmt.Errorf(`\%c inside brackets has no equivalent`, e)
			case e == 's':
				b.WriteString("[" + onigSpace + "]")
			case e == 'S':
				b.WriteString("[^" + onigSpace + "]")
			case e == 'd':
				b.WriteString(`\p{Nd}`)
			case e == 'D':
				b.WriteString(`\P{Nd}`)
			case e == 'w':
				b.WriteString("[" + onigWord + "]")
			case e == 'W':
				b.WriteString("[^" + onigWord + "]")
			case (e == 'b' || e == 'B') && !inClass:
				if engine == engineGo {
					return "", errors.New(`word boundaries (\b, \B) are ASCII-only in Go`)
				}
				w := "[" + onigWord + "]"
				if e == 'b' {
					fmt.Fprintf(&b, `(?:(?<=%s)(?!%s)|(?<!%s)(?=%s))`, w, w, w, w)
				} else {
					fmt.Fprintf(&b, `(?:(?<=%s)(?=%s)|(?<!%s)(?!%s))`, w, w, w, w)
				}
			default:
				b.WriteRune('\\')
				b.WriteRune(e)
			}
		case c == '[' && !inClass:
			inClass = true
			b.WriteRune(c)
			if i+1 < len(rs) && rs[i+1] == '^' {
				i++
				b.WriteRune('^')
			}
			if i+1 < len(rs) && rs[i+1] == ']' { // a leading ] is literal
				i++
				b.WriteString(`\]`)
			}
		case c == '[' && inClass && i+1 < len(rs) && rs[i+1] == ':':
			return "", errors.New("POSIX bracket classes ([:alpha:] and the like) have no Unicode equivalent here")
		case c == '[' && inClass:
			return "", errors.New("nested character classes have no equivalent")
		case c == '&' && inClass && i+1 < len(rs) && rs[i+1] == '&':
			return "", errors.New("character class intersection (&&) has no equivalent")
		case c == ']' && inClass:
			inClass = false
			b.WriteRune(c)
		default:
			b.WriteRune(c)
		}
	}
	return b.String(), nil
}
