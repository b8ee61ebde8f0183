package nn

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestConcurrentSessions is a service embedding strata: one loaded model,
// one pager and one budget shared by goroutines that each generate from
// their own prompt at the same time, streaming every hidden state through
// a callback. Each session's logits must equal, bit for bit, those of the
// same prompt run alone; the budget's peak must stay within its limit; and
// afterwards nothing is pinned or left allocated.
func TestConcurrentSessions(t *testing.T) {
	sessions, steps := 8, 12
	if raceEnabled || testing.Short() {
		sessions, steps = 4, 6
	}
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	prompts := make([][]int32, sessions)
	for i := range prompts {
		for k := range 5 + 3*i { // lengths 5, 8, 11, ...: one to several chunks
			prompts[i] = append(prompts[i], int32((7*i+31*k+1)%cfg.VocabSize))
		}
	}
	const maxPos, chunk = 48, 4
	for _, strategy := range []paging.Strategy{paging.StrategyMinimal, paging.StrategyBalanced, paging.StrategyAggressive} {
		t.Run(string(strategy), func(t *testing.T) {
			// The KV cache and buffers of every session, and room for a
			// third of the weights beyond the smallest plan: the layers
			// stream, and the sessions contend for the room.
			_, err := paging.Plan(info, 1, strategy, maxPos, sessions, paging.WithChunkTokens(chunk))
			var be *paging.BudgetError
			if !errors.As(err, &be) {
				t.Fatalf("a 1-byte budget planned: %v", err)
			}
			limit := be.Needed + lm.WeightBytes()/3
			plan, err := paging.Plan(info, limit, strategy, maxPos, sessions, paging.WithChunkTokens(chunk))
			if err != nil {
				t.Fatal(err)
			}
			b := tensor.NewCPU(2)
			defer b.Close()
			budget := newBudget(t, b, limit, "cpu")
			pager, err := paging.NewPager(Source(lm), budget, plan, paging.Options{})
			if err != nil {
				t.Fatal(err)
			}
			m, err := New(cfg, b, budget, pager)
			if err != nil {
				t.Fatal(err)
			}
			run := func(ctx context.Context, s *Session, prompt []int32, streamed *int64) ([]float32, error) {
				hook := func(layer int, h *tensor.Tensor) error { // a streaming callback
					buf := make([]byte, h.NumBytes())
					if err := b.Download(buf, h); err != nil {
						return err
					}
					atomic.AddInt64(streamed, int64(len(buf)))
					return nil
				}
				logits, err := s.Forward(ctx, prompt, false, hook)
				if err != nil {
					return nil, err
				}
				out := append([]float32(nil), logits...)
				for range steps {
					id := int32(Argmax(logits))
					if logits, err = s.Forward(ctx, []int32{id}, false, hook); err != nil {
						return nil, err
					}
					out = append(out, logits...)
				}
				return out, nil
			}
			// One by one.
			ctx := context.Background()
			var streamed int64
			want := make([][]float32, sessions)
			for i, p := range prompts {
				s, err := m.NewSession(maxPos, chunk)
				if err != nil {
					t.Fatal(err)
				}
				want[i], err = run(ctx, s, p, &streamed)
				s.Close()
				if err != nil {
					t.Fatalf("session %d alone: %v", i, err)
				}
			}
			// All at once. The sessions are opened first, as a service
			// admits a request by allocating its KV cache: the plan's KV
			// reserve is not held for sessions yet to open, and weights
			// pinned by running sessions may fill it (see the report).
			ss := make([]*Session, sessions)
			for i := range ss {
				if ss[i], err = m.NewSession(maxPos, chunk); err != nil {
					t.Fatal(err)
				}
			}
			got := make([][]float32, sessions)
			errs := make([]error, sessions)
			var wg sync.WaitGroup
			for i, p := range prompts {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer ss[i].Close()
					got[i], errs[i] = run(ctx, ss[i], p, &streamed)
				}()
			}
			finished := make(chan struct{})
			go func() { wg.Wait(); close(finished) }()
			select {
			case <-finished:
			case <-time.After(60 * time.Second):
				// A deadlock in the pager: close it to free the sessions.
				pager.Close()
				<-finished
				t.Fatalf("%d concurrent sessions deadlocked (%+v)", sessions, pager.Stats())
			}
			for i := range prompts {
				if errs[i] != nil {
					t.Errorf("session %d, concurrent: %v", i, errs[i])
					continue
				}
				if !bytes.Equal(f32Bytes(got[i]), f32Bytes(want[i])) {
					t.Errorf("session %d: concurrent logits differ from the same prompt run alone", i)
				}
			}
			st := pager.Stats()
			t.Logf("%d sessions x (prompt + %d steps) at once: peak %d of %d bytes, %d acquires, hit rate %.2f, %s moved to the device, %d bytes streamed to callbacks",
				sessions, steps, budget.Peak(), limit, st.Acquires, st.HitRate(), paging.FormatSize(st.BytesHostToDevice), streamed)
			if budget.Peak() > limit {
				t.Errorf("budget peak %d over the limit %d", budget.Peak(), limit)
			}
			if st.PinnedLayers != 0 || st.BadReleases != 0 {
				t.Errorf("%d layers pinned, %d bad releases", st.PinnedLayers, st.BadReleases)
			}
			for _, c := range budget.Categories() {
				if c.Category != paging.ResidentWeights.String() && c.Category != paging.StreamedWeights.String() && c.Allocated != 0 {
					t.Errorf("%s: %d bytes still allocated with every session closed", c.Category, c.Allocated)
				}
			}
			if err := pager.Close(); err != nil {
				t.Error(err)
			}
			if err := budget.Close(); err != nil {
				t.Error(err)
			}
			if budget.Used() != 0 {
				t.Errorf("%d bytes charged after Close", budget.Used())
			}
		})
	}
}

// TestConcurrentSessionsHostWeights runs the same service with every weight
// resident (HostWeights, no budget): sessions at once match sessions alone.
func TestConcurrentSessionsHostWeights(t *testing.T) {
	m, _, done := openFixture(t, fixtures.TinyLlamaBF16)
	defer done()
	const sessions, steps = 6, 8
	ctx := context.Background()
	run := func(seed int) ([]float32, error) {
		s, err := m.NewSession(32, 8)
		if err != nil {
			return nil, err
		}
		defer s.Close()
		prompt := []int32{1, int32(10 + seed), int32(100 + 3*seed), 7}
		logits, err := s.Forward(ctx, prompt, false, nil)
		if err != nil {
			return nil, err
		}
		out := append([]float32(nil), logits...)
		for range steps {
			if logits, err = s.Forward(ctx, []int32{int32(Argmax(logits))}, false, nil); err != nil {
				return nil, err
			}
			out = append(out, logits...)
		}
		return out, nil
	}
	want := make([][]float32, sessions)
	for i := range want {
		var err error
		if want[i], err = run(i); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, sessions)
	for i := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, err := run(i)
			if err == nil && !bytes.Equal(f32Bytes(got), f32Bytes(want[i])) {
				err = fmt.Errorf("session %d: concurrent logits differ from the same prompt run alone", i)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}
