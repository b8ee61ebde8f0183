package tokenizer

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/strata-llm/strata/loader/fixtures"
)

// Fuzz targets for tokenizer.json and tokenizer_config.json as downloaded:
// a file is refused with an error, or it makes a tokenizer whose Encode,
// Decode and Stream neither panic nor return ids that name no token. (Text
// input to a fixed tokenizer is fuzzed by FuzzEncode.)

// checkTokenizer runs text through tok and checks what every accepted
// tokenizer must give: ids inside the id space that Decode knows, and a
// Stream that adds up to Decode.
func checkTokenizer(t *testing.T, tok *Tokenizer, text string) {
	t.Helper()
	if n := tok.VocabSize(); n < 0 || n > maxTokenIDs {
		t.Fatalf("VocabSize %d outside [0, %d]", n, maxTokenIDs)
	}
	for _, id := range []int{tok.BOS(), tok.EOS()} {
		if _, ok := tok.Token(id); id != -1 && !ok {
			t.Fatalf("special token id %d names no token", id)
		}
	}
	for _, special := range []bool{false, true} {
		ids, err := tok.Encode(text, special)
		if !utf8.ValidString(text) {
			if err == nil {
				t.Fatalf("Encode(%q) of invalid UTF-8: no error", text)
			}
			return
		}
		if err != nil {
			if !strings.HasPrefix(err.Error(), "tokenizer: ") {
				t.Fatalf("Encode error %q lacks the package prefix", err)
			}
			continue
		}
		for _, id := range ids {
			if _, ok := tok.Token(id); !ok {
				t.Fatalf("Encode(%q, %v) returned id %d, which names no token (vocabulary size %d)", text, special, id, tok.VocabSize())
			}
		}
		dec, err := tok.Decode(ids)
		if err != nil {
			t.Fatalf("Decode of Encode's ids %v: %v", ids, err)
		}
		st := tok.NewStream()
		var got strings.Builder
		for _, id := range ids {
			piece, err := st.Add(id)
			if err != nil {
				t.Fatalf("Stream.Add(%d): %v", id, err)
			}
			got.WriteString(piece)
		}
		got.WriteString(st.Flush())
		if got.String() != dec {
			t.Fatalf("stream of %v = %q, Decode = %q", ids, got.String(), dec)
		}
	}
	// Ids that name no token are errors, never panics.
	for _, id := range []int{-1, tok.VocabSize(), 1 << 40} {
		if _, err := tok.Decode([]int{id}); !errors.Is(err, ErrUnknownID) {
			t.Fatalf("Decode([%d]) = %v, want ErrUnknownID", id, err)
		}
	}
}

// tinyTokenizers are small hand-written tokenizer.json files exercising
// each supported component, as seeds.
var tinyTokenizers = []string{
	`{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<unk>": 3}, "merges": ["a b"], "unk_token": "<unk>"}}`,
	`{"added_tokens": [{"id": 4, "content": "<s>", "special": true}], "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
	  "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
	  "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
	  "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}], "special_tokens": {"<s>": {"ids": [4]}}},
	  "model": {"type": "BPE", "vocab": {"▁": 0, "a": 1, "▁a": 2, "<0x41>": 3, "<s>": 4}, "merges": [["▁", "a"]], "byte_fallback": true}}`,
	`{"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\d+|\\s+"}, "behavior": "Isolated"}, {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}]},
	  "decoder": {"type": "ByteLevel"}, "post_processor": {"type": "ByteLevel"},
	  "model": {"type": "BPE", "vocab": {"Ġ": 0, "a": 1, "Ġa": 2, "1": 3}, "merges": ["Ġ a"]}}`,
	`{"pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 1], "cls": ["<s>", 0]},
	  "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "x": 2}, "merges": [], "continuing_subword_prefix": "##", "end_of_word_suffix": "</w>"}}`,
	`{"pre_tokenizer": {"type": "Digits", "individual_digits": true}, "model": {"type": "BPE", "vocab": {"1": 0}, "merges": []},
	  "added_tokens": [{"id": 16777215, "content": "<big>"}]}`,
	`{"model": {"type": "BPE", "vocab": {"a": 4611686018427387903}, "merges": []}}`,
	`{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>"}}, {"Sequence": {"id": "A"}}], "special_tokens": {"<x>": {"ids": [-7]}}}}`,
}

var tinyConfigs = []string{
	``,
	`{"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": true, "add_eos_token": true}`,
	`{"added_tokens_decoder": {"7": {"content": "<pad>", "special": true}}, "additional_special_tokens": ["<a>", "<b>"]}`,
	`{"added_tokens_decoder": {"99999999999999999999": {"content": "<x>"}}}`,
}

// FuzzParse parses arbitrary tokenizer.json and tokenizer_config.json
// contents and, when they are accepted, encodes text with the result.
func FuzzParse(f *testing.F) {
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16} {
		dir := fixtures.Dir(name)
		tj, err := os.ReadFile(filepath.Join(dir, TokenizerFile))
		if err != nil {
			f.Skipf("fixture tokenizer not available: %v", err)
		}
		cj, _ := os.ReadFile(filepath.Join(dir, ConfigFile))
		f.Add(tj, cj, "Hello, world! 12 <s>")
	}
	for i, tj := range tinyTokenizers {
		f.Add([]byte(tj), []byte(tinyConfigs[i%len(tinyConfigs)]), "a ab 1 <s>x\u00e9")
	}
	f.Fuzz(func(t *testing.T, tokJSON, cfgJSON []byte, text string) {
		tok, err := Parse(tokJSON, cfgJSON)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "tokenizer: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
			return
		}
		checkTokenizer(t, tok, text)
	})
}

