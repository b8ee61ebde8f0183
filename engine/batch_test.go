package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
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

// submitAll submits reqs to b together and returns each one's emitted
// tokens and last token once every stream has ended.
func submitAll(t *testing.T, b *Batcher, reqs []Request) ([][]int32, []Token) {
	t.Helper()
	got := make([][]int32, len(reqs))
	ends := make([]Token, len(reqs))
	var wg sync.WaitGroup
	for i, req := range reqs {
		ch, err := b.Submit(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); got[i], ends[i] = collect(t, ch) }()
	}
	wg.Wait()
	return got, ends
}

// greedyRequests is a request for each prompt of maxTokens tokens, EOS
// ignored.
func greedyRequests(prompts [][]int32, maxTokens int) []Request {
	reqs := make([]Request, len(prompts))
	for i, p := range prompts {
		reqs[i] = Request{Prompt: p, MaxTokens: maxTokens, IgnoreEOS: true}
	}
	return reqs
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
	got, ends := submitAll(t, b, greedyRequests(prompts, 6))
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
	// The steps' time by part adds up to their time; on the CPU the
	// forward's device time is its launch (computed as called).
	sp := st.StepSplit
	t.Logf("%d steps in %v: %+v", st.Steps, st.StepTimeSum, sp)
	if sum := sp.Schedule + sp.Prepare + sp.Launch + sp.Wait + sp.Download + sp.Sample; sum != st.StepTimeSum ||
		sp.Schedule <= 0 || sp.Prepare <= 0 || sp.Launch <= 0 || sp.Download <= 0 || sp.Sample <= 0 || sp.Device != sp.Launch || sp.Wait != 0 {
		t.Errorf("the steps' %v split %+v", st.StepTimeSum, sp)
	}
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Submit(context.Background(), Request{Prompt: []int32{1}}); !errors.Is(err, ErrDraining) {
		t.Errorf("after Close: %v", err)
	}
}

// TestBatcherRefusals: Submit tells apart what no retry can fix (a prompt
// over the context, a request larger than the whole KV pool) from what
// waits (a request that fits the pool is queued), with errors that name
// the sizes.
func TestBatcherRefusals(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	e, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: 48, Chunk: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	// A pool of 4 blocks of 4 positions: 16 positions, a third of the
	// context.
	b, err := e.NewBatcher(BatchOptions{MaxSequences: 2, BlockSize: 4, KVBlocks: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	prompt := func(n int) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = int32(1 + i)
		}
		return p
	}
	for _, tc := range []struct {
		name      string
		req       Request
		want      error // nil: accepted
		notWant   error
		wantInMsg []string
	}{
		{"prompt over the context", Request{Prompt: prompt(48)}, ErrPromptTooLong, ErrBusy, []string{"48 prompt tokens", "48 positions"}},
		{"whole context over the pool", Request{Prompt: prompt(2), IgnoreEOS: true}, ErrTooLarge, ErrBusy, []string{"2 prompt tokens and 46 new tokens", "47 KV positions", "(16 positions)"}},
		{"one position over the pool", Request{Prompt: prompt(10), MaxTokens: 8, IgnoreEOS: true}, ErrTooLarge, ErrBusy, []string{"17 KV positions", "5 blocks of 4", "4 blocks"}},
		{"the whole pool", Request{Prompt: prompt(10), MaxTokens: 7, IgnoreEOS: true}, nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ch, err := b.Submit(context.Background(), tc.req)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				ids, end := collect(t, ch)
				if end.Err != nil || len(ids) != tc.req.MaxTokens {
					t.Errorf("%d tokens, end %+v", len(ids), end)
				}
				return
			}
			if !errors.Is(err, tc.want) || errors.Is(err, tc.notWant) {
				t.Fatalf("got %v, want %v (and not %v)", err, tc.want, tc.notWant)
			}
			for _, s := range tc.wantInMsg {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("%q does not say %q", err, s)
				}
			}
		})
	}
	if st := b.Stats(); st.Rejected != 2 {
		t.Errorf("%d requests rejected, want the 2 over the pool", st.Rejected)
	}
}

