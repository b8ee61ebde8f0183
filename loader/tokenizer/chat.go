package tokenizer

import (
	"encoding/json"
	"errors"
	"maps"
)

// ChatTemplate returns the model's chat template, the Jinja source that
// turns a conversation into prompt text (package chat renders it), or ""
// when the model has none: chat_template.jinja, else tokenizer_config.json's
// chat_template (a string, or the one named "default" of a list of named
// templates), else a GGUF file's tokenizer.chat_template.
func (t *Tokenizer) ChatTemplate() string { return t.chatTemplate }

// SpecialTokens returns the named special tokens by their config names
// (bos_token, eos_token, unk_token, pad_token, ...), as a chat template
// sees them; a GGUF vocabulary names its BOS, EOS and unknown tokens.
func (t *Tokenizer) SpecialTokens() map[string]string { return maps.Clone(t.named) }

// Special reports whether id is a special token (an added token marked
// special, or a GGUF control token): text for people leaves them out, as
// Hugging Face's decode(ids, skip_special_tokens=True) does.
func (t *Tokenizer) Special(id int) bool { return t.special[id] }

// chatTemplate reads tokenizer_config.json's chat_template: a string, or a
// list of {"name", "template"} of which the one named "default" is the
// chat template ("" when none is).
func chatTemplate(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var named []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", errors.New("neither a string nor a list of named templates")
	}
	for _, n := range named {
		if n.Name == "default" {
			return n.Template, nil
		}
	}
	return "", nil
}
