package tokenizer

import (
	"encoding/json"
	"errors"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

func TestAppendLossy(t *testing.T) {
	cases := []struct {
		in   string
		want string
	}{
		// The example of the Unicode standard, chapter 3 (U+FFFD substitution
		// of maximal subparts).
		{"\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64", "a\uFFFD\uFFFD\uFFFDb\uFFFDc\uFFFD\uFFFDd"},
		// A surrogate and an overlong form: every byte is its own subpart.
		{"\xED\xA0\x80", "\uFFFD\uFFFD\uFFFD"},
		{"\xC0\xAF", "\uFFFD\uFFFD"},
		{"\xE0\x80\x80", "\uFFFD\uFFFD\uFFFD"},
		{"\xF4\x90\x80\x80", "\uFFFD\uFFFD\uFFFD\uFFFD"},
		// A truncated sequence at the end is one subpart.
		{"ok\xF0\x9F\x9A", "ok\uFFFD"},
		{"€🚀", "€🚀"},
	}
	for _, c := range cases {
		if got := lossyString([]byte(c.in)); got != c.want {
			t.Errorf("lossy(% x) = %q, want %q", c.in, got, c.want)
		}
	}
	// Not final: an incomplete sequence is left for later.
	out, n := appendLossy(nil, []byte("a\xE2\x82"), false)
	if string(out) != "a" || n != 1 {
		t.Errorf("appendLossy(a E2 82, false) = %q, %d; want \"a\", 1", out, n)
	}
}

func spanTexts(s string, sp []span) []string {
	var out []string
	for _, x := range sp {
		out = append(out, s[x.start:x.end])
	}
	return out
}

// The split scanners against splits worked out by hand from the expressions.
func TestSplitScanners(t *testing.T) {
	llama3, _ := newRegexMatcher(llama3Pattern)
	qwen2, _ := newRegexMatcher(qwen2Pattern)
	cases := []struct {
		m    matcher
		in   string
		want []string
	}{
		{scanMatcher(gpt2Next), "Hello, world!", []string{"Hello", ",", " world", "!"}},
		{scanMatcher(gpt2Next), "I'm  here\n\n", []string{"I", "'m", " ", " here", "\n\n"}},
		{scanMatcher(gpt2Next), "it'S 2024ab", []string{"it", "'", "S", " 2024", "ab"}},
		{scanMatcher(gpt2Next), "a \u00a0b", []string{"a", " ", "\u00a0", "b"}},
		{llama3, "Hello, world!", []string{"Hello", ",", " world", "!"}},
		{llama3, "it'S 1234567", []string{"it", "'S", " ", "123", "456", "7"}},
		{llama3, "x  \n  y", []string{"x", "  \n", " ", " y"}},
		{llama3, "(foo)...\n\nbar", []string{"(foo", ")...\n\n", "bar"}},
		{llama3, "\tHi", []string{"\tHi"}},
		{qwen2, "x 42", []string{"x", " ", "4", "2"}},
	}
	for _, c := range cases {
		if got := spanTexts(c.in, c.m.matches(c.in)); !reflect.DeepEqual(got, c.want) {
			t.Errorf("split %q = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestSplitBehaviors(t *testing.T) {
	s := "a-b--c"
	ms := literalMatcher("-").matches(s)
	cases := map[splitBehavior][]string{
		splitRemoved:            {"a", "b", "c"},
		splitIsolated:           {"a", "-", "b", "-", "-", "c"},
		splitMergedWithPrevious: {"a-", "b-", "-", "c"},
		splitMergedWithNext:     {"a", "-b", "-", "-c"},
		splitContiguous:         {"a", "-", "b", "--", "c"},
	}
	for b, want := range cases {
		if got := spanTexts(s, applyBehavior(cover(s, ms, false), b)); !reflect.DeepEqual(got, want) {
			t.Errorf("behavior %d: %q, want %q", b, got, want)
		}
	}
	// Inverted: the pattern matches what is kept.
	got := spanTexts(s, applyBehavior(cover(s, ms, true), splitRemoved))
	if want := []string{"-", "-", "-"}; !reflect.DeepEqual(got, want) {
		t.Errorf("inverted Removed: %q, want %q", got, want)
	}
}

func texts(ps []piece) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.text)
	}
	return out
}

// Cases from the Hugging Face tokenizers' own tests of added tokens.
func TestAddedTokenOptions(t *testing.T) {
	mask := addedToken{id: 0, content: "<mask>", singleWord: true}
	m := newAddedMatcher([]addedToken{mask}, []string{"<mask>"})
	got := texts(m.split(piece{text: "<mask> My name <mask> A<mask> <mask>ony <mask>", id: -1}, nil))
	want := []string{"<mask>", " My name ", "<mask>", " A<mask> <mask>ony ", "<mask>"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("single_word: %q, want %q", got, want)
	}

	mask.lstrip, mask.rstrip = true, true
	m = newAddedMatcher([]addedToken{mask}, []string{"<mask>"})
	got = texts(m.split(piece{text: "Hi <mask> there\t<mask>\t<mask>\u2000", id: -1}, nil))
	want = []string{"Hi", " <mask> ", "there", "\t<mask>\t", "<mask>\u2000"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("lstrip/rstrip: %q, want %q", got, want)
	}

	// Leftmost, then longest.
	m = newAddedMatcher([]addedToken{{id: 1, content: "<a>"}, {id: 2, content: "<a><b>"}, {id: 3, content: "b>"}},
		[]string{"<a>", "<a><b>", "b>"})
	ps := m.split(piece{text: "x<a><b>y<a>", id: -1}, nil)
	if got, want := texts(ps), []string{"x", "<a><b>", "y", "<a>"}; !reflect.DeepEqual(got, want) {
		t.Errorf("longest match: %q, want %q", got, want)
	}
	if ps[1].id != 2 || ps[3].id != 1 || ps[0].id != -1 {
		t.Errorf("longest match ids: %+v", ps)
	}
}

// preTokenizeAll runs pre on the text pieces of ps.
func preTokenizeAll(pre preTokenizer, ps []piece) []piece {
	var out []piece
	for _, p := range ps {
		if p.id >= 0 {
			out = append(out, p)
			continue
		}
		pre.preTokenize(p, func(q piece) { out = append(out, q) })
	}
	return out
}

func TestMetaspacePreTokenizer(t *testing.T) {
	m := metaspacePreTokenizer{replacement: "▁", prepend: prependAlways, split: true}
	got := texts(preTokenizeAll(m, []piece{{text: "Hey   friend!", id: -1, first: true}}))
	if want := []string{"▁Hey", "▁", "▁", "▁friend!"}; !reflect.DeepEqual(got, want) {
		t.Errorf("always/split: %q, want %q", got, want)
	}
	// prepend_scheme "first": only the piece at the start of the text.
	m = metaspacePreTokenizer{replacement: "▁", prepend: prependFirst}
	s := newAddedMatcher([]addedToken{{id: 1, content: "<s>"}}, []string{"<s>"})
	ps := s.split(piece{text: " Hey <s>how <s>are <s> you", id: -1, first: true}, nil)
	got = texts(preTokenizeAll(m, ps))
	if want := []string{"▁Hey▁", "<s>", "how▁", "<s>", "are▁", "<s>", "▁you"}; !reflect.DeepEqual(got, want) {
		t.Errorf("first: %q, want %q", got, want)
	}
}

// decodeBoth runs tokens through the whole-list and the streaming form of d.
func decodeBoth(d decoder, tokens []string) (batch, stream string) {
	batch = strings.Join(d.decodeChain(tokens), "")
	c := &collector{}
	head := d.stage(c)
	for _, tok := range tokens {
		head.token(tok)
	}
	head.flush()
	return batch, c.take()
}

// Cases from the Hugging Face tokenizers' tests of each decoder.
func TestDecoders(t *testing.T) {
	cases := []struct {
		d      decoder
		tokens []string
		want   string
	}{
		{byteFallbackDecoder{}, []string{"<0xE5>", "<0x8f>", "<0xab>", "a"}, "叫a"},
		{byteFallbackDecoder{}, []string{"<0xE5>", "<0x8f>", "a"}, "\uFFFD\uFFFDa"},
		{byteFallbackDecoder{}, []string{"<0x61>", "<0x+A>", "<0xZZ>"}, "a\n<0xZZ>"},
		{stripDecoder{'H', 1, 0}, []string{"Hey", " friend!", "HHH"}, "ey friend!HH"},
		{stripDecoder{'y', 0, 1}, []string{"Hey", " friend!"}, "He friend!"},
		{metaspaceDecoder{'▁', true}, []string{"▁Hey", "▁friend!"}, "Hey friend!"},
		{metaspaceDecoder{'▁', false}, []string{"▁Hey", "▁friend!"}, " Hey friend!"},
		{byteLevelDecoder{}, []string{"Hello", "Ġworld", "Ġ", "ðŁ", "ļĢ"}, "Hello world 🚀"},
		{byteLevelDecoder{}, []string{"ðŁ", "!"}, "\uFFFD!"},
		// The Llama 2 decoder: the leading space of the whole text is stripped.
		{decoderSeq{replaceDecoder{replacer{literal: "▁", content: " "}}, byteFallbackDecoder{}, fuseDecoder{}, stripDecoder{' ', 1, 0}},
			[]string{"▁", "▁Hello", "<0xE6>", "<0x98>", "<0xBE>", "▁▁x"}, " Hello显  x"},
		// Fused text through steps that then see it as one token.
		{decoderSeq{fuseDecoder{}, stripDecoder{'x', 2, 2}}, []string{"x", "xa", "bx", "x", "x"}, "abx"},
		{decoderSeq{fuseDecoder{}, replaceDecoder{replacer{literal: "ab", content: "-"}}}, []string{"a", "b", "a", "aa", "b", "a"}, "-aa-a"},
		{decoderSeq{fuseDecoder{}, metaspaceDecoder{'▁', true}}, []string{"▁a", "▁b"}, "ab"},
	}
	for i, c := range cases {
		batch, stream := decodeBoth(c.d, c.tokens)
		if batch != c.want {
			t.Errorf("case %d: decode %q = %q, want %q", i, c.tokens, batch, c.want)
		}
		if stream != c.want {
			t.Errorf("case %d: stream %q = %q, want %q", i, c.tokens, stream, c.want)
		}
	}
}

func TestCleanupStage(t *testing.T) {
	in := []string{"Hello", " ,", " world", " .", " I", " don", " '", " t", " know", " n't", " ' ", "s", " !"}
	want := cleanupSpaces(strings.Join(in, ""))
	if want != "Hello, world. I don't known't's!" {
		t.Fatalf("cleanupSpaces = %q", want)
	}
	c := &collector{}
	st := &cleanupStage{next: c}
	var got strings.Builder
	for _, s := range in {
		st.text(s)
		got.WriteString(c.take())
	}
	st.flush()
	got.WriteString(c.take())
	if got.String() != want {
		t.Errorf("stream cleanup = %q, want %q", got.String(), want)
	}
}

// --- synthetic tokenizer.json files ---

// alphabet returns the GPT-2 byte-level alphabet: printable Latin-1 bytes
// stand for themselves, the other bytes take U+0100 onwards in order.
func alphabet() []string {
	var out []string
	next := rune(0x100)
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			out = append(out, string(rune(b)))
		} else {
			out = append(out, string(next))
			next++
		}
	}
	return out
}