// budgetsUsed is the bytes in use on the engine's device budgets.
func budgetsUsed(e *Engine) []int64 {
	var u []int64
	for _, b := range e.budgets {
		u = append(u, b.Used())
	}
	return u
}

// TestBatcherMatchesAlone: on every fixture and on one device, two, a
// budget that streams the layers (or pages the experts) on one device and
// on two, experts computed on the CPU (all the missing ones, or a split of
// each step's), the hybrid strategy (the CPU's layers and the fake GPU's)
// with F16 and Q8_0 weights, the KV cache in host memory (alone and with
// the hybrid strategy), and both unified memory modes (weights in managed
// memory), requests of random prompt lengths and lengths, submitted in two
// waves so that some join while others decode, with one cancelled
// mid-stream and one larger than the KV pool, get the greedy ids each gets
// alone; the refused request is ErrTooLarge, the cancelled one ends with
// its context's error; when they all end every KV block is free, and after
// Close the budgets are back at their values before the batcher. The pool
// stores the engine's KV dtype: F16 and Q8_B8 pools too.
func TestBatcherMatchesAlone(t *testing.T) {
	type config struct {
		name     string
		fixture  string
		devices  int
		gpu      bool // a fake GPU (pinned host memory), with the hybrid's rates
		managed  bool // the device is a managedCPU, for the unified modes
		quant    quant.Type
		mode     paging.MemoryMode
		strategy paging.Strategy
		kvCache  paging.KVPlacement
		budget   func(t *testing.T, lm *loader.Model) int64
		kvBlocks int // 0: the default, one context's worth
		// kvPositions is Options.KVPositions: the room the plans keep for
		// the pool.
		kvPositions int
		kv          tensor.DType
		// expertsCPU is Memory.ExpertsCPU, with the rates of rates
		// when not nil.
		expertsCPU paging.ExpertCPUPolicy
		rates      func(lm *loader.Model) *paging.Rates
	}
	const ctxLen, block = 32, 4
	var configs []config
	for _, f := range []string{fixtures.TinyLlamaBF16, fixtures.TinyLlamaF16Sharded, fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		configs = append(configs, config{name: "one device", fixture: f, devices: 1, kvBlocks: 6})
	}
	configs = append(configs,
		config{name: "two devices", fixture: fixtures.TinyQwen3F16, devices: 2, kvBlocks: 6},
		config{name: "F16 pool", fixture: fixtures.TinyLlamaF16Sharded, devices: 1, kvBlocks: 6, kv: tensor.F16},
		config{name: "Q8_B8 pool on two devices", fixture: fixtures.TinyQwen3F16, devices: 2, kvBlocks: 6, kv: tensor.Q8_B8},
		config{name: "streamed", fixture: fixtures.TinyLlamaF16Sharded, devices: 1, strategy: paging.StrategyBalanced,
			budget: func(*testing.T, *loader.Model) int64 { return 400 << 10 }},
		config{name: "experts paged", fixture: fixtures.TinyQwen3MoEF16, devices: 1,
			budget: func(t *testing.T, lm *loader.Model) int64 {
				return expertBudget(t, lm, ctxLen, 8, lm.Config.MoE.ExpertsPerToken+2)
			}},
		config{name: "experts on the CPU", fixture: fixtures.TinyQwen3MoEF16, devices: 1, expertsCPU: paging.ExpertCPUAlways,
			budget: func(t *testing.T, lm *loader.Model) int64 {
				return expertBudget(t, lm, ctxLen, 8, lm.Config.MoE.ExpertsPerToken+2)
			}},
		config{name: "experts split", fixture: fixtures.TinyQwen3MoEF16, devices: 1, expertsCPU: paging.ExpertCPUAuto,
			budget: func(t *testing.T, lm *loader.Model) int64 {
				return expertBudget(t, lm, ctxLen, 8, lm.Config.MoE.ExpertsPerToken+2)
			},
			rates: func(lm *loader.Model) *paging.Rates {
				// An expert uploads in 1 ms and takes the CPU 0.7 a row:
				// a step's misses split between the two, those of one
				// row on the CPU, those of more on the link.
				eb := float64(lm.Config.MoE.ExpertSize) * float64(lm.Config.HiddenSize) * 3 * 2
				return &paging.Rates{H2D: eb * 1e3, CPU: eb / 0.7e-3}
			}},
		config{name: "hybrid", fixture: fixtures.TinyLlamaF16Sharded, gpu: true, strategy: paging.StrategyHybrid,
			budget: func(*testing.T, *loader.Model) int64 { return 400 << 10 }},
		config{name: "hybrid Q8_0", fixture: fixtures.TinyLlamaF16Sharded, quant: quant.Q8_0, gpu: true, strategy: paging.StrategyHybrid,
			budget: func(*testing.T, *loader.Model) int64 { return 200 << 10 }},
		config{name: "two devices streamed", fixture: fixtures.TinyLlamaF16Sharded, devices: 2, strategy: paging.StrategyBalanced, kvBlocks: 6, kvPositions: 2 * ctxLen,
			budget: func(*testing.T, *loader.Model) int64 { return 200 << 10 }},
		config{name: "host KV", fixture: fixtures.TinyQwen3F16, gpu: true, kvCache: paging.KVHost,
			budget: func(*testing.T, *loader.Model) int64 { return 8 << 20 }},
		config{name: "hybrid host KV", fixture: fixtures.TinyLlamaF16Sharded, gpu: true, strategy: paging.StrategyHybrid, kvCache: paging.KVHost,
			budget: func(*testing.T, *loader.Model) int64 { return 400 << 10 }},
		config{name: "unified", fixture: fixtures.TinyLlamaF16Sharded, managed: true, mode: paging.ModeUnified,
			budget: func(*testing.T, *loader.Model) int64 { return 400 << 10 }},
		config{name: "unified-noprefetch", fixture: fixtures.TinyQwen3F16, managed: true, mode: paging.ModeUnifiedNoPrefetch,
			budget: func(*testing.T, *loader.Model) int64 { return 400 << 10 }},
	)
	for _, tc := range configs {
		t.Run(tc.name+"/"+tc.fixture, func(t *testing.T) {
			lm := openFixture(t, tc.fixture)
			if tc.quant != 0 {
				lm = openGGUF(t, tc.fixture, tc.quant)
			}
			o := Options{Backends: cpus(tc.devices), Context: ctxLen, Chunk: 8, KVPositions: tc.kvPositions,
				Memory: Memory{Strategy: tc.strategy, Mode: tc.mode, KVCache: tc.kvCache, KVDType: tc.kv, ExpertsCPU: tc.expertsCPU}}
			if tc.rates != nil {
				o.Rates = tc.rates(lm)
			}
			var managed *managedCPU
			switch {
			case tc.gpu:
				gpu := newFakeGPU()
				defer gpu.Close()
				o.Backends, o.TwinMinTokens, o.Rates = []tensor.Backend{gpu}, 4, &testRates
			case tc.managed:
				managed = &managedCPU{CPU: tensor.NewCPU(1)}
				o.Backends = []tensor.Backend{managed}
			}
			if tc.budget != nil {
				for range o.Backends {
					o.Memory.Budgets = append(o.Memory.Budgets, tc.budget(t, lm))
				}
			}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if tc.strategy == paging.StrategyHybrid && (e.Hybrid() == nil || len(e.Hybrid().Plan.CPULayers) == 0) {
				t.Fatalf("no layer on the CPU under the hybrid strategy")
			}
			if tc.kvCache == paging.KVHost && len(e.KV().HostBlocks) == 0 {
				t.Fatal("no block's KV cache in host memory")
			}
			if tc.mode != "" && (e.Mode() != tc.mode || managed.allocs == 0) {
				t.Fatalf("mode %s with %d managed allocations, want %s", e.Mode(), managed.allocs, tc.mode)
			}
			if tc.quant != 0 {
				n := 0
				for _, ti := range lm.Tensors() {
					if ti.DType.String() == tc.quant.String() {
						n++
					}
				}
				if n < lm.Config.NumLayers {
					t.Fatalf("%d tensors of the model are %v", n, tc.quant)
				}
			}
			for d, dev := range e.Devices() {
				if tc.strategy == paging.StrategyBalanced && len(dev.Plan.StreamedLayers) == 0 {
					t.Fatalf("device %d streams nothing under its budget", d)
				}
			}
			before := budgetsUsed(e)
			kvUsed := func() int64 {
				var n int64
				for _, bg := range e.budgets {
					n += bg.UsedBy(paging.KVCache)
				}
				return n
			}
			kvBefore := kvUsed()
			b, err := e.NewBatcher(BatchOptions{MaxSequences: 4, StepTokens: 8, BlockSize: block, KVBlocks: tc.kvBlocks})
			if err != nil {
				t.Fatal(err)
			}
			st := b.Stats()
			t.Logf("KV pool of %d blocks of %d positions", st.KVBlocks, st.BlockSize)
			if tc.kv != tensor.Invalid {
				// The pool is stored in the engine's KV dtype.
				if got, want := kvUsed()-kvBefore, nn.KVCacheBytes(lm.Config, st.KVBlocks*st.BlockSize, tc.kv); got != want {
					t.Errorf("the pool charged %d KV bytes, want %d (%v)", got, want, tc.kv)
				}
			}
			r := rand.New(rand.NewPCG(uint64(len(tc.name)), uint64(len(tc.fixture))))
			vocab := lm.Config.VocabSize
			var reqs []Request
			for range 7 {
				p := make([]int32, 1+r.IntN(12))
				for j := range p {
					p[j] = int32(r.IntN(vocab))
				}
				reqs = append(reqs, Request{Prompt: p, MaxTokens: 1 + r.IntN(8), IgnoreEOS: true})
			}
			// Too large for the pool: every position of the context.
			huge := Request{Prompt: []int32{1, 2}, IgnoreEOS: true}
			if tc.kvBlocks > 0 { // a pool smaller than one context
				if _, err := b.Submit(context.Background(), huge); !errors.Is(err, ErrTooLarge) {
					t.Errorf("a request of %d positions in a pool of %d: %v", ctxLen, st.KVBlocks*block, err)
				}
			}
			got := make([][]int32, len(reqs))
			ends := make([]Token, len(reqs))
			var wg sync.WaitGroup
			submit := func(i int, first chan<- struct{}) {
				ch, err := b.Submit(context.Background(), reqs[i])
				if err != nil {
					t.Error(err)
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					for tok := range ch {
						if tok.Emitted {
							got[i] = append(got[i], tok.ID)
							if first != nil {
								close(first)
								first = nil
							}
						}
						ends[i] = tok
					}
				}()
			}
			first := make(chan struct{})
			for i := range 3 {
				if i == 0 {
					submit(i, first)
				} else {
					submit(i, nil)
				}
			}
			<-first // the first wave decodes: the second joins it
			for i := 3; i < len(reqs); i++ {
				submit(i, nil)
			}
			cctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			// More tokens than the stream holds: its reader, which stops
			// reading after the second, cancels it mid-way.
			cch, err := b.Submit(cctx, Request{Prompt: []int32{3, 1, 4, 1, 5}, MaxTokens: 18, IgnoreEOS: true})
			if err != nil {
				t.Fatal(err)
			}
			var cend Token
			for tok := range cch {
				if tok.Emitted && tok.GeneratedTokens == 2 {
					time.Sleep(10 * time.Millisecond) // the stream fills
					cancel()
				}
				cend = tok
			}
			if !errors.Is(cend.Err, context.Canceled) {
				t.Errorf("the cancelled request ended with %+v", cend)
			}
			wg.Wait()
			st = b.Stats()
			if st.KVBlocksFree != st.KVBlocks || st.Running != 0 || st.Queued != 0 {
				t.Errorf("after every request: %d of %d blocks free, %d running, %d queued", st.KVBlocksFree, st.KVBlocks, st.Running, st.Queued)
			}
			if st.BatchSizeSum <= st.Steps {
				t.Errorf("%d steps ran %d sequences in all: nothing was batched", st.Steps, st.BatchSizeSum)
			}
			if es := e.Stats(); tc.expertsCPU != "" && (es.ExpertsOnCPU == 0 || es.ExpertMisses == 0 && tc.expertsCPU == paging.ExpertCPUAuto) {
				t.Errorf("experts %s: %d on the CPU, %d misses uploaded", tc.expertsCPU, es.ExpertsOnCPU, es.ExpertMisses)
			}
			t.Logf("%d steps, mean batch %.2f, mean time to first token %v, mean inter-token latency %v", st.Steps,
				float64(st.BatchSizeSum)/float64(st.Steps), st.TimeToFirstTokenSum/time.Duration(max(st.FirstTokens, 1)), st.InterTokenLatencySum/time.Duration(max(st.InterTokens, 1)))
			for i, req := range reqs {
				ch, err := b.Submit(context.Background(), req)
				if err != nil {
					t.Fatal(err)
				}
				alone, end := collect(t, ch)
				if fmt.Sprint(got[i]) != fmt.Sprint(alone) || ends[i].Finish != FinishLength || end.Finish != FinishLength {
					t.Errorf("request %d (prompt %d tokens): %v in the batch (end %+v), %v alone (end %+v)", i, len(req.Prompt), got[i], ends[i], alone, end)
				}
			}
			if err := b.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			if tc.strategy == paging.StrategyBalanced && e.Stats().BytesHostToDevice == 0 {
				t.Error("nothing was streamed under the budget")
			}
			if after := budgetsUsed(e); fmt.Sprint(after) != fmt.Sprint(before) {
				t.Errorf("budgets at %v after the batcher, %v before", after, before)
			}
		})
	}
}

