package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/internal/oneline"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/loader/tokenizer/chat"
)

// server answers OpenAI's completion and chat APIs over one engine's
// batcher.
type server struct {
	eng     *engine.Engine
	b       *engine.Batcher
	tok     *tokenizer.Tokenizer
	tmpl    *chat.Template // nil: tmplErr says why the chat endpoint refuses
	tmplErr error
	name    string // the model's id in the API
	created int64
	m       *metrics

	// defaultMaxTokens is a completion's max_tokens when none is given
	// (OpenAI's 16); a chat's runs to the context's end.
	defaultMaxTokens int
	// maxPending is the text a streamed request's client may leave
	// unread before the request ends (defaultMaxPending).
	maxPending int
	draining   atomic.Bool
}

// defaultMaxPending is a server's maxPending.
const defaultMaxPending = 1 << 20

// newServer makes a server; tok is required, and the chat template is
// the tokenizer's (a model without one refuses chat requests).
func newServer(eng *engine.Engine, b *engine.Batcher, tok *tokenizer.Tokenizer, name string) *server {
	s := &server{eng: eng, b: b, tok: tok, name: name, created: time.Now().Unix(), m: newMetrics(eng, b), defaultMaxTokens: 16, maxPending: defaultMaxPending}
	s.tmpl, s.tmplErr = chat.FromTokenizer(tok)
	return s
}

// handler routes the endpoints; every answer, an unknown path or method
// included, is counted in the metrics.
func (s *server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/v1/completions", s.endpoint("/v1/completions", http.MethodPost, s.completions))
	mux.Handle("/v1/chat/completions", s.endpoint("/v1/chat/completions", http.MethodPost, s.chatCompletions))
	mux.Handle("/v1/models", s.endpoint("/v1/models", http.MethodGet, s.models))
	mux.Handle("/v1/models/{id...}", s.endpoint("/v1/models/{id}", http.MethodGet, s.model))
	mux.Handle("/health", s.endpoint("/health", http.MethodGet, s.health))
	mux.Handle("/metrics", s.endpoint("/metrics", http.MethodGet, s.m.handler().ServeHTTP))
	mux.Handle("/", s.endpoint("other", "", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{status: http.StatusNotFound, Message: fmt.Sprintf("no endpoint %s %s", r.Method, oneline.String(r.URL.Path)), Type: "invalid_request_error"})
	}))
	return mux
}

// endpoint checks the method and counts the answer by endpoint and status
// (499 when the client went away before any answer).
func (s *server) endpoint(name, method string, h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		if method != "" && r.Method != method {
			sw.Header().Set("Allow", method)
			writeError(sw, &apiError{status: http.StatusMethodNotAllowed, Message: fmt.Sprintf("%s takes %s, not %s", name, method, r.Method), Type: "invalid_request_error"})
		} else {
			h(sw, r)
		}
		status := sw.status
		if status == 0 {
			status = http.StatusOK
			if r.Context().Err() != nil {
				status = 499
			}
		}
		s.m.count(name, status)
	})
}

// statusWriter remembers the status written; it flushes and unwraps for
// http.ResponseController.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() { http.NewResponseController(w.ResponseWriter).Flush() }

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

func (s *server) health(w http.ResponseWriter, r *http.Request) {
	if s.draining.Load() {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "draining"})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *server) modelCard() map[string]any {
	return map[string]any{"id": s.name, "object": "model", "created": s.created, "owned_by": "strata"}
}

func (s *server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{s.modelCard()}})
}

func (s *server) model(w http.ResponseWriter, r *http.Request) {
	if id := r.PathValue("id"); id != s.name {
		writeError(w, s.unknownModel(id))
		return
	}
	writeJSON(w, http.StatusOK, s.modelCard())
}

func (s *server) unknownModel(name string) *apiError {
	return (&apiError{status: http.StatusNotFound, Message: fmt.Sprintf("the model %q does not exist: this server serves %q", oneline.String(name), s.name), Type: "invalid_request_error"}).withCode("model_not_found")
}