// byteLevelJSON builds a byte-level tokenizer: ids 0..255 are the bytes,
// then the merges' results, then <|begin_of_text|> and <|end_of_text|>.
func byteLevelJSON(t *testing.T, pre any, merges []string) []byte {
	t.Helper()
	vocab := map[string]int{}
	for i, s := range alphabet() {
		vocab[s] = i
	}
	for _, m := range merges {
		a, b, _ := strings.Cut(m, " ")
		if _, ok := vocab[a+b]; !ok {
			vocab[a+b] = len(vocab)
		}
	}
	bos, eos := len(vocab), len(vocab)+1
	doc := map[string]any{
		"added_tokens": []any{
			map[string]any{"id": bos, "content": "<|begin_of_text|>", "special": true, "normalized": false},
			map[string]any{"id": eos, "content": "<|end_of_text|>", "special": true, "normalized": false},
		},
		"normalizer":    nil,
		"pre_tokenizer": pre,
		"post_processor": map[string]any{"type": "TemplateProcessing",
			"single":         []any{map[string]any{"SpecialToken": map[string]any{"id": "<|begin_of_text|>", "type_id": 0}}, map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}}},
			"special_tokens": map[string]any{"<|begin_of_text|>": map[string]any{"id": "<|begin_of_text|>", "ids": []int{bos}, "tokens": []string{"<|begin_of_text|>"}}}},
		"decoder": map[string]any{"type": "ByteLevel"},
		"model":   map[string]any{"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": true},
	}
	raw, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func llama3Pre(pattern string) any {
	return map[string]any{"type": "Sequence", "pretokenizers": []any{
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": pattern}, "behavior": "Isolated", "invert": false},
		map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
	}}
}

