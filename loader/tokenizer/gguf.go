package tokenizer

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"sort"
	"strings"

	"golang.org/x/text/unicode/norm"
)

// The token types of a GGUF vocabulary (tokenizer.ggml.token_type).
const (
	TokenNormal      = 1
	TokenUnknown     = 2
	TokenControl     = 3
	TokenUserDefined = 4
	TokenUnused      = 5
	TokenByte        = 6
)

// GGUFVocab is a tokenizer as a GGUF file stores it (the tokenizer.ggml.*
// metadata of llama.cpp), in one of two kinds:
//
//   - "llama": SentencePiece-style BPE with byte fallback (Llama 2,
//     TinyLlama, Mistral). Text gets a ▁ in front when AddSpacePrefix is
//     set (at its start and after each special token) and ▁ for every
//     space; pieces merge by the pairs of Merges when the file has them,
//     else as SentencePiece does, the adjacent pair whose concatenation is
//     the token of highest score first (the leftmost among equals);
//     characters outside the vocabulary become <0xXX> byte tokens.
//   - "gpt2": byte-level BPE (GPT-2, Llama 3, Qwen2): the text is split by
//     the pre-tokenizer Pre names, written in the byte-level alphabet and
//     merged by Merges.
//
// Tokens of type TokenControl and TokenUnknown are special tokens and
// TokenUserDefined ones added tokens: each is cut out of the text wherever
// it appears, before anything else. A TokenUnused token spelled
// "[PAD<id>]" is a hole in the id space (llama.cpp's converter pads the
// vocabulary to the embedding's rows with them).
type GGUFVocab struct {
	Model  string    // "llama" or "gpt2"
	Pre    string    // gpt2: the pre-tokenizer, one of GGUFPreTokenizers
	Tokens []string  // by id
	Scores []float32 // llama: one per token, or nil
	Types  []int32   // one per token, or nil (all normal)
	Merges []string  // "a b", lowest rank first; may be nil for llama
	// BOS, EOS and UNK are token ids, -1 for none.
	BOS, EOS, UNK  int
	AddBOS, AddEOS bool // Encode(text, true) adds them
	AddSpacePrefix bool // llama: ▁ in front of text
	// ChatTemplate is tokenizer.chat_template, "" when none.
	ChatTemplate string
}

// ggufPre is a pre-tokenizer of the gpt2 kind.
type ggufPre struct {
	pattern      string // split expression; gpt2Pattern is ByteLevel's own
	nfc          bool   // the text is put in Unicode NFC first (Qwen2)
	ignoreMerges bool   // a word that is a token is that token (Llama 3)
}

// ggufPres are the tokenizer.ggml.pre names strata implements, with the
// Hugging Face pre-tokenizers they stand for.
var ggufPres = map[string]ggufPre{
	"gpt-2":            {pattern: gpt2Pattern},
	"llama-bpe":        {pattern: llama3Pattern, ignoreMerges: true},
	"llama3":           {pattern: llama3Pattern, ignoreMerges: true},
	"llama-v3":         {pattern: llama3Pattern, ignoreMerges: true},
	"qwen2":            {pattern: qwen2Pattern, nfc: true},
	"deepseek-r1-qwen": {pattern: qwen2Pattern, nfc: true},
}

