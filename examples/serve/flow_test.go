package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/examples/internal/defaultmodel"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor/quant"
)

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func idle(b *engine.Batcher) func() bool {
	return func() bool { st := b.Stats(); return st.Running == 0 && st.Queued == 0 }
}

// TestStopStrings: a stop string made of the end of one token's text and
// the start of the next's ends the request there, whole or streamed: the
// text before it is answered, the stop string is not, the finish reason
// is stop and fewer tokens are generated than asked for.
func TestStopStrings(t *testing.T) {
	ts := newTestServer(t, testOptions{noChat: true})
	prompt := encode(t, ts.tok, "Hello, world!", true)
	gen := greedy(t, ts.eng, prompt, 24)
	dec := ts.tok.NewStream()
	var pieces []string
	for _, id := range gen {
		if ts.tok.Special(int(id)) {
			continue
		}
		p, err := dec.Add(int(id))
		if err != nil {
			t.Fatal(err)
		}
		pieces = append(pieces, p)
	}
	full := strings.Join(pieces, "") + dec.Flush()
	stop := ""
	for k := 2; k+1 < len(pieces)-4 && stop == ""; k++ {
		if pieces[k] != "" && pieces[k+1] != "" {
			last, _ := utf8.DecodeLastRuneInString(pieces[k])
			first, _ := utf8.DecodeRuneInString(pieces[k+1])
			stop = string(last) + string(first)
		}
	}
	if stop == "" {
		t.Fatalf("no two tokens with text in a row in %q", pieces)
	}
	want := full[:strings.Index(full, stop)]
	for _, tc := range []struct {
		name, stop string
		stream     bool
	}{
		{"a string", jsonOf(stop), false},
		{"a list", jsonOf([]string{"\x00never", stop}), false},
		{"streamed", jsonOf(stop), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := fmt.Sprintf(`{"prompt":"Hello, world!","max_tokens":24,"temperature":0,"stop":%s,"stream":%v,"stream_options":{"include_usage":true}}`, tc.stop, tc.stream)
			status, _, raw := post(t, t.Context(), ts.url+"/v1/completions", body)
			if status != 200 {
				t.Fatalf("status %d: %s", status, raw)
			}
			var got, finish string
			var usage *apiUsage
			if tc.stream {
				ev := events(t, bytes.NewReader(raw))
				for _, e := range ev[:len(ev)-1] {
					c := decode(t, []byte(e))
					if c.Usage != nil {
						usage = c.Usage
						continue
					}
					if strings.Contains(c.Choices[0].Text, stop) {
						t.Errorf("a chunk holds the stop string: %s", e)
					}
					got += c.Choices[0].Text
					if c.Choices[0].FinishReason != nil {
						finish = *c.Choices[0].FinishReason
					}
				}
			} else {
				c := decode(t, raw)
				got, finish, usage = c.Choices[0].Text, *c.Choices[0].FinishReason, c.Usage
			}
			if got != want || finish != "stop" {
				t.Errorf("text %q finish %q, want %q and stop (stop string %q in %q)", got, finish, want, stop, full)
			}
			if usage == nil || usage.CompletionTokens >= len(gen) {
				t.Errorf("usage %+v: the request ran on past its stop string", usage)
			}
		})
	}
	waitFor(t, "the batcher to be idle", idle(ts.b))
}