func mustParse(t *testing.T, tj, cfg []byte) *Tokenizer {
	t.Helper()
	tok, err := Parse(tj, cfg)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return tok
}

func TestLlama3Style(t *testing.T) {
	merges := []string{"H i", "Ġ t", "h e", "Ġt he", "r e", "Ġthe re", "1 2", "12 3"}
	tok := mustParse(t, byteLevelJSON(t, llama3Pre(llama3Pattern), merges), []byte(`{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}`))
	id := func(s string) int {
		t.Helper()
		i := tok.ID(s)
		if i < 0 {
			t.Fatalf("no token %q", s)
		}
		return i
	}
	// "Hi there 123456" splits into Hi | " there" | " " | 123 | 456.
	want := []int{id("<|begin_of_text|>"), id("Hi"), id("Ġthere"), id("Ġ"), id("123"), id("4"), id("5"), id("6"), id("<|end_of_text|>")}
	got, err := tok.Encode("Hi there 123456<|end_of_text|>", true)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Encode = %v, want %v", got, want)
	}
	if tok.BOS() != want[0] || tok.EOS() != want[len(want)-1] {
		t.Errorf("BOS, EOS = %d, %d", tok.BOS(), tok.EOS())
	}
	dec, err := tok.Decode(got)
	if err != nil || dec != "<|begin_of_text|>Hi there 123456<|end_of_text|>" {
		t.Errorf("Decode = %q, %v", dec, err)
	}

	// Qwen2's expression: digits one at a time.
	tok = mustParse(t, byteLevelJSON(t, llama3Pre(qwen2Pattern), merges), nil)
	got, _ = tok.Encode("123", false)
	if want := []int{'1', '2', '3'}; !reflect.DeepEqual(got, want) {
		t.Errorf("qwen2 Encode(123) = %v, want %v", got, want)
	}
	if tok.BOS() != 256+len(merges) || tok.EOS() != -1 {
		t.Errorf("without config: BOS, EOS = %d, %d; want the template's %d, -1", tok.BOS(), tok.EOS(), 256+len(merges))
	}
}

