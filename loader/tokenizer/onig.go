package tokenizer

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2/v2"
)

// Hugging Face compiles split and replace expressions with Oniguruma (Ruby
// syntax). compileOnig runs them with Go's regexp where it can, for its
// guarantee of time linear in the text (though regexp2 is often faster on
// these expressions), and with regexp2, a backtracking engine of .NET
// syntax, where they need what Go's lacks (lookaround, backreferences,
// atomic groups, possessive quantifiers, Unicode word boundaries).
// translateOnig rewrites what the syntaxes mean differently: \s, \d, \w
// and \h become explicit Unicode classes, ^ and $ match at every line, the
// option m is dot-all.
const (
	onigSpace = `\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}`
	onigHex   = `0-9a-fA-F`
)

// onigWord is Oniguruma's \w: Alphabetic, marks, decimal digits, connector
// punctuation, and the Latin-1 superscripts and fractions (² ³ ¹ ¼ ½ ¾) of
// its 8-bit word table. Alphabetic is L, Nl and Other_Alphabetic, which
// Go's regexp cannot name: the ranges are the characters of
// Other_Alphabetic outside L, Nl and M (circled and squared letters).
const onigWord = `\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{B2}\x{B3}\x{B9}\x{BC}-\x{BE}` +
	`\x{24B6}-\x{24E9}\x{1F130}-\x{1F149}\x{1F150}-\x{1F169}\x{1F170}-\x{1F189}`

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
		// An empty match just after a match is dropped, as Oniguruma's
		// iterator in Hugging Face's library (and Go's regexp) does.
		if n == 0 && len(out) > 0 && out[len(out)-1].end == start {
			return true
		}
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
// \D \w \W \h \H as Unicode classes inside and outside brackets, \b and \B
// (regexp2 only) as lookarounds on Oniguruma's word characters, \uHHHH as
// \x{HHHH}, \p{^X} as \P{X}, {,n} as {0,n}, the inline option m as s, and
// ^ and $ as line anchors. What has no equivalent is an error: negated
// classes inside brackets (but \D), POSIX brackets, class intersection and
// nested classes, and for Go's regexp the word boundaries.
func translateOnig(expr string, engine onigEngine) (string, error) {
	var b strings.Builder
	b.WriteString("(?m)") // Ruby syntax: ^ and $ are line anchors
	inClass := false
	rs := []rune(expr)
	for i := 0; i < len(rs); i++ {
		c := rs[i]
		switch {
		case c == '\\' && i+1 < len(rs):
			i++
			e := rs[i]
			switch {
			case inClass && (e == 's' || e == 'd' || e == 'w' || e == 'h'):
				b.WriteString(map[rune]string{'s': onigSpace, 'd': `\p{Nd}`, 'w': onigWord, 'h': onigHex}[e])
			case inClass && e == 'D':
				b.WriteString(`\P{Nd}`)
			case inClass && (e == 'S' || e == 'W' || e == 'H'):
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
			case e == 'h':
				b.WriteString("[" + onigHex + "]")
			case e == 'H':
				b.WriteString("[^" + onigHex + "]")
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
			case e == 'u' && i+4 < len(rs) && isHex(rs[i+1:i+5]):
				fmt.Fprintf(&b, `\x{%s}`, string(rs[i+1:i+5]))
				i += 4
			case (e == 'p' || e == 'P') && i+2 < len(rs) && rs[i+1] == '{' && rs[i+2] == '^':
				if e == 'p' {
					e = 'P'
				} else {
					e = 'p'
				}
				b.WriteString(`\` + string(e) + "{")
				i += 2
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
		case c == '(' && !inClass && i+1 < len(rs) && rs[i+1] == '?':
			n, err := translateOptions(&b, rs[i:])
			if err != nil {
				return "", err
			}
			i += n - 1
		case c == '{' && !inClass && i+1 < len(rs) && rs[i+1] == ',' && i > 0:
			// {,n} is {0,n} when n is a number and the brace closes.
			j := i + 2
			for j < len(rs) && rs[j] >= '0' && rs[j] <= '9' {
				j++
			}
			if j > i+2 && j < len(rs) && rs[j] == '}' {
				b.WriteString("{0")
			} else {
				b.WriteRune(c)
			}
		default:
			b.WriteRune(c)
		}
	}
	return b.String(), nil
}

// translateOptions writes the group opening at the start of rs, "(?...",
// and returns how many runes it took. Inline options (?imx-imx) and
// (?imx-imx: keep i and x; Ruby's m (dot matches newline) is s in Go and
// .NET. Other groups ((?:, (?=, (?<name>, ...) are written as they are.
func translateOptions(b *strings.Builder, rs []rune) (int, error) {
	j := 2
	for j < len(rs) && (rs[j] == '-' || unicode.IsLetter(rs[j])) {
		j++
	}
	if j == 2 || j >= len(rs) || (rs[j] != ')' && rs[j] != ':') {
		b.WriteString("(?")
		return 2, nil
	}
	b.WriteString("(?")
	for _, o := range rs[2:j] {
		switch o {
		case 'i', 'x', '-':
			b.WriteRune(o)
		case 'm':
			b.WriteRune('s')
		default:
			return 0, fmt.Errorf("inline option %q has no equivalent", o)
		}
	}
	b.WriteRune(rs[j])
	return j + 1, nil
}

func isHex(rs []rune) bool {
	for _, r := range rs {
		if !strings.ContainsRune("0123456789abcdefABCDEF", r) {
			return false
		}
	}
	return true
}
