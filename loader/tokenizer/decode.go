package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// decoder turns token strings back into text. decodeChain is the whole-list
// form, following the Hugging Face decoders step by step; stage builds the
// incremental form used by Stream, which must produce the same text.
type decoder interface {
	decodeChain(tokens []string) []string
	stage(next sink) sink
}

// sink receives decoder output. Before a fusing step (Fuse, ByteLevel) the
// stream is a list of tokens; after one it is pieces of a single text.
type sink interface {
	token(s string)
	text(s string)
	flush()
}

type decoderSeq []decoder

func (d decoderSeq) decodeChain(tokens []string) []string {
	for _, s := range d {
		tokens = s.decodeChain(tokens)
	}
	return tokens
}

func (d decoderSeq) stage(next sink) sink {
	for i := len(d) - 1; i >= 0; i-- {
		next = d[i].stage(next)
	}
	return next
}

// wholeText is the fallback for a token step that meets fused text: the text
// is one token, known only at the end, so it is held until flush and then
// passed through the whole-list form.
type wholeText struct {
	next  sink
	buf   strings.Builder
	saw   bool
	batch func([]string) []string
}

func (w *wholeText) text(s string) { w.saw = true; w.buf.WriteString(s) }

func (w *wholeText) flushText() {
	if w.saw {
		for _, t := range w.batch([]string{w.buf.String()}) {
			w.next.text(t)
		}
		w.buf.Reset()
		w.saw = false
	}
}

// --- Replace ---

type replaceDecoder struct{ replacer }

func (r replaceDecoder) decodeChain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = r.replace(t)
	}
	return out
}

func (r replaceDecoder) stage(next sink) sink {
	return &replaceStage{r: r, next: next, whole: wholeText{next: next, batch: r.decodeChain}}
}

type replaceStage struct {
	r       replaceDecoder
	next    sink
	pending string // fused text that may still start a match
	whole   wholeText
}

func (s *replaceStage) token(t string) { s.next.token(s.r.replace(t)) }

func (s *replaceStage) text(t string) {
	if s.r.re != nil || s.r.literal == "" {
		s.whole.text(t)
		return
	}
	buf := s.pending + t
	pat := s.r.literal
	var out strings.Builder
	for {
		j := strings.Index(buf, pat)
		if j < 0 {
			break
		}
		out.WriteString(buf[:j])
		out.WriteString(s.r.content)
		buf = buf[j+len(pat):]
	}
	// Keep the longest tail that could still grow into a match.
	keep := 0
	for k := min(len(pat)-1, len(buf)); k > 0; k-- {
		if strings.HasPrefix(pat, buf[len(buf)-k:]) {
			keep = k
			break
		}
	}
	out.WriteString(buf[:len(buf)-keep])
	s.pending = buf[len(buf)-keep:]
	if out.Len() > 0 {
		s.next.text(out.String())
	}
}

func (s *replaceStage) flush() {
	if s.pending != "" {
		s.next.text(s.pending)
		s.pending = ""
	}
	s.whole.flushText()
	s.next.flush()
}

// --- ByteFallback ---

// byteFallbackDecoder turns runs of <0xXX> tokens back into text: the run's
// bytes if they are valid UTF-8 as a whole, else one U+FFFD per byte.
type byteFallbackDecoder struct{}

// parseByteToken reads a <0xXX> token. Like Rust's u8::from_str_radix,
// which the Hugging Face decoder uses, it also takes "<0x+X>".
func parseByteToken(t string) (byte, bool) {
	if len(t) != 6 || !strings.HasPrefix(t, "<0x") || t[5] != '>' {
		return 0, false
	}
	h := t[3:5]
	if h[0] == '+' {
		h = h[1:]
	}
	var v byte
	for i := 0; i < len(h); i++ {
		c := h[i]
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		v = v<<4 | c
	}
	return v, true
}

func appendByteRun(out []string, run []byte) []string {
	if utf8.Valid(run) {
		return append(out, string(run))
	}
	for range run {
		out = append(out, "\uFFFD")
	}
	return out
}

func (byteFallbackDecoder) decodeChain(tokens []string) []string {
	out := make([]string, 0, len(tokens))
	var run []byte
	for _, t := range tokens {
		if b, ok := parseByteToken(t); ok {
			run = append(run, b)
			continue
		}
		if len(run) > 0 {
			out = appendByteRun(out, run)
			run = run[:0]
		}
		out = append(out, t)
	}
	if len(run) > 0 {
		out = appendByteRun(out, run)
	}
	return out
}