// TestBatcherStreamsOncePerStep: under a budget that streams layers, a
// batch of sequences moves each streamed byte once per step, as one
// session moves it once per token: with the room for its KV pool planned
// (Options.KVPositions), a batched step moves the plan's streamed bytes
// of a decode step and loads at most as many layers as a session's step,
// nothing is read again from disk
// and no weight the plan keeps resident leaves the device; a pool larger
// than the plan's room is refused with ErrKVRoom (before, it took the
// resident weights' place and every step loaded them again from disk),
// leaving the budget as it was; the default pool is the room the plan
// left beside a session's room, at least one context.
func TestBatcherStreamsOncePerStep(t *testing.T) {
	const ctxLen, block, seqs = 32, 4, 4
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	for _, tc := range []struct {
		name        string
		kvPositions int // Options.KVPositions
		kvBlocks    int // BatchOptions.KVBlocks
		stepTokens  int // BatchOptions.StepTokens, 0 for 8 (the engine's chunk)
		wantErr     error
		wantText    string // in the error
		wantBlocks  int    // the pool's blocks, at least
	}{
		{name: "pool planned", kvPositions: seqs * 16, kvBlocks: seqs * 16 / block, wantBlocks: seqs * 16 / block},
		{name: "pool beyond the plan", kvBlocks: seqs * 16 / block, wantErr: ErrKVRoom, wantText: "give the engine Options.KVPositions 64"},
		{name: "pool planned, steps beyond the chunk", kvPositions: seqs * 16, kvBlocks: seqs * 16 / block, stepTokens: 256, wantErr: ErrKVRoom,
			wantText: "the plan kept room for the pool and for steps of 8 rows (the engine's chunk): ask for at most that many rows a step (BatchOptions.StepTokens), not 256"},
		{name: "default pool, planned", kvPositions: seqs*16 + 2*ctxLen, wantBlocks: ctxLen/block + 4},
		{name: "default pool", wantBlocks: ctxLen / block},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu := newFakeGPU()
			defer gpu.Close()
			e, err := Open(context.Background(), lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: 8, KVPositions: tc.kvPositions,
				Memory: Memory{Strategy: paging.StrategyBalanced, Budgets: []int64{500 << 10}}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			plan := e.Devices()[0].Plan
			if plan.StreamedBytes == 0 {
				t.Fatal("the budget streams nothing")
			}
			// A session's decode steps: the bytes and loads of one pass.
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			ids := []int32{1, 2, 3}
			for range 4 {
				if _, err := s.Forward(context.Background(), ids, false, nil); err != nil {
					t.Fatal(err)
				}
				e.MarkStep()
				ids = []int32{5}
			}
			st0 := e.Stats()
			if _, err := s.Forward(context.Background(), ids, false, nil); err != nil {
				t.Fatal(err)
			}
			e.MarkStep()
			st1 := e.Stats()
			s.Close()
			pass, loads := st1.LastStepBytes, st1.Loads-st0.Loads
			t.Logf("plan streams %d bytes (depth %d); a session's decode step moves %d bytes in %d loads", plan.StreamedBytes, plan.PrefetchDepth, pass, loads)
			if pass == 0 || loads == 0 {
				t.Fatalf("a session's step moved %d bytes in %d loads: nothing streams", pass, loads)
			}
			before := budgetsUsed(e)
			resident := e.budgets[0].UsedBy(paging.ResidentWeights)
			b, err := e.NewBatcher(BatchOptions{MaxSequences: seqs, StepTokens: cmp.Or(tc.stepTokens, 8), BlockSize: block, KVBlocks: tc.kvBlocks})
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.wantText) {
					t.Fatalf("a pool of %d blocks of %d positions in a plan for one context of %d: %v, want %v", tc.kvBlocks, block, ctxLen, err, tc.wantErr)
				}
				t.Log(err)
				if after := budgetsUsed(e); fmt.Sprint(after) != fmt.Sprint(before) {
					t.Errorf("budget at %v after the refused pool, %v before", after, before)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close(context.Background())
			if got := b.Stats().KVBlocks; got < tc.wantBlocks {
				t.Errorf("pool of %d blocks, want at least %d", got, tc.wantBlocks)
			}
			if got := e.budgets[0].UsedBy(paging.ResidentWeights); got != resident {
				t.Errorf("resident weights %d bytes with the pool, %d before it", got, resident)
			}
			stB := e.Stats()
			var chs []<-chan Token
			for i := range seqs {
				ch, err := b.Submit(context.Background(), Request{Prompt: []int32{1, int32(i + 2)}, MaxTokens: 10, IgnoreEOS: true})
				if err != nil {
					t.Fatal(err)
				}
				chs = append(chs, ch)
			}
			for _, ch := range chs {
				if _, end := collect(t, ch); end.Err != nil {
					t.Fatal(end.Err)
				}
			}
			bs, stA := b.Stats(), e.Stats()
			steps := stA.Steps - stB.Steps
			if steps != bs.Steps || steps == 0 {
				t.Fatalf("%d steps marked on the engine for %d batched steps", steps, bs.Steps)
			}
			moved, disk, batchLoads := stA.BytesHostToDevice-stB.BytesHostToDevice, stA.BytesDiskToHost-stB.BytesDiskToHost, stA.Loads-stB.Loads
			t.Logf("%d batched steps of %.1f rows: %d bytes moved (%d a step, the most %d), %d loads, %d misses, %d prefetches, %d bytes read from disk",
				steps, float64(bs.StepRowsSum)/float64(bs.Steps), moved, moved/steps, stA.MaxStepBytes, batchLoads, stA.Misses-stB.Misses, stA.Prefetches-stB.Prefetches, disk)
			// The plan's streamed bytes a step, within one pass over the
			// run: a prefetch may land before or after the step it serves
			// (the session's one measured step may count the next one's
			// first layer too: 191488 bytes in 3 loads where the plan
			// streams 125952, and a batched step then moved 122675 to
			// 125952). Once per step, not once per sequence.
			per := plan.StreamedBytes
			if moved <= (steps-1)*per || moved >= (steps+1)*per || stA.MaxStepBytes >= 2*max(pass, per) {
				t.Errorf("%d batched steps moved %d bytes (the most in a step %d), want %d a step, the plan's", steps, moved, stA.MaxStepBytes, per)
			}
			if batchLoads < steps || batchLoads > steps*loads+1 {
				t.Errorf("%d batched steps loaded %d layers, want at least one and at most %d a step, as a session's", steps, batchLoads, loads)
			}
			if disk != 0 {
				t.Errorf("the batched steps read %d bytes from disk again: the host cache or the resident weights were lost", disk)
			}
		})
	}
}

