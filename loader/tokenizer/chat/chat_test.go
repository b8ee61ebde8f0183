package chat

import (
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/loader/tokenizer"
)

// The tokenizers of loader/tokenizer's reference data, parsed once.
var (
	toksOnce sync.Once
	toks     map[string]*tokenizer.Tokenizer
	toksErr  error
)

func readGz(name string) ([]byte, error) {
	f, err := os.Open(filepath.Join("..", "testdata", name))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		return nil, err
	}
	return io.ReadAll(z)
}

func testTokenizer(t *testing.T, model string) *tokenizer.Tokenizer {
	t.Helper()
	toksOnce.Do(func() {
		toks = map[string]*tokenizer.Tokenizer{}
		for _, m := range []string{"llama3", "qwen3", "llama2", "mistral_nemo"} {
			tj, err := readGz(m + "/tokenizer.json.gz")
			if err != nil {
				toksErr = err
				return
			}
			cj, err := readGz(m + "/tokenizer_config.json.gz")
			if err != nil {
				toksErr = err
				return
			}
			if toks[m], err = tokenizer.Parse(tj, cj); err != nil {
				toksErr = err
				return
			}
		}
	})
	if toksErr != nil {
		t.Fatal(toksErr)
	}
	return toks[model]
}

// rendering is a reference's text, or the message of the exception the
// template raised.
type rendering struct {
	Text  *string `json:"text"`
	Error string  `json:"error"`
}

type chatCase struct {
	Model               string         `json:"model"`
	Name                string         `json:"name"`
	Messages            []Message      `json:"messages"`
	AddGenerationPrompt bool           `json:"add_generation_prompt"`
	Vars                map[string]any `json:"vars"`
	Python, JS          rendering
}

// TestReference renders the conversations of testdata/chat_cases.json with
// the real chat templates of Llama 3, Qwen3 and Mistral-Nemo and compares
// with the renderings of Python's Jinja as transformers runs it. Where
// @huggingface/jinja renders the same (all but four cases, where its
// selectattr(..., "undefined") keeps no message, so Mistral-Nemo's check
// that roles alternate passes or another one raises), that is the JS
// reference too.
func TestReference(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "testdata", "chat_cases.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ref struct {
		Cases []chatCase `json:"cases"`
	}
	if err := json.Unmarshal(data, &ref); err != nil {
		t.Fatal(err)
	}
	for _, c := range ref.Cases {
		tmpl, err := FromTokenizer(testTokenizer(t, c.Model))
		if err != nil {
			t.Fatal(err)
		}
		got, err := tmpl.Render(c.Messages, Options{AddGenerationPrompt: c.AddGenerationPrompt, Vars: c.Vars})
		want := c.Python
		switch {
		case want.Text == nil:
			if !errors.Is(err, ErrRender) || !strings.HasSuffix(err.Error(), ": "+want.Error) {
				t.Errorf("%s/%s/%v: %q, %v; want an error ending %q", c.Model, c.Name, c.AddGenerationPrompt, got, err, want.Error)
			}
		case err != nil || got != *want.Text:
			t.Errorf("%s/%s/%v:\n got %q, %v\nwant %q", c.Model, c.Name, c.AddGenerationPrompt, got, err, *want.Text)
		}
	}
	if len(ref.Cases) < 50 {
		t.Errorf("%d reference cases", len(ref.Cases))
	}
}

// TestTemplate: a model without a template, a template that does not
// compile, one that raises, the special tokens and variables it sees, and
// variables that cannot replace the conversation.
func TestTemplate(t *testing.T) {
	if _, err := FromTokenizer(testTokenizer(t, "llama2")); !errors.Is(err, ErrNoTemplate) {
		t.Errorf("Llama 2's tokenizer: %v, want ErrNoTemplate", err)
	}
	special := map[string]string{"bos_token": "<s>", "eos_token": "</s>"}
	user := []Message{{Role: "user", Content: "hi"}}
	for _, tc := range []struct {
		name, src string
		msgs      []Message
		o         Options
		want      string
		err       string // in the error of New, or of Render (ErrRender)
	}{
		{"special tokens", "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m['content'] }}{% endfor %}{{ eos_token }}", user, Options{}, "<s>user:hi</s>", ""},
		{"generation prompt", "{% if add_generation_prompt %}A:{% endif %}", user, Options{AddGenerationPrompt: true}, "A:", ""},
		{"no generation prompt", "{% if add_generation_prompt %}A:{% endif %}x", user, Options{}, "x", ""},
		{"vars", "{{ enable_thinking }}|{{ n + 1 }}", user, Options{Vars: map[string]any{"enable_thinking": false, "n": 2}}, "False|3", ""},
		{"vars cannot replace the conversation", "{{ messages | length }}{{ add_generation_prompt }}{{ bos_token }}", user,
			Options{Vars: map[string]any{"messages": []any{1, 2, 3}, "add_generation_prompt": "yes", "bos_token": "B"}}, "1False<s>", ""},
		{"trim and lstrip blocks", "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n", user, Options{}, "hi\n", ""},
		{"raise_exception", "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}", user, Options{},
			"", "chat: the chat template failed on the conversation: a system message first"},
		{"does not compile", "{% for m in messages %}", user, Options{}, "", "chat: the chat template does not compile"},
		{"unknown filter", "{{ messages | nosuchfilter }}", user, Options{}, "", "nosuchfilter"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tmpl, err := New(tc.src, special)
			if err == nil {
				var got string
				got, err = tmpl.Render(tc.msgs, tc.o)
				if err == nil && got != tc.want {
					t.Errorf("Render = %q, want %q", got, tc.want)
				}
				if err != nil && !errors.Is(err, ErrRender) {
					t.Errorf("Render: %v does not wrap ErrRender", err)
				}
			}
			switch {
			case tc.err == "" && err != nil:
				t.Fatal(err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err) || strings.Contains(err.Error(), "\n")):
				t.Fatalf("error %v, want one line with %q", err, tc.err)
			}
		})
	}
}

// TestConcurrent renders one template from many goroutines (run with
// -race): each gets its own conversation back.
func TestConcurrent(t *testing.T) {
	tmpl, err := FromTokenizer(testTokenizer(t, "qwen3"))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			content := strings.Repeat("x", i+1)
			got, err := tmpl.Render([]Message{{Role: "user", Content: content}}, Options{AddGenerationPrompt: true})
			if want := "<|im_start|>user\n" + content + "<|im_end|>\n<|im_start|>assistant\n"; err != nil || got != want {
				t.Errorf("goroutine %d: %q, %v; want %q", i, got, err, want)
			}
		})
	}
	wg.Wait()
}