// GGUFPreTokenizers lists the tokenizer.ggml.pre names FromGGUF accepts
// for the gpt2 kind, sorted.
func GGUFPreTokenizers() []string {
	var names []string
	for n := range ggufPres {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

var padToken = regexp.MustCompile(`^\[PAD[0-9]+\]$`)

// FromGGUF builds the tokenizer a GGUF vocabulary describes, with the same
// internal structures Parse builds from the equivalent tokenizer.json: a
// "llama" vocabulary becomes the Llama 2 pipeline (Prepend and Replace
// normalizers, BPE with byte fallback, the Replace, ByteFallback, Fuse,
// Strip decoders), a "gpt2" one GPT-2's, Llama 3's or Qwen2's byte-level
// pipeline. Encode(text, true) adds BOS and EOS as AddBOS and AddEOS say.
// An unknown kind or pre-tokenizer is an error wrapping ErrUnsupported.
func FromGGUF(v *GGUFVocab) (*Tokenizer, error) {
	t, err := fromGGUF(v)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: GGUF vocabulary: %w", err)
	}
	return t, nil
}

func fromGGUF(v *GGUFVocab) (*Tokenizer, error) {
	n := len(v.Tokens)
	switch {
	case v.Model != "llama" && v.Model != "gpt2":
		return nil, fmt.Errorf("%w tokenizer model %q (supported: llama, gpt2)", ErrUnsupported, v.Model)
	case n == 0:
		return nil, errors.New("no tokens")
	case n > maxTokenIDs:
		return nil, fmt.Errorf("%d tokens, more than the %d supported", n, maxTokenIDs)
	case v.Scores != nil && len(v.Scores) != n:
		return nil, fmt.Errorf("%d scores for %d tokens", len(v.Scores), n)
	case v.Types != nil && len(v.Types) != n:
		return nil, fmt.Errorf("%d token types for %d tokens", len(v.Types), n)
	}
	for _, id := range []struct {
		name string
		id   int
	}{{"BOS", v.BOS}, {"EOS", v.EOS}, {"unknown token", v.UNK}} {
		if id.id < -1 || id.id >= n {
			return nil, fmt.Errorf("%s id %d outside the %d tokens", id.name, id.id, n)
		}
	}
	typ := func(id int) int32 {
		if v.Types == nil {
			return TokenNormal
		}
		return v.Types[id]
	}

	m := &bpeModel{vocab: make(map[string]int, n), cache: make(map[string][]int)}
	t := &Tokenizer{model: m, bos: v.BOS, eos: v.EOS, tokens: make([]string, n), known: make([]bool, n)}
	var added []addedToken
	for id, tok := range v.Tokens {
		ty := typ(id)
		if tok == "" || ty == TokenUnused && padToken.MatchString(tok) {
			continue // a hole in the id space
		}
		if prev, dup := m.vocab[tok]; dup {
			return nil, fmt.Errorf("token %q has ids %d and %d", tok, prev, id)
		}
		m.vocab[tok] = id
		t.tokens[id], t.known[id] = tok, true
		switch ty {
		case TokenControl, TokenUnknown:
			added = append(added, addedToken{id: id, content: tok, special: true})
		case TokenUserDefined:
			added = append(added, addedToken{id: id, content: tok})
		}
	}
	if v.UNK >= 0 {
		m.unk = v.Tokens[v.UNK]
	}
	for b := range m.byteIDs {
		id, ok := m.vocab[fmt.Sprintf("<0x%02X>", b)]
		if !ok {
			id = -1
		}
		m.byteIDs[b] = id
	}

	if v.Model == "llama" {
		m.byteFallback, m.fuseUnk = true, true
		replace := replaceNormalizer{replacer{literal: " ", content: "▁"}}
		strip := 0
		if v.AddSpacePrefix {
			t.norm = normalizerSeq{prependNormalizer("▁"), replace}
			strip = 1
		} else {
			t.norm = normalizerSeq{replace}
		}
		t.dec = decoderSeq{replaceDecoder{replacer{literal: "▁", content: " "}}, byteFallbackDecoder{},
			fuseDecoder{}, stripDecoder{content: ' ', start: strip}}
	} else {
		p, ok := ggufPres[v.Pre]
		if !ok {
			return nil, fmt.Errorf("%w pre-tokenizer %q (supported: %s)", ErrUnsupported, v.Pre, strings.Join(GGUFPreTokenizers(), ", "))
		}
		m.ignoreMerges = p.ignoreMerges
		if p.pattern == gpt2Pattern {
			t.pre = byteLevelPreTokenizer{useRegex: true}
		} else {
			split, err := newRegexMatcher(p.pattern)
			if err != nil {
				return nil, err
			}
			t.pre = preTokenizerSeq{splitPreTokenizer{m: split, behavior: splitIsolated, regex: p.pattern}, byteLevelPreTokenizer{}}
		}
		if p.nfc {
			t.norm = unicodeNormalizer{norm.NFC}
		}
		t.dec = byteLevelDecoder{}
	}

	switch {
	case v.Merges != nil:
		if err := m.setMerges(v.Merges); err != nil {
			return nil, err
		}
	case v.Model == "gpt2":
		return nil, errors.New("a gpt2 vocabulary needs merges")
	default:
		if v.Scores == nil {
			return nil, errors.New("a llama vocabulary needs scores or merges")
		}
		m.mergesFromScores(v, typ)
		t.scores = slices.Clone(v.Scores)
	}

	step := postStep{nil}
	if v.AddBOS && v.BOS >= 0 {
		step = append(postStep{{v.BOS}}, step...)
	}
	if v.AddEOS && v.EOS >= 0 {
		step = append(step, []int{v.EOS})
	}
	if len(step) > 1 {
		t.post = []postStep{step}
	}
	t.setAdded(added)
	t.maxTokenBytes = t.tokenSpan(added)
	t.named = map[string]string{}
	for _, n := range []struct {
		key string
		id  int
	}{{"bos_token", v.BOS}, {"eos_token", v.EOS}, {"unk_token", v.UNK}} {
		if n.id >= 0 && t.known[n.id] {
			t.named[n.key] = t.tokens[n.id]
		}
	}
	t.chatTemplate = v.ChatTemplate
	return t, nil
}

// setMerges fills the merge table from "a b" strings, rank by rank.
func (m *bpeModel) setMerges(merges []string) error {
	m.merges = make(map[uint64]merge, len(merges))
	for rank, s := range merges {
		// As llama.cpp reads them: the first space after the first byte.
		i := strings.IndexByte(s[min(1, len(s)):], ' ')
		if i < 0 {
			return fmt.Errorf("merge %d %q is not two tokens separated by a space", rank, s)
		}
		i += min(1, len(s))
		l, r := s[:i], s[i+1:]
		a, ok := m.vocab[l]
		if !ok {
			return fmt.Errorf("merge %d: token %q is not in the vocabulary", rank, l)
		}
		b, ok := m.vocab[r]
		if !ok {
			return fmt.Errorf("merge %d: token %q is not in the vocabulary", rank, r)
		}
		id, ok := m.vocab[l+r]
		if !ok {
			return fmt.Errorf("merge %d: merged token %q is not in the vocabulary", rank, l+r)
		}
		if _, dup := m.merges[pairKey(a, b)]; !dup {
			m.merges[pairKey(a, b)] = merge{rank: int32(rank), id: int32(id)}
		}
	}
	return nil
}

// mergesFromScores builds SentencePiece's merges: every pair of tokens
// whose concatenation is a normal, user-defined or unused token merges
// into it, higher scores first (equal scores share a rank, so the
// leftmost pair goes first).
func (m *bpeModel) mergesFromScores(v *GGUFVocab, typ func(int) int32) {
	type cand struct {
		a, b, id int
	}
	var cands []cand
	for id, tok := range v.Tokens {
		switch typ(id) {
		case TokenNormal, TokenUserDefined, TokenUnused:
		default:
			continue
		}
		if vid, ok := m.vocab[tok]; !ok || vid != id {
			continue
		}
		for k := 1; k < len(tok); k++ {
			if !utf8Boundary(tok, k) {
				continue
			}
			a, ok := m.vocab[tok[:k]]
			if !ok {
				continue
			}
			if b, ok := m.vocab[tok[k:]]; ok {
				cands = append(cands, cand{a, b, id})
			}
		}
	}
	score := func(id int) float32 {
		if s := v.Scores[id]; s == s {
			return s
		}
		return float32(math.Inf(-1)) // a NaN merges last
	}
	scores := make([]float32, 0, len(cands))
	for _, c := range cands {
		scores = append(scores, score(c.id))
	}
	slices.Sort(scores)
	scores = slices.Compact(scores)
	m.merges = make(map[uint64]merge, len(cands))
	for _, c := range cands {
		i, _ := slices.BinarySearch(scores, score(c.id))
		m.merges[pairKey(c.a, c.b)] = merge{rank: int32(len(scores) - 1 - i), id: int32(c.id)}
	}
}

// utf8Boundary reports whether byte k of s starts a character.
func utf8Boundary(s string, k int) bool { return s[k]&0xC0 != 0x80 }

// GGUFVocab returns the tokenizer as a GGUF vocabulary of size ids (the
// model's embedding rows; ids the tokenizer leaves free are written as
// unused "[PAD<id>]" tokens, as llama.cpp's converter writes them), for
// writing a GGUF file that FromGGUF, and llama.cpp, read back as the same
// tokenizer. Tokenizers of the forms GGUF has a name for can be written:
// SentencePiece-style BPE with byte fallback (the "llama" kind), and
// byte-level BPE with GPT-2's, Llama 3's or Qwen2's pre-tokenizer (the
// "gpt2" kind); anything else is an error wrapping ErrUnsupported.
//
// Two differences from the tokenizer.json are accepted: the <0xXX> tokens
// of the llama kind are byte tokens, which llama.cpp never matches in the
// text (tokenizer.json may list them as special added tokens), and a
// Metaspace pre-tokenizer with prepend_scheme "first" is written as the
// llama kind's space prefix, which llama.cpp also puts after a special
// token in the text.
func (t *Tokenizer) GGUFVocab(size int) (*GGUFVocab, error) {
	v, err := t.ggufVocab(size)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: cannot write as a GGUF vocabulary: %w", err)
	}
	return v, nil
}