// TestBatcherHostKV: with the KV cache in host memory (-kv-cache host,
// alone and with the hybrid strategy) the batch's pool keeps those
// blocks' part in host memory, charged to no device budget, and their
// attention runs on the CPU at every step (the engine's KV counters
// count it); the greedy ids are a session's alone; after Close the
// budgets are as before. Under a host memory limit a pool larger than the
// room the plan set aside for the KV cache there is refused with
// ErrKVRoom naming the limit, a pool within it is made, and the default
// pool is what fits there (one context), else MaxSequences contexts.
func TestBatcherHostKV(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	const ctxLen, block = 32, 4
	hostKV := nn.KVCacheBytes(lm.Config, ctxLen, tensor.F32)
	for _, tc := range []struct {
		name       string
		mem        Memory
		kvBlocks   int
		wantErr    error
		wantBlocks int // the default pool's blocks (KVBlocks 0)
	}{
		{name: "host", mem: Memory{KVCache: paging.KVHost, Budgets: []int64{8 << 20}}},
		{name: "hybrid", mem: Memory{KVCache: paging.KVHost, Strategy: paging.StrategyHybrid, Budgets: []int64{400 << 10}}},
		{name: "host limit, pool within", mem: Memory{KVCache: paging.KVHost, Budgets: []int64{8 << 20}, HostCache: hostKV + 64<<10}, kvBlocks: ctxLen / block},
		{name: "host limit, default pool", mem: Memory{KVCache: paging.KVHost, Budgets: []int64{8 << 20}, HostCache: hostKV + 64<<10}, wantBlocks: ctxLen / block},
		{name: "host, default pool", mem: Memory{KVCache: paging.KVHost, Budgets: []int64{8 << 20}}, wantBlocks: 3 * ctxLen / block},
		{name: "host limit, pool over", mem: Memory{KVCache: paging.KVHost, Budgets: []int64{8 << 20}, HostCache: hostKV + 64<<10}, kvBlocks: 2 * ctxLen / block, wantErr: ErrKVRoom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu := newFakeGPU()
			defer gpu.Close()
			e, err := Open(context.Background(), lm, Options{Backends: []tensor.Backend{gpu}, Context: ctxLen, Chunk: 8, Rates: &testRates, Memory: tc.mem})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if len(e.KV().HostBlocks) == 0 {
				t.Fatal("no block's KV cache in host memory")
			}
			prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77, 12, 8, 40, 2, 6}, {7}, {3, 4, 5, 6, 7}}
			const steps = 5
			want := make([][]int32, len(prompts))
			for i, p := range prompts {
				s, err := e.NewSession()
				if err != nil {
					t.Fatal(err)
				}
				for _, l := range decode(t, s, p, steps) {
					want[i] = append(want[i], int32(nn.Argmax(l)))
				}
				s.Close()
			}
			before := budgetsUsed(e)
			kv0 := e.budgets[0].UsedBy(paging.KVCache)
			b, err := e.NewBatcher(BatchOptions{MaxSequences: 3, StepTokens: 8, BlockSize: block, KVBlocks: tc.kvBlocks})
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), "host memory limit") {
					t.Fatalf("a pool of %d blocks of %d positions over the host memory limit: %v, want %v naming the limit", tc.kvBlocks, block, err, tc.wantErr)
				}
				t.Log(err)
				if after := budgetsUsed(e); fmt.Sprint(after) != fmt.Sprint(before) {
					t.Errorf("budget at %v after the refusal, %v before", after, before)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if n := b.Stats().KVBlocks; tc.wantBlocks > 0 && n != tc.wantBlocks {
				t.Errorf("the default pool has %d blocks, want %d", n, tc.wantBlocks)
			}
			if kv := e.budgets[0].UsedBy(paging.KVCache); kv != kv0 {
				t.Errorf("the pool charged %d bytes of KV cache to the device budget: every block's is in host memory", kv-kv0)
			}
			st0 := e.KV().KVStats
			got, ends := submitAll(t, b, greedyRequests(prompts, steps+1))
			for i := range prompts {
				if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) || ends[i].Err != nil {
					t.Errorf("request %d: %v (end %+v), alone %v", i, got[i], ends[i], want[i])
				}
			}
			// After Close: the batcher counts a step once its tokens are
			// sent, so the last step's count may trail its requests' ends.
			if err := b.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			bs, st1 := b.Stats(), e.KV().KVStats
			gpuBlocks := lm.Config.NumLayers
			if h := e.Hybrid(); h != nil {
				for _, l := range h.Plan.CPULayers { // the CPU's blocks attend in their own stage
					if b := l - lm.Config.BlockLayer(0); b >= 0 && b < lm.Config.NumLayers {
						gpuBlocks--
					}
				}
			}
			calls := st1.CPUAttentions - st0.CPUAttentions
			t.Logf("%d steps of mean batch %.2f: %d CPU attentions over the host pool (%v), %d bytes down", bs.Steps, float64(bs.BatchSizeSum)/float64(bs.Steps),
				calls, st1.CPUAttention-st0.CPUAttention, st1.DownloadBytes-st0.DownloadBytes)
			if bs.BatchSizeSum <= bs.Steps {
				t.Errorf("no step ran more than one sequence: %+v", bs)
			}
			if calls != bs.Steps*int64(gpuBlocks) {
				t.Errorf("%d CPU attentions in %d steps, want one for each of the %d blocks the device computes, at every step", calls, bs.Steps, gpuBlocks)
			}
			if after := budgetsUsed(e); fmt.Sprint(after) != fmt.Sprint(before) {
				t.Errorf("budgets at %v after the batcher, %v before", after, before)
			}
		})
	}
}

