package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"

	"github.com/strata-llm/strata/loader/tokenizer/chat"
	"github.com/strata-llm/strata/nn"
)

// apiRequest is the body of POST /v1/completions and
// /v1/chat/completions: the fields of OpenAI's API that serve reads.
// Fields it does not know are ignored (clients send many); values it
// cannot honour are refused.
type apiRequest struct {
	Model    string          `json:"model"`
	Prompt   json.RawMessage `json:"prompt"`
	Messages []apiMessage    `json:"messages"`

	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	TopK                *int            `json:"top_k"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	N                   *int            `json:"n"`
	BestOf              *int            `json:"best_of"`
	Echo                bool            `json:"echo"`
	Logprobs            json.RawMessage `json:"logprobs"`
	PresencePenalty     *float64        `json:"presence_penalty"`
	FrequencyPenalty    *float64        `json:"frequency_penalty"`
	LogitBias           map[string]any  `json:"logit_bias"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// apiMessage is one turn of a chat: content is a string or a list of
// parts, of which serve reads the text ones.
type apiMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// apiError is an error response in OpenAI's shape.
type apiError struct {
	status  int
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) Error() string { return e.Message }

// badRequest is a 400 naming the parameter at fault ("" for none).
func badRequest(param, format string, a ...any) *apiError {
	e := &apiError{status: http.StatusBadRequest, Message: fmt.Sprintf(format, a...), Type: "invalid_request_error"}
	if param != "" {
		e.Param = &param
	}
	return e
}

// withCode sets the error's code.
func (e *apiError) withCode(code string) *apiError {
	e.Code = &code
	return e
}

// writeError writes e as {"error": {...}}.
func writeError(w http.ResponseWriter, e *apiError) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	json.NewEncoder(w).Encode(map[string]any{"error": e})
}

// maxBody bounds a request body.
const maxBody = 8 << 20

// decodeRequest reads the body into r: bad JSON, or a field of the
// wrong type, is a 400 saying where.
func decodeRequest(req *http.Request, w http.ResponseWriter) (*apiRequest, *apiError) {
	body := http.MaxBytesReader(w, req.Body, maxBody)
	var r apiRequest
	dec := json.NewDecoder(body)
	if err := dec.Decode(&r); err != nil {
		var te *json.UnmarshalTypeError
		var mb *http.MaxBytesError
		switch {
		case errors.As(err, &mb):
			return nil, &apiError{status: http.StatusRequestEntityTooLarge, Message: fmt.Sprintf("the request body is over %d bytes", maxBody), Type: "invalid_request_error"}
		case errors.As(err, &te) && te.Field != "":
			return nil, badRequest(te.Field, "%s: a %s is not a %s", te.Field, te.Value, te.Type)
		default:
			return nil, badRequest("", "the body is not a JSON object: %v", err)
		}
	}
	if dec.More() {
		return nil, badRequest("", "the body holds more than one JSON value")
	}
	return &r, nil
}

// sampling checks the sampling parameters and returns the sampler's
// settings: OpenAI's defaults (temperature 1, top_p 1), top_p 0 keeping
// only the most likely token as Hugging Face's does, top_k 0 or -1 for
// every token, and a random seed when none is given.
func (r *apiRequest) sampling() (nn.SamplerConfig, *apiError) {
	c := nn.SamplerConfig{Temperature: 1, TopP: 1}
	if r.Temperature != nil {
		t := *r.Temperature
		if t < 0 || t > 2 || math.IsNaN(t) {
			return c, badRequest("temperature", "temperature %v must be within [0, 2]", t)
		}
		c.Temperature = t
	}
	if r.TopP != nil {
		p := *r.TopP
		if p < 0 || p > 1 || math.IsNaN(p) {
			return c, badRequest("top_p", "top_p %v must be within [0, 1]", p)
		}
		c.TopP = p
		if p == 0 {
			c.TopP = nn.TopPMostLikely
		}
	}
	if r.TopK != nil {
		switch k := *r.TopK; {
		case k == -1:
		case k < 0:
			return c, badRequest("top_k", "top_k %d must be >= 0 (or -1 for every token)", k)
		default:
			c.TopK = k
		}
	}
	if r.Seed != nil {
		c.Seed = uint64(*r.Seed)
	} else {
		var b [8]byte
		rand.Read(b[:])
		for _, v := range b {
			c.Seed = c.Seed<<8 | uint64(v)
		}
	}
	if err := c.Validate(); err != nil {
		return c, badRequest("", "%v", err)
	}
	return c, nil
}

// maxStops is how many stop strings OpenAI's API takes.
const maxStops = 4

// stops reads stop: a string or a list of at most four; empty strings
// are dropped.
func (r *apiRequest) stops() ([]string, *apiError) {
	if isNull(r.Stop) {
		return nil, nil
	}
	var list []string
	var one string
	if err := json.Unmarshal(r.Stop, &one); err == nil {
		list = []string{one}
	} else if err := json.Unmarshal(r.Stop, &list); err != nil {
		return nil, badRequest("stop", "stop must be a string or a list of strings")
	}
	if len(list) > maxStops {
		return nil, badRequest("stop", "stop holds %d strings; at most %d", len(list), maxStops)
	}
	var out []string
	for _, s := range list {
		if s != "" {
			out = append(out, s)
		}
	}
	return out, nil
}

