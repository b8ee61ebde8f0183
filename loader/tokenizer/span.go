package tokenizer

import "unicode/utf8"

// MaxTokenBytes returns the most bytes of input text that one token can
// stand for, so that a text of n bytes encodes to at least
// n/MaxTokenBytes tokens: a caller with room for k tokens can refuse a text
// longer than k*MaxTokenBytes bytes without encoding it. It is 0 when the
// tokenizer gives no such bound, because a step of its pipeline may remove
// text or fold a run of any length into one token: a Strip or Unicode
// normalizer, a Replace that may shorten, a pre-tokenizer that removes what
// it splits on, added tokens that swallow the whitespace beside them,
// unknown characters fused into one token or dropped.
func (t *Tokenizer) MaxTokenBytes() int { return t.maxTokenBytes }

// tokenSpan computes MaxTokenBytes. Every step that it accepts keeps the
// text or lengthens it (Metaspace writes a space as ▁, byte-level BPE a byte
// as one or two bytes), and a token's string is the text it stands for
// with such steps applied (byte fallback tokens, <0xNN>, are longer still),
// so the longest token string bounds the input one token covers.
func (t *Tokenizer) tokenSpan(added []addedToken) int {
	if t.norm != nil && !normKeepsText(t.norm) {
		return 0
	}
	byteLevel := false
	if t.pre != nil {
		keeps, bl := preKeepsText(t.pre)
		if !keeps {
			return 0
		}
		byteLevel = bl
	}
	n := 0
	m := t.model
	if !m.coversEveryByte(byteLevel) {
		if m.unk == "" || m.fuseUnk {
			return 0 // unknown characters are dropped, or fused into one token
		}
		n = utf8.UTFMax // an unknown token stands for one character
	}
	for s := range m.vocab {
		n = max(n, len(s))
	}
	for _, a := range added {
		if a.lstrip || a.rstrip {
			return 0
		}
		n = max(n, len(a.content))
	}
	return n
}

// coversEveryByte reports whether every character of any text has a token
// of its own or byte tokens to fall back on, so that the unknown token is
// never used: with byte fallback, every <0xNN> token; with byte-level
// pre-tokenization (byteLevel), every character of the byte alphabet.
func (m *bpeModel) coversEveryByte(byteLevel bool) bool {
	if m.byteFallback {
		all := true
		for _, id := range m.byteIDs {
			all = all && id >= 0
		}
		if all {
			return true
		}
	}
	if !byteLevel || m.prefix != "" || m.suffix != "" {
		return false
	}
	for _, s := range byteUTF8 {
		if _, ok := m.vocab[s]; !ok {
			return false
		}
	}
	return true
}

// normKeepsText reports whether a normalizer never shortens text.
func normKeepsText(n normalizer) bool {
	switch n := n.(type) {
	case normalizerSeq:
		for _, s := range n {
			if !normKeepsText(s) {
				return false
			}
		}
		return true
	case prependNormalizer:
		return true
	case replaceNormalizer:
		return n.re == nil && len(n.content) >= len(n.literal)
	}
	return false // Strip removes text, Unicode forms may compose characters
}

// preKeepsText reports whether a pre-tokenizer passes on every byte of its
// input (possibly lengthened), and whether it writes the text in the
// byte-level alphabet.
func preKeepsText(p preTokenizer) (keeps, byteLevel bool) {
	switch p := p.(type) {
	case preTokenizerSeq:
		for _, s := range p {
			k, bl := preKeepsText(s)
			if !k {
				return false, false
			}
			byteLevel = byteLevel || bl
		}
		return true, byteLevel
	case byteLevelPreTokenizer:
		return true, true
	case metaspacePreTokenizer, digitsPreTokenizer:
		return true, false
	case splitPreTokenizer:
		return p.behavior != splitRemoved, false
	}
	return false, false
}
