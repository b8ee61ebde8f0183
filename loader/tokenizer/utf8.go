package tokenizer

import "unicode/utf8"

// appendLossy appends the UTF-8 decoding of b to dst, replacing every
// maximal ill-formed subsequence with one U+FFFD, the rule of the Unicode
// standard (chapter 3, "U+FFFD substitution of maximal subparts") that both
// Python's errors="replace" and Rust's from_utf8_lossy follow. Go's own
// conversions write one U+FFFD per bad byte instead, which would not match.
//
// When final is false, a sequence that is still valid but cut short by the
// end of b is left unconsumed, so a streaming caller can wait for more bytes.
// It returns the extended dst and the number of bytes of b consumed.
func appendLossy(dst, b []byte, final bool) ([]byte, int) {
	i := 0
	for i < len(b) {
		c := b[i]
		if c < utf8.RuneSelf {
			dst = append(dst, c)
			i++
			continue
		}
		need, lo, hi := 0, byte(0x80), byte(0xBF)
		switch {
		case c >= 0xC2 && c <= 0xDF:
			need = 1
		case c == 0xE0:
			need, lo = 2, 0xA0
		case c == 0xED:
			need, hi = 2, 0x9F
		case c >= 0xE1 && c <= 0xEF:
			need = 2
		case c == 0xF0:
			need, lo = 3, 0x90
		case c == 0xF4:
			need, hi = 3, 0x8F
		case c >= 0xF1 && c <= 0xF3:
			need = 3
		default:
			dst = utf8.AppendRune(dst, utf8.RuneError)
			i++
			continue
		}
		j := i + 1
		bad := false
		for k := 0; k < need; k++ {
			if j >= len(b) {
				if !final {
					return dst, i
				}
				bad = true
				break
			}
			l, h := byte(0x80), byte(0xBF)
			if k == 0 {
				l, h = lo, hi
			}
			if b[j] < l || b[j] > h {
				bad = true
				break
			}
			j++
		}
		if bad {
			dst = utf8.AppendRune(dst, utf8.RuneError)
		} else {
			dst = append(dst, b[i:j]...)
		}
		i = j
	}
	return dst, i
}

// lossyString decodes b as a whole with appendLossy.
func lossyString(b []byte) string {
	out, _ := appendLossy(make([]byte, 0, len(b)), b, true)
	return string(out)
}