func (d byteFallbackDecoder) stage(next sink) sink {
	return &byteFallbackStage{next: next, whole: wholeText{next: next, batch: d.decodeChain}}
}

type byteFallbackStage struct {
	next  sink
	run   []byte
	whole wholeText
}

func (s *byteFallbackStage) endRun() {
	if len(s.run) > 0 {
		for _, t := range appendByteRun(nil, s.run) {
			s.next.token(t)
		}
		s.run = s.run[:0]
	}
}

func (s *byteFallbackStage) token(t string) {
	if b, ok := parseByteToken(t); ok {
		s.run = append(s.run, b)
		return
	}
	s.endRun()
	s.next.token(t)
}

func (s *byteFallbackStage) text(t string) { s.whole.text(t) }

func (s *byteFallbackStage) flush() {
	s.endRun()
	s.whole.flushText()
	s.next.flush()
}

// --- Fuse ---

type fuseDecoder struct{}

func (fuseDecoder) decodeChain(tokens []string) []string {
	return []string{strings.Join(tokens, "")}
}

func (fuseDecoder) stage(next sink) sink { return &fuseStage{next: next} }

type fuseStage struct {
	next sink
	saw  bool
}

func (s *fuseStage) token(t string) { s.saw = true; s.next.text(t) }
func (s *fuseStage) text(t string)  { s.saw = true; s.next.text(t) }
func (s *fuseStage) flush() {
	if !s.saw {
		s.next.text("") // the whole-list form always yields one token
	}
	s.saw = false
	s.next.flush()
}

// --- Strip ---

// stripDecoder removes up to start leading and stop trailing copies of a
// character from each token.
type stripDecoder struct {
	content     rune
	start, stop int
}

func (d stripDecoder) strip(t string) string {
	rs := []rune(t)
	cut := 0
	for i := 0; i < d.start && i < len(rs); i++ {
		if rs[i] != d.content {
			break
		}
		cut = i + 1
	}
	end := len(rs)
	for i := 0; i < min(d.stop, len(rs)-cut); i++ {
		if rs[len(rs)-1-i] != d.content {
			break
		}
		end = len(rs) - 1 - i
	}
	return string(rs[cut:end])
}

func (d stripDecoder) decodeChain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = d.strip(t)
	}
	return out
}

func (d stripDecoder) stage(next sink) sink {
	return &stripStage{d: d, next: next, startLeft: d.start}
}

type stripStage struct {
	d         stripDecoder
	next      sink
	startLeft int // leading copies that may still be cut from the fused text
	held      int // trailing copies of content held back (at most d.stop)
}

func (s *stripStage) token(t string) { s.next.token(s.d.strip(t)) }

func (s *stripStage) text(t string) {
	var out strings.Builder
	c := string(s.d.content)
	for _, r := range t {
		if s.startLeft > 0 {
			if r == s.d.content {
				s.startLeft--
				continue
			}
			s.startLeft = 0
		}
		if r == s.d.content && s.d.stop > 0 {
			if s.held == s.d.stop {
				out.WriteString(c) // the oldest held copy can no longer be trailing
			} else {
				s.held++
			}
			continue
		}
		out.WriteString(strings.Repeat(c, s.held))
		s.held = 0
		out.WriteRune(r)
	}
	if out.Len() > 0 {
		s.next.text(out.String())
	}
}

func (s *stripStage) flush() {
	s.held = 0 // trailing copies, at most stop of them, are cut
	s.startLeft = s.d.start
	s.next.flush()
}

// --- Metaspace ---

// metaspaceDecoder turns the replacement back into spaces; in the first
// token it is dropped instead when the pre-tokenizer prepends it.
type metaspaceDecoder struct {
	replacement rune
	dropFirst   bool
}

func (d metaspaceDecoder) apply(t string, first bool) string {
	var b strings.Builder
	for _, r := range t {
		if r == d.replacement {
			if first && d.dropFirst {
				continue
			}
			r = ' '
		}
		b.WriteRune(r)
	}
	return b.String()
}

func (d metaspaceDecoder) decodeChain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = d.apply(t, i == 0)
	}
	return out
}

