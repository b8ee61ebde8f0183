package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
)

func collect(t *testing.T, ch <-chan Token) ([]int32, Token) {
	t.Helper()
	var ids []int32
	var last Token
	for tok := range ch {
		if tok.Emitted {
			ids = append(ids, tok.ID)
		}
		last = tok
	}
	return ids, last
}

// TestBatcher: requests submitted at once get the greedy ids a session run
// alone gets, end with "length" at MaxTokens, and are counted; a cancelled
// request ends with its context's error; a prompt that cannot fit, a full
// queue and a closing batcher are refused with their errors.
func TestBatcher(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	e, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: 48, Chunk: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77, 12}, {7}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}
	want := make([][]int32, len(prompts))
	for i, p := range prompts {
		s, err := e.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		logits := decode(t, s, p, 5)
		for _, l := range logits {
			want[i] = append(want[i], int32(nn.Argmax(l)))
		}
		s.Close()
	}
	b, err := e.NewBatcher(BatchOptions{MaxSequences: 3, MaxQueue: 8})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	got := make([][]int32, len(prompts))
	ends := make([]Token, len(prompts))
	for i, p := range prompts {
		ch, err := b.Submit(context.Background(), Request{Prompt: p, MaxTokens: 6, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); got[i], ends[i] = collect(t, ch) }()
	}
	wg.Wait()
	for i := range prompts {
		if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) || ends[i].Finish != FinishLength || ends[i].Err != nil {
			t.Errorf("request %d: %v (end %+v), alone %v", i, got[i], ends[i], want[i])
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := b.Submit(ctx, Request{Prompt: []int32{1, 5}, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-ch
	cancel()
	for range ch { // the stream ends
	}
	if _, err := b.Submit(context.Background(), Request{Prompt: make([]int32, 48)}); !errors.Is(err, ErrPromptTooLong) {
		t.Errorf("a 48-token prompt in a 48-position context: %v", err)
	}
	st := b.Stats()
	if st.Requests != 5 || st.GenTokens < 24 || st.Steps == 0 {
		t.Errorf("stats %+v", st)
	}
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Submit(context.Background(), Request{Prompt: []int32{1}}); !errors.Is(err, ErrDraining) {
		t.Errorf("after Close: %v", err)
	}
}
