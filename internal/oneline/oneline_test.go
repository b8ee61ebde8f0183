package oneline

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"testing"
)

func TestString(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"one line", "one line"},
		{"yaml: unmarshal errors:\n  line 2: field x not found\n  line 3: field y not found", "yaml: unmarshal errors: line 2: field x not found; line 3: field y not found"},
		{"a\r\n\r\nb\n", "a; b"},
		{"\n", ""},
	} {
		if got := String(c.in); got != c.want {
			t.Errorf("String(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestError(t *testing.T) {
	if Error(nil) != nil {
		t.Error("Error(nil) is not nil")
	}
	one := errors.New("one line")
	if Error(one) != one {
		t.Error("a one-line error was wrapped")
	}
	multi := Error(fmt.Errorf("config:\n  line 1: %w", fs.ErrNotExist))
	if strings.Contains(multi.Error(), "\n") || !errors.Is(multi, fs.ErrNotExist) {
		t.Errorf("%q: not one line, or no longer wraps fs.ErrNotExist", multi)
	}
}

func TestJSON(t *testing.T) {
	long := "[" + strings.Repeat("1, ", 100) + "1]"
	for _, c := range []struct{ in, want string }{
		{"[1,\n  2,\n  \"x\"\n]", `[1,2,"x"]`},
		{`"a\nb"`, `"a\nb"`},
		{"not json\nat all", `"not json\nat all"`},
		{long, "[" + strings.Repeat("1,", 31) + "1..."},
		{`"` + strings.Repeat("é", 40) + `"`, `"` + strings.Repeat("é", 31) + "..."},
	} {
		got := JSON([]byte(c.in))
		if got != c.want || strings.ContainsAny(got, "\r\n") {
			t.Errorf("JSON(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