func (d metaspaceDecoder) stage(next sink) sink {
	return &metaspaceStage{d: d, next: next, whole: wholeText{next: next, batch: d.decodeChain}}
}

type metaspaceStage struct {
	d     metaspaceDecoder
	next  sink
	n     int
	whole wholeText
}

func (s *metaspaceStage) token(t string) { s.next.token(s.d.apply(t, s.n == 0)); s.n++ }
func (s *metaspaceStage) text(t string)  { s.whole.text(t) }
func (s *metaspaceStage) flush() {
	s.whole.flushText()
	s.n = 0
	s.next.flush()
}

// --- ByteLevel ---

// byteLevelDecoder maps alphabet characters back to bytes and decodes all
// tokens together as UTF-8, substituting U+FFFD for ill-formed bytes.
type byteLevelDecoder struct{}

func (byteLevelDecoder) decodeChain(tokens []string) []string {
	var b []byte
	for _, t := range tokens {
		b = appendByteLevelToken(b, t)
	}
	return []string{lossyString(b)}
}

func (d byteLevelDecoder) stage(next sink) sink {
	return &byteLevelStage{next: next, whole: wholeText{next: next, batch: d.decodeChain}}
}

type byteLevelStage struct {
	next    sink
	pending []byte // an incomplete UTF-8 sequence
	saw     bool
	whole   wholeText
}

func (s *byteLevelStage) token(t string) {
	s.saw = true
	s.pending = appendByteLevelToken(s.pending, t)
	out, n := appendLossy(nil, s.pending, false)
	s.pending = append(s.pending[:0], s.pending[n:]...)
	if len(out) > 0 {
		s.next.text(string(out))
	}
}

func (s *byteLevelStage) text(t string) { s.whole.text(t) }

func (s *byteLevelStage) flush() {
	if s.saw || !s.whole.saw {
		out, _ := appendLossy(nil, s.pending, true)
		s.next.text(string(out))
	}
	s.pending = s.pending[:0]
	s.saw = false
	s.whole.flushText()
	s.next.flush()
}

// --- no decoder: tokens joined with spaces ---

type spaceJoinStage struct {
	next sink
	n    int
}

func (s *spaceJoinStage) token(t string) {
	if s.n > 0 {
		s.next.text(" ")
	}
	s.n++
	s.next.text(t)
}
func (s *spaceJoinStage) text(t string) { s.next.text(t) }
func (s *spaceJoinStage) flush()        { s.n = 0; s.next.flush() }

// --- clean_up_tokenization_spaces ---

// cleanupReplacements are applied in order to decoded text when the
// tokenizer config sets clean_up_tokenization_spaces, as transformers does.
var cleanupReplacements = [][2]string{
	{" .", "."}, {" ?", "?"}, {" !", "!"}, {" ,", ","}, {" ' ", "'"},
	{" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"},
}

func cleanupSpaces(s string) string {
	for _, r := range cleanupReplacements {
		s = strings.ReplaceAll(s, r[0], r[1])
	}
	return s
}

// cleanupStage applies cleanupSpaces to streamed text. Every pattern starts
// with a space, is at most 4 bytes long and only ever deletes spaces, so text
// can be cleaned independently on either side of any point preceded by three
// non-space bytes; the stage holds back what lies after the last such point.
type cleanupStage struct {
	next    sink
	pending string
}

func (s *cleanupStage) token(t string) { s.text(t) }

func (s *cleanupStage) text(t string) {
	s.pending += t
	cut := 0
	for p := len(s.pending); p >= 3; p-- {
		if !strings.Contains(s.pending[p-3:p], " ") {
			cut = p
			break
		}
	}
	if cut > 0 {
		s.next.text(cleanupSpaces(s.pending[:cut]))
		s.pending = s.pending[cut:]
	}
}

func (s *cleanupStage) flush() {
	if s.pending != "" {
		s.next.text(cleanupSpaces(s.pending))
		s.pending = ""
	}
	s.next.flush()
}

// collector is the end of the chain: it gathers the output text.
type collector struct{ b strings.Builder }

func (c *collector) token(t string) { c.b.WriteString(t) }
func (c *collector) text(t string)  { c.b.WriteString(t) }
func (c *collector) flush()         {}

func (c *collector) take() string {
	s := c.b.String()
	c.b.Reset()
	return s
}