func (t *Tokenizer) ggufVocab(size int) (*GGUFVocab, error) {
	m := t.model
	if len(t.tokens) > size {
		return nil, fmt.Errorf("the tokenizer has ids up to %d, beyond the model's vocabulary of %d", len(t.tokens)-1, size)
	}
	if m.prefix != "" || m.suffix != "" {
		return nil, fmt.Errorf("%w BPE with a continuing_subword_prefix or end_of_word_suffix", ErrUnsupported)
	}
	v := &GGUFVocab{Tokens: make([]string, size), Types: make([]int32, size), BOS: t.bos, EOS: t.eos, UNK: -1,
		ChatTemplate: t.chatTemplate}
	if m.unk != "" {
		v.UNK = t.lookup(m.unk)
	}
	var err error
	if m.byteFallback {
		v.Model = "llama"
		v.AddSpacePrefix, err = t.spaceScheme()
	} else {
		v.Model = "gpt2"
		v.Pre, err = t.preName()
	}
	if err != nil {
		return nil, err
	}
	if v.AddBOS, v.AddEOS, err = t.specialFlags(); err != nil {
		return nil, err
	}

	for id := range size {
		if id >= len(t.tokens) || !t.known[id] {
			v.Tokens[id], v.Types[id] = fmt.Sprintf("[PAD%d]", id), TokenUnused
			continue
		}
		v.Tokens[id], v.Types[id] = t.tokens[id], TokenNormal
	}
	for _, am := range []*addedMatcher{t.rawAdded, t.normAdded} {
		for _, a := range am.tokens {
			v.Types[a.id] = TokenUserDefined
			if a.special {
				v.Types[a.id] = TokenControl
			}
		}
	}
	if v.UNK >= 0 {
		v.Types[v.UNK] = TokenUnknown
	}
	if m.byteFallback {
		for _, id := range m.byteIDs {
			if id >= 0 {
				v.Types[id] = TokenByte
			}
		}
	}
	seen := make(map[string]int, size)
	for id, tok := range v.Tokens {
		if prev, dup := seen[tok]; dup {
			return nil, fmt.Errorf("token %q has ids %d and %d", tok, prev, id)
		}
		seen[tok] = id
	}

	if t.scores != nil { // read from a GGUF file without merges
		v.Scores = make([]float32, size)
		copy(v.Scores, t.scores)
		return v, nil
	}
	if v.Merges, err = m.mergeList(); err != nil {
		return nil, err
	}
	if v.Model == "llama" {
		// Scores that make SentencePiece's merging follow the merges: the
		// token of an earlier merge scores higher.
		v.Scores = make([]float32, size)
		for id := range v.Scores {
			v.Scores[id] = -float32(len(v.Merges))
		}
		for i := len(v.Merges) - 1; i >= 0; i-- {
			l, r, _ := strings.Cut(v.Merges[i], " ")
			v.Scores[m.vocab[l+r]] = -float32(i)
		}
	}
	return v, nil
}