// TestBusyAndDraining: a full queue answers 429 with Retry-After, a
// server shutting down 503 with Retry-After (and /health 503).
func TestBusyAndDraining(t *testing.T) {
	ts := newTestServer(t, testOptions{batch: engine.BatchOptions{MaxSequences: 1, MaxQueue: 1}, noChat: true})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// A request nobody reads holds the only sequence; a second fills the
	// queue.
	if _, err := ts.b.Submit(ctx, engine.Request{Prompt: []int32{1, 5}, IgnoreEOS: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first request to run", func() bool { return ts.b.Stats().Running == 1 })
	if _, err := ts.b.Submit(ctx, engine.Request{Prompt: []int32{1, 6}}); err != nil {
		t.Fatal(err)
	}
	status, h, body := post(t, t.Context(), ts.url+"/v1/completions", `{"prompt":"a","max_tokens":2}`)
	if c := decode(t, body); status != 429 || h.Get("Retry-After") == "" || c.Error == nil || *c.Error.Code != "server_busy" {
		t.Errorf("status %d, Retry-After %q: %s", status, h.Get("Retry-After"), body)
	}
	cancel()
	waitFor(t, "the batcher to be idle", idle(ts.b))

	ts.s.draining.Store(true)
	if err := ts.b.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	status, h, body = post(t, t.Context(), ts.url+"/v1/completions", `{"prompt":"a","max_tokens":2}`)
	if status != 503 || h.Get("Retry-After") == "" || !strings.Contains(string(body), `"error"`) {
		t.Errorf("status %d, Retry-After %q: %s", status, h.Get("Retry-After"), body)
	}
	resp, err := http.Get(ts.url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Errorf("/health while draining: %d", resp.StatusCode)
	}
}

// TestOverPool: a request whose KV reservation is larger than the whole
// pool answers 413 without Retry-After (no retry can fit it), streamed or
// not, with a message naming its positions and the pool's; one that fits
// the pool exactly runs.
func TestOverPool(t *testing.T) {
	// A pool of 4 blocks of 4 positions; the context is the engine's.
	ts := newTestServer(t, testOptions{batch: engine.BatchOptions{MaxSequences: 2, BlockSize: 4, KVBlocks: 4}, noChat: true})
	for _, tc := range []struct {
		name   string
		body   string
		status int
	}{
		{"over by one", `{"prompt":[1,5,9],"max_tokens":15,"temperature":0}`, 413},
		{"over by one, streamed", `{"prompt":[1,5,9],"max_tokens":15,"temperature":0,"stream":true}`, 413},
		{"the whole context", `{"prompt":[1,5,9],"max_tokens":200,"temperature":0}`, 413},
		{"the whole pool", `{"prompt":[1,5,9],"max_tokens":14,"temperature":0}`, 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, h, body := post(t, t.Context(), ts.url+"/v1/completions", tc.body)
			if status != tc.status {
				t.Fatalf("status %d, want %d: %s", status, tc.status, body)
			}
			if status == 200 {
				return
			}
			c := decode(t, body)
			if h.Get("Retry-After") != "" || c.Error == nil || c.Error.Code == nil || *c.Error.Code != "kv_pool_exceeded" {
				t.Errorf("Retry-After %q: %s", h.Get("Retry-After"), body)
			}
			if c.Error != nil && (!strings.Contains(c.Error.Message, "KV positions") || !strings.Contains(c.Error.Message, "the whole pool holds 4 blocks (16 positions)")) {
				t.Errorf("the message does not name the sizes: %s", c.Error.Message)
			}
		})
	}
	if st := ts.b.Stats(); st.Rejected != 3 || st.KVBlocksFree != st.KVBlocks {
		t.Errorf("%d rejected (want 3), %d of %d KV blocks free", st.Rejected, st.KVBlocksFree, st.KVBlocks)
	}
}

// gateWriter is a client that reads the first write and then stalls
// until released.
type gateWriter struct {
	h       http.Header
	first   chan struct{}
	release chan struct{}
	once    sync.Once
	mu      sync.Mutex
	buf     bytes.Buffer
}

func (w *gateWriter) Header() http.Header { return w.h }
func (w *gateWriter) WriteHeader(int)     {}
func (w *gateWriter) Flush()              {}
func (w *gateWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	w.buf.Write(b)
	w.mu.Unlock()
	w.once.Do(func() { close(w.first); <-w.release })
	return len(b), nil
}

// TestCancelMidStream: a client that goes away after its first chunk
// ends its request at the batcher's next steps (not at max_tokens), gets
// no [DONE], and the KV cache it held is given back. A second request,
// read slowly, runs beside it in the same batch; its tokens are counted
// apart from the cancelled one's.
func TestCancelMidStream(t *testing.T) {
	ts := newTestServer(t, testOptions{batch: engine.BatchOptions{MaxSequences: 2}, noChat: true})
	used := ts.eng.Devices()[0].UsedBytes
	pctx, release := context.WithCancel(t.Context())
	defer release()
	pacer, err := ts.b.Submit(pctx, engine.Request{Prompt: []int32{1, 5}, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	pause := make(chan struct{})
	pacerGen := make(chan int, 1)
	go func() {
		n := 0
		for tok := range pacer {
			n = tok.GeneratedTokens
			select {
			case <-pause:
			default:
				time.Sleep(time.Millisecond)
			}
		}
		pacerGen <- n
	}()
	ctx, cancel := context.WithCancel(t.Context())
	req := httptest.NewRequestWithContext(ctx, "POST", "/v1/completions",
		strings.NewReader(`{"prompt":"Hi","max_tokens":240,"temperature":0,"stream":true}`))
	w := &gateWriter{h: http.Header{}, first: make(chan struct{}), release: make(chan struct{})}
	close(w.release)
	done := make(chan struct{})
	go func() {
		ts.s.handler().ServeHTTP(w, req)
		close(done)
	}()
	<-w.first
	close(pause)
	cancel()
	release()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not return after the client went away")
	}
	waitFor(t, "the batcher to be idle", idle(ts.b))
	if own := ts.b.Stats().GenTokens - int64(<-pacerGen); own >= 240 {
		t.Errorf("%d tokens generated: the request ran to max_tokens after its client left", own)
	}
	if strings.Contains(w.buf.String(), "[DONE]") {
		t.Errorf("a client that left was answered [DONE]: %s", w.buf.String())
	}
	if now := ts.eng.Devices()[0].UsedBytes; now != used {
		t.Errorf("%d bytes in use after the request, %d before", now, used)
	}
}

// TestSlowClient: a streamed request whose client does not read holds up
// neither the batcher nor the other requests; past the server's limit of
// unread text it ends.
func TestSlowClient(t *testing.T) {
	for _, tc := range []struct {
		name    string
		pending int
	}{
		{"within the limit", defaultMaxPending},
		{"past the limit", 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := newTestServer(t, testOptions{noChat: true})
			ts.s.maxPending = tc.pending
			prompt := encode(t, ts.tok, "Hello, world!", true)
			if n := len(greedy(t, ts.eng, prompt, 100)); n != 100 {
				t.Fatalf("the prompt's greedy generation ends after %d tokens", n)
			}
			req := httptest.NewRequestWithContext(t.Context(), "POST", "/v1/completions",
				strings.NewReader(`{"prompt":"Hello, world!","max_tokens":100,"temperature":0,"stream":true}`))
			w := &gateWriter{h: http.Header{}, first: make(chan struct{}), release: make(chan struct{})}
			done := make(chan struct{})
			go func() {
				ts.s.handler().ServeHTTP(w, req)
				close(done)
			}()
			<-w.first // the client takes no more until released
			pctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			status, _, body := post(t, pctx, ts.url+"/v1/completions", `{"prompt":"Hi","max_tokens":30}`)
			if status != 200 {
				t.Errorf("another request: status %d: %s", status, body)
			}
			waitFor(t, "the batcher to be idle", idle(ts.b))
			gen := ts.b.Stats().GenTokens - int64(decode(t, body).Usage.CompletionTokens)
			close(w.release)
			<-done
			switch {
			case tc.pending == defaultMaxPending && (gen != 100 || !strings.HasSuffix(w.buf.String(), "data: [DONE]\n\n")):
				t.Errorf("%d tokens generated, the stream ends %q: want 100 and [DONE]", gen, tail(w.buf.String()))
			case tc.pending < defaultMaxPending && (gen >= 100 || strings.Contains(w.buf.String(), "[DONE]")):
				t.Errorf("%d tokens generated, the stream ends %q: want the request ended early", gen, tail(w.buf.String()))
			}
		})
	}
}

func tail(s string) string { return s[max(0, len(s)-60):] }

// TestDrain: when serve's context ends (SIGTERM), it stops accepting
// connections and lets the requests under way finish; with a deadline too
// short, they end with the batcher's ErrDraining (503) and serve says so.
func TestDrain(t *testing.T) {
	for _, tc := range []struct {
		name  string
		drain time.Duration
		err   string
	}{
		{"in time", 30 * time.Second, ""},
		{"past the deadline", 200 * time.Millisecond, "drain: requests still running"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := newTestServer(t, testOptions{batch: engine.BatchOptions{MaxSequences: 1}, noChat: true})
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, stop := context.WithCancel(t.Context())
			defer stop()
			served := make(chan error, 1)
			go func() { served <- ts.s.serve(ctx, ln, tc.drain, io.Discard) }()
			// A request nobody reads yet holds the batcher's one sequence,
			// so that the HTTP request waits in the queue when the drain
			// starts.
			hctx, release := context.WithCancel(t.Context())
			defer release()
			held, err := ts.b.Submit(hctx, engine.Request{Prompt: []int32{1, 5}, MaxTokens: 40, IgnoreEOS: true})
			if err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the held request to run", func() bool { return ts.b.Stats().Running == 1 })
			type answer struct {
				status int
				body   []byte
			}
			answered := make(chan answer, 1)
			go func() {
				resp, err := http.Post("http://"+ln.Addr().String()+"/v1/completions", "application/json",
					strings.NewReader(`{"prompt":"Hi","max_tokens":30,"temperature":0,"stream":true}`))
				if err != nil {
					t.Error(err)
					answered <- answer{}
					return
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				answered <- answer{resp.StatusCode, b}
			}()
			waitFor(t, "the HTTP request to be queued", func() bool { return ts.b.Stats().Queued == 1 })
			stop()
			waitFor(t, "the listener to close", func() bool {
				c, err := net.Dial("tcp", ln.Addr().String())
				if err == nil {
					c.Close()
				}
				return err != nil
			})
			if tc.err == "" {
				go func() {
					for range held {
					}
				}()
			}
			// Past the deadline the held request stays held (its context
			// is released at the end) until the drain ends it: released
			// earlier, on a loaded machine before the drain's deadline, it
			// would let the queued request run.
			a := <-answered
			err = <-served
			if tc.err == "" {
				ev := events(t, bytes.NewReader(a.body))
				if err != nil || a.status != 200 || len(ev) < 2 || ev[len(ev)-1] != "[DONE]" || !strings.Contains(ev[len(ev)-2], `"finish_reason":"length"`) {
					t.Errorf("serve: %v; the request answered %d %s", err, a.status, a.body)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("serve: %v, want %q", err, tc.err)
			}
			if a.status != 503 || !strings.Contains(string(a.body), "shutting down") {
				t.Errorf("the request answered %d %s, want 503 and the batcher's ErrDraining", a.status, a.body)
			}
		})
	}
}

// loadDeviceEnv names the device TestLoad runs on: the CPU when unset;
// "cuda" in a binary built with -tags cuda runs the same load on a GPU.
const loadDeviceEnv = "STRATA_SERVE_DEVICE"

// loadBudget is TestLoad's budget on device: on the CPU 3,900,000 bytes,
// room for the fixture and about two requests' KV caches beside a
// session's; elsewhere the same room beyond what the device holds for the
// engine and a batcher of one KV block (its weights in the device's
// dtypes, its buffers, any fixed workspace), measured on each.
func loadBudget(t *testing.T, device string) int64 {
	const cpuBudget = 3_900_000
	if device == "cpu" {
		return cpuBudget
	}
	base := func(device string) int64 {
		ts := newTestServer(t, testOptions{device: device, batch: engine.BatchOptions{MaxSequences: 4, MaxQueue: 2, KVBlocks: 1}, noChat: true})
		used := ts.eng.Devices()[0].UsedBytes
		ts.close()
		return used
	}
	dev, cpu := base(device), base("cpu")
	t.Logf("the engine and a batcher of one block hold %d bytes on %s, %d on the CPU", dev, device, cpu)
	return cpuBudget + dev - cpu
}

// TestLoad: concurrent clients with prompts of mixed lengths, some
// streamed and dropped after the first chunk, some not streamed and given
// up by their client after a few milliseconds, some over the context,
// some asking for more KV positions than the pool of 15 blocks holds
// (413 at once, not retried), under a budget with room for two requests'
// KV caches and a queue of two: every answer is a success or an intended
// 413 or 429 (503 is TestDrain's), each greedy answer equals the same
// request sent alone after the load (the same bits on the CPU; on another
// device at most a quarter may differ, each logged), every KV block is
// free and the budget ends where it began. STRATA_SERVE_DEVICE=cuda runs
// it on a GPU.
func TestLoad(t *testing.T) {
	device := cmp.Or(os.Getenv(loadDeviceEnv), "cpu")
	ts := newTestServer(t, testOptions{
		device: device,
		mem:    engine.Memory{Budgets: []int64{loadBudget(t, device)}},
		batch:  engine.BatchOptions{MaxSequences: 4, MaxQueue: 2, KVBlocks: 15},
		noChat: true,
	})
	d0 := ts.eng.Devices()[0]
	used := d0.UsedBytes
	st0 := ts.b.Stats()
	t.Logf("on %s: budget %d bytes, %d in use, KV pool of %d blocks of %d positions, context %d", d0.Name, d0.BudgetBytes, used, st0.KVBlocks, st0.BlockSize, ts.eng.Context())
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	type job struct {
		prompt  []int32
		max     int
		drop    bool // streamed, dropped after the first chunk
		abandon bool // not streamed, its client gives up after a few milliseconds
		over    bool // the whole context: more KV positions than the pool holds
		status  int
		text    string
	}
	rng := rand.New(rand.NewPCG(1, 2))
	jobs := make([]*job, 48)
	ctxLen := ts.eng.Context() // 256: prompts of 300 are over it
	for i := range jobs {
		n := []int{1, 3, 17, 60, 130, 300}[rng.IntN(6)]
		j := &job{prompt: make([]int32, n), max: 1 + rng.IntN(24), drop: i%8 == 4, abandon: i%8 == 5 && n < ctxLen, over: i%8 == 7 && n < ctxLen}
		switch {
		case j.abandon:
			j.max = 80
		case j.over:
			j.max = ctxLen - n // the pool of 15 blocks holds 240 positions
		}
		j.prompt[0] = 1
		for k := 1; k < n; k++ {
			j.prompt[k] = int32(3 + rng.IntN(500))
		}
		jobs[i] = j
	}
	// send posts j's request once and reads its answer: all of it, or,
	// for a dropped stream, its first chunk before it hangs up. An
	// abandoned request's client gives up after a few milliseconds,
	// whether it waits for the headers or reads the body.
	send := func(j *job, try int) (status int, h http.Header, raw []byte, err error) {
		rctx := ctx
		if j.abandon {
			var cancel context.CancelFunc
			rctx, cancel = context.WithTimeout(ctx, time.Duration(2+try%5)*time.Millisecond)
			defer cancel()
		}
		body := fmt.Sprintf(`{"prompt":%s,"max_tokens":%d,"temperature":0,"stream":%v}`, jsonOf(j.prompt), j.max, j.drop)
		req, _ := http.NewRequestWithContext(rctx, "POST", ts.url+"/v1/completions", strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, nil, nil, err
		}
		defer resp.Body.Close()
		if j.drop && resp.StatusCode == 200 {
			line, err := bufio.NewReader(resp.Body).ReadString('\n')
			return resp.StatusCode, resp.Header, []byte(line), err
		}
		raw, err = io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, raw, err
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	busy := map[bool]int{} // 429s by whether the queue was full (else the KV budget)
	overPool := 0          // 413s of requests larger than the whole pool
	abandoned := 0
	next := make(chan *job)
	for range 8 {
		wg.Go(func() {
			for j := range next {
				for try := 0; try < 50; try++ { // a client that retries after a 429, as Retry-After asks
					status, h, raw, err := send(j, try)
					if err != nil {
						j.status = 0
						if j.abandon && errors.Is(err, context.DeadlineExceeded) {
							mu.Lock()
							abandoned++
							mu.Unlock()
						} else {
							t.Error(err)
						}
						break
					}
					j.status = status
					if status == 200 {
						if !j.drop {
							j.text = decode(t, raw).Choices[0].Text
						}
						break
					}
					if c := decode(t, raw); c.Error == nil {
						t.Errorf("status %d without an error: %s", status, raw)
					}
					if status == 413 && j.over {
						// Refused for the pool: no retry would fit it.
						if !strings.Contains(string(raw), "the whole pool holds") || h.Get("Retry-After") != "" {
							t.Errorf("the 413 of a request larger than the pool (Retry-After %q): %s", h.Get("Retry-After"), raw)
						}
						mu.Lock()
						overPool++
						mu.Unlock()
					}
					if status != 429 {
						break
					}
					if h.Get("Retry-After") == "" {
						t.Error("a 429 without Retry-After")
					}
					mu.Lock()
					busy[strings.Contains(string(raw), "queued")]++
					mu.Unlock()
					time.Sleep(time.Duration(1+try%7) * time.Millisecond)
				}
			}
		})
	}
	for _, j := range jobs {
		next <- j
	}
	close(next)
	wg.Wait()
	waitFor(t, "the batcher to be idle", idle(ts.b))
	if st := ts.b.Stats(); st.KVBlocksFree != st.KVBlocks || st.KVBlocks != st0.KVBlocks {
		t.Errorf("after the load %d of %d KV blocks are free (the pool had %d)", st.KVBlocksFree, st.KVBlocks, st0.KVBlocks)
	}
	if now := ts.eng.Devices()[0].UsedBytes; now != used {
		t.Errorf("%d bytes in use after the load, %d before", now, used)
	}
	counts := map[int]int{}
	compared, differ := 0, 0
	for i, j := range jobs {
		counts[j.status]++
		switch {
		case len(j.prompt) >= ts.eng.Context():
			if j.status != 413 {
				t.Errorf("job %d: a prompt of %d tokens answered %d, want 413", i, len(j.prompt), j.status)
			}
		case j.over:
			if j.status != 413 {
				t.Errorf("job %d: a request of %d positions in a pool of %d answered %d, want 413", i, len(j.prompt)+j.max-1, st0.KVBlocks*st0.BlockSize, j.status)
			}
		case j.status == 429 || j.drop && j.status == 200:
		case j.abandon && j.status == 0: // its client gave up before an answer
		case j.status == 200:
			compared++
			alone := aloneText(t, ts, j.prompt, j.max)
			if j.text == alone {
				continue
			}
			if device == "cpu" {
				t.Errorf("job %d: %q, alone %q", i, j.text, alone)
				continue
			}
			differ++
			t.Logf("job %d (prompt %d tokens): %q in the load, %q alone: the same for %d bytes", i, len(j.prompt), j.text, alone, commonPrefix(j.text, alone))
		default:
			t.Errorf("job %d: status %d", i, j.status)
		}
	}
	t.Logf("statuses: %v, after 429s for a full queue %d, for the budget %d; %d over the whole pool (413); %d abandoned by their clients; %d greedy answers compared with the request alone, %d differ",
		counts, busy[true], busy[false], overPool, abandoned, compared, differ)
	if counts[200] == 0 || compared == 0 || overPool == 0 {
		t.Errorf("%d requests succeeded, %d compared, %d refused for the pool: the load missed a case", counts[200], compared, overPool)
	}
	if 4*differ > compared {
		t.Errorf("%d of %d greedy answers on %s differ from the request alone: more than the device's rounding explains", differ, compared, device)
	}
}

// aloneText is the text of a greedy request of n tokens sent alone to
// the server (no other request running).
func aloneText(t *testing.T, ts *testServer, prompt []int32, n int) string {
	t.Helper()
	code, _, raw := post(t, t.Context(), ts.url+"/v1/completions", fmt.Sprintf(`{"prompt":%s,"max_tokens":%d,"temperature":0}`, jsonOf(prompt), n))
	if code != 200 {
		t.Fatalf("alone: status %d: %s", code, raw)
	}
	return decode(t, raw).Choices[0].Text
}

func commonPrefix(a, b string) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// syncBuffer is a bytes.Buffer for a writer and a reader at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startRun runs the command with args on a free port of the loopback and
// returns its address and a stop that ends its context (as cli.Main does
// on the first SIGINT or SIGTERM) and returns run's error and stderr.
func startRun(t *testing.T, args ...string) (addr string, stop func() (error, string)) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	var stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"-addr", "127.0.0.1:0", "-device", "cpu", "-threads", "1"}, args...), io.Discard, &stderr)
	}()
	re := regexp.MustCompile(`http://(\S+) `)
	var m []string
	waitFor(t, "serve to listen", func() bool {
		select {
		case err := <-done:
			t.Fatalf("run: %v", err)
		default:
		}
		m = re.FindStringSubmatch(stderr.String())
		return m != nil
	})
	return m[1], func() (error, string) {
		cancel()
		select {
		case err := <-done:
			return err, stderr.String()
		case <-time.After(30 * time.Second):
			t.Fatal("run did not return after its context ended")
			return nil, ""
		}
	}
}