// TestPick: a row of finite logits gives the sampler's token; a NaN or an
// infinity anywhere in it (the check reads eight bytes at a time: the
// first element, a middle one, the last, a row shorter than a word) is an
// error naming the token.
func TestPick(t *testing.T) {
	greedy, err := nn.NewSampler(nn.SamplerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	row := func(n, best int) []float32 {
		l := make([]float32, n)
		for i := range l {
			l[i] = float32(i%13) * 0.5
		}
		l[best] = 100
		return l
	}
	set := func(l []float32, i int, v float64) []float32 { l[i] = float32(v); return l }
	nan, inf := math.NaN(), math.Inf(1)
	for _, tc := range []struct {
		name   string
		logits []float32
		want   int32 // -1: an error
	}{
		{"finite", row(32000, 31111), 31111},
		{"one logit", row(1, 0), 0},
		{"NaN first", set(row(32000, 5), 0, nan), -1},
		{"NaN in the middle", set(row(32000, 5), 16001, nan), -1},
		{"NaN last", set(row(32000, 5), 31999, nan), -1},
		{"+Inf", set(row(101, 5), 57, inf), -1},
		{"-Inf", set(row(101, 5), 3, -inf), -1},
		{"NaN in a row of three", set(row(3, 0), 2, nan), -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := pick(greedy, tc.logits, 7)
			switch {
			case tc.want < 0 && (err == nil || !strings.Contains(err.Error(), "token 7 hold a NaN or an infinity")):
				t.Errorf("got %d, %v; want the error of token 7", id, err)
			case tc.want >= 0 && (err != nil || id != tc.want):
				t.Errorf("got %d, %v; want %d", id, err, tc.want)
			}
		})
	}
}

// BenchmarkPick is a batched step's host work for one row of logits of a
// 32,000-token vocabulary (Llama 2's), greedy: the check that they are
// finite and the argmax (64 rows a step for 64 streams).
func BenchmarkPick(b *testing.B) {
	greedy, err := nn.NewSampler(nn.SamplerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	l := make([]float32, 32000)
	for i := range l {
		l[i] = float32((i*7919)%32000) * 1e-3
	}
	for b.Loop() {
		if _, err := pick(greedy, l, 1); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)*64/1e6, "ms/64rows")
}