// common checks what both endpoints share: the model's name (empty is
// this server's model) and the parameters serve cannot honour.
func (s *server) common(req *apiRequest) *apiError {
	if req.Model != "" && req.Model != s.name {
		return s.unknownModel(req.Model)
	}
	return req.check()
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	req, aerr := decodeRequest(r, w)
	if aerr == nil {
		aerr = s.common(req)
	}
	var ids []int32
	if aerr == nil {
		var p promptInput
		if p, aerr = req.prompt(); aerr == nil {
			if p.isID {
				ids, aerr = s.checkIDs(p.ids)
			} else {
				ids, aerr = s.encode(p.text, true)
			}
		}
	}
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	s.generate(w, r, req, ids, false)
}

func (s *server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	req, aerr := decodeRequest(r, w)
	if aerr == nil {
		aerr = s.common(req)
	}
	if aerr == nil && s.tmpl == nil {
		aerr = s.noTemplate()
	}
	var ids []int32
	if aerr == nil {
		var msgs []chat.Message
		if msgs, aerr = req.messages(); aerr == nil {
			text, err := s.tmpl.Render(msgs, chat.Options{AddGenerationPrompt: true})
			if err != nil {
				aerr = badRequest("messages", "%v", err)
			} else {
				ids, aerr = s.encode(text, false) // the template wrote the special tokens
			}
		}
	}
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	s.generate(w, r, req, ids, true)
}

// noTemplate is the 400 of a chat request to a model without a chat
// template, or with one the Jinja engine does not compile.
func (s *server) noTemplate() *apiError {
	if errors.Is(s.tmplErr, chat.ErrNoTemplate) {
		return badRequest("messages", "the model %s has no chat template: send the prompt text to /v1/completions", s.name)
	}
	return badRequest("messages", "the model %s has a chat template serve cannot run: %v", s.name, s.tmplErr)
}

// tooLong is the 413 of a prompt that leaves no room in the context.
func (s *server) tooLong(n int) *apiError {
	return (&apiError{status: http.StatusRequestEntityTooLarge,
		Message: fmt.Sprintf("the prompt of %d tokens leaves no room in the context of %d positions", n, s.eng.Context()),
		Type:    "invalid_request_error"}).withCode("context_length_exceeded")
}

// encode tokenizes a prompt; one longer than the context is a 413, told
// without encoding it when even the longest tokens could not fit it.
func (s *server) encode(text string, addSpecial bool) ([]int32, *apiError) {
	if n := s.tok.MaxTokenBytes(); n > 0 && len(text) > s.eng.Context()*n {
		return nil, (&apiError{status: http.StatusRequestEntityTooLarge,
			Message: fmt.Sprintf("the prompt of %d bytes cannot fit in the context of %d positions", len(text), s.eng.Context()),
			Type:    "invalid_request_error"}).withCode("context_length_exceeded")
	}
	enc, err := s.tok.Encode(text, addSpecial)
	if err != nil {
		return nil, badRequest("prompt", "%v", err)
	}
	if len(enc) == 0 {
		return nil, badRequest("prompt", "the prompt encodes to no tokens")
	}
	ids := make([]int32, len(enc))
	for i, id := range enc {
		ids[i] = int32(id)
	}
	if len(ids) >= s.eng.Context() {
		return nil, s.tooLong(len(ids))
	}
	return ids, nil
}

// checkIDs checks a prompt given as token ids.
func (s *server) checkIDs(ids []int32) ([]int32, *apiError) {
	vocab := s.eng.Config().VocabSize
	for i, id := range ids {
		if id < 0 || int(id) >= vocab {
			return nil, badRequest("prompt", "token id %d at prompt position %d is outside the vocabulary of %d", id, i, vocab)
		}
	}
	if len(ids) >= s.eng.Context() {
		return nil, s.tooLong(len(ids))
	}
	return ids, nil
}

// engineError maps the batcher's errors to statuses: no room now 429, a
// server shutting down 503 (both with Retry-After), a prompt over the
// context or a request larger than the whole KV pool (no retry fits it)
// 413, anything else 500.
func engineError(err error) *apiError {
	msg := oneline.String(err.Error())
	switch {
	case errors.Is(err, engine.ErrBusy):
		return (&apiError{status: http.StatusTooManyRequests, Message: msg, Type: "rate_limit_error"}).withCode("server_busy")
	case errors.Is(err, engine.ErrDraining):
		return (&apiError{status: http.StatusServiceUnavailable, Message: msg, Type: "server_error"}).withCode("shutting_down")
	case errors.Is(err, engine.ErrPromptTooLong):
		return (&apiError{status: http.StatusRequestEntityTooLarge, Message: msg, Type: "invalid_request_error"}).withCode("context_length_exceeded")
	case errors.Is(err, engine.ErrTooLarge):
		return (&apiError{status: http.StatusRequestEntityTooLarge, Message: msg, Type: "invalid_request_error"}).withCode("kv_pool_exceeded")
	}
	return &apiError{status: http.StatusInternalServerError, Message: msg, Type: "server_error"}
}

