package tokenizer

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// The files under testdata are written by testdata/gen/gen.js with Hugging
// Face's tokenizers library (its Rust code): real tokenizer files of four
// model families, gzipped, with the library's encodings of a text corpus,
// and its output for split and replace expressions and the Unicode
// normalizers.

// readTestdata reads a file under testdata, gunzipping a .gz one.
func readTestdata(t testing.TB, name string) []byte {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var r io.Reader = f
	if filepath.Ext(name) == ".gz" {
		z, err := gzip.NewReader(f)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		r = z
	}
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

func unmarshalTestdata(t testing.TB, name string, v any) {
	t.Helper()
	if err := json.Unmarshal(readTestdata(t, name), v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

// failures stops a parity test from printing hundreds of lines for one
// defect.
type failures struct {
	t    *testing.T
	n    int
	what string
}

func (f *failures) errorf(format string, args ...any) {
	f.t.Helper()
	if f.n++; f.n <= 8 {
		f.t.Errorf(format, args...)
	}
}

func (f *failures) done(total int) {
	if f.n > 8 {
		f.t.Errorf("%s: %d differences in %d cases (8 shown)", f.what, f.n, total)
	}
}

// TestParityModels: real tokenizers (Llama 3, Qwen3 with its NFC
// normalizer, Llama 2's SentencePiece BPE, Mistral-Nemo whose split
// expression has a lookahead) encode and decode the corpus as Hugging
// Face's library does.
func TestParityModels(t *testing.T) {
	for _, name := range []string{"llama3", "qwen3", "llama2", "mistral_nemo"} {
		t.Run(name, func(t *testing.T) {
			tok, err := Parse(readTestdata(t, name+"/tokenizer.json.gz"), readTestdata(t, name+"/tokenizer_config.json.gz"))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			// Decode is compared with the library's, which leaves the
			// spaces that transformers' clean-up removes.
			tok.cleanup = false
			var ref struct {
				Cases []struct {
					Text    string `json:"text"`
					IDs     []int  `json:"ids"`
					Special []int  `json:"special"`
					Decoded string `json:"decoded"`
				} `json:"cases"`
			}
			unmarshalTestdata(t, name+"/cases.json", &ref)
			if len(ref.Cases) < 100 {
				t.Fatalf("%d cases", len(ref.Cases))
			}
			f := failures{t: t, what: name}
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

// TestParitySplit: Split pre-tokenizers cut text into the pieces Hugging
// Face's library does, for the expressions of real tokenizers (GPT-2,
// Llama 3, Qwen2, Mistral-Nemo, o200k) and for constructs Go's regexp
// lacks or means otherwise (lookaround, \b, atomic groups, possessive
// quantifiers, backreferences, line anchors, Oniguruma's \w).
func TestParitySplit(t *testing.T) {
	var ref struct {
		Groups []struct {
			Name    string                       `json:"name"`
			Pattern string                       `json:"pattern"`
			Cases   []map[string]json.RawMessage `json:"cases"`
		} `json:"groups"`
	}
	unmarshalTestdata(t, "split_cases.json", &ref)
	if len(ref.Groups) < 20 {
		t.Fatalf("%d groups", len(ref.Groups))
	}
	for _, g := range ref.Groups {
		name := g.Name
		if name == "" {
			name = g.Pattern
		}
		t.Run(name, func(t *testing.T) {
			m, err := newRegexMatcher(g.Pattern)
			if err != nil {
				t.Fatalf("newRegexMatcher(%q): %v", g.Pattern, err)
			}
			f := failures{t: t, what: name}
			for _, c := range g.Cases {
				var text string
				if err := json.Unmarshal(c["text"], &text); err != nil {
					t.Fatal(err)
				}
				for key, raw := range c {
					if key == "text" {
						continue
					}
					var want []string
					if err := json.Unmarshal(raw, &want); err != nil {
						t.Fatal(err)
					}
					behavior, invert := key, false
					if key == "InvertedIsolated" {
						behavior, invert = "Isolated", true
					}
					b, ok := splitBehaviors[behavior]
					if !ok {
						t.Fatalf("case key %q", key)
					}
					var got []string
					splitPreTokenizer{m: m, behavior: b, invert: invert}.preTokenize(piece{text: text, id: -1}, func(p piece) { got = append(got, p.text) })
					if !slices.Equal(got, want) {
						f.errorf("%s %q:\n got %q\nwant %q", key, text, got, want)
					}
				}
			}
			f.done(len(g.Cases))
		})
	}
}

// TestParityReplace: Replace normalizers with regular expressions rewrite
// text as Hugging Face's library does.
func TestParityReplace(t *testing.T) {
	var ref struct {
		Groups []struct {
			Pattern string `json:"pattern"`
			Content string `json:"content"`
			Cases   []struct {
				Text string `json:"text"`
				Want string `json:"want"`
			} `json:"cases"`
		} `json:"groups"`
	}
	unmarshalTestdata(t, "replace_cases.json", &ref)
	for _, g := range ref.Groups {
		t.Run(g.Pattern, func(t *testing.T) {
			r, err := patternJSON{Regex: &g.Pattern}.replacer(g.Content)
			if err != nil {
				t.Fatal(err)
			}
			f := failures{t: t, what: g.Pattern}
			for _, c := range g.Cases {
				if got := r.replace(c.Text); got != c.Want {
					f.errorf("replace(%q) = %q, want %q", c.Text, got, c.Want)
				}
			}
			f.done(len(g.Cases))
		})
	}
}

// TestParityNormalize: the Unicode normalizers give Hugging Face's output,
// also for runs of more than 30 combining marks (where a stream-safe
// normalizer would insert U+034F).
func TestParityNormalize(t *testing.T) {
	var ref struct {
		Groups []struct {
			Form  string `json:"form"`
			Cases []struct {
				Text string `json:"text"`
				Want string `json:"want"`
			} `json:"cases"`
		} `json:"groups"`
	}
	unmarshalTestdata(t, "normalize_cases.json", &ref)
	if len(ref.Groups) != 4 {
		t.Fatalf("%d forms", len(ref.Groups))
	}
	for _, g := range ref.Groups {
		t.Run(g.Form, func(t *testing.T) {
			n, err := parseNormalizer(json.RawMessage(fmt.Sprintf(`{"type": %q}`, g.Form)))
			if err != nil {
				t.Fatal(err)
			}
			f := failures{t: t, what: g.Form}
			for _, c := range g.Cases {
				if got := n.normalize(c.Text); got != c.Want {
					f.errorf("%s(%+q)\n got %+q\nwant %+q", g.Form, c.Text, got, c.Want)
				}
			}
			f.done(len(g.Cases))
		})
	}
}
