package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/loader/tokenizer/chat"
	"github.com/strata-llm/strata/nn"
)

// testServer is a server on the tiny Llama fixture, on the CPU, with
// Mistral-Nemo's chat template (from loader/tokenizer/testdata) beside
// the fixture's tokenizer unless noChat.
type testServer struct {
	eng *engine.Engine
	b   *engine.Batcher
	tok *tokenizer.Tokenizer
	s   *server
	url string
	// close stops the server, the batcher and the engine (once; the test's
	// cleanup calls it too).
	close func()
}

// testOptions adjust a test server.
type testOptions struct {
	batch  engine.BatchOptions
	mem    engine.Memory
	noChat bool
	device string // "" is the CPU
}

func newTestServer(t *testing.T, o testOptions) *testServer {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaBF16))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	tok := fixtureTokenizer(t, !o.noChat)
	if o.device == "" {
		o.device = "cpu"
	}
	eng, err := engine.Open(t.Context(), lm, engine.Options{Devices: []string{o.device}, Threads: 1, Memory: o.mem})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	b, err := eng.NewBatcher(o.batch)
	if err != nil {
		t.Fatal(err)
	}
	ts := &testServer{eng: eng, b: b, tok: tok, s: newServer(eng, b, tok, "tiny")}
	hs := httptest.NewServer(ts.s.handler())
	ts.url = hs.URL
	ts.close = sync.OnceFunc(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		b.Close(ctx)
		hs.Close()
		eng.Close()
	})
	t.Cleanup(ts.close)
	return ts
}