// TestRun: the command serves the embedded model until its context ends
// (cli.Main cancels it on the first SIGINT or SIGTERM), then drains and
// returns without error.
func TestRun(t *testing.T) {
	addr, stop := startRun(t)
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"`+defaultmodel.Name+`","prompt":"Hi","max_tokens":3}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("status %d", resp.StatusCode)
	}
	if err, stderr := stop(); err != nil || !strings.Contains(stderr, "serve: drained") {
		t.Errorf("run: %v, stderr %q", err, stderr)
	}
}

// TestRunPipeline: over two CPU devices with -pipeline, completions are
// those of one device (greedy, so the same text).
func TestRunPipeline(t *testing.T) {
	var texts []string
	for _, args := range [][]string{nil, {"-device", "cpu", "-devices", "0,1", "-pipeline"}} {
		addr, stop := startRun(t, args...)
		status, _, body := post(t, t.Context(), "http://"+addr+"/v1/completions", `{"model":"`+defaultmodel.Name+`","prompt":"Hi","max_tokens":6,"temperature":0}`)
		if status != 200 {
			t.Fatalf("%v: status %d: %s", args, status, body)
		}
		texts = append(texts, decode(t, body).Choices[0].Text)
		if err, stderr := stop(); err != nil {
			t.Fatalf("%v: %v, stderr %q", args, err, stderr)
		}
	}
	if texts[0] != texts[1] {
		t.Errorf("one device %q, two pipelined %q", texts[0], texts[1])
	}
}

