package tokenizer

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// checkCases encodes and decodes every reference case of f with tok, and
// checks Encode(text, true) adds BOS as the fixture's post-processor does.
func checkCases(t *testing.T, what string, f fixture, tok *Tokenizer) {
	t.Helper()
	bos, eos := specialIDs(t, f.dir)
	if tok.BOS() != bos || tok.EOS() != eos {
		t.Errorf("%s: BOS, EOS = %d, %d; want %d, %d", what, tok.BOS(), tok.EOS(), bos, eos)
	}
	for _, c := range f.cases {
		got, err := tok.Encode(c.Text, false)
		if err != nil || !equalIDs(got, c.IDs) {
			t.Errorf("%s: Encode(%q)\n got %v, %v\nwant %v", what, c.Text, got, err, c.IDs)
		}
		got, err = tok.Encode(c.Text, true)
		if want := append([]int{bos}, c.IDs...); err != nil || !equalIDs(got, want) {
			t.Errorf("%s: Encode(%q, true) = %v, %v; want %v", what, c.Text, got, err, want)
		}
		dec, err := tok.Decode(c.IDs)
		if err != nil || dec != c.Decoded {
			t.Errorf("%s: Decode(%v) = %q, %v; want %q", what, c.IDs, dec, err, c.Decoded)
		}
		// Streaming adds up to Decode.
		st := tok.NewStream()
		var sb strings.Builder
		for _, id := range c.IDs {
			p, err := st.Add(id)
			if err != nil {
				t.Fatal(err)
			}
			sb.WriteString(p)
		}
		if sb.WriteString(st.Flush()); sb.String() != c.Decoded {
			t.Errorf("%s: streamed %v = %q, want %q", what, c.IDs, sb.String(), c.Decoded)
		}
	}
	// Special tokens in the text are cut out whole.
	got, err := tok.Encode("<s>"+f.cases[0].Text+"</s>", false)
	if err != nil || len(got) < 2 || got[0] != bos || got[len(got)-1] != eos {
		t.Errorf("%s: special tokens in the text: %v, %v", what, got, err)
	}
}

// TestGGUFVocabFixtures: each fixture's tokenizer written as a GGUF
// vocabulary is of the kind GGUF names it by, and read back it encodes and
// decodes the reference cases as transformers did; written again it gives
// the same vocabulary.
func TestGGUFVocabFixtures(t *testing.T) {
	for _, f := range allFixtures(t) {
		v, err := f.tok.GGUFVocab(f.tok.VocabSize())
		if err != nil {
			t.Fatalf("%s: %v", f.name, err)
		}
		wantModel, wantPre := "llama", ""
		if f.byteLevel {
			wantModel, wantPre = "gpt2", "gpt-2"
		}
		if v.Model != wantModel || v.Pre != wantPre || !v.AddBOS || v.AddEOS || v.AddSpacePrefix == f.byteLevel {
			t.Errorf("%s: model %q pre %q add_bos %v add_eos %v space prefix %v", f.name, v.Model, v.Pre, v.AddBOS, v.AddEOS, v.AddSpacePrefix)
		}
		if len(v.Merges) == 0 || len(v.Tokens) != f.tok.VocabSize() {
			t.Errorf("%s: %d merges, %d tokens", f.name, len(v.Merges), len(v.Tokens))
		}
		if !f.byteLevel {
			for _, tc := range []struct {
				tok  string
				want int32
			}{{"<unk>", TokenUnknown}, {"<s>", TokenControl}, {"</s>", TokenControl}, {"<0x0A>", TokenByte}, {"▁", TokenNormal}} {
				if got := v.Types[f.tok.ID(tc.tok)]; got != tc.want {
					t.Errorf("%s: token %q has type %d, want %d", f.name, tc.tok, got, tc.want)
				}
			}
		}
		tok, err := FromGGUF(v)
		if err != nil {
			t.Fatalf("%s: %v", f.name, err)
		}
		checkCases(t, f.name, f, tok)
		again, err := tok.GGUFVocab(tok.VocabSize())
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(again, v) {
			t.Errorf("%s: the vocabulary read back writes differently", f.name)
		}
	}
}

