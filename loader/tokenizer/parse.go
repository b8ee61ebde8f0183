package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"golang.org/x/text/unicode/norm"
	"sort"
	"strings"
	"unicode/utf8"
)

// tokenizerFile is the part of tokenizer.json this package reads.
type tokenizerFile struct {
	AddedTokens   []addedTokenJSON `json:"added_tokens"`
	Normalizer    json.RawMessage  `json:"normalizer"`
	PreTokenizer  json.RawMessage  `json:"pre_tokenizer"`
	PostProcessor json.RawMessage  `json:"post_processor"`
	Decoder       json.RawMessage  `json:"decoder"`
	Model         json.RawMessage  `json:"model"`
}

type addedTokenJSON struct {
	ID         *int   `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	Lstrip     bool   `json:"lstrip"`
	Rstrip     bool   `json:"rstrip"`
	Normalized *bool  `json:"normalized"`
	Special    bool   `json:"special"`
}

func (a addedTokenJSON) token(id int) addedToken {
	norm := !a.Special
	if a.Normalized != nil {
		norm = *a.Normalized
	}
	return addedToken{id: id, content: a.Content, special: a.Special, singleWord: a.SingleWord,
		lstrip: a.Lstrip, rstrip: a.Rstrip, normalized: norm}
}

// isNull reports whether a component is absent or JSON null.
func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || bytes.Equal(t, []byte("null"))
}

// componentType reads the "type" field of a component.
func componentType(raw json.RawMessage) (string, error) {
	var c struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		return "", err
	}
	return c.Type, nil
}

// patternJSON is {"String": "..."} or {"Regex": "..."}.
type patternJSON struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

func (p patternJSON) replacer(content string) (replacer, error) {
	switch {
	case p.String != nil:
		return replacer{literal: *p.String, content: content}, nil
	case p.Regex != nil:
		re, err := compileOnig(*p.Regex)
		if err != nil {
			return replacer{}, fmt.Errorf("%w regex %q: %v", ErrUnsupported, *p.Regex, err)
		}
		return replacer{re: re, content: content}, nil
	}
	return replacer{}, errors.New("pattern has neither String nor Regex")
}

func (p patternJSON) matcher() (matcher, error) {
	switch {
	case p.String != nil:
		return literalMatcher(*p.String), nil
	case p.Regex != nil:
		m, err := newRegexMatcher(*p.Regex)
		if err != nil {
			return nil, fmt.Errorf("%w regex %q: %v", ErrUnsupported, *p.Regex, err)
		}
		return m, nil
	}
	return nil, errors.New("pattern has neither String nor Regex")
}

func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var v struct {
			Normalizers []json.RawMessage `json:"normalizers"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		var seq normalizerSeq
		for _, r := range v.Normalizers {
			if isNull(r) {
				continue
			}
			n, err := parseNormalizer(r)
			if err != nil {
				return nil, err
			}
			seq = append(seq, n)
		}
		return seq, nil
	case "Prepend":
		var v struct {
			Prepend string `json:"prepend"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		return prependNormalizer(v.Prepend), nil
	case "Replace":
		var v struct {
			Pattern patternJSON `json:"pattern"`
			Content string      `json:"content"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		r, err := v.Pattern.replacer(v.Content)
		if err != nil {
			return nil, fmt.Errorf("normalizer Replace: %w", err)
		}
		return replaceNormalizer{r}, nil
	case "Strip":
		var v struct {
			Left  bool `json:"strip_left"`
			Right bool `json:"strip_right"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		return stripNormalizer{v.Left, v.Right}, nil
	case "NFC":
		return unicodeNormalizer{norm.NFC}, nil
	case "NFD":
		return unicodeNormalizer{norm.NFD}, nil
	case "NFKC":
		return unicodeNormalizer{norm.NFKC}, nil
	case "NFKD":
		return unicodeNormalizer{norm.NFKD}, nil
	}
	return nil, fmt.Errorf("%w normalizer type %q", ErrUnsupported, typ)
}

func parsePrependScheme(raw json.RawMessage) (prependScheme, error) {
	var v struct {
		PrependScheme  *string `json:"prepend_scheme"`
		AddPrefixSpace *bool   `json:"add_prefix_space"`
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return 0, err
	}
	scheme := prependAlways
	if v.PrependScheme != nil {
		switch *v.PrependScheme {
		case "always":
		case "first":
			scheme = prependFirst
		case "never":
			scheme = prependNever
		default:
			return 0, fmt.Errorf("unknown prepend_scheme %q", *v.PrependScheme)
		}
	}
	if v.AddPrefixSpace != nil && !*v.AddPrefixSpace {
		scheme = prependNever
	}
	return scheme, nil
}

func singleRune(s, what string) (rune, error) {
	if utf8.RuneCountInString(s) != 1 {
		return 0, fmt.Errorf("%s %q is not one character", what, s)
	}
	r, _ := utf8.DecodeRuneInString(s)
	return r, nil
}

func parsePreTokenizer(raw json.RawMessage) (preTokenizer, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var v struct {
			PreTokenizers []json.RawMessage `json:"pretokenizers"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		var seq preTokenizerSeq
		for _, r := range v.PreTokenizers {
			p, err := parsePreTokenizer(r)
			if err != nil {
				return nil, err
			}
			seq = append(seq, p)
		}
		return seq, nil
	case "ByteLevel":
		v := struct {
			AddPrefixSpace bool `json:"add_prefix_space"`
			UseRegex       bool `json:"use_regex"`
		}{AddPrefixSpace: true, UseRegex: true}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		return byteLevelPreTokenizer{addPrefixSpace: v.AddPrefixSpace, useRegex: v.UseRegex}, nil
	case "Metaspace":
		v := struct {
			Replacement string `json:"replacement"`
			Split       bool   `json:"split"`
		}{Split: true}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		if _, err := singleRune(v.Replacement, "pre_tokenizer Metaspace: replacement"); err != nil {
			return nil, err
		}
		scheme, err := parsePrependScheme(raw)
		if err != nil {
			return nil, fmt.Errorf("pre_tokenizer Metaspace: %w", err)
		}
		return metaspacePreTokenizer{replacement: v.Replacement, prepend: scheme, split: v.Split}, nil
	case "Split":
		var v struct {
			Pattern  patternJSON `json:"pattern"`
			Behavior string      `json:"behavior"`
			Invert   bool        `json:"invert"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		m, err := v.Pattern.matcher()
		if err != nil {
			return nil, fmt.Errorf("pre_tokenizer Split: %w", err)
		}
		b, ok := splitBehaviors[v.Behavior]
		if !ok {
			return nil, fmt.Errorf("pre_tokenizer Split: unknown behavior %q", v.Behavior)
		}
		sp := splitPreTokenizer{m: m, behavior: b, invert: v.Invert}
		if v.Pattern.Regex != nil {
			sp.regex = *v.Pattern.Regex
		}
		return sp, nil
	case "Digits":
		var v struct {
			Individual bool `json:"individual_digits"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		return digitsPreTokenizer{individual: v.Individual}, nil
	case "WhitespaceSplit":
		return splitPreTokenizer{m: funcMatcher(isSpace), behavior: splitRemoved}, nil
	case "Punctuation":
		v := struct {
			Behavior string `json:"behavior"`
		}{Behavior: "Isolated"}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		b, ok := splitBehaviors[v.Behavior]
		if !ok {
			return nil, fmt.Errorf("pre_tokenizer Punctuation: unknown behavior %q", v.Behavior)
		}
		return splitPreTokenizer{m: funcMatcher(isPunctuation), behavior: b}, nil
	}
	return nil, fmt.Errorf("%w pre_tokenizer type %q", ErrUnsupported, typ)
}

func parseDecoder(raw json.RawMessage) (decoder, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var v struct {
			Decoders []json.RawMessage `json:"decoders"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		var seq decoderSeq
		for _, r := range v.Decoders {
			d, err := parseDecoder(r)
			if err != nil {
				return nil, err
			}
			seq = append(seq, d)
		}
		return seq, nil
	case "ByteLevel":
		return byteLevelDecoder{}, nil
	case "ByteFallback":
		return byteFallbackDecoder{}, nil
	case "Fuse":
		return fuseDecoder{}, nil
	case "Replace":
		var v struct {
			Pattern patternJSON `json:"pattern"`
			Content string      `json:"content"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		r, err := v.Pattern.replacer(v.Content)
		if err != nil {
			return nil, fmt.Errorf("decoder Replace: %w", err)
		}
		return replaceDecoder{r}, nil
	case "Strip":
		var v struct {
			Content string `json:"content"`
			Start   int    `json:"start"`
			Stop    int    `json:"stop"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		c, err := singleRune(v.Content, "decoder Strip: content")
		if err != nil {
			return nil, err
		}
		if v.Start < 0 || v.Stop < 0 {
			return nil, fmt.Errorf("decoder Strip: negative start %d or stop %d", v.Start, v.Stop)
		}
		return stripDecoder{content: c, start: v.Start, stop: v.Stop}, nil
	case "Metaspace":
		var v struct {
			Replacement string `json:"replacement"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		r, err := singleRune(v.Replacement, "decoder Metaspace: replacement")
		if err != nil {
			return nil, err
		}
		scheme, err := parsePrependScheme(raw)
		if err != nil {
			return nil, fmt.Errorf("decoder Metaspace: %w", err)
		}
		return metaspaceDecoder{replacement: r, dropFirst: scheme != prependNever}, nil
	}
	return nil, fmt.Errorf("%w decoder type %q", ErrUnsupported, typ)
}

// postStep is one step of a post-processor: a list of items, each a fixed
// list of ids or the encoded sequence itself (ids == nil).
type postStep [][]int

func (p postStep) apply(ids []int) []int {
	out := make([]int, 0, len(ids)+4)
	for _, it := range p {
		if it == nil {
			out = append(out, ids...)
		} else {
			out = append(out, it...)
		}
	}
	return out
}

// parsePostProcessor returns the steps that add special tokens to a single
// sequence. A nil step (ByteLevel) leaves the ids as they are.
func parsePostProcessor(raw json.RawMessage) ([]postStep, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var v struct {
			Processors []json.RawMessage `json:"processors"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		var steps []postStep
		for _, r := range v.Processors {
			s, err := parsePostProcessor(r)
			if err != nil {
				return nil, err
			}
			steps = append(steps, s...)
		}
		return steps, nil
	case "ByteLevel":
		return nil, nil
	case "TemplateProcessing":
		var v struct {
			Single []struct {
				SpecialToken *struct {
					ID string `json:"id"`
				} `json:"SpecialToken"`
				Sequence *struct {
					ID string `json:"id"`
				} `json:"Sequence"`
			} `json:"single"`
			SpecialTokens map[string]struct {
				IDs []int `json:"ids"`
			} `json:"special_tokens"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		var step postStep
		for _, it := range v.Single {
			switch {
			case it.Sequence != nil:
				step = append(step, nil)
			case it.SpecialToken != nil:
				st, ok := v.SpecialTokens[it.SpecialToken.ID]
				if !ok {
					return nil, fmt.Errorf("post_processor TemplateProcessing: special token %q has no entry in special_tokens", it.SpecialToken.ID)
				}
				step = append(step, append([]int{}, st.IDs...))
			default:
				return nil, errors.New("post_processor TemplateProcessing: template item is neither SpecialToken nor Sequence")
			}
		}
		return []postStep{step}, nil
	case "RobertaProcessing", "BertProcessing":
		var v struct {
			Sep [2]json.RawMessage `json:"sep"`
			Cls [2]json.RawMessage `json:"cls"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, err
		}
		var sep, cls int
		if err := json.Unmarshal(v.Sep[1], &sep); err != nil {
			return nil, fmt.Errorf("post_processor %s: sep: %v", typ, err)
		}
		if err := json.Unmarshal(v.Cls[1], &cls); err != nil {
			return nil, fmt.Errorf("post_processor %s: cls: %v", typ, err)
		}
		return []postStep{{{cls}, nil, {sep}}}, nil
	}
	return nil, fmt.Errorf("%w post_processor type %q", ErrUnsupported, typ)
}

// parseMerges reads merges in either form: "a b" strings or ["a", "b"] pairs.
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, fmt.Errorf("merges: %v", err)
	}
	out := make([][2]string, len(items))
	for i, it := range items {
		var s string
		if err := json.Unmarshal(it, &s); err == nil {
			a, b, ok := strings.Cut(s, " ")
			if !ok || strings.Contains(b, " ") {
				return nil, fmt.Errorf("merges: entry %d %q is not two tokens separated by a space", i, s)
			}
			out[i] = [2]string{a, b}
			continue
		}
		var pair []string
		if err := json.Unmarshal(it, &pair); err != nil || len(pair) != 2 {
			return nil, fmt.Errorf("merges: entry %d is neither \"a b\" nor a pair of strings", i)
		}
		out[i] = [2]string{pair[0], pair[1]}
	}
	return out, nil
}

func parseModel(raw json.RawMessage) (*bpeModel, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	if typ != "" && typ != "BPE" {
		return nil, fmt.Errorf("%w model type %q (only BPE is implemented)", ErrUnsupported, typ)
	}
	var v struct {
		Type                    string          `json:"type"`
		Vocab                   map[string]int  `json:"vocab"`
		Merges                  json.RawMessage `json:"merges"`
		UnkToken                *string         `json:"unk_token"`
		ContinuingSubwordPrefix *string         `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string         `json:"end_of_word_suffix"`
		FuseUnk                 bool            `json:"fuse_unk"`
		ByteFallback            bool            `json:"byte_fallback"`
		IgnoreMerges            bool            `json:"ignore_merges"`
		Dropout                 *float64        `json:"dropout"`
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	if v.Type == "" && v.Merges == nil {
		return nil, errors.New("model has no type")
	}
	if v.Dropout != nil && *v.Dropout != 0 {
		return nil, fmt.Errorf("%w BPE dropout %v (encoding would be random)", ErrUnsupported, *v.Dropout)
	}
	m := &bpeModel{
		vocab:        v.Vocab,
		fuseUnk:      v.FuseUnk,
		byteFallback: v.ByteFallback,
		ignoreMerges: v.IgnoreMerges,
		cache:        make(map[string][]int),
	}
	if m.vocab == nil {
		m.vocab = map[string]int{}
	}
	for tok, id := range m.vocab {
		if id < 0 {
			return nil, fmt.Errorf("model vocab: token %q has negative id %d", tok, id)
		}
	}
	if v.UnkToken != nil {
		m.unk = *v.UnkToken
	}
	if v.ContinuingSubwordPrefix != nil {
		m.prefix = *v.ContinuingSubwordPrefix
	}
	if v.EndOfWordSuffix != nil {
		m.suffix = *v.EndOfWordSuffix
	}
	for b := range m.byteIDs {
		id, ok := m.vocab[fmt.Sprintf("<0x%02X>", b)]
		if !ok {
			id = -1
		}
		m.byteIDs[b] = id
	}
	merges, err := parseMerges(v.Merges)
	if err != nil {
		return nil, err
	}
	m.merges = make(map[uint64]merge, len(merges))
	for rank, mg := range merges {
		a, ok := m.vocab[mg[0]]
		if !ok {
			return nil, fmt.Errorf("merges: entry %d: token %q is not in the vocabulary", rank, mg[0])
		}
		b, ok := m.vocab[mg[1]]
		if !ok {
			return nil, fmt.Errorf("merges: entry %d: token %q is not in the vocabulary", rank, mg[1])
		}
		right := mg[1] // the merged token drops the right side's continuing prefix
		if len(right) >= len(m.prefix) {
			right = right[len(m.prefix):]
		}
		id, ok := m.vocab[mg[0]+right]
		if !ok {
			return nil, fmt.Errorf("merges: entry %d: merged token %q is not in the vocabulary", rank, mg[0]+right)
		}
		m.merges[pairKey(a, b)] = merge{rank: int32(rank), id: int32(id)}
	}
	return m, nil
}

// sortedAdded returns the added tokens in the order the Hugging Face
// AddedVocabulary builds its matchers: special tokens first, then the others,
// each in file order.
func sortedAdded(tokens []addedToken) []addedToken {
	out := append([]addedToken(nil), tokens...)
	sort.SliceStable(out, func(i, j int) bool { return out[i].special && !out[j].special })
	return out
}

// sortedNumeric sorts decimal id strings by value.
func sortedNumeric(keys []string) []string {
	sort.Slice(keys, func(i, j int) bool {
		if len(keys[i]) != len(keys[j]) {
			return len(keys[i]) < len(keys[j])
		}
		return keys[i] < keys[j]
	})
	return keys
}
