package tokenizer

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzOnig: any expression compiles or is refused without a panic; the
// matches of one that compiles, on either engine, are ordered, disjoint,
// on character boundaries and with no empty match just after a match, and
// replaceAll puts the content in their place.
func FuzzOnig(f *testing.F) {
	for _, c := range [][2]string{
		{`\s+(?!\S)|\s+`, "a   b  \n"},
		{`(?i:'s|'t)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}`, "It'S 12345 ok"},
		{`^\s+|\s+$`, " a \n b "},
		{`\w+|\W`, "été Ⓐ² x_1"},
		{`x*`, "axxb"},
		{`\p{L}+|(?=\p{N})`, "v1.2 ab3"},
		{`(?m)a.b|\h+`, "a\nb f0"},
		{`\d{,2}|\u00e9|\b`, "123é"},
	} {
		f.Add(c[0], c[1])
	}
	f.Fuzz(func(t *testing.T, expr, text string) {
		if len(expr) > 40 || len(text) > 24 {
			return // short texts keep backtracking cheap
		}
		re, err := compileOnig(expr)
		if err != nil {
			return
		}
		ms := re.matches(text)
		prev := -1
		var want strings.Builder
		for _, m := range ms {
			if m.start < prev || m.end < m.start || m.end > len(text) || !boundary(text, m.start) || !boundary(text, m.end) ||
				m.start == m.end && m.start == prev {
				t.Fatalf("%q on %q: matches %v", expr, text, ms)
			}
			want.WriteString(text[max(prev, 0):m.start])
			want.WriteString("<>")
			prev = m.end
		}
		want.WriteString(text[max(prev, 0):])
		if got := re.replaceAll(text, "<>"); got != want.String() {
			t.Fatalf("%q on %q: replaceAll = %q, want %q", expr, text, got, want.String())
		}
	})
}

// boundary reports whether i is at a character boundary of s, an invalid
// byte being a character of its own.
func boundary(s string, i int) bool {
	j := 0
	for j < i {
		_, n := utf8.DecodeRuneInString(s[j:])
		j += n
	}
	return j == i
}
