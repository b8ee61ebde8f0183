package main

import "strings"

// stopper holds back generated text that may be the start of a stop
// string, so that a stop string split over several tokens is found and
// never sent: Add takes the text of each new token and returns what can
// be sent now, and whether a stop string appeared (the text before it is
// the last to send).
type stopper struct {
	stops   []string
	pending string
}

// Add appends text and returns the part that is safe to send.
func (s *stopper) Add(text string) (out string, stopped bool) {
	buf := s.pending + text
	if len(s.stops) == 0 {
		s.pending = ""
		return buf, false
	}
	first := -1
	for _, stop := range s.stops {
		if i := strings.Index(buf, stop); i >= 0 && (first < 0 || i < first) {
			first = i
		}
	}
	if first >= 0 {
		s.pending = ""
		return buf[:first], true
	}
	// Keep the longest tail of buf that begins some stop string: a stop
	// string beginning before it would be a longer such tail.
	keep := 0
	for _, stop := range s.stops {
		for n := min(len(stop)-1, len(buf)); n > keep; n-- {
			if strings.HasSuffix(buf, stop[:n]) {
				keep = n
				break
			}
		}
	}
	s.pending = buf[len(buf)-keep:]
	return buf[:len(buf)-keep], false
}

// Flush returns the text held back, at the end of the generation: it
// began a stop string that never finished.
func (s *stopper) Flush() string {
	out := s.pending
	s.pending = ""
	return out
}
