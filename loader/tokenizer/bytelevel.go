package tokenizer

// The byte-level alphabet of GPT-2 style tokenizers: every byte is written
// as one printable character so that BPE never sees raw control bytes or
// spaces. Printable Latin-1 bytes stand for themselves; the other 68 bytes
// are given the code points from U+0100 upwards, in byte order.
var (
	byteToRune [256]rune
	byteUTF8   [256]string // byteToRune as UTF-8
	runeToByte = map[rune]byte{}
)

func init() {
	next := rune(0x100)
	for b := 0; b < 256; b++ {
		printable := (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
		if printable {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = next
			next++
		}
		runeToByte[byteToRune[b]] = byte(b)
		byteUTF8[b] = string(byteToRune[b])
	}
}

// appendByteLevel appends s with every byte written as its alphabet
// character.
func appendByteLevel(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		dst = append(dst, byteUTF8[s[i]]...)
	}
	return dst
}

// appendByteLevelToken appends the bytes that token stands for. A token with
// any character outside the alphabet is taken as its own UTF-8 bytes, as the
// Hugging Face ByteLevel decoder does.
func appendByteLevelToken(dst []byte, token string) []byte {
	start := len(dst)
	for _, r := range token {
		b, ok := runeToByte[r]
		if !ok {
			return append(dst[:start], token...)
		}
		dst = append(dst, b)
	}
	return dst
}