// TestGGUFVocabScores: the SentencePiece fixture's vocabulary without its
// merges, as llama.cpp reads it (by scores alone), tokenizes the reference
// cases as transformers did; written again it keeps the scores and still
// has no merges.
func TestGGUFVocabScores(t *testing.T) {
	for _, f := range allFixtures(t) {
		if f.byteLevel {
			continue
		}
		v, err := f.tok.GGUFVocab(f.tok.VocabSize())
		if err != nil {
			t.Fatal(err)
		}
		v.Merges = nil
		tok, err := FromGGUF(v)
		if err != nil {
			t.Fatal(err)
		}
		checkCases(t, f.name+" by scores", f, tok)
		again, err := tok.GGUFVocab(tok.VocabSize())
		if err != nil {
			t.Fatal(err)
		}
		if again.Merges != nil || !reflect.DeepEqual(again.Scores, v.Scores) {
			t.Errorf("written again: %d merges, scores equal %v", len(again.Merges), reflect.DeepEqual(again.Scores, v.Scores))
		}
	}
}

// TestGGUFSentencePieceOrder: without merges, pieces merge by the score of
// the token they make, the leftmost pair among equal scores first; a
// character outside the vocabulary falls back to byte tokens, and holes in
// the id space name no token.
func TestGGUFSentencePieceOrder(t *testing.T) {
	tokens := []string{"<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "▁", "a", "b", "c", "ab", "bc", "[PAD11]"}
	types := []int32{TokenUnknown, TokenControl, TokenControl, TokenByte, TokenByte, 1, 1, 1, 1, 1, 1, TokenUnused}
	for _, tc := range []struct {
		name     string
		ab, bc   float32
		text     string
		want     []int
		noPrefix bool
	}{
		{"ab scores higher", -1, -2, "abc", []int{1, 5, 9, 8}, false},
		{"bc scores higher", -2, -1, "abc", []int{1, 5, 6, 10}, false},
		{"equal scores: leftmost", -1, -1, "abc", []int{1, 5, 9, 8}, false},
		{"no space prefix", -1, -2, "abc", []int{1, 9, 8}, true},
		{"byte fallback", -1, -2, "é", []int{1, 5, 3, 4}, false},
	} {
		scores := make([]float32, len(tokens))
		scores[9], scores[10] = tc.ab, tc.bc
		tok, err := FromGGUF(&GGUFVocab{Model: "llama", Tokens: tokens, Scores: scores, Types: types,
			BOS: 1, EOS: 2, UNK: 0, AddBOS: true, AddSpacePrefix: !tc.noPrefix})
		if err != nil {
			t.Fatal(err)
		}
		got, err := tok.Encode(tc.text, true)
		if err != nil || !equalIDs(got, tc.want) {
			t.Errorf("%s: Encode(%q) = %v, %v; want %v", tc.name, tc.text, got, err, tc.want)
		}
		if dec, err := tok.Decode(got[1:]); err != nil || dec != tc.text {
			t.Errorf("%s: Decode = %q, %v", tc.name, dec, err)
		}
		if _, err := tok.Decode([]int{11}); !errors.Is(err, ErrUnknownID) {
			t.Errorf("%s: the [PAD11] hole decodes: %v", tc.name, err)
		}
	}
}

// TestGGUFPreTokenizers: each named pre-tokenizer of the gpt2 kind splits
// as the tokenizer.json it stands for: GPT-2 keeps digits in runs, Llama 3
// in threes, Qwen2 one by one; the byte-level form written back names the
// same pre-tokenizer.
func TestGGUFPreTokenizers(t *testing.T) {
	// A byte-level vocabulary of every byte and no merges: each id is one
	// byte, so the ids show the words only through the merges below.
	var tokens []string
	for b := range 256 {
		tokens = append(tokens, byteUTF8[b])
	}
	tokens = append(tokens, "12", "123", "1234")
	merges := []string{"1 2", "12 3", "123 4"}
	for _, tc := range []struct {
		pre  string
		want []int
	}{
		{"gpt-2", []int{258}},
		{"llama-bpe", []int{257, int('4')}},
		{"qwen2", []int{int('1'), int('2'), int('3'), int('4')}},
	} {
		tok, err := FromGGUF(&GGUFVocab{Model: "gpt2", Pre: tc.pre, Tokens: tokens, Merges: merges, BOS: -1, EOS: -1, UNK: -1})
		if err != nil {
			t.Fatal(err)
		}
		got, err := tok.Encode("1234", false)
		if err != nil || !equalIDs(got, tc.want) {
			t.Errorf("%s: Encode(1234) = %v, %v; want %v", tc.pre, got, err, tc.want)
		}
		v, err := tok.GGUFVocab(len(tokens))
		if err != nil || v.Pre != tc.pre {
			t.Errorf("%s: written back as %+v, %v", tc.pre, v, err)
		}
	}
}

// TestFromGGUFRefuses: vocabularies that cannot be read are refused with
// an error naming the problem.
func TestFromGGUFRefuses(t *testing.T) {
	ok := func() *GGUFVocab {
		return &GGUFVocab{Model: "llama", Tokens: []string{"<unk>", "a", "b", "ab"}, Scores: []float32{0, 0, 0, -1},
			BOS: -1, EOS: -1, UNK: 0}
	}
	if _, err := FromGGUF(ok()); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name        string
		edit        func(v *GGUFVocab)
		msg         string
		unsupported bool
	}{
		{"unknown kind", func(v *GGUFVocab) { v.Model = "bert" }, `"bert"`, true},
		{"unknown pre-tokenizer", func(v *GGUFVocab) { v.Model, v.Pre, v.Merges = "gpt2", "falcon", []string{"a b"} }, `"falcon"`, true},
		{"no tokens", func(v *GGUFVocab) { v.Tokens, v.Scores = nil, nil }, "no tokens", false},
		{"short scores", func(v *GGUFVocab) { v.Scores = v.Scores[:2] }, "2 scores", false},
		{"short types", func(v *GGUFVocab) { v.Types = []int32{1} }, "1 token types", false},
		{"duplicate token", func(v *GGUFVocab) { v.Tokens[2] = "a" }, `"a" has ids 1 and 2`, false},
		{"BOS outside", func(v *GGUFVocab) { v.BOS = 4 }, "BOS id 4", false},
		{"no scores or merges", func(v *GGUFVocab) { v.Scores = nil }, "needs scores or merges", false},
		{"gpt2 without merges", func(v *GGUFVocab) { v.Model, v.Pre = "gpt2", "gpt-2" }, "needs merges", false},
		{"merge without a space", func(v *GGUFVocab) { v.Merges = []string{"ab"} }, `"ab" is not two tokens`, false},
		{"merge of an unknown token", func(v *GGUFVocab) { v.Merges = []string{"a c"} }, `"c" is not in the vocabulary`, false},
		{"merge to an unknown token", func(v *GGUFVocab) { v.Merges = []string{"b a"} }, `"ba" is not in the vocabulary`, false},
	} {
		v := ok()
		tc.edit(v)
		_, err := FromGGUF(v)
		if err == nil || !strings.Contains(err.Error(), tc.msg) || strings.Contains(err.Error(), "\n") || errors.Is(err, ErrUnsupported) != tc.unsupported {
			t.Errorf("%s: %v; want one line with %s (unsupported %v)", tc.name, err, tc.msg, tc.unsupported)
		}
	}
}