// writeAPIError writes e, with Retry-After for a busy or draining server.
func writeAPIError(w http.ResponseWriter, e *apiError) {
	if e.status == http.StatusTooManyRequests || e.status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "1")
	}
	writeError(w, e)
}

// generate runs the request and writes its answer, whole or streamed.
func (s *server) generate(w http.ResponseWriter, r *http.Request, req *apiRequest, ids []int32, isChat bool) {
	sampler, aerr := req.sampling()
	var stops []string
	if aerr == nil {
		stops, aerr = req.stops()
	}
	def := s.defaultMaxTokens
	if isChat {
		def = 0
	}
	var maxTokens int
	if aerr == nil {
		maxTokens, aerr = req.maxTokens(def)
	}
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	out := &response{id: newID("cmpl-"), object: "text_completion", model: s.name, created: time.Now().Unix(), chat: isChat}
	if isChat {
		out.id, out.object = newID("chatcmpl-"), "chat.completion"
	}
	emit := func(t string) error { out.text = append(out.text, t...); return nil }
	var p *pipe
	if req.Stream {
		out.sse = &sse{w: w, rc: http.NewResponseController(w)}
		p = newPipe(out.chunk, s.maxPending, func() { out.sse.rc.SetWriteDeadline(time.Now()) })
		emit = p.emit
	}
	finish, n, err := s.run(r.Context(), engine.Request{Prompt: ids, MaxTokens: maxTokens, Sampler: sampler}, stops, emit)
	var perr error
	if p != nil {
		perr = p.close()
	}
	usage := &apiUsage{PromptTokens: len(ids), CompletionTokens: n, TotalTokens: len(ids) + n}
	switch {
	case err != nil && r.Context().Err() != nil, perr != nil:
		// The client went away, or does not read: nobody to answer.
	case err != nil && (out.sse == nil || !out.sse.started):
		writeAPIError(w, engineError(err))
	case err != nil:
		out.sse.send(map[string]any{"error": engineError(err)})
		out.sse.done()
	case out.sse != nil:
		out.end(finish, usage, req.StreamOptions != nil && req.StreamOptions.IncludeUsage)
	default:
		writeJSON(w, http.StatusOK, out.whole(finish, usage))
	}
}

// run submits the request and passes its text to emit as it comes,
// holding back what may begin a stop string; a stop string ends the
// request (its context is cancelled) and is not emitted. It returns the
// finish reason and the tokens generated, once the batcher is done with
// the request.
func (s *server) run(ctx context.Context, req engine.Request, stops []string, emit func(string) error) (finish string, n int, err error) {
	ctx, cancel := context.WithCancel(ctx)
	start := time.Now()
	ch, err := s.b.Submit(ctx, req)
	if err != nil {
		cancel()
		return "", 0, err
	}
	s.m.promptTokens.Add(float64(len(req.Prompt)))
	defer func() {
		cancel()
		for range ch { // the batcher ends the stream at its next step
		}
		s.m.completionTokens.Add(float64(n))
	}()
	dec := s.tok.NewStream()
	st := stopper{stops: stops}
	var last time.Time
	for t := range ch {
		if t.Done {
			if t.Err != nil {
				return "", n, t.Err
			}
			text, stopped := st.Add(dec.Flush())
			if !stopped {
				text += st.Flush()
			}
			if text != "" {
				if err := emit(text); err != nil {
					return "", n, err
				}
			}
			if stopped {
				return engine.FinishStop, n, nil
			}
			return t.Finish, n, nil
		}
		if !t.Emitted {
			continue
		}
		n++
		now := time.Now()
		if n == 1 {
			s.m.timeToFirstToken.Observe(now.Sub(start).Seconds())
		} else {
			s.m.interTokenLatency.Observe(now.Sub(last).Seconds())
		}
		last = now
		if s.tok.Special(int(t.ID)) {
			continue // as Hugging Face's skip_special_tokens
		}
		piece, err := dec.Add(int(t.ID))
		if err != nil {
			return "", n, err
		}
		text, stopped := st.Add(piece)
		if text != "" {
			if err := emit(text); err != nil {
				return "", n, err
			}
		}
		if stopped {
			return engine.FinishStop, n, nil
		}
	}
	return "", n, errors.New("serve: the engine ended the request without saying why")
}