func TestGPT2AddPrefixSpace(t *testing.T) {
	pre := map[string]any{"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}
	tok := mustParse(t, byteLevelJSON(t, pre, []string{"Ġ t", "h e", "Ġt he"}), nil)
	got, err := tok.Encode("the", false)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int{tok.ID("Ġthe")}; !reflect.DeepEqual(got, want) {
		t.Errorf("Encode(the) = %v, want %v", got, want)
	}
}

func TestConfigOverridesTemplate(t *testing.T) {
	tj := byteLevelJSON(t, llama3Pre(llama3Pattern), nil)
	cfg := `{"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>", "special": true}, "add_bos_token": false, "add_eos_token": true}`
	tok := mustParse(t, tj, []byte(cfg))
	got, _ := tok.Encode("a", true)
	if want := []int{'a', tok.EOS()}; !reflect.DeepEqual(got, want) {
		t.Errorf("add_bos_token false, add_eos_token true: %v, want %v", got, want)
	}
	// A flag left out counts as false, as in transformers.
	tok = mustParse(t, tj, []byte(`{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_eos_token": true}`))
	got, _ = tok.Encode("a", true)
	if want := []int{'a', tok.EOS()}; !reflect.DeepEqual(got, want) {
		t.Errorf("add_eos_token only: %v, want %v", got, want)
	}
	// Special tokens named only in the config become added tokens, with the
	// next free ids (the vocabulary has 258 entries).
	tok = mustParse(t, tj, []byte(`{"pad_token": "ab", "extra_special_tokens": ["<|new|>", {"content": "<|newer|>"}]}`))
	got, _ = tok.Encode("xab<|new|><|newer|>", false)
	if want := []int{'x', 258, 259, 260}; !reflect.DeepEqual(got, want) {
		t.Errorf("config special tokens: %v, want %v", got, want)
	}
	// transformers ignores clean_up_tokenization_spaces for BPE models unless
	// a second flag forces it.
	tok = mustParse(t, tj, []byte(`{"clean_up_tokenization_spaces": true}`))
	ids, _ := tok.Encode("Hi , there .", false)
	if s, _ := tok.Decode(ids); s != "Hi , there ." {
		t.Errorf("clean_up_tokenization_spaces alone: Decode = %q", s)
	}
	tok = mustParse(t, tj, []byte(`{"clean_up_tokenization_spaces": true, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": true}`))
	if s, _ := tok.Decode(ids); s != "Hi, there." {
		t.Errorf("clean_up_tokenization_spaces forced: Decode = %q", s)
	}
	if s := streamAll(t, tok.NewStream(), ids); s != "Hi, there." {
		t.Errorf("clean_up_tokenization_spaces forced: stream = %q", s)
	}
}

func TestParseErrors(t *testing.T) {
	good := map[string]any{}
	if err := json.Unmarshal(byteLevelJSON(t, llama3Pre(llama3Pattern), []string{"a b"}), &good); err != nil {
		t.Fatal(err)
	}
	with := func(key string, v any) []byte {
		doc := map[string]any{}
		for k, x := range good {
			doc[k] = x
		}
		doc[key] = v
		raw, _ := json.Marshal(doc)
		return raw
	}
	model := good["model"].(map[string]any)
	withModel := func(key string, v any) []byte {
		m := map[string]any{}
		for k, x := range model {
			m[k] = x
		}
		m[key] = v
		return with("model", m)
	}
	cases := []struct {
		name        string
		json        []byte
		mention     string
		unsupported bool
	}{
		{"not json", []byte("{"), "tokenizer.json", false},
		{"BertNormalizer", with("normalizer", map[string]any{"type": "BertNormalizer"}), `"BertNormalizer"`, true},
		{"nested", with("normalizer", map[string]any{"type": "Sequence", "normalizers": []any{map[string]any{"type": "Lowercase"}}}), `"Lowercase"`, true},
		{"pre", with("pre_tokenizer", map[string]any{"type": "BertPreTokenizer"}), `"BertPreTokenizer"`, true},
		{"intersection", with("pre_tokenizer", map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `[\w&&[^\d]]+`}, "behavior": "Isolated"}), "intersection", true},
		{"bad regex", with("normalizer", map[string]any{"type": "Replace", "pattern": map[string]any{"Regex": `a(?=b`}, "content": ""}), "a(?=b", true},
		{"behavior", with("pre_tokenizer", map[string]any{"type": "Split", "pattern": map[string]any{"String": " "}, "behavior": "Sideways"}), `"Sideways"`, false},
		{"decoder", with("decoder", map[string]any{"type": "WordPiece"}), `"WordPiece"`, true},
		{"post", with("post_processor", map[string]any{"type": "Mystery"}), `"Mystery"`, true},
		{"unigram", with("model", map[string]any{"type": "Unigram", "vocab": []any{}}), `"Unigram"`, true},
		{"dropout", withModel("dropout", 0.1), "dropout", true},
		{"merge", withModel("merges", []string{"a zz"}), `"zz"`, false},
		{"merge form", withModel("merges", []any{42}), "entry 0", false},
		{"no model", with("model", nil), "no model", false},
	}
	for _, c := range cases {
		_, err := Parse(c.json, nil)
		if err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		if !strings.HasPrefix(err.Error(), "tokenizer: ") || !strings.Contains(err.Error(), c.mention) {
			t.Errorf("%s: error %q does not mention %s", c.name, err, c.mention)
		}
		if errors.Is(err, ErrUnsupported) != c.unsupported {
			t.Errorf("%s: errors.Is(err, ErrUnsupported) = %v", c.name, !c.unsupported)
		}
	}
	if _, err := Parse(with("normalizer", nil), []byte("[")); err == nil || !strings.Contains(err.Error(), "tokenizer_config.json") {
		t.Errorf("bad config: %v", err)
	}
	// A special token of the config written over several lines is quoted
	// on one.
	cfg := []byte("{\n  \"bos_token\": [\n    1,\n    2\n  ]\n}\n")
	if _, err := Parse(with("normalizer", nil), cfg); err == nil || !strings.Contains(err.Error(), "bos_token: special token [1,2] is neither") || strings.Contains(err.Error(), "\n") {
		t.Errorf("special token over several lines: %q", err)
	}
	if _, err := Load(t.TempDir()); err == nil || !strings.Contains(err.Error(), "tokenizer.json") {
		t.Errorf("Load of an empty dir: %v", err)
	}
}

