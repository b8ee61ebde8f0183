package main

import (
	"strings"
	"testing"
)

// TestStopper: a stop string is found whether it comes in one piece of
// text or spread over several, the text before it is sent and the stop
// string never is, and text that only began a stop string is sent once
// it cannot be one or at the end.
func TestStopper(t *testing.T) {
	for _, tc := range []struct {
		name    string
		stops   []string
		pieces  []string
		want    string
		stopped bool
	}{
		{"no stops", nil, []string{"ab", "cd"}, "abcd", false},
		{"no match", []string{"xyz"}, []string{"ab", "cd"}, "abcd", false},
		{"in one piece", []string{"cd"}, []string{"abcde", "fg"}, "ab", true},
		{"across two pieces", []string{"cd"}, []string{"abc", "de"}, "ab", true},
		{"across three pieces", []string{"bcde"}, []string{"ab", "c", "d", "ef"}, "a", true},
		{"a false start", []string{"abc"}, []string{"xab", "x", "abd"}, "xabxabd", false},
		{"a false start then the stop", []string{"abc"}, []string{"ab", "ab", "c"}, "ab", true},
		{"the earliest of two", []string{"de", "bc"}, []string{"abcdef"}, "a", true},
		{"at the start", []string{"ab"}, []string{"a", "bcd"}, "", true},
		{"held at the end", []string{"abc"}, []string{"xa", "b"}, "xab", false},
		{"multibyte", []string{"é!"}, []string{"café", "!"}, "caf", true},
		{"overlapping prefixes", []string{"aab"}, []string{"a", "a", "a", "b"}, "a", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := stopper{stops: tc.stops}
			var got strings.Builder
			stopped := false
			for _, p := range tc.pieces {
				out, stop := s.Add(p)
				got.WriteString(out)
				for _, st := range tc.stops {
					if strings.Contains(out, st) {
						t.Errorf("Add(%q) sent %q, which holds the stop string %q", p, out, st)
					}
				}
				if stop {
					stopped = true
					break
				}
			}
			if !stopped {
				got.WriteString(s.Flush())
			}
			if got.String() != tc.want || stopped != tc.stopped {
				t.Errorf("sent %q (stopped %v), want %q (stopped %v)", got.String(), stopped, tc.want, tc.stopped)
			}
		})
	}
}
