// Package chat renders a model's chat template, the Jinja program in its
// tokenizer_config.json (chat_template, or chat_template.jinja beside it)
// or in its GGUF file (tokenizer.chat_template), which turns a
// conversation into the prompt text the model was trained on. It renders
// as transformers' apply_chat_template does: the template sees messages
// (each with role and content), add_generation_prompt, the tokenizer's
// named special tokens (bos_token, eos_token, ...) and any variables the
// caller adds (enable_thinking, say); blocks are trimmed as with Jinja's
// trim_blocks and lstrip_blocks; raise_exception ends the rendering with
// the template's message.
//
// The Jinja engine is github.com/ardanlabs/jinja, written for chat
// templates. Tests compare its output with Python's Jinja (transformers'
// engine) and @huggingface/jinja (transformers.js') on the real templates
// of Llama 3, Qwen3 and Mistral-Nemo.
//
// Example:
//
//	tmpl, err := chat.FromTokenizer(tok)
//	if err != nil {
//		return err // chat.ErrNoTemplate: the model has none
//	}
//	text, err := tmpl.Render([]chat.Message{{Role: "user", Content: "Hi"}}, chat.Options{AddGenerationPrompt: true})
//	if err != nil {
//		return err // the conversation is not one the template accepts
//	}
//	ids, err := tok.Encode(text, false) // the template wrote the special tokens
package chat

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ardanlabs/jinja"

	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/loader/tokenizer"
)

// ErrNoTemplate is returned by FromTokenizer for a model without a chat
// template.
var ErrNoTemplate = errors.New("chat: the model has no chat template")

// ErrRender wraps the error of a rendering that failed: the template
// raised an exception (raise_exception) or failed on the conversation.
var ErrRender = errors.New("chat: the chat template failed on the conversation")

// Message is one turn of a conversation.
type Message struct {
	Role    string // system, user, assistant, ...
	Content string
}

// Options adjust a rendering.
type Options struct {
	// AddGenerationPrompt ends the text with the start of the
	// assistant's turn, for the model to continue.
	AddGenerationPrompt bool
	// Vars are more variables for the template (enable_thinking, ...);
	// they cannot replace messages, add_generation_prompt or the special
	// tokens.
	Vars map[string]any
}

// Template is a compiled chat template. It is safe for concurrent use.
type Template struct {
	t       *jinja.Template
	special map[string]string
}

// New compiles a chat template's source; special are the named special
// tokens the template may read (bos_token, eos_token, ...).
func New(source string, special map[string]string) (*Template, error) {
	t, err := compile(source)
	if err != nil {
		return nil, fmt.Errorf("chat: the chat template does not compile: %s", oneline.String(err.Error()))
	}
	sp := map[string]string{}
	for k, v := range special {
		sp[k] = v
	}
	return &Template{t: t, special: sp}, nil
}

// compile is jinja.Compile that turns a panic of the engine into an error.
func compile(source string) (t *jinja.Template, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("the Jinja engine failed: %v", r)
		}
	}()
	return jinja.Compile(source)
}

// FromTokenizer compiles the chat template of tok with its named special
// tokens; a tokenizer without one is ErrNoTemplate.
func FromTokenizer(tok *tokenizer.Tokenizer) (*Template, error) {
	src := tok.ChatTemplate()
	if strings.TrimSpace(src) == "" {
		return nil, ErrNoTemplate
	}
	return New(src, tok.SpecialTokens())
}

// Render returns the prompt text of msgs. A template that raises an
// exception, or fails on msgs, is an error wrapping ErrRender with the
// template's message on one line.
func (t *Template) Render(msgs []Message, o Options) (text string, err error) {
	data := make(map[string]any, len(o.Vars)+len(t.special)+2)
	for k, v := range o.Vars {
		data[k] = v
	}
	for k, v := range t.special {
		data[k] = v
	}
	list := make([]any, len(msgs))
	for i, m := range msgs {
		list[i] = map[string]any{"role": m.Role, "content": m.Content}
	}
	data["messages"] = list
	data["add_generation_prompt"] = o.AddGenerationPrompt
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: the Jinja engine failed: %s", ErrRender, oneline.String(fmt.Sprint(r)))
		}
	}()
	text, err = t.t.Render(data)
	if err != nil {
		return "", fmt.Errorf("%w: %s", ErrRender, oneline.String(err.Error()))
	}
	return text, nil
}