// response builds a request's answer.
type response struct {
	id, object, model string
	created           int64
	chat              bool
	text              []byte
	sse               *sse
	roleSent          bool
}

func (o *response) head(object string, choices any, usage *apiUsage) apiResponse {
	return apiResponse{ID: o.id, Object: object, Created: o.created, Model: o.model, Choices: choices, Usage: usage}
}

// whole is the non-streamed answer.
func (o *response) whole(finish string, usage *apiUsage) apiResponse {
	text := string(o.text)
	if o.chat {
		return o.head(o.object, []chatChoice{{Message: &chatMessageOut{Role: "assistant", Content: &text}, FinishReason: &finish}}, usage)
	}
	return o.head(o.object, []completionChoice{{Text: text, FinishReason: &finish}}, usage)
}

// chunk streams a piece of text.
func (o *response) chunk(text string) error {
	if o.chat {
		d := &chatMessageOut{Content: &text}
		if !o.roleSent {
			d.Role, o.roleSent = "assistant", true
		}
		return o.sse.send(o.head("chat.completion.chunk", []chatChoice{{Delta: d}}, nil))
	}
	return o.sse.send(o.head("text_completion", []completionChoice{{Text: text}}, nil))
}

// end streams the finish reason, the usage when asked for, and [DONE].
func (o *response) end(finish string, usage *apiUsage, withUsage bool) {
	if o.chat {
		d := &chatMessageOut{}
		if !o.roleSent {
			empty := ""
			d.Role, d.Content = "assistant", &empty
		}
		o.sse.send(o.head("chat.completion.chunk", []chatChoice{{Delta: d, FinishReason: &finish}}, nil))
	} else {
		o.sse.send(o.head("text_completion", []completionChoice{{FinishReason: &finish}}, nil))
	}
	if withUsage {
		object := "text_completion"
		if o.chat {
			object = "chat.completion.chunk"
		}
		o.sse.send(o.head(object, []any{}, usage))
	}
	o.sse.done()
}

// sse writes server-sent events; the headers go with the first event, so
// that a request refused before its first token still gets its status.
type sse struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	started bool
}

func (e *sse) start() {
	if e.started {
		return
	}
	e.started = true
	h := e.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	e.w.WriteHeader(http.StatusOK)
}

func (e *sse) send(v any) error {
	e.start()
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(e.w, "data: %s\n\n", b); err != nil {
		return err
	}
	return e.rc.Flush()
}

func (e *sse) done() {
	e.start()
	io.WriteString(e.w, "data: [DONE]\n\n")
	e.rc.Flush()
}

// serve answers on ln until ctx ends, then drains: it stops accepting,
// lets the running and queued requests finish within drain (the batcher
// ends those still running then), and returns.
func (s *server) serve(ctx context.Context, ln net.Listener, drain time.Duration, log io.Writer) error {
	hs := &http.Server{Handler: s.handler(), ReadHeaderTimeout: 30 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	s.draining.Store(true)
	st := s.b.Stats()
	fmt.Fprintf(log, "serve: %v: draining %d running and %d queued requests (at most %v)\n", context.Cause(ctx), st.Running, st.Queued, drain)
	dctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	// The handlers get a little longer than the batcher, to write the
	// answers of the requests it ended.
	sctx, cancelShutdown := context.WithTimeout(context.Background(), drain+2*time.Second)
	defer cancelShutdown()
	shut := make(chan error, 1)
	go func() { shut <- hs.Shutdown(sctx) }()
	berr := s.b.Close(dctx)
	if err := <-shut; err != nil {
		hs.Close()
	}
	if berr != nil {
		return fmt.Errorf("serve: drain: requests still running after %v were ended", drain)
	}
	fmt.Fprintln(log, "serve: drained")
	return nil
}
