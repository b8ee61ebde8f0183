package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
)

// refCase is one tokenizer case of a fixture's reference.json, written by
// Hugging Face transformers.
type refCase struct {
	Text    string `json:"text"`
	IDs     []int  `json:"ids"`
	Decoded string `json:"decoded"`
}

type fixture struct {
	name  string
	dir   string
	tok   *Tokenizer
	cases []refCase
	// byteLevel is set for the fixture whose decode(encode(s)) == s holds.
	byteLevel bool
}

func loadFixture(t testing.TB, name string) fixture {
	t.Helper()
	dir := fixtures.Dir(name)
	raw, err := os.ReadFile(filepath.Join(dir, "reference.json"))
	if err != nil {
		t.Skipf("fixture %s not available: %v", name, err)
	}
	var ref struct {
		Tokenizer struct {
			Kind   string    `json:"kind"`
			Encode []refCase `json:"encode"`
		} `json:"tokenizer"`
	}
	if err := json.Unmarshal(raw, &ref); err != nil {
		t.Fatalf("%s: reference.json: %v", name, err)
	}
	if len(ref.Tokenizer.Encode) == 0 {
		t.Fatalf("%s: reference.json has no tokenizer cases", name)
	}
	tok, err := Load(dir)
	if err != nil {
		t.Fatalf("Load(%s): %v", name, err)
	}
	return fixture{name: name, dir: dir, tok: tok, cases: ref.Tokenizer.Encode, byteLevel: name == fixtures.TinyLlamaF16Sharded}
}

func allFixtures(t testing.TB) []fixture {
	return []fixture{loadFixture(t, fixtures.TinyLlamaF16Sharded), loadFixture(t, fixtures.TinyLlamaBF16)}
}

func equalIDs(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestReferenceEncode(t *testing.T) {
	for _, f := range allFixtures(t) {
		for _, c := range f.cases {
			got, err := f.tok.Encode(c.Text, false)
			if err != nil {
				t.Errorf("%s: Encode(%q): %v", f.name, c.Text, err)
				continue
			}
			if !equalIDs(got, c.IDs) {
				t.Errorf("%s: Encode(%q)\n got %v\nwant %v", f.name, c.Text, got, c.IDs)
			}
		}
	}
}

func TestReferenceDecode(t *testing.T) {
	for _, f := range allFixtures(t) {
		for _, c := range f.cases {
			got, err := f.tok.Decode(c.IDs)
			if err != nil {
				t.Errorf("%s: Decode(%v): %v", f.name, c.IDs, err)
				continue
			}
			if got != c.Decoded {
				t.Errorf("%s: Decode(%v) = %q, want %q", f.name, c.IDs, got, c.Decoded)
			}
		}
	}
}

// specialIDs reads, independently of the package, the ids of the config's
// bos_token and eos_token from the fixture's JSON files.
func specialIDs(t *testing.T, dir string) (bos, eos int) {
	t.Helper()
	var cfg struct {
		BOS string `json:"bos_token"`
		EOS string `json:"eos_token"`
	}
	var tj struct {
		AddedTokens []struct {
			ID      int    `json:"id"`
			Content string `json:"content"`
		} `json:"added_tokens"`
	}
	for name, v := range map[string]any{"tokenizer_config.json": &cfg, "tokenizer.json": &tj} {
		raw, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(raw, v); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	bos, eos = -1, -1
	for _, a := range tj.AddedTokens {
		if a.Content == cfg.BOS {
			bos = a.ID
		}
		if a.Content == cfg.EOS {
			eos = a.ID
		}
	}
	if bos < 0 || eos < 0 {
		t.Fatalf("%s: bos %q or eos %q not among the added tokens", dir, cfg.BOS, cfg.EOS)
	}
	return bos, eos
}

func TestSpecialTokens(t *testing.T) {
	for _, f := range allFixtures(t) {
		bos, eos := specialIDs(t, f.dir)
		if f.tok.BOS() != bos || f.tok.EOS() != eos {
			t.Errorf("%s: BOS, EOS = %d, %d; want %d, %d", f.name, f.tok.BOS(), f.tok.EOS(), bos, eos)
		}
		if got, want := f.tok.VocabSize(), configVocabSize(t, f.dir); got != want {
			t.Errorf("%s: VocabSize = %d, want %d (config.json vocab_size)", f.name, got, want)
		}
		for _, c := range f.cases {
			got, err := f.tok.Encode(c.Text, true)
			if err != nil {
				t.Fatal(err)
			}
			// Both fixtures' post-processor is TemplateProcessing "<s> $A".
			want := append([]int{bos}, c.IDs...)
			if !equalIDs(got, want) {
				t.Errorf("%s: Encode(%q, true) = %v, want %v", f.name, c.Text, got, want)
			}
		}
		// The special tokens written in the text are split out whole.
		text := "<s>" + f.cases[0].Text + "</s>"
		got, err := f.tok.Encode(text, false)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) < 2 || got[0] != bos || got[len(got)-1] != eos {
			t.Errorf("%s: Encode(%q) = %v, want it to start with %d and end with %d", f.name, text, got, bos, eos)
		}
		dec, err := f.tok.Decode(got)
		if err != nil {
			t.Fatal(err)
		}
		if f.byteLevel && dec != text {
			t.Errorf("%s: Decode(Encode(%q)) = %q", f.name, text, dec)
		}
	}
}

func configVocabSize(t *testing.T, dir string) int {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		VocabSize int `json:"vocab_size"`
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	return cfg.VocabSize
}