// TestGGUF: a GGUF file's tokenizer.chat_template is the chat endpoint's
// template, and the file's base name the model's id.
func TestGGUF(t *testing.T) {
	src, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaBF16))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	types, _, err := loader.GGUFTensorTypes(src.Config, quant.F32)
	if err != nil {
		t.Fatal(err)
	}
	tok := fixtureTokenizer(t, true)
	v, err := tok.GGUFVocab(src.Config.VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	if v.ChatTemplate == "" {
		t.Fatal("the vocabulary has no chat template")
	}
	path := filepath.Join(t.TempDir(), "tiny.gguf")
	err = loader.WriteGGUFModel(t.Context(), path, loader.GGUFModel{Config: src.Config, Vocab: v, Types: types, FileType: loader.GGUFFileType(quant.F32),
		Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
			ti, _ := src.Tensor(spec.Name)
			return src.ReadRows(t.Context(), ti, r0, r1, dst)
		}})
	if err != nil {
		t.Fatal(err)
	}
	addr, stop := startRun(t, "-model", path)
	defer stop()
	status, _, body := post(t, t.Context(), "http://"+addr+"/v1/chat/completions",
		`{"model":"tiny","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_tokens":4}`)
	if c := decode(t, body); status != 200 || c.Model != "tiny" || c.Choices[0].Message == nil || c.Usage.CompletionTokens == 0 {
		t.Errorf("status %d: %s", status, body)
	}
	status, _, body = post(t, t.Context(), "http://"+addr+"/v1/chat/completions", `{"messages":[{"role":"assistant","content":"a"}]}`)
	if status != 400 || !strings.Contains(string(body), "must alternate") {
		t.Errorf("the template's exception: status %d: %s", status, body)
	}
}