// TestGGUFVocabRefuses: tokenizers GGUF cannot describe are refused with
// an error wrapping ErrUnsupported, and so is a model vocabulary smaller
// than the tokenizer's ids.
func TestGGUFVocabRefuses(t *testing.T) {
	base := `{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<s>": 3, "</s>": 4}, "merges": ["a b"]},
		"added_tokens": [{"id": 3, "content": "<s>", "special": true}, {"id": 4, "content": "</s>", "special": true}],
		"decoder": {"type": "ByteLevel"}, %s}`
	for _, tc := range []struct {
		name, parts string
		size        int
		msg         string
	}{
		{"whitespace pre-tokenizer", `"pre_tokenizer": {"type": "WhitespaceSplit"}`, 5, "pre-tokenizer"},
		{"byte-level with a prefix space", `"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": true}`, 5, "pre-tokenizer"},
		{"two tokens before the text", `"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false},
			"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"SpecialToken": {"id": "</s>"}}, {"Sequence": {"id": "A"}}],
			"special_tokens": {"<s>": {"ids": [3]}, "</s>": {"ids": [4]}}}`, 5, "before the text"},
		{"vocabulary too small", `"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false}`, 4, "beyond the model's vocabulary of 4"},
	} {
		tok, err := Parse([]byte(strings.Replace(base, "%s", tc.parts, 1)), nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		_, err = tok.GGUFVocab(tc.size)
		if err == nil || !strings.Contains(err.Error(), tc.msg) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v; want one line with %q", tc.name, err, tc.msg)
		}
	}
}