// mergeList returns the merges as "a b" strings, lowest rank first.
func (m *bpeModel) mergeList() ([]string, error) {
	byID := make(map[int]string, len(m.vocab))
	for tok, id := range m.vocab {
		byID[id] = tok
	}
	type ranked struct {
		rank int32
		s    string
	}
	list := make([]ranked, 0, len(m.merges))
	for k, mg := range m.merges {
		a, b := byID[int(k>>32)], byID[int(uint32(k))]
		if strings.Contains(a, " ") || strings.Contains(b, " ") || a == "" {
			return nil, fmt.Errorf("%w merge of %q and %q: a GGUF merge cannot hold a space", ErrUnsupported, a, b)
		}
		list = append(list, ranked{mg.rank, a + " " + b})
	}
	sort.Slice(list, func(i, j int) bool { return list[i].rank < list[j].rank })
	out := make([]string, len(list))
	for i, r := range list {
		out[i] = r.s
	}
	return out, nil
}

// spaceScheme checks that a byte-fallback tokenizer is the Llama 2
// pipeline and reports whether it puts ▁ in front of text.
func (t *Tokenizer) spaceScheme() (bool, error) {
	bad := func(what string) error {
		return fmt.Errorf("%w %s for a SentencePiece-style tokenizer (want the Llama 2 pipeline)", ErrUnsupported, what)
	}
	replace := func(n normalizer) bool {
		r, ok := n.(replaceNormalizer)
		return ok && r.re == nil && r.literal == " " && r.content == "▁"
	}
	var prefix bool
	switch n := t.norm.(type) {
	case nil:
	case replaceNormalizer:
		if !replace(n) {
			return false, bad("normalizer")
		}
	case normalizerSeq:
		switch {
		case len(n) == 1 && replace(n[0]):
		case len(n) == 2 && n[0] == prependNormalizer("▁") && replace(n[1]):
			prefix = true
		default:
			return false, bad("normalizer")
		}
	default:
		return false, bad("normalizer")
	}
	switch p := t.pre.(type) {
	case nil:
		if t.norm == nil {
			return false, bad("missing pre-tokenizer")
		}
	case metaspacePreTokenizer:
		if p.replacement != "▁" || p.split {
			return false, bad("Metaspace pre-tokenizer")
		}
		if t.norm == nil {
			prefix = p.prepend != prependNever
		} else if p.prepend != prependNever {
			return false, bad("Metaspace pre-tokenizer after a normalizer")
		}
	default:
		return false, bad("pre-tokenizer")
	}
	return prefix, nil
}