// TestFlags: bad flags and settings are usage errors of one line, before
// anything is served; a port in use is an error naming -addr.
func TestFlags(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for _, tc := range []struct {
		args  []string
		usage bool
		want  string
	}{
		{[]string{"-max-sequences", "0"}, true, "-max-sequences 0 must be > 0"},
		{[]string{"-max-queue", "-1"}, true, "-max-queue -1 must be > 0"},
		{[]string{"-kv-positions", "-1"}, true, "-kv-positions -1 must be >= 0"},
		{[]string{"-drain-timeout", "0s"}, true, "-drain-timeout 0s must be > 0"},
		{[]string{"-context", "100000", "-device", "cpu"}, true, "-context 100000 is longer than the model's context of"},
		{[]string{"-offload", "hybrid", "-device", "cpu"}, true, "-offload hybrid computes beside a GPU"},
		{[]string{"-gpu-memory-limit", "lots"}, true, "-gpu-memory-limit"},
		{[]string{"-device", "tpu:x"}, true, "-device"},
		{[]string{"-extra"}, true, "flag provided but not defined"},
		{[]string{"-model", "/nonexistent/model"}, false, "/nonexistent/model"},
		{[]string{"-addr", busy.Addr().String(), "-device", "cpu"}, false, "-addr"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			err := run(t.Context(), tc.args, io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("run: %v, want %q", err, tc.want)
			}
			if cli.IsUsage(err) != tc.usage {
				t.Errorf("a usage error: %v, want %v", cli.IsUsage(err), tc.usage)
			}
			if errors.Is(err, context.Canceled) {
				t.Errorf("run: %v", err)
			}
		})
	}
}