// TestMergeForms checks that "a b" strings and ["a", "b"] pairs give the same
// model, and that byte fallback and unk work on a SentencePiece-style vocab.
func TestMergeForms(t *testing.T) {
	vocab := map[string]int{"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6, "▁ab": 7}
	doc := func(merges any) []byte {
		raw, _ := json.Marshal(map[string]any{
			"normalizer":    map[string]any{"type": "Sequence", "normalizers": []any{map[string]any{"type": "Prepend", "prepend": "▁"}, map[string]any{"type": "Replace", "pattern": map[string]any{"String": " "}, "content": "▁"}}},
			"pre_tokenizer": nil,
			"decoder":       map[string]any{"type": "Sequence", "decoders": []any{map[string]any{"type": "Replace", "pattern": map[string]any{"String": "▁"}, "content": " "}, map[string]any{"type": "ByteFallback"}, map[string]any{"type": "Fuse"}, map[string]any{"type": "Strip", "content": " ", "start": 1, "stop": 0}}},
			"model":         map[string]any{"type": "BPE", "vocab": vocab, "merges": merges, "unk_token": "<unk>", "byte_fallback": true, "fuse_unk": true},
		})
		return raw
	}
	for _, merges := range []any{[]string{"▁ a", "▁a b"}, [][]string{{"▁", "a"}, {"▁a", "b"}}} {
		tok := mustParse(t, doc(merges), nil)
		got, err := tok.Encode("ab é xy", false)
		if err != nil {
			t.Fatal(err)
		}
		// ▁ab | ▁ | é as bytes C3 A9 | ▁ | x and y fused into one <unk>
		if want := []int{7, 3, 1, 2, 3, 0}; !reflect.DeepEqual(got, want) {
			t.Errorf("merges %v: Encode = %v, want %v", merges, got, want)
		}
		if s, _ := tok.Decode(got); s != "ab é <unk>" {
			t.Errorf("Decode = %q", s)
		}
	}
}

// Oniguruma's \s, \d and \w are Unicode classes (Go's are ASCII), its ^
// and $ line anchors; expressions with lookaround, backreferences, atomic
// groups or word boundaries run on regexp2, the others on Go's regexp.
func TestTranslateOnig(t *testing.T) {
	cases := []struct {
		expr, in string
		want     []string
		regexp2  bool // the expression needs regexp2
	}{
		{`\s+`, "a\u00a0\u3000b\u0085c", []string{"\u00a0\u3000", "\u0085"}, false},
		{`[^\s\p{L}]+`, "a\u00a0!?b", []string{"!?"}, false},
		{`\d+`, "x١٢y", []string{"١٢"}, false},
		{`[\D]+`, "x١٢y", []string{"x", "y"}, false},
		{`\w+`, "été_1 ok", []string{"été_1", "ok"}, false},
		// Oniguruma's word characters: Alphabetic (Ⓐ, Ⅻ), marks (U+0903),
		// ² and ½; not ⑴ nor U+200D.
		{`\w+`, "aⒶⅫ\u0903²½⑴b\u200dc", []string{"aⒶⅫ\u0903²½", "b", "c"}, false},
		{`\S+`, "ab\u2028cd", []string{"ab", "cd"}, false},
		{`[]a]+|\[`, "]a[", []string{"]a", "["}, false},
		{`\h+|[\h]`, "ab f0 z", []string{"ab", "f0"}, false},
		{`a{,2}`, "aaa", []string{"aa", "a"}, false},
		{`\u00e9|\p{^L}`, "é1x", []string{"é", "1"}, false},
		{`^a|b$`, "ab\nab", []string{"a", "b", "a", "b"}, false},
		{`(?m)a.b`, "a\nb", []string{"a\nb"}, false},
		{`\s+(?!\S)|\s+`, "a   b  ", []string{"  ", " ", "  "}, true},
		{`(?<=\d)(?=(?:\d{3})+(?!\d))`, "1234567", []string{"", ""}, true},
		{`\b\w+\b`, "été Ⓐb", []string{"été", "Ⓐb"}, true},
		{`(\w)\1`, "abbcdd", []string{"bb", "dd"}, true},
		{`(?>\d+)\.|\d++`, "12.34", []string{"12.", "34"}, true},
		{`x\Z`, "x\n", []string{"x"}, true},
		{`[\w\d]\b`, "aa b", []string{"a", "b"}, true},
	}
	for _, c := range cases {
		re, err := compileOnig(c.expr)
		if err != nil {
			t.Errorf("%s: %v", c.expr, err)
			continue
		}
		if got := spanTexts(c.in, re.matches(c.in)); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s on %q: %q, want %q", c.expr, c.in, got, c.want)
		}
		if (re.re2 != nil) != c.regexp2 {
			t.Errorf("%s: on regexp2 %v, want %v", c.expr, re.re2 != nil, c.regexp2)
		}
	}
	for _, expr := range []string{`[\S]`, `[\W]`, `[[:alpha:]]`, `[a-c&&b]`, `[a[b]]`, `(?y)a`, `a(?=b`} {
		if _, err := compileOnig(expr); err == nil {
			t.Errorf("%s: no error", expr)
		}
	}
}