// fixtureTokenizer is the fixture's tokenizer, with Mistral-Nemo's chat
// template in its tokenizer_config.json when withChat.
func fixtureTokenizer(t *testing.T, withChat bool) *tokenizer.Tokenizer {
	t.Helper()
	src := fixtures.Dir(fixtures.TinyLlamaBF16)
	dir := t.TempDir()
	tj, err := os.ReadFile(filepath.Join(src, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	raw, err := os.ReadFile(filepath.Join(src, "tokenizer_config.json"))
	if err == nil {
		err = json.Unmarshal(raw, &cfg)
	}
	if err != nil {
		t.Fatal(err)
	}
	if withChat {
		cfg["chat_template"] = testdataTemplate(t, "mistral_nemo")
	}
	raw, _ = json.Marshal(cfg)
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tj, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// testdataTemplate is the chat template of a family's real
// tokenizer_config.json in loader/tokenizer/testdata.
func testdataTemplate(t *testing.T, family string) string {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "..", "loader", "tokenizer", "testdata", family, "tokenizer_config.json.gz"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		ChatTemplate string `json:"chat_template"`
	}
	if err := json.NewDecoder(zr).Decode(&cfg); err != nil {
		t.Fatal(err)
	}
	return cfg.ChatTemplate
}

// greedy is what one request alone generates: a session of its own,
// greedy sampling, n tokens or up to an EOS.
func greedy(t *testing.T, eng *engine.Engine, prompt []int32, n int) []int32 {
	t.Helper()
	sess, err := eng.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	sampler, _ := nn.NewSampler(nn.SamplerConfig{})
	logits, err := sess.Forward(t.Context(), prompt, false, nil)
	var out []int32
	for err == nil && len(out) < n && len(prompt)+len(out) < eng.Context() {
		id := int32(sampler.Sample(logits))
		out = append(out, id)
		if eng.Config().EOS != nil && id == int32(eng.Config().EOS[0]) {
			break
		}
		logits, err = sess.Forward(t.Context(), []int32{id}, false, nil)
	}
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// text decodes ids as serve does (special tokens left out).
func text(t *testing.T, tok *tokenizer.Tokenizer, ids []int32) string {
	t.Helper()
	var keep []int
	for _, id := range ids {
		if !tok.Special(int(id)) {
			keep = append(keep, int(id))
		}
	}
	s, err := tok.Decode(keep)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func encode(t *testing.T, tok *tokenizer.Tokenizer, s string, addSpecial bool) []int32 {
	t.Helper()
	enc, err := tok.Encode(s, addSpecial)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]int32, len(enc))
	for i, id := range enc {
		ids[i] = int32(id)
	}
	return ids
}

// post sends a JSON body and returns the status, headers and body.
func post(t *testing.T, ctx context.Context, url, body string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, b
}

// completion is the part of a response the tests read.
type completion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index        int     `json:"index"`
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Message      *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *apiUsage `json:"usage"`
	Error *struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

func decode(t *testing.T, b []byte) completion {
	t.Helper()
	var c completion
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatalf("%v in %s", err, b)
	}
	return c
}

// TestEndpoints: each endpoint's answer, and each bad request's status
// and OpenAI error, with the parameter at fault.
func TestEndpoints(t *testing.T) {
	ts := newTestServer(t, testOptions{})
	prompt := "Hello, world!"
	ids := encode(t, ts.tok, prompt, true)
	want8 := text(t, ts.tok, greedy(t, ts.eng, ids, 8))
	msgs := []chat.Message{{Role: "user", Content: "Hi there"}}
	rendered, err := ts.s.tmpl.Render(msgs, chat.Options{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(rendered, "<s>[INST]") {
		t.Fatalf("Mistral-Nemo's template rendered %q", rendered)
	}
	chatIDs := encode(t, ts.tok, rendered, false)
	wantChat := text(t, ts.tok, greedy(t, ts.eng, chatIDs, 6))
	long := make([]string, 300)
	for i := range long {
		long[i] = "5"
	}
	longIDs := "[" + strings.Join(long, ",") + "]"

	for _, tc := range []struct {
		name, method, path, body string
		status                   int
		check                    func(t *testing.T, c completion, h http.Header)
		param, code              string // of an error
	}{
		{name: "completion", method: "POST", path: "/v1/completions", status: 200,
			body: `{"model":"tiny","prompt":"Hello, world!","max_tokens":8,"temperature":0,"some_field_clients_send":{"x":1}}`,
			check: func(t *testing.T, c completion, _ http.Header) {
				if c.Object != "text_completion" || !strings.HasPrefix(c.ID, "cmpl-") || c.Created == 0 || c.Model != "tiny" {
					t.Errorf("id %q object %q created %d model %q", c.ID, c.Object, c.Created, c.Model)
				}
				if len(c.Choices) != 1 || c.Choices[0].Text != want8 || *c.Choices[0].FinishReason != "length" {
					t.Errorf("choices %+v, want the text %q, finish length", c.Choices, want8)
				}
				if u := c.Usage; u == nil || u.PromptTokens != len(ids) || u.CompletionTokens != 8 || u.TotalTokens != len(ids)+8 {
					t.Errorf("usage %+v, want %d prompt tokens and 8 more", u, len(ids))
				}
			}},
		{name: "prompt as ids", method: "POST", path: "/v1/completions", status: 200,
			body: fmt.Sprintf(`{"prompt":%s,"max_tokens":8,"top_p":0,"temperature":1}`, jsonOf(ids)),
			check: func(t *testing.T, c completion, _ http.Header) {
				if c.Choices[0].Text != want8 {
					t.Errorf("text %q, want %q", c.Choices[0].Text, want8)
				}
			}},
		{name: "prompt as a list of one", method: "POST", path: "/v1/completions", status: 200,
			body: `{"prompt":["Hello, world!"],"max_tokens":8,"top_k":1,"seed":7}`,
			check: func(t *testing.T, c completion, _ http.Header) {
				if c.Choices[0].Text != want8 {
					t.Errorf("text %q, want %q", c.Choices[0].Text, want8)
				}
			}},
		{name: "chat", method: "POST", path: "/v1/chat/completions", status: 200,
			body: `{"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}],"max_completion_tokens":6,"temperature":0}`,
			check: func(t *testing.T, c completion, _ http.Header) {
				if c.Object != "chat.completion" || !strings.HasPrefix(c.ID, "chatcmpl-") {
					t.Errorf("id %q object %q", c.ID, c.Object)
				}
				m := c.Choices[0].Message
				if m == nil || m.Role != "assistant" || m.Content != wantChat {
					t.Errorf("message %+v, want the assistant's %q", m, wantChat)
				}
				if c.Usage.PromptTokens != len(chatIDs) {
					t.Errorf("%d prompt tokens, want the rendered conversation's %d", c.Usage.PromptTokens, len(chatIDs))
				}
			}},
		{name: "models", method: "GET", path: "/v1/models", status: 200},
		{name: "a model", method: "GET", path: "/v1/models/tiny", status: 200},
		{name: "health", method: "GET", path: "/health", status: 200},
		{name: "metrics", method: "GET", path: "/metrics", status: 200},

		{name: "bad JSON", method: "POST", path: "/v1/completions", body: `{"prompt":`, status: 400},
		{name: "two JSON values", method: "POST", path: "/v1/completions", body: `{"prompt":"a"} {}`, status: 400},
		{name: "a field of the wrong type", method: "POST", path: "/v1/completions", body: `{"prompt":"a","max_tokens":"8"}`, status: 400, param: "max_tokens"},
		{name: "no prompt", method: "POST", path: "/v1/completions", body: `{"max_tokens":1}`, status: 400, param: "prompt"},
		{name: "an empty prompt list", method: "POST", path: "/v1/completions", body: `{"prompt":[]}`, status: 400, param: "prompt"},
		{name: "two prompts", method: "POST", path: "/v1/completions", body: `{"prompt":["a","b"]}`, status: 400, param: "prompt"},
		{name: "an id outside the vocabulary", method: "POST", path: "/v1/completions", body: `{"prompt":[1,512]}`, status: 400, param: "prompt"},
		{name: "temperature over 2", method: "POST", path: "/v1/completions", body: `{"prompt":"a","temperature":2.5}`, status: 400, param: "temperature"},
		{name: "top_p over 1", method: "POST", path: "/v1/completions", body: `{"prompt":"a","top_p":1.5}`, status: 400, param: "top_p"},
		{name: "top_k negative", method: "POST", path: "/v1/completions", body: `{"prompt":"a","top_k":-2}`, status: 400, param: "top_k"},
		{name: "max_tokens 0", method: "POST", path: "/v1/completions", body: `{"prompt":"a","max_tokens":0}`, status: 400, param: "max_tokens"},
		{name: "n 2", method: "POST", path: "/v1/completions", body: `{"prompt":"a","n":2}`, status: 400, param: "n"},
		{name: "echo", method: "POST", path: "/v1/completions", body: `{"prompt":"a","echo":true}`, status: 400, param: "echo"},
		{name: "logprobs", method: "POST", path: "/v1/completions", body: `{"prompt":"a","logprobs":3}`, status: 400, param: "logprobs"},
		{name: "a presence penalty", method: "POST", path: "/v1/completions", body: `{"prompt":"a","presence_penalty":0.5}`, status: 400, param: "presence_penalty"},
		{name: "a frequency penalty", method: "POST", path: "/v1/completions", body: `{"prompt":"a","frequency_penalty":-1}`, status: 400, param: "frequency_penalty"},
		{name: "a logit bias", method: "POST", path: "/v1/completions", body: `{"prompt":"a","logit_bias":{"5":10}}`, status: 400, param: "logit_bias"},
		{name: "neutral values clients send", method: "POST", path: "/v1/completions", status: 200,
			body: `{"prompt":"a","max_tokens":1,"presence_penalty":0,"frequency_penalty":0,"logit_bias":{},"logprobs":null,"n":1,"best_of":1,"echo":false,"stop":null,"user":"x"}`},
		{name: "five stop strings", method: "POST", path: "/v1/completions", body: `{"prompt":"a","stop":["a","b","c","d","e"]}`, status: 400, param: "stop"},
		{name: "stop not strings", method: "POST", path: "/v1/completions", body: `{"prompt":"a","stop":3}`, status: 400, param: "stop"},
		{name: "chat without messages", method: "POST", path: "/v1/chat/completions", body: `{"messages":[]}`, status: 400, param: "messages"},
		{name: "a message without a role", method: "POST", path: "/v1/chat/completions", body: `{"messages":[{"content":"a"}]}`, status: 400, param: "messages[0].role"},
		{name: "an image part", method: "POST", path: "/v1/chat/completions", body: `{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, status: 400, param: "messages[0].content"},
		{name: "the template raises an exception", method: "POST", path: "/v1/chat/completions", body: `{"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}`, status: 400, param: "messages",
			check: func(t *testing.T, c completion, _ http.Header) {
				if !strings.Contains(c.Error.Message, "must alternate") {
					t.Errorf("message %q, want the template's", c.Error.Message)
				}
			}},
		{name: "an unknown model", method: "POST", path: "/v1/completions", body: `{"model":"gpt-4","prompt":"a"}`, status: 404, code: "model_not_found"},
		{name: "an unknown model's card", method: "GET", path: "/v1/models/gpt-4", status: 404, code: "model_not_found"},
		{name: "a prompt over the context", method: "POST", path: "/v1/completions", body: `{"prompt":` + longIDs + `}`, status: 413, code: "context_length_exceeded"},
		{name: "a text prompt over the context", method: "POST", path: "/v1/completions", body: `{"prompt":"` + strings.Repeat("hello ", 400) + `"}`, status: 413, code: "context_length_exceeded"},
		{name: "a wrong method", method: "GET", path: "/v1/completions", status: 405},
		{name: "an unknown path", method: "GET", path: "/v2/nothing", status: 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), tc.method, ts.url+tc.path, strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			if tc.path == "/metrics" {
				for _, name := range []string{"strata_requests_total", "strata_prompt_tokens_total", "strata_completion_tokens_total",
					"strata_batch_size", "strata_queue_length", "strata_time_to_first_token_seconds_bucket",
					"strata_inter_token_latency_seconds_bucket", "strata_layer_hits_total", "strata_device_used_bytes",
					`strata_batch_step_seconds_total{part="launch"}`, `strata_batch_step_seconds_total{part="device"}`} {
					if !bytes.Contains(body, []byte("\n"+name)) {
						t.Errorf("/metrics has no %s", name)
					}
				}
				return
			}
			if resp.Header.Get("Content-Type") != "application/json" {
				t.Errorf("Content-Type %q", resp.Header.Get("Content-Type"))
			}
			c := decode(t, body)
			if tc.status >= 400 {
				if c.Error == nil || c.Error.Message == "" || c.Error.Type == "" || strings.Contains(c.Error.Message, "\n") {
					t.Fatalf("not an OpenAI error of one line: %s", body)
				}
				if tc.param != "" && (c.Error.Param == nil || *c.Error.Param != tc.param) {
					t.Errorf("param %v, want %q: %s", c.Error.Param, tc.param, body)
				}
				if tc.code != "" && (c.Error.Code == nil || *c.Error.Code != tc.code) {
					t.Errorf("code %v, want %q: %s", c.Error.Code, tc.code, body)
				}
			}
			if tc.check != nil {
				tc.check(t, c, resp.Header)
			}
		})
	}
}

// TestNoChatTemplate: a model without a chat template answers a chat
// request 400, saying so; its completions still run.
func TestNoChatTemplate(t *testing.T) {
	ts := newTestServer(t, testOptions{noChat: true})
	status, _, body := post(t, t.Context(), ts.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"a"}]}`)
	if c := decode(t, body); status != 400 || c.Error == nil || !strings.Contains(c.Error.Message, "has no chat template") {
		t.Errorf("status %d: %s", status, body)
	}
	if status, _, body := post(t, t.Context(), ts.url+"/v1/completions", `{"prompt":"a","max_tokens":2}`); status != 200 {
		t.Errorf("completion: status %d: %s", status, body)
	}
}

func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// events reads a server-sent event stream: the data of each event, which
// must be a line "data: ..." and a blank line.
func events(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("line %q of the stream is not data", line)
		}
		out = append(out, data)
		if !sc.Scan() || sc.Text() != "" {
			t.Fatalf("the event %q is not followed by a blank line", line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestStream: "stream": true answers server-sent events, each one chunk
// of JSON, then the finish reason, the usage when asked for, and
// "data: [DONE]"; the text is that of the same request unstreamed.
func TestStream(t *testing.T) {
	ts := newTestServer(t, testOptions{})
	for _, tc := range []struct {
		name, path, body string
		chat             bool
	}{
		{"completion", "/v1/completions", `{"prompt":"Hello, world!","max_tokens":12,"temperature":0%s}`, false},
		{"chat", "/v1/chat/completions", `{"messages":[{"role":"user","content":"Hi"}],"max_tokens":12,"temperature":0%s}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, _, body := post(t, t.Context(), ts.url+tc.path, fmt.Sprintf(tc.body, ""))
			if status != 200 {
				t.Fatalf("status %d: %s", status, body)
			}
			whole := decode(t, body)
			want := whole.Choices[0].Text
			if tc.chat {
				want = whole.Choices[0].Message.Content
			}
			req, _ := http.NewRequestWithContext(t.Context(), "POST", ts.url+tc.path,
				strings.NewReader(fmt.Sprintf(tc.body, `,"stream":true,"stream_options":{"include_usage":true}`)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("status %d, Content-Type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			ev := events(t, resp.Body)
			if len(ev) < 4 || ev[len(ev)-1] != "[DONE]" {
				t.Fatalf("events %q: want chunks, the finish, the usage and [DONE]", ev)
			}
			var got strings.Builder
			wantObject := "text_completion"
			if tc.chat {
				wantObject = "chat.completion.chunk"
			}
			id := ""
			for i, e := range ev[:len(ev)-3] {
				c := decode(t, []byte(e))
				if id == "" {
					id = c.ID
				}
				if c.Object != wantObject || c.ID != id || len(c.Choices) != 1 || c.Choices[0].FinishReason != nil {
					t.Fatalf("chunk %d: %s", i, e)
				}
				if tc.chat {
					if (i == 0) != (c.Choices[0].Delta.Role == "assistant") {
						t.Errorf("chunk %d: the role comes with the first chunk only: %s", i, e)
					}
					got.WriteString(*c.Choices[0].Delta.Content)
				} else {
					got.WriteString(c.Choices[0].Text)
				}
			}
			if got.String() != want {
				t.Errorf("streamed %q, want %q", got.String(), want)
			}
			fin := decode(t, []byte(ev[len(ev)-3]))
			if fin.Choices[0].FinishReason == nil || *fin.Choices[0].FinishReason != *whole.Choices[0].FinishReason {
				t.Errorf("finish chunk %s, want %q", ev[len(ev)-3], *whole.Choices[0].FinishReason)
			}
			u := decode(t, []byte(ev[len(ev)-2]))
			if u.Usage == nil || *u.Usage != *whole.Usage || len(u.Choices) != 0 {
				t.Errorf("usage chunk %s, want %+v", ev[len(ev)-2], *whole.Usage)
			}
		})
	}
}

// TestModelNameWithSlash: a model's id may hold slashes, as Hugging
// Face's names do ("org/name").
func TestModelNameWithSlash(t *testing.T) {
	ts := newTestServer(t, testOptions{noChat: true})
	ts.s.name = "org/tiny" // before any request
	resp, err := http.Get(ts.url + "/v1/models/org/tiny")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"id":"org/tiny"`) {
		t.Errorf("status %d: %s", resp.StatusCode, body)
	}
	if status, _, body := post(t, t.Context(), ts.url+"/v1/completions", `{"model":"org/tiny","prompt":"a","max_tokens":1}`); status != 200 {
		t.Errorf("status %d: %s", status, body)
	}
}
