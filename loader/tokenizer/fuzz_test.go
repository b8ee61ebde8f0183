package tokenizer

import (
	"testing"
	"unicode/utf8"
)

// FuzzEncode encodes arbitrary strings with both fixture tokenizers: no
// panic, an error exactly when the text is not UTF-8, byte-level round trip,
// the stream agreeing with Decode, and no token standing for more than
// MaxTokenBytes of the text. The seed corpus is the reference
// cases plus special-token spellings.
func FuzzEncode(f *testing.F) {
	fxs := allFixtures(f)
	for _, fx := range fxs {
		for _, c := range fx.cases {
			f.Add(c.Text)
		}
	}
	for _, s := range []string{"<s>a</s>", "<0x41><unk>", " \u2581x", "'S 'll 12345 \r\n\t x", "\xff\xfe", "é\u0301"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, fx := range fxs {
			ids, err := fx.tok.Encode(s, true)
			if !utf8.ValidString(s) {
				if err == nil {
					t.Fatalf("%s: Encode(%q) of invalid UTF-8: no error", fx.name, s)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s: Encode(%q): %v", fx.name, s, err)
			}
			if n := fx.tok.MaxTokenBytes(); n <= 0 || (len(ids)-1)*n < len(s) {
				t.Fatalf("%s: %d bytes encode to %d tokens, MaxTokenBytes %d", fx.name, len(s), len(ids)-1, n)
			}
			if len(ids) == 0 || ids[0] != fx.tok.BOS() {
				t.Fatalf("%s: Encode(%q, true) = %v, does not start with BOS", fx.name, s, ids)
			}
			dec, err := fx.tok.Decode(ids[1:])
			if err != nil {
				t.Fatalf("%s: Decode: %v", fx.name, err)
			}
			if fx.byteLevel && dec != s {
				t.Fatalf("%s: Decode(Encode(%q)) = %q", fx.name, s, dec)
			}
			if got := streamAll(t, fx.tok.NewStream(), ids[1:]); got != dec {
				t.Fatalf("%s: stream = %q, Decode = %q", fx.name, got, dec)
			}
		}
	})
}