// TestGGUFVocabParity: the real tokenizers of the parity test written as
// GGUF vocabularies (Llama 3 as "llama-bpe", Qwen3 as "qwen2", Llama 2 as
// the llama kind, with its merges and by its scores alone) and read back
// encode and decode the corpus as Hugging Face's library does;
// Mistral-Nemo's pre-tokenizer has no GGUF name strata knows and is
// refused.
func TestGGUFVocabParity(t *testing.T) {
	for _, tc := range []struct {
		name, model, pre string
		scoresOnly       bool
	}{
		{"llama3", "gpt2", "llama-bpe", false},
		{"qwen3", "gpt2", "qwen2", false},
		{"llama2", "llama", "", false},
		{"llama2", "llama", "", true},
		{"mistral_nemo", "", "", false},
	} {
		t.Run(fmt.Sprintf("%s/scores-only=%v", tc.name, tc.scoresOnly), func(t *testing.T) {
			src, err := Parse(readTestdata(t, tc.name+"/tokenizer.json.gz"), readTestdata(t, tc.name+"/tokenizer_config.json.gz"))
			if err != nil {
				t.Fatal(err)
			}
			v, err := src.GGUFVocab(src.VocabSize())
			if tc.model == "" {
				if !errors.Is(err, ErrUnsupported) {
					t.Fatalf("GGUFVocab: %v, want an error wrapping ErrUnsupported", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if v.Model != tc.model || v.Pre != tc.pre {
				t.Errorf("model %q pre %q", v.Model, v.Pre)
			}
			if tc.scoresOnly {
				v.Merges = nil
			}
			if v.ChatTemplate != src.ChatTemplate() {
				t.Errorf("GGUFVocab's ChatTemplate %.40q..., want the config's %.40q...", v.ChatTemplate, src.ChatTemplate())
			}
			tok, err := FromGGUF(v)
			if err != nil {
				t.Fatal(err)
			}
			if tok.ChatTemplate() != src.ChatTemplate() {
				t.Errorf("FromGGUF lost the chat template: %.40q...", tok.ChatTemplate())
			}
			for _, key := range []string{"bos_token", "eos_token"} {
				if got, want := tok.SpecialTokens()[key], src.SpecialTokens()[key]; got != want {
					t.Errorf("SpecialTokens()[%s] = %q, want %q", key, got, want)
				}
			}
			if id := tok.EOS(); id >= 0 && !tok.Special(id) {
				t.Errorf("the EOS token %d is not Special", id)
			}
			var ref struct {
				Cases []struct {
					Text    string `json:"text"`
					IDs     []int  `json:"ids"`
					Special []int  `json:"special"`
					Decoded string `json:"decoded"`
				} `json:"cases"`
			}
			unmarshalTestdata(t, tc.name+"/cases.json", &ref)
			f := failures{t: t, what: tc.name}
			for _, c := range ref.Cases {
				got, err := tok.Encode(c.Text, false)
				if err != nil || !slices.Equal(got, c.IDs) {
					f.errorf("Encode(%q)\n got %v, %v\nwant %v", c.Text, got, err, c.IDs)
					continue
				}
				got, err = tok.Encode(c.Text, true)
				if err != nil || !slices.Equal(got, c.Special) {
					f.errorf("Encode(%q, true)\n got %v, %v\nwant %v", c.Text, got, err, c.Special)
				}
				dec, err := tok.Decode(c.IDs)
				if err != nil || dec != c.Decoded {
					f.errorf("Decode(%v) = %q, %v; want %q", c.IDs, dec, err, c.Decoded)
				}
			}
			f.done(len(ref.Cases))
		})
	}
}