// FuzzComponents keeps the byte-level fixture's model and vocabulary and
// takes the normalizer, pre-tokenizer, decoder and post-processor from the
// fuzzer, so that mutations reach the components' parsers and pipelines
// instead of dying in the JSON syntax of a 20 KB file.
func FuzzComponents(f *testing.F) {
	base := map[string]json.RawMessage{}
	for _, name := range []string{fixtures.TinyLlamaBF16, fixtures.TinyLlamaF16Sharded} {
		tj, err := os.ReadFile(filepath.Join(fixtures.Dir(name), TokenizerFile))
		if err != nil {
			f.Skipf("fixture tokenizer not available: %v", err)
		}
		var parts map[string]json.RawMessage
		if err := json.Unmarshal(tj, &parts); err != nil {
			f.Fatal(err)
		}
		f.Add([]byte(parts["normalizer"]), []byte(parts["pre_tokenizer"]), []byte(parts["decoder"]), []byte(parts["post_processor"]), "Hello, world! 12 <s>")
		base = parts // the last one's model: byte-level, whose vocabulary covers every byte
	}
	for _, c := range [][4]string{
		{`{"type": "Strip", "content": " ", "left": true, "right": true}`, `{"type": "Punctuation", "behavior": "Contiguous"}`, `{"type": "Strip", "content": "a", "start": 99, "stop": 99}`, `{"type": "Sequence", "processors": [{"type": "ByteLevel"}]}`},
		{`{"type": "Replace", "pattern": {"Regex": "(a|b)+"}, "content": ""}`, `{"type": "Split", "pattern": {"Regex": "\\w+(?=x)"}, "behavior": "Removed"}`, `{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}`, `{"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1]}`},
		{`{"type": "NFKC"}`, `{"type": "Metaspace", "replacement": "x", "prepend_scheme": "first", "split": false}`, `{"type": "Fuse"}`, `{"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "</s>"}}], "special_tokens": {"</s>": {"ids": [2, 2]}}}`},
	} {
		f.Add([]byte(c[0]), []byte(c[1]), []byte(c[2]), []byte(c[3]), "a \u00a0b\n\n12345 ab's</s>")
	}
	f.Fuzz(func(t *testing.T, norm, pre, dec, post []byte, text string) {
		parts := map[string]json.RawMessage{}
		for k, v := range base {
			parts[k] = v
		}
		for k, v := range map[string][]byte{"normalizer": norm, "pre_tokenizer": pre, "decoder": dec, "post_processor": post} {
			if !json.Valid(v) {
				return // the file would not be JSON: FuzzParse covers that
			}
			parts[k] = v
		}
		tj, err := json.Marshal(parts)
		if err != nil {
			t.Fatal(err)
		}
		tok, err := Parse(tj, nil)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "tokenizer: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
			return
		}
		checkTokenizer(t, tok, text)
	})
}

// TestParseHostileIDs: ids far beyond any real vocabulary are refused at
// load time rather than sizing the id tables (2^62 would panic in make, 2^31
// would allocate tens of GB), and a post-processor that adds an id naming
// no token is refused rather than emitting it from Encode.
func TestParseHostileIDs(t *testing.T) {
	cases := map[string]string{
		"vocab id 2^62":         `{"model": {"type": "BPE", "vocab": {"a": 4611686018427387903}, "merges": []}}`,
		"vocab id 2^31":         `{"model": {"type": "BPE", "vocab": {"a": 2147483648}, "merges": []}}`,
		"added token id 2^40":   `{"added_tokens": [{"id": 1099511627776, "content": "<x>"}], "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}`,
		"template id negative":  `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>"}}, {"Sequence": {"id": "A"}}], "special_tokens": {"<x>": {"ids": [-7]}}}}`,
		"template id not known": `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "<x>"}}], "special_tokens": {"<x>": {"ids": [5]}}}}`,
		"roberta cls not known": `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 0], "cls": ["<s>", 99]}}`,
	}
	for name, tj := range cases {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		tok, err := Parse([]byte(tj), nil)
		runtime.ReadMemStats(&after)
		if err == nil {
			ids, _ := tok.Encode("a", true)
			t.Errorf("%s: accepted (Encode(\"a\", true) = %v)", name, ids)
			continue
		}
		if !strings.HasPrefix(err.Error(), "tokenizer: tokenizer.json: ") {
			t.Errorf("%s: error %q does not name the file", name, err)
		}
		if got := after.TotalAlloc - before.TotalAlloc; got > 16<<20 {
			t.Errorf("%s: %d MB allocated refusing it", name, got>>20)
		}
	}
	// The largest id allowed still loads.
	if _, err := Parse([]byte(`{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"id": 1000000, "content": "<x>"}]}`), nil); err != nil {
		t.Errorf("an added token at id 1000000: %v", err)
	}
}
