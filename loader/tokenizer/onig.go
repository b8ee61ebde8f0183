package tokenizer

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
)

// Oniguruma, the engine Hugging Face compiles split and replace expressions
// with, gives \s, \d and \w their Unicode meaning; Go's regexp gives them
// their ASCII one. translateOnig rewrites them as explicit Unicode classes.
const (
	onigSpace = `\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}`
	onigWord  = `\p{L}\p{M}\p{Nd}\p{Pc}`
)

// compileOnig compiles an Oniguruma expression with Go's regexp, after
// translateOnig.
func compileOnig(expr string) (*regexp.Regexp, error) {
	t, err := translateOnig(expr)
	if err != nil {
		return nil, err
	}
	return regexp.Compile(t)
}

// translateOnig rewrites \s \S \d \D \w \W with Unicode classes, inside and
// outside brackets. Word boundaries and negated classes inside brackets have
// no Go equivalent and are an error.
func translateOnig(expr string) (string, error) {
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
			case inClass && (e == 'S' || e == 'D' || e == 'W'):
				return "", fmt.Errorf(`\%c inside brackets has no Go equivalent`, e)
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
			case e == 'b' || e == 'B':
				if !inClass {
					return "", errors.New(`word boundaries (\b, \B) are ASCII-only in Go`)
				}
				b.WriteRune('\\')
				b.WriteRune(e)
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
			return "", errors.New("POSIX bracket classes ([:alpha:] and the like) are ASCII-only in Go")
		case c == ']' && inClass:
			inClass = false
			b.WriteRune(c)
		default:
			b.WriteRune(c)
		}
	}
	return b.String(), nil
}
