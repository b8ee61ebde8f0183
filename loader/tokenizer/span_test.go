package tokenizer

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
)

// TestMaxTokenBytes checks the bound on the text one token stands for: on
// the fixtures and variants of them, each text encodes to at least
// len(text)/MaxTokenBytes tokens, and a pipeline that can drop or fold text
// gives no bound.
func TestMaxTokenBytes(t *testing.T) {
	read := func(name string) map[string]any {
		raw, err := os.ReadFile(filepath.Join(fixtures.Dir(name), TokenizerFile))
		if err != nil {
			t.Fatal(err)
		}
		doc := map[string]any{}
		if err := json.Unmarshal(raw, &doc); err != nil {
			t.Fatal(err)
		}
		return doc
	}
	// variant returns a fixture's tokenizer.json changed by edit.
	variant := func(name string, edit func(doc, model map[string]any)) []byte {
		doc := read(name)
		if edit != nil {
			edit(doc, doc["model"].(map[string]any))
		}
		raw, err := json.Marshal(doc)
		if err != nil {
			t.Fatal(err)
		}
		return raw
	}
	sp, bl := fixtures.TinyLlamaBF16, fixtures.TinyLlamaF16Sharded // SentencePiece-style, byte-level
	seqNorm := func(doc map[string]any, extra map[string]any) {
		doc["normalizer"] = map[string]any{"type": "Sequence", "normalizers": []any{doc["normalizer"], extra}}
	}
	cases := []struct {
		name    string
		json    []byte
		bounded bool
	}{
		{"sentencepiece fixture", variant(sp, nil), true},
		{"byte-level fixture", variant(bl, nil), true},
		{"unknown characters not fused", variant(sp, func(_, m map[string]any) { m["byte_fallback"], m["fuse_unk"] = false, false }), true},
		{"unknown characters fused", variant(sp, func(_, m map[string]any) { m["byte_fallback"] = false }), false},
		{"unknown characters dropped", variant(sp, func(_, m map[string]any) { m["byte_fallback"], m["unk_token"] = false, nil }), false},
		{"strip", variant(sp, func(d, _ map[string]any) {
			seqNorm(d, map[string]any{"type": "Strip", "strip_left": true, "strip_right": true})
		}), false},
		{"nfc", variant(sp, func(d, _ map[string]any) { seqNorm(d, map[string]any{"type": "NFC"}) }), false},
		{"shortening replace", variant(sp, func(d, _ map[string]any) {
			seqNorm(d, map[string]any{"type": "Replace", "pattern": map[string]any{"String": "ab"}, "content": "a"})
		}), false},
		{"whitespace split", variant(bl, func(d, _ map[string]any) {
			d["pre_tokenizer"] = map[string]any{"type": "Sequence", "pretokenizers": []any{map[string]any{"type": "WhitespaceSplit"}, d["pre_tokenizer"]}}
		}), false},
		{"lstrip added token", variant(sp, func(d, _ map[string]any) {
			d["added_tokens"].([]any)[2].(map[string]any)["lstrip"] = true
		}), false},
		{"byte alphabet incomplete", variant(bl, func(_, m map[string]any) {
			vocab, merges := m["vocab"].(map[string]any), fmt.Sprint(m["merges"])
			for _, s := range alphabet() {
				if !strings.Contains(merges, s) {
					delete(vocab, s) // a byte no merge needs: its character is now dropped
					return
				}
			}
			t.Fatal("every byte character is used by a merge")
		}), false},
	}
	texts := []string{
		benchText(4000),
		strings.Repeat(" ", 3000),
		strings.Repeat("a", 3000),
		strings.Repeat("显存不足🚀", 300),
		strings.Repeat("<s></s>", 300),
		strings.Repeat("\n\t ~é", 500),
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tok := mustParse(t, c.json, nil)
			n := tok.MaxTokenBytes()
			if (n > 0) != c.bounded {
				t.Fatalf("MaxTokenBytes = %d, want a bound: %v", n, c.bounded)
			}
			if n == 0 {
				return
			}
			for _, s := range texts {
				ids, err := tok.Encode(s, false)
				if err != nil {
					t.Fatal(err)
				}
				if len(ids)*n < len(s) {
					t.Errorf("%d bytes (%.20q...) encode to %d tokens of at most %d bytes each", len(s), s, len(ids), n)
				}
			}
		})
	}
}