// TestOnigWordClass: onigWord holds exactly Alphabetic, M, Nd, Pc and the
// six Latin-1 characters of Oniguruma's word table, by Go's Unicode tables.
func TestOnigWordClass(t *testing.T) {
	re := regexp.MustCompile(`^[` + onigWord + `]$`)
	latin1 := "\u00b2\u00b3\u00b9\u00bc\u00bd\u00be"
	for r := rune(0); r <= unicode.MaxRune; r++ {
		if r >= 0xd800 && r < 0xe000 {
			continue
		}
		want := unicode.In(r, unicode.L, unicode.Nl, unicode.Other_Alphabetic, unicode.M, unicode.Nd, unicode.Pc) || strings.ContainsRune(latin1, r)
		if got := re.MatchString(string(r)); got != want {
			t.Fatalf("%U: in onigWord %v, want %v", r, got, want)
		}
	}
}

func TestUnicodeNormalizers(t *testing.T) {
	// "é" precomposed (U+00E9) and decomposed (e + U+0301); "ﬁ" is a
	// compatibility ligature that only the K forms expand.
	in := "cafe\u0301 caf\u00e9 \ufb01"
	cases := map[string]string{
		"NFC":  "caf\u00e9 caf\u00e9 \ufb01",
		"NFD":  "cafe\u0301 cafe\u0301 \ufb01",
		"NFKC": "caf\u00e9 caf\u00e9 fi",
		"NFKD": "cafe\u0301 cafe\u0301 fi",
	}
	for form, want := range cases {
		n, err := parseNormalizer(json.RawMessage(`{"type":"` + form + `"}`))
		if err != nil {
			t.Fatalf("%s: %v", form, err)
		}
		if got := n.normalize(in); got != want {
			t.Errorf("%s(%q) = %q, want %q", form, in, got, want)
		}
	}
}