// preName returns the tokenizer.ggml.pre name of a byte-level tokenizer.
func (t *Tokenizer) preName() (string, error) {
	bl := func(p preTokenizer) (byteLevelPreTokenizer, bool) {
		b, ok := p.(byteLevelPreTokenizer)
		return b, ok && !b.addPrefixSpace
	}
	if _, ok := t.dec.(byteLevelDecoder); !ok {
		return "", fmt.Errorf("%w decoder for a byte-level tokenizer (want ByteLevel)", ErrUnsupported)
	}
	nfc := false
	switch n := t.norm.(type) {
	case nil:
	case unicodeNormalizer:
		nfc = n.form == norm.NFC
		if !nfc {
			return "", fmt.Errorf("%w normalizer for a byte-level tokenizer", ErrUnsupported)
		}
	default:
		return "", fmt.Errorf("%w normalizer for a byte-level tokenizer", ErrUnsupported)
	}
	pattern := ""
	switch p := t.pre.(type) {
	case byteLevelPreTokenizer:
		if b, ok := bl(p); ok && b.useRegex {
			pattern = gpt2Pattern
		}
	case preTokenizerSeq:
		if len(p) == 2 {
			sp, ok := p[0].(splitPreTokenizer)
			b, ok2 := bl(p[1])
			if ok && ok2 && !b.useRegex && sp.behavior == splitIsolated && !sp.invert {
				pattern = sp.regex
			}
		}
	}
	for _, name := range []string{"gpt-2", "llama-bpe", "qwen2"} {
		p := ggufPres[name]
		if p.pattern == pattern && p.nfc == nfc && p.ignoreMerges == t.model.ignoreMerges {
			return name, nil
		}
	}
	return "", fmt.Errorf("%w pre-tokenizer: GGUF names only GPT-2's, Llama 3's and Qwen2's", ErrUnsupported)
}

// specialFlags reads add_bos and add_eos off the post-processor: nothing,
// or BOS before the text and EOS after it.
func (t *Tokenizer) specialFlags() (addBOS, addEOS bool, err error) {
	if len(t.post) == 0 {
		return false, false, nil
	}
	if len(t.post) > 1 {
		return false, false, fmt.Errorf("%w post-processor of %d steps", ErrUnsupported, len(t.post))
	}
	var before, after []int
	seq := false
	for _, it := range t.post[0] {
		switch {
		case it == nil:
			seq = true
		case seq:
			after = append(after, it...)
		default:
			before = append(before, it...)
		}
	}
	switch {
	case !seq:
		return false, false, fmt.Errorf("%w post-processor that drops the text", ErrUnsupported)
	case len(before) > 1 || len(before) == 1 && before[0] != t.bos:
		return false, false, fmt.Errorf("%w post-processor adding %v before the text (GGUF can say only BOS)", ErrUnsupported, before)
	case len(after) > 1 || len(after) == 1 && after[0] != t.eos:
		return false, false, fmt.Errorf("%w post-processor adding %v after the text (GGUF can say only EOS)", ErrUnsupported, after)
	}
	return len(before) == 1, len(after) == 1, nil
}
