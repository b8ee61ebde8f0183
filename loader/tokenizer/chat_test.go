package tokenizer

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestChatTemplateRealConfigs: the chat template and the named special
// tokens of the real tokenizer_config.json files are read as written, and
// the special added tokens are Special.
func TestChatTemplateRealConfigs(t *testing.T) {
	for _, tc := range []struct {
		name     string
		template bool
		named    map[string]string
		special  []string // tokens that are Special
		plain    []string // tokens that are not
	}{
		{"llama3", true, map[string]string{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
			[]string{"<|begin_of_text|>", "<|eot_id|>"}, []string{"Hello"}},
		{"qwen3", true, map[string]string{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
			[]string{"<|im_start|>", "<|im_end|>"}, []string{"hello"}},
		{"llama2", false, map[string]string{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
			[]string{"<s>", "</s>"}, []string{"▁the"}},
		{"mistral_nemo", true, map[string]string{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
			[]string{"<s>", "[INST]"}, []string{"hello"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := readTestdata(t, tc.name+"/tokenizer_config.json.gz")
			tok, err := Parse(readTestdata(t, tc.name+"/tokenizer.json.gz"), cfg)
			if err != nil {
				t.Fatal(err)
			}
			var raw struct {
				ChatTemplate string `json:"chat_template"`
			}
			if err := json.Unmarshal(cfg, &raw); err != nil {
				t.Fatal(err)
			}
			if got := tok.ChatTemplate(); got != raw.ChatTemplate || (got != "") != tc.template {
				t.Errorf("ChatTemplate = %.60q..., want %.60q... (a template: %v)", got, raw.ChatTemplate, tc.template)
			}
			if got := tok.SpecialTokens(); !maps.Equal(got, tc.named) {
				t.Errorf("SpecialTokens = %v, want %v", got, tc.named)
			}
			for _, s := range tc.special {
				if id := tok.ID(s); id < 0 || !tok.Special(id) {
					t.Errorf("%q (id %d) is not Special", s, id)
				}
			}
			for _, s := range tc.plain {
				if id := tok.ID(s); id < 0 || tok.Special(id) {
					t.Errorf("%q (id %d) is Special or unknown", s, id)
				}
			}
		})
	}
}

// TestChatTemplateForms: chat_template as a string, as a list of named
// templates (the one named "default"), null or absent; anything else is an
// error naming the key.
func TestChatTemplateForms(t *testing.T) {
	tj := byteLevelJSON(t, llama3Pre(llama3Pattern), nil)
	for _, tc := range []struct {
		name, config, want, err string
	}{
		{"string", `{"chat_template": "{{ bos_token }}x"}`, "{{ bos_token }}x", ""},
		{"named list", `{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}`, "D", ""},
		{"named list without default", `{"chat_template": [{"name": "tool_use", "template": "T"}]}`, "", ""},
		{"null", `{"chat_template": null}`, "", ""},
		{"absent", `{}`, "", ""},
		{"number", `{"chat_template": 3}`, "", "tokenizer_config.json: chat_template: neither a string nor a list of named templates"},
		{"list of strings", `{"chat_template": ["a"]}`, "", "chat_template: neither a string"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok, err := Parse(tj, []byte(tc.config))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || strings.Contains(err.Error(), "\n") {
					t.Fatalf("Parse = %v, want an error with %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := tok.ChatTemplate(); got != tc.want {
				t.Errorf("ChatTemplate = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestChatTemplateFile: Load takes chat_template.jinja over the config's
// chat_template; a file that is not UTF-8 text, or that cannot be read, is
// an error naming it.
func TestChatTemplateFile(t *testing.T) {
	tj := byteLevelJSON(t, llama3Pre(llama3Pattern), nil)
	for _, tc := range []struct {
		name string
		file any // string, []byte, or true for a directory; nil for none
		want string
		err  string
	}{
		{"config only", nil, "from config", ""},
		{"file", "{{ messages }} from file", "{{ messages }} from file", ""},
		{"not UTF-8", []byte{'a', 0xff, 'b'}, "", "chat_template.jinja is not UTF-8 text"},
		{"a directory", true, "", "read chat_template.jinja"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			write := func(name string, data []byte) {
				if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			write(TokenizerFile, tj)
			write(ConfigFile, []byte(`{"chat_template": "from config"}`))
			switch f := tc.file.(type) {
			case string:
				write(ChatTemplateFile, []byte(f))
			case []byte:
				write(ChatTemplateFile, f)
			case bool:
				os.Mkdir(filepath.Join(dir, ChatTemplateFile), 0o755)
			}
			tok, err := Load(dir)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Load = %v, want an error with %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := tok.ChatTemplate(); got != tc.want {
				t.Errorf("ChatTemplate = %q, want %q", got, tc.want)
			}
		})
	}
}