// check refuses what serve does not do: more than one choice, echo,
// log probabilities, penalties, logit biases (their neutral values pass,
// as clients send them).
func (r *apiRequest) check() *apiError {
	switch {
	case r.PresencePenalty != nil && *r.PresencePenalty != 0:
		return badRequest("presence_penalty", "presence_penalty is not supported (0 only)")
	case r.FrequencyPenalty != nil && *r.FrequencyPenalty != 0:
		return badRequest("frequency_penalty", "frequency_penalty is not supported (0 only)")
	case len(r.LogitBias) > 0:
		return badRequest("logit_bias", "logit_bias is not supported")
	case r.N != nil && *r.N != 1:
		return badRequest("n", "n %d: only one choice per request (n 1)", *r.N)
	case r.BestOf != nil && *r.BestOf != 1:
		return badRequest("best_of", "best_of %d: only one candidate per request (best_of 1)", *r.BestOf)
	case r.Echo:
		return badRequest("echo", "echo is not supported")
	case !isNull(r.Logprobs) && string(r.Logprobs) != "false" && string(r.Logprobs) != "0":
		return badRequest("logprobs", "logprobs are not supported")
	}
	return nil
}

// maxTokens is the max_tokens asked for (max_completion_tokens in chat),
// or def when none is given; 0 or less is refused.
func (r *apiRequest) maxTokens(def int) (int, *apiError) {
	name, v := "max_tokens", r.MaxTokens
	if v == nil && r.MaxCompletionTokens != nil {
		name, v = "max_completion_tokens", r.MaxCompletionTokens
	}
	if v == nil {
		return def, nil
	}
	if *v <= 0 {
		return 0, badRequest(name, "%s %d must be >= 1", name, *v)
	}
	return *v, nil
}

// promptInput is a completion's prompt: text, or token ids.
type promptInput struct {
	text string
	ids  []int32
	isID bool
}

// prompt reads prompt: a string, a list of one string, a list of token
// ids, or a list of one list of ids (several prompts are several
// choices: refused).
func (r *apiRequest) prompt() (promptInput, *apiError) {
	var p promptInput
	if isNull(r.Prompt) {
		return p, badRequest("prompt", "prompt is required")
	}
	if json.Unmarshal(r.Prompt, &p.text) == nil {
		return p, nil
	}
	var texts []string
	if json.Unmarshal(r.Prompt, &texts) == nil && len(texts) > 0 {
		if len(texts) != 1 {
			return p, badRequest("prompt", "prompt holds %d prompts: one per request", len(texts))
		}
		p.text = texts[0]
		return p, nil
	}
	p.isID = true
	if json.Unmarshal(r.Prompt, &p.ids) == nil && len(p.ids) > 0 {
		return p, nil
	}
	var lists [][]int32
	if json.Unmarshal(r.Prompt, &lists) == nil && len(lists) > 0 {
		if len(lists) != 1 {
			return p, badRequest("prompt", "prompt holds %d prompts: one per request", len(lists))
		}
		if len(lists[0]) > 0 {
			p.ids = lists[0]
			return p, nil
		}
	}
	return p, badRequest("prompt", "prompt must be a string or a non-empty list of token ids")
}

// messages reads messages for the chat template: each needs a role, and
// content as a string or a list of text parts.
func (r *apiRequest) messages() ([]chat.Message, *apiError) {
	if len(r.Messages) == 0 {
		return nil, badRequest("messages", "messages is required: a list of at least one message")
	}
	out := make([]chat.Message, len(r.Messages))
	for i, m := range r.Messages {
		param := "messages[" + strconv.Itoa(i) + "]"
		if m.Role == "" {
			return nil, badRequest(param+".role", "%s has no role", param)
		}
		out[i].Role = m.Role
		if isNull(m.Content) {
			continue
		}
		if json.Unmarshal(m.Content, &out[i].Content) == nil {
			continue
		}
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(m.Content, &parts); err != nil {
			return nil, badRequest(param+".content", "%s.content must be a string or a list of parts", param)
		}
		var text bytes.Buffer
		for _, p := range parts {
			if p.Type != "text" {
				return nil, badRequest(param+".content", "%s.content: a part of type %q: only text parts are supported", param, p.Type)
			}
			text.WriteString(p.Text)
		}
		out[i].Content = text.String()
	}
	return out, nil
}

func isNull(raw json.RawMessage) bool {
	return len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null"
}

// newID is a response id: prefix and 24 hex digits.
func newID(prefix string) string {
	var b [12]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// apiUsage counts a request's tokens.
type apiUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// The responses: a completion's choices carry text, a chat's a message
// (delta when streamed).
type (
	completionChoice struct {
		Text         string  `json:"text"`
		Index        int     `json:"index"`
		Logprobs     any     `json:"logprobs"`
		FinishReason *string `json:"finish_reason"`
	}
	chatMessageOut struct {
		Role    string  `json:"role,omitempty"`
		Content *string `json:"content,omitempty"`
	}
	chatChoice struct {
		Index        int             `json:"index"`
		Message      *chatMessageOut `json:"message,omitempty"`
		Delta        *chatMessageOut `json:"delta,omitempty"`
		Logprobs     any             `json:"logprobs"`
		FinishReason *string         `json:"finish_reason"`
	}
	apiResponse struct {
		ID      string    `json:"id"`
		Object  string    `json:"object"`
		Created int64     `json:"created"`
		Model   string    `json:"model"`
		Choices any       `json:"choices"`
		Usage   *apiUsage `json:"usage,omitempty"`
	}
)