// TestUnicodeNormalizersLongRuns: runs of more than 30 combining marks are
// ordered and composed whole, with no U+034F inserted (x/text's stream-safe
// format does that; Hugging Face's normalizers do not). The wanted strings
// are Hugging Face's output.
func TestUnicodeNormalizersLongRuns(t *testing.T) {
	acute, grave := "\u0301", "\u0316" // classes 230 and 220
	cases := []struct{ form, in, want string }{
		{"NFC", "a" + strings.Repeat(acute, 40), "\u00e1" + strings.Repeat(acute, 39)},
		{"NFD", "a" + strings.Repeat(acute, 40), "a" + strings.Repeat(acute, 40)},
		{"NFC", "a" + strings.Repeat(acute, 30) + grave + "b", "\u00e1" + grave + strings.Repeat(acute, 29) + "b"},
		{"NFD", "a" + strings.Repeat(acute, 30) + grave + "b", "a" + grave + strings.Repeat(acute, 30) + "b"},
		{"NFKC", "\u1100\u1161\u11a8" + strings.Repeat(acute, 36), "\uac01" + strings.Repeat(acute, 36)},
		{"NFKD", "\u00c5" + strings.Repeat(acute, 31) + "\u212b", "A\u030a" + strings.Repeat(acute, 31) + "A\u030a"},
		{"NFC", "\u00c5" + strings.Repeat(acute, 31) + "\u212b", "\u01fa" + strings.Repeat(acute, 30) + "\u00c5"},
		// A U+034F of the text stays, once.
		{"NFC", "a" + strings.Repeat(acute, 35) + "\u034f" + acute, "\u00e1" + strings.Repeat(acute, 34) + "\u034f" + acute},
	}
	for _, c := range cases {
		n, err := parseNormalizer(json.RawMessage(`{"type":"` + c.form + `"}`))
		if err != nil {
			t.Fatalf("%s: %v", c.form, err)
		}
		if got := n.normalize(c.in); got != c.want {
			t.Errorf("%s(%+q)\n got %+q\nwant %+q", c.form, c.in, got, c.want)
		}
	}
}
