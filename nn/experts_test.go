package nn

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// expertRig serves a mixture of experts through a pager whose plan caches
// experts, under a budget of the layers resident (or streamed, when
// extra < 0) and a cache of a few experts.
type expertRig struct {
	lm     *loader.Model
	b      *tensor.CPU
	budget *paging.Budget
	pager  *paging.Pager
	m      *Model
	limit  int64
	slots  int
}

const (
	expertMaxPos = 48
	expertChunk  = 8
)

// newExpertRig pages lm's experts with a cache of slots experts. With
// stream, the budget is the smallest the strategy plans with, so the
// layers stream too and the cache holds the least it may (slots must be
// the experts per token: the planner places the layers first); otherwise
// the layers stay resident.
func newExpertRig(t *testing.T, lm *loader.Model, src paging.Source, st paging.Strategy, slots int, stream bool, opts paging.Options) *expertRig {
	return newExpertRigFor(t, lm, src, st, slots, stream, opts, expertMaxPos)
}

// newExpertRigFor is newExpertRig for sessions of maxPos positions.
func newExpertRigFor(t *testing.T, lm *loader.Model, src paging.Source, st paging.Strategy, slots int, stream bool, opts paging.Options, maxPos int) *expertRig {
	t.Helper()
	cfg := lm.Config
	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	k := cfg.MoE.ExpertsPerToken
	planOpts := []paging.PlanOption{paging.WithChunkTokens(expertChunk), paging.WithExpertCache(k)}
	full, err := paging.Plan(info, 1<<40, paging.StrategyBalanced, maxPos, 1, planOpts...)
	if err != nil {
		t.Fatal(err)
	}
	limit := full.PredictedPeakBytes - full.ExpertCacheBytes + int64(slots)*full.ExpertSlotBytes
	if stream {
		_, err := paging.Plan(info, 1, st, maxPos, 1, planOpts...)
		var be *paging.BudgetError
		if !errors.As(err, &be) {
			t.Fatalf("a 1-byte budget planned: %v", err)
		}
		limit = be.Needed + int64(slots-k)*full.ExpertSlotBytes
	}
	plan, err := paging.Plan(info, limit, st, maxPos, 1, planOpts...)
	if err != nil {
		t.Fatal(err)
	}
	if st != paging.StrategyAggressive && plan.ExpertSlots != slots || stream && plan.StreamedBytes == 0 {
		t.Fatalf("plan at %d: %d expert slots (want %d), %d bytes streamed", limit, plan.ExpertSlots, slots, plan.StreamedBytes)
	}
	r := &expertRig{lm: lm, b: tensor.NewCPU(1), limit: limit, slots: plan.ExpertSlots}
	r.budget = newBudget(t, r.b, limit, "cpu")
	if r.pager, err = paging.NewPager(src, r.budget, plan, opts); err != nil {
		t.Fatal(err)
	}
	if r.m, err = New(cfg, r.b, r.budget, r.pager); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.pager.Close(); err != nil {
			t.Error(err)
		}
		if r.budget.Peak() > limit {
			t.Errorf("budget peaked at %d over its limit %d", r.budget.Peak(), limit)
		}
		if err := r.budget.Close(); err != nil {
			t.Error(err)
		}
		r.b.Close()
	})
	return r
}

// expertBytes is one routed expert's bytes in lm.
func expertBytes(lm *loader.Model) int64 {
	var n int64
	for _, name := range Source(lm).(paging.ExpertSource).LayerExperts(lm.Config.BlockLayer(0))[0] {
		ti, _ := lm.Tensor(name)
		n += ti.Size
	}
	return n
}

// decodeMarked runs the prompt and greedy steps in a new session,
// marking a step after each, and returns every logit it saw.
func decodeMarked(t *testing.T, m *Model, mark func(), prompt []int32, steps int) []float32 {
	t.Helper()
	s, err := m.NewSession(expertMaxPos, expertChunk)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	logits, err := s.Forward(ctx, prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	all := append([]float32(nil), logits...)
	mark()
	last := logits[len(logits)-m.cfg.VocabSize:]
	for range steps {
		if last, err = s.Forward(ctx, []int32{int32(Argmax(last))}, false, nil); err != nil {
			t.Fatal(err)
		}
		all = append(all, last...)
		mark()
	}
	return all
}

// residentReference is the logits of the prompt and greedy steps with
// every weight resident and no budget.
func residentReference(t *testing.T, lm *loader.Model, prompt []int32, steps int) []float32 {
	t.Helper()
	b := tensor.NewCPU(1)
	defer b.Close()
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	m, err := New(lm.Config, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	return decodeMarked(t, m, func() {}, prompt, steps)
}

// sameLogits fails t unless got holds want's logits, bit for bit.
func sameLogits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d logits, want %d", what, len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%s: logit %d is %v, want %v", what, i, got[i], want[i])
		}
	}
}

var expertPrompt = []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3, 9, 100}

// TestPagedExpertsBitIdentical runs the Mixtral and Qwen3-MoE fixtures
// with their experts paged through caches of a few experts, the layers
// resident or streaming, with and without prefetch: the logits are
// bit-identical to a run with every weight resident, the budget is never
// exceeded, experts are evicted and loaded again, and the bytes moved for
// experts are the misses' and prefetches' experts, per step too.
func TestPagedExpertsBitIdentical(t *testing.T) {
	for _, name := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			lm, err := loader.Open(fixtures.Dir(name))
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			const steps = 12
			want := residentReference(t, lm, expertPrompt, steps)
			k := lm.Config.MoE.ExpertsPerToken
			eb := expertBytes(lm)
			for _, tc := range []struct {
				st       paging.Strategy
				slots    int
				stream   bool
				prefetch bool
			}{
				{paging.StrategyBalanced, k, false, false},
				{paging.StrategyBalanced, k + 3, false, true},
				{paging.StrategyBalanced, k, true, true},
				{paging.StrategyMinimal, k, true, false},
				{paging.StrategyAggressive, k, true, true},
			} {
				label := fmt.Sprintf("%s, %d slots, stream %v, prefetch %v", tc.st, tc.slots, tc.stream, tc.prefetch)
				t.Run(label, func(t *testing.T) {
					opts := paging.Options{}
					if !tc.prefetch {
						opts.PrefetchDepth = -1
					}
					r := newExpertRig(t, lm, Source(lm), tc.st, tc.slots, tc.stream, opts)
					got := decodeMarked(t, r.m, func() { r.pager.MarkStep() }, expertPrompt, steps)
					sameLogits(t, label, got, want)
					r.pager.SettleExperts()
					st := r.pager.Stats()
					if st.ExpertSlots >= st.ExpertsTotal || st.ExpertEvictions == 0 || st.ExpertMisses == 0 {
						t.Errorf("experts did not page: %d slots of %d, %d evictions, %d misses", st.ExpertSlots, st.ExpertsTotal, st.ExpertEvictions, st.ExpertMisses)
					}
					if st.ExpertBytesMoved != (st.ExpertMisses+st.ExpertPrefetches)*eb {
						t.Errorf("%d expert bytes moved for %d misses and %d prefetches of %d bytes", st.ExpertBytesMoved, st.ExpertMisses, st.ExpertPrefetches, eb)
					}
					if !tc.prefetch {
						if st.ExpertPrefetches != 0 {
							t.Errorf("prefetch off: %d prefetches", st.ExpertPrefetches)
						}
						if d := st.ExpertBytesPerStep - st.ExpertMissesPerStep*float64(eb); d > 1e-6*st.ExpertBytesPerStep || d < -1e-6*st.ExpertBytesPerStep || st.ExpertMissesPerStep == 0 {
							t.Errorf("per step: %v expert bytes for %v misses of %d bytes", st.ExpertBytesPerStep, st.ExpertMissesPerStep, eb)
						}
					} else if tc.slots > k && st.ExpertPrefetches == 0 {
						t.Error("no expert prefetched")
					} else if tc.slots == k && st.ExpertPrefetches != 0 {
						t.Errorf("%d experts prefetched into a cache that the experts computing fill", st.ExpertPrefetches)
					}
					if st.ExpertsPinned != 0 || st.PinnedLayers != 0 {
						t.Errorf("%d experts and %d layers pinned after the run", st.ExpertsPinned, st.PinnedLayers)
					}
					if g, _ := r.m.ExpertGuesses(); tc.prefetch && g == 0 {
						t.Error("no experts guessed")
					}
				})
			}
		})
	}
}

// writeModel writes lm's tensors, changed by edit, and its config into a
// new model directory.
func writeModel(t *testing.T, lm *loader.Model, edit func(name string, data []byte)) *loader.Model {
	t.Helper()
	dir := t.TempDir()
	var ts []loader.NamedTensor
	for _, l := range lm.Layers() {
		for _, ti := range l.Tensors {
			host, err := lm.ReadTensor(context.Background(), ti.Name)
			if err != nil {
				t.Fatal(err)
			}
			edit(ti.Name, host.Bytes())
			ts = append(ts, loader.NamedTensor{Name: ti.Name, T: host})
		}
	}
	if err := loader.WriteSafetensors(filepath.Join(dir, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(lm.Dir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	return out
}

// TestExpertGuessCounted forces the guesses of the next block's experts
// right or wrong and checks that they are counted so: the Mixtral fixture
// with its attention outputs and experts' down projections zero leaves the
// hidden state the same through every block, so each block's MLP norm
// input is the same; with the MLP norms equal the next block's router sees
// the very state its guess saw (every guess right), with each block's
// norm the negation of the one before it sees its opposite, and chooses
// its k worst experts (every guess wrong, for k <= experts/2).
func TestExpertGuessCounted(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyMixtralBF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	norm0, err := lm.ReadTensor(context.Background(), cfg.LayerNames(cfg.BlockLayer(0))[arch.MLPNorm])
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		right bool
	}{{"right", true}, {"wrong", false}} {
		t.Run(tc.name, func(t *testing.T) {
			edited := writeModel(t, lm, func(name string, data []byte) {
				switch {
				case strings.HasSuffix(name, "o_proj.weight") || strings.HasSuffix(name, ".w2.weight"):
					clear(data)
				case strings.HasSuffix(name, "post_attention_layernorm.weight"):
					copy(data, norm0.Bytes())
					var block int
					fmt.Sscanf(strings.TrimPrefix(name, "model.layers."), "%d", &block)
					if !tc.right && block%2 == 1 {
						for i := 1; i < len(data); i += 2 {
							data[i] ^= 0x80 // the BF16 sign bit
						}
					}
				}
			})
			r := newExpertRig(t, edited, Source(edited), paging.StrategyBalanced, 2*cfg.MoE.ExpertsPerToken, false, paging.Options{})
			const steps = 10
			decodeMarked(t, r.m, func() {}, expertPrompt, steps)
			guessed, right := r.m.ExpertGuesses()
			want := int64(steps * (cfg.NumLayers - 1) * cfg.MoE.ExpertsPerToken)
			if guessed != want {
				t.Errorf("%d experts guessed, want %d (%d steps, %d blocks with a next, %d experts)", guessed, want, steps, cfg.NumLayers-1, cfg.MoE.ExpertsPerToken)
			}
			switch {
			case tc.right && right != guessed:
				t.Errorf("%d of %d guesses right, want all", right, guessed)
			case !tc.right && right != 0:
				t.Errorf("%d of %d guesses right, want none", right, guessed)
			}
			r.pager.SettleExperts()
			if st := r.pager.Stats(); tc.right && st.ExpertPrefetchHits != st.ExpertPrefetches {
				t.Errorf("every guess right, yet %d of %d prefetched experts used", st.ExpertPrefetchHits, st.ExpertPrefetches)
			}
		})
	}
}

// TestSparseTimes: each decode step counts every sparse block once in
// Model.SparseTimes, with some time waiting for its router's scores and
// some after them.
func TestSparseTimes(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyMixtralBF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	r := newExpertRig(t, lm, Source(lm), paging.StrategyBalanced, 2*cfg.MoE.ExpertsPerToken, false, paging.Options{})
	sparse := int64(0)
	for i := range cfg.NumLayers {
		if cfg.Sparse(i) {
			sparse++
		}
	}
	var marks []SparseTimes
	decodeMarked(t, r.m, func() { marks = append(marks, r.m.SparseTimes()) }, expertPrompt, 4)
	chunks := int64((len(expertPrompt) + expertChunk - 1) / expertChunk)
	if marks[0].Blocks != sparse*chunks {
		t.Errorf("after the prompt's %d chunks %d sparse blocks counted, want %d", chunks, marks[0].Blocks, sparse*chunks)
	}
	for i := 1; i < len(marks); i++ {
		a, b := marks[i-1], marks[i]
		if b.Blocks-a.Blocks != sparse || b.RouterWait <= a.RouterWait || b.Host <= a.Host {
			t.Errorf("step %d: %d sparse blocks, waited %v, host %v; want %d blocks and some of each time", i, b.Blocks-a.Blocks, b.RouterWait-a.RouterWait, b.Host-a.Host, sparse)
		}
	}
}

// expertFaults is an ExpertSource whose reads of one tensor fail a number
// of times.
type expertFaults struct {
	paging.ExpertSource
	mu    sync.Mutex
	name  string
	fails int
}

var errExpertFault = errors.New("injected expert read fault")

func (s *expertFaults) ReadTensor(ctx context.Context, layer int, name string, dst []byte) error {
	s.mu.Lock()
	fail := name == s.name && s.fails > 0
	if fail {
		s.fails--
	}
	s.mu.Unlock()
	if fail {
		return fmt.Errorf("expert faults: %s: %w", name, errExpertFault)
	}
	return s.ExpertSource.ReadTensor(ctx, layer, name, dst)
}

// TestExpertLoadFaultRetry: a forward whose expert load fails (an upload
// to the cache, or a read for the CPU, -experts-cpu always) returns the
// error with nothing pinned, and the same session's retry gives the logits
// of a run without faults.
func TestExpertLoadFaultRetry(t *testing.T) {
	for _, policy := range []paging.ExpertCPUPolicy{paging.ExpertCPUNever, paging.ExpertCPUAlways} {
		t.Run(string(policy), func(t *testing.T) { expertLoadFaultRetry(t, policy) })
	}
}

func expertLoadFaultRetry(t *testing.T, policy paging.ExpertCPUPolicy) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyQwen3MoEF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	want := residentReference(t, lm, expertPrompt, 0)
	cfg := lm.Config
	for _, x := range []int{0, 5, 11, 15} { // whichever the prompt chooses fails on its first read
		src := &expertFaults{ExpertSource: Source(lm).(paging.ExpertSource), name: cfg.LayerExperts(cfg.BlockLayer(1))[x][arch.ExpertUp], fails: 1}
		r := newExpertRig(t, lm, src, paging.StrategyBalanced, cfg.MoE.Experts/2, false, paging.Options{PrefetchDepth: -1, ExpertsCPU: policy})
		if policy != paging.ExpertCPUNever {
			cpu := tensor.NewCPU(1)
			defer cpu.Close()
			r.m.SetExpertCPU(cpu)
		}
		s, err := r.m.NewSession(expertMaxPos, expertChunk)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		_, err = s.Forward(ctx, expertPrompt, true, nil)
		if st := r.pager.Stats(); st.ExpertsPinned != 0 || st.PinnedLayers != 0 {
			t.Errorf("expert %d: after the fault %d experts and %d layers pinned", x, st.ExpertsPinned, st.PinnedLayers)
		}
		if err == nil {
			s.Close()
			continue // the prompt did not choose the expert
		}
		if !errors.Is(err, errExpertFault) || s.Pos() != 0 {
			t.Fatalf("expert %d: forward: %v at position %d, want the injected fault at 0", x, err, s.Pos())
		}
		got, err := s.Forward(ctx, expertPrompt, true, nil)
		if err != nil {
			t.Fatalf("expert %d: retry: %v", x, err)
		}
		sameLogits(t, fmt.Sprintf("expert %d retry", x), got, want)
		if st := r.pager.Stats(); (st.ExpertsOnCPU > 0) != (policy == paging.ExpertCPUAlways) || st.ExpertsPinned != 0 {
			t.Errorf("expert %d: %d experts on the CPU with policy %s, %d pinned", x, st.ExpertsOnCPU, policy, st.ExpertsPinned)
		}
		s.Close()
		return
	}
	t.Fatal("the prompt chose none of the failing experts")
}

// TestExpertsTwoSessions runs two sessions of one model concurrently over
// a cache too small for both at once, with the missing experts uploaded or
// computed on the CPU: each gets the logits of a run alone. Run with -race.
func TestExpertsTwoSessions(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyMixtralBF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	const steps = 8
	want := residentReference(t, lm, expertPrompt, steps)
	for _, policy := range []paging.ExpertCPUPolicy{paging.ExpertCPUNever, paging.ExpertCPUAlways} {
		t.Run(string(policy), func(t *testing.T) { expertsTwoSessions(t, lm, policy, want) })
	}
}

func expertsTwoSessions(t *testing.T, lm *loader.Model, policy paging.ExpertCPUPolicy, want []float32) {
	const steps = 8
	r := newExpertRig(t, lm, Source(lm), paging.StrategyBalanced, lm.Config.MoE.ExpertsPerToken+1, false, paging.Options{ExpertsCPU: policy})
	cpu := tensor.NewCPU(2)
	defer cpu.Close()
	r.m.SetExpertCPU(cpu)
	var wg sync.WaitGroup
	got := make([][]float32, 2)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i] = decodeMarked(t, r.m, func() {}, expertPrompt, steps)
		}()
	}
	wg.Wait()
	for i := range got {
		sameLogits(t, fmt.Sprintf("session %d", i), got[i], want)
	}
	// Under always every miss is the CPU's and none is prefetched (the
	// CPU computed it): the cache may stay empty, with no acquire.
	if st := r.pager.Stats(); st.ExpertsPinned != 0 || policy == paging.ExpertCPUNever && st.ExpertAcquires == 0 || (st.ExpertsOnCPU > 0) != (policy == paging.ExpertCPUAlways) {
		t.Errorf("%d experts pinned, %d acquires, %d on the CPU", st.ExpertsPinned, st.ExpertAcquires, st.ExpertsOnCPU)
	}
}

// TestExpertPolicies measures the expert cache's policies on synthetic
// routing with a cache of a quarter of the experts, prefetch off, for two
// shapes: under uniform routing each hits the cached fraction (less a
// margin for a finite run), under skewed routing more. The hit rates are
// logged (go test -v): which policy misses less (the README's table).
func TestExpertPolicies(t *testing.T) {
	if raceEnabled || testing.Short() {
		t.Skip("a measurement of thousands of decode steps: run without -race or -short")
	}
	for _, shape := range []struct {
		name                  string
		blocks, experts, topK int
	}{
		{"4 blocks of 32 experts, top-4", 4, 32, 4},
		{"8 blocks of 8 experts, top-2", 8, 8, 2},
	} {
		t.Run(shape.name, func(t *testing.T) {
			cfg, err := arch.Preset("tiny")
			if err != nil {
				t.Fatal(err)
			}
			cfg.SetFamily(arch.Qwen3MoE)
			cfg.NumLayers, cfg.VocabSize, cfg.MaxPositions = shape.blocks, 97, 2048
			cfg.MoE = &arch.MoE{Experts: shape.experts, ExpertsPerToken: shape.topK, ExpertSize: 16, SparseStep: 1, NormTopK: true}
			lm, err := loader.SynthesizeOpen(context.Background(), t.TempDir(), cfg, loader.SynthOptions{DType: tensor.F16, Seed: 3})
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			const steps = 1500
			total := cfg.NumLayers * cfg.MoE.Experts
			slots := total / 4
			fraction := float64(slots) / float64(total)
			rate := map[string]float64{}
			for _, rc := range []struct {
				name           string
				skew, locality float64
			}{
				{"uniform", 0, 0},
				{"skew 1.2", 1.2, 0},
				{"skew 1.2, locality 0.5", 1.2, 0.5},
				{"skew 0.8, locality 0.3", 0.8, 0.3},
			} {
				for _, policy := range []paging.ExpertPolicy{paging.ExpertLRU, paging.ExpertLFU} {
					key := rc.name + " " + string(policy)
					r := newExpertRigFor(t, lm, Source(lm), paging.StrategyBalanced, slots, false, paging.Options{ExpertPolicy: policy, PrefetchDepth: -1}, steps+8)
					c := lm.Config.Clone()
					c.MoE.Synthetic = &arch.SyntheticRouting{Skew: rc.skew, Locality: rc.locality, Seed: 11}
					m, err := New(c, r.b, r.budget, r.pager)
					if err != nil {
						t.Fatal(err)
					}
					s, err := m.NewSession(steps+8, expertChunk)
					if err != nil {
						t.Fatal(err)
					}
					ctx := context.Background()
					if _, err := s.Forward(ctx, []int32{1, 2, 3, 4, 5, 6, 7, 8}, false, nil); err != nil {
						t.Fatal(err)
					}
					before := r.pager.Stats()
					for i := range steps - 1 {
						if _, err := s.Forward(ctx, []int32{int32(i % cfg.VocabSize)}, false, nil); err != nil {
							t.Fatal(err)
						}
					}
					s.Close()
					st := r.pager.Stats()
					rate[key] = float64(st.ExpertHits-before.ExpertHits) / float64(st.ExpertAcquires-before.ExpertAcquires)
					t.Logf("%-26s hit rate %.3f (cached fraction %.3f)", key, rate[key], fraction)
				}
			}
			for _, policy := range []string{"lru", "lfu"} {
				if u := rate["uniform "+policy]; u < fraction-0.015 {
					t.Errorf("%s under uniform routing: hit rate %.3f below the cached fraction %.3f", policy, u, fraction)
				}
				for _, skewed := range []string{"skew 1.2 ", "skew 1.2, locality 0.5 ", "skew 0.8, locality 0.3 "} {
					if rate[skewed+policy] <= rate["uniform "+policy] {
						t.Errorf("%s: %shit rate %.3f, no better than uniform routing's %.3f", policy, skewed, rate[skewed+policy], rate["uniform "+policy])
					}
				}
			}
		})
	}
}

// TestBatchExpertGuesses: a batch whose experts are paged guesses, in its
// decode steps (every row one sequence's token), the next sparse block's
// experts from that block's router over every row, prefetches them and
// counts the guesses (ExpertGuesses: at most the experts, right at most
// the guessed); steps with prompt chunks guess nothing. The logits are
// those of the batch on the resident model, bit for bit.
func TestBatchExpertGuesses(t *testing.T) {
	for _, name := range []string{fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			lm, err := loader.Open(fixtures.Dir(name))
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			cfg := lm.Config
			seqs := func() []*batchSeq {
				return []*batchSeq{
					{prompt: expertPrompt[:5], steps: 6},
					{prompt: expertPrompt[3:9], steps: 6},
					{prompt: expertPrompt[6:], steps: 6},
				}
			}
			run := func(m *Model) []*batchSeq {
				b, err := m.NewBatch(BatchOptions{MaxPos: 16, MaxRows: expertChunk, BlockSize: 4, Blocks: 12})
				if err != nil {
					t.Fatal(err)
				}
				defer b.Close()
				ss := seqs()
				runBatch(t, b, ss, expertChunk)
				return ss
			}
			res, _ := residentModel(t, lm, 1)
			want := run(res)
			r := newExpertRig(t, lm, Source(lm), paging.StrategyBalanced, 2*cfg.MoE.ExpertsPerToken, false, paging.Options{})
			got := run(r.m)
			for i := range want {
				for j := range want[i].logits {
					sameLogits(t, fmt.Sprintf("sequence %d token %d", i, j), got[i].logits[j], want[i].logits[j])
				}
			}
			guessed, right := r.m.ExpertGuesses()
			// At most each of 6 all-decode steps guesses each sparse block
			// after the first.
			maxGuessed := int64(6 * (cfg.NumLayers - 1) * cfg.MoE.Experts)
			t.Logf("guessed %d experts in batch decode steps, %d right", guessed, right)
			if guessed == 0 || guessed > maxGuessed || right > guessed || right == 0 {
				t.Errorf("guessed %d (at most %d), right %d", guessed, maxGuessed, right)
			}
			if st := r.pager.Stats(); st.ExpertPrefetches == 0 || st.ExpertsPinned != 0 {
				t.Errorf("%d expert prefetches, %d pinned", st.ExpertPrefetches, st.ExpertsPinned)
			}
		})
	}
}

// orderLog records, in order, what a sparse block asks of its weights and
// what the host waits for: the misses acquired (acquire), the guess's
// prefetches (prefetch), the experts computed on the CPU (cpu), the
// downloads of computed results (download) and the uploads from ordinary
// memory (upload), each with its layer where it has one.
type orderLog struct {
	mu  sync.Mutex
	on  bool
	log []string
	// cpuStart holds, for a layer whose visit puts experts on the CPU,
	// a channel closed when the first of them starts (HostExpert); late
	// counts the device's experts that waited 50 ms for it in vain.
	cpuStart map[int]chan struct{}
	late     int
	// devExpert maps the device's expert weights acquired to their layer.
	devExpert map[*tensor.Tensor]int
}

// acquired notes the device's expert weights of layer.
func (o *orderLog) acquired(layer int, ws map[int]map[string]*tensor.Tensor) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.devExpert == nil {
		o.devExpert = map[*tensor.Tensor]int{}
	}
	for _, m := range ws {
		for _, t := range m {
			o.devExpert[t] = layer
		}
	}
}

// deviceExpert reports the layer of w when it is a device's expert weight.
func (o *orderLog) deviceExpert(w *tensor.Tensor) (int, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	l, ok := o.devExpert[w]
	return l, ok
}

// expectCPU notes that layer's visit puts experts on the CPU.
func (o *orderLog) expectCPU(layer int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.cpuStart == nil {
		o.cpuStart = map[int]chan struct{}{}
	}
	o.cpuStart[layer] = make(chan struct{})
}

// cpuStarted notes that layer's first expert on the CPU started.
func (o *orderLog) cpuStarted(layer int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if ch, ok := o.cpuStart[layer]; ok {
		close(ch)
		delete(o.cpuStart, layer)
	}
}

// awaitCPU holds a device's expert of layer until the layer's experts on
// the CPU have started, for 50 ms at most (then counted late).
func (o *orderLog) awaitCPU(layer int) {
	o.mu.Lock()
	ch, ok := o.cpuStart[layer]
	o.mu.Unlock()
	if !ok {
		return
	}
	select {
	case <-ch:
	case <-time.After(50 * time.Millisecond):
		o.mu.Lock()
		o.late++
		o.mu.Unlock()
	}
}

func (o *orderLog) add(ev string, layer int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.on {
		o.log = append(o.log, fmt.Sprintf("%s %d", ev, layer))
	}
}

// orderWeights is a pager whose expert calls are logged.
type orderWeights struct {
	*paging.Pager
	o *orderLog
}

func (w orderWeights) AcquireExperts(ctx context.Context, layer int, experts []int) (map[int]map[string]*tensor.Tensor, error) {
	w.o.add("acquire", layer)
	return w.Pager.AcquireExperts(ctx, layer, experts)
}

func (w orderWeights) AcquireExpertsLazy(ctx context.Context, layer int, experts []int) (map[int]map[string]*tensor.Tensor, []int, func(int) error, error) {
	w.o.add("acquire", layer)
	ws, pending, await, err := w.Pager.AcquireExpertsLazy(ctx, layer, experts)
	if err != nil {
		return ws, pending, await, err
	}
	w.o.acquired(layer, ws)
	return ws, pending, func(e int) error {
		w.o.add("await", layer)
		return await(e)
	}, nil
}

func (w orderWeights) ExpertsOnCPU(layer int, experts, tokens []int, onCPU []bool) {
	w.Pager.ExpertsOnCPU(layer, experts, tokens, onCPU)
	if slices.Contains(onCPU[:len(experts)], true) {
		w.o.expectCPU(layer)
	}
}

func (w orderWeights) PrefetchExperts(layer int, experts []int) {
	w.o.add("prefetch", layer)
	w.Pager.PrefetchExperts(layer, experts)
}

func (w orderWeights) HostExpert(ctx context.Context, layer, expert, tokens int) (map[string]*tensor.Tensor, func(), error) {
	w.o.add("cpu", layer)
	w.o.cpuStarted(layer)
	return w.Pager.HostExpert(ctx, layer, expert, tokens)
}

// orderCPU is a CPU backend whose downloads and uploads are logged.
type orderCPU struct {
	*tensor.CPU
	o *orderLog
}

func (c orderCPU) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	c.o.add("download", -1)
	return c.CPU.Download(dst, src)
}

// MatMul holds a device's expert's product until the CPU's experts of its
// block have started (orderLog.awaitCPU).
func (c orderCPU) MatMul(out, x, w, bias *tensor.Tensor) error {
	if l, ok := c.o.deviceExpert(w); ok {
		c.o.awaitCPU(l)
	}
	return c.CPU.MatMul(out, x, w, bias)
}

func (c orderCPU) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	c.o.add("upload", -len(src)) // its size: the routing weights' is 4·k bytes a decode step
	return c.CPU.Upload(dst, off, src)
}

// TestExpertsOverlapOrder: in a decode step of a sparse block whose
// misses are split between the CPU and the link (-experts-cpu auto, a CPU
// slower than the link for one expert), the misses' copies are queued
// first: the block's first acquire of experts comes right after its
// router's scores, before the routing weights go up (on a GPU the link
// idles from one block's last copy to the next one's first, and each host
// step before the acquire added to that). The rows the CPU computes with
// are downloaded before the CPU's first expert (the acquire is lazy, so
// nothing queued waits for a copy yet), and the CPU's experts start before
// the device's experts are queued (each device expert waits, 50 ms at
// most, for the CPU's of its block to start: they ran after the host
// queued the device's, mostly after the copies, on the H200). The guess's
// prefetches follow the block's acquires (behind its misses on the link);
// the CPU's experts' outputs go up after the last of them, none between
// two. The logits are the resident run's.
func TestExpertsOverlapOrder(t *testing.T) {
	for _, tc := range []struct {
		fixture string
		policy  paging.ExpertCPUPolicy
	}{
		{fixtures.TinyMixtralBF16, paging.ExpertCPUAuto},
		{fixtures.TinyQwen3MoEF16, paging.ExpertCPUAuto},
		{fixtures.TinyQwen3MoEF16, paging.ExpertCPUAlways},
	} {
		t.Run(tc.fixture+"/"+string(tc.policy), func(t *testing.T) {
			lm, err := loader.Open(fixtures.Dir(tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			defer lm.Close()
			const steps = 6
			want := residentReference(t, lm, expertPrompt, steps)
			eb := expertBytes(lm)
			split := &paging.Rates{H2D: float64(eb) / 1.5e-3, CPU: float64(eb) * 1e3} // 1.5 ms up, 1 on the CPU
			k := lm.Config.MoE.ExpertsPerToken
			r := newExpertRig(t, lm, Source(lm), paging.StrategyBalanced, 2*k, false, paging.Options{ExpertsCPU: tc.policy, Rates: split})
			o := &orderLog{}
			m, err := New(lm.Config, orderCPU{r.b, o}, r.budget, orderWeights{r.pager, o})
			if err != nil {
				t.Fatal(err)
			}
			cpu := tensor.NewCPU(1)
			defer cpu.Close()
			m.SetExpertCPU(cpu)
			steps0 := 0
			got := decodeMarked(t, m, func() {
				o.mu.Lock()
				o.on = steps0 < steps // the decode steps, not the prompt
				o.mu.Unlock()
				steps0++
			}, expertPrompt, steps)
			sameLogits(t, "split", got, want)
			o.mu.Lock()
			log := o.log
			o.mu.Unlock()
			var cpus, prefetches int
			block, firstAcquire := -1, -1 // the layer of the acquires under way, and the first's event
			lastDownload, lastCPU, lastWeightsUp, prefetched := -1, -1, -1, -1
			weightsUp := fmt.Sprintf("upload %d", -4*k) // the routing weights of a decode step
			// The uploads after a block's last expert on the CPU, up to the
			// next block's first expert: its CPU experts' outputs in one,
			// and the next block's routing weights.
			blockCPUs, uploadsAfter := 0, 0
			endBlock := func(i int) {
				if blockCPUs >= 2 && uploadsAfter > 2 {
					t.Errorf("event %d: %d uploads after a block's %d experts on the CPU, want their outputs in one and the next block's weights: %v", i, uploadsAfter, blockCPUs, log[max(0, i-8):i])
				}
				blockCPUs, uploadsAfter = 0, 0
			}
			for i, ev := range log {
				var what string
				var layer int
				fmt.Sscanf(ev, "%s %d", &what, &layer)
				if (what == "acquire" || what == "cpu") && layer != block {
					endBlock(i)
				}
				switch what {
				case "upload":
					if blockCPUs > 0 {
						uploadsAfter++
					}
					if ev == weightsUp {
						lastWeightsUp = i
					}
				case "acquire":
					if prefetched >= 0 && layer == block {
						t.Errorf("event %d: acquire in layer %d after its prefetch for the next block: %v", i, layer, log[max(0, i-6):i+1])
					}
					prefetched = -1
					if layer != block {
						block, firstAcquire = layer, i
						// Right after its router's scores: nothing between,
						// the routing weights' upload least of all.
						if i >= 2 && (log[i-1] != "download -1" || log[i-2] == weightsUp) {
							t.Errorf("event %d: the first acquire of layer %d does not follow its router's scores at once: %v", i, layer, log[max(0, i-4):i+1])
						}
					}
				case "download":
					lastDownload = i
				case "prefetch":
					prefetches++
					prefetched = layer
				case "cpu":
					cpus++
					if layer != block { // a visit whose experts are all on the CPU or cached
						block, firstAcquire = layer, i
					}
					// The block's first: after its routing weights went up
					// and then its rows came down.
					if lastCPU < firstAcquire && !(lastWeightsUp > lastCPU && lastDownload > lastWeightsUp) {
						t.Errorf("event %d: the first expert on the CPU in layer %d before its rows were downloaded: %v", i, layer, log[max(0, i-6):i+1])
					}
					if lastCPU == i-2 && strings.HasPrefix(log[i-1], "upload") {
						t.Errorf("event %d: an output handed up between two experts on the CPU: %v", i, log[max(0, i-4):i+1])
					}
					lastCPU = i
					blockCPUs++
					uploadsAfter = 0
				}
			}
			o.mu.Lock()
			late := o.late
			o.mu.Unlock()
			if late > 0 {
				t.Errorf("%d of the device's experts were queued before the CPU's experts of their block started (each waited 50 ms for them)", late)
			}
			st := r.pager.Stats()
			t.Logf("%d events over %d decode steps: %d experts on the CPU, %d prefetches; %d misses uploaded", len(log), steps, cpus, prefetches, st.ExpertMisses)
			if cpus == 0 || prefetches == 0 || tc.policy == paging.ExpertCPUAuto && st.ExpertMisses == 0 {
				t.Errorf("the decode steps put %d experts on the CPU, prefetched %d times, uploaded %d misses: the order is not exercised", cpus, prefetches, st.ExpertMisses)
			}
		})
	}
}

// meetCPU is a CPU whose products, until two have run at once, wait up to
// 50 ms for another to start beside them; most is the most it saw at once.
type meetCPU struct {
	tensor.Backend
	mu             sync.Mutex
	inFlight, most int
	met            chan struct{}
	closed         bool
}

func (c *meetCPU) MatMul(out, x, w, bias *tensor.Tensor) error {
	c.mu.Lock()
	c.inFlight++
	c.most = max(c.most, c.inFlight)
	if c.inFlight == 2 && !c.closed {
		close(c.met)
		c.closed = true
	}
	c.mu.Unlock()
	select {
	case <-c.met:
	case <-time.After(50 * time.Millisecond):
	}
	c.mu.Lock()
	c.inFlight--
	c.mu.Unlock()
	return c.Backend.MatMul(out, x, w, bias)
}

// TestExpertsOnCPUAtOnce: a block's experts on the CPU are computed
// several at once (cpuExpertsAtOnce), their products side by side on the
// CPU's threads, and the logits are still the resident run's, bit for bit.
func TestExpertsOnCPUAtOnce(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyQwen3MoEF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	const steps = 4
	want := residentReference(t, lm, expertPrompt, steps)
	k := lm.Config.MoE.ExpertsPerToken
	r := newExpertRig(t, lm, Source(lm), paging.StrategyBalanced, 2*k, false, paging.Options{ExpertsCPU: paging.ExpertCPUAlways})
	inner := tensor.NewCPU(2)
	defer inner.Close()
	cpu := &meetCPU{Backend: inner, met: make(chan struct{})}
	r.m.SetExpertCPU(cpu)
	got := decodeMarked(t, r.m, func() {}, expertPrompt, steps)
	sameLogits(t, "experts on the CPU at once", got, want)
	st := r.pager.Stats()
	cpu.mu.Lock()
	most := cpu.most
	cpu.mu.Unlock()
	t.Logf("%d experts on the CPU, at most %d products at once", st.ExpertsOnCPU, most)
	if most < 2 || st.ExpertsOnCPU < 2 {
		t.Errorf("%d experts on the CPU, at most %d products at once: want several at once", st.ExpertsOnCPU, most)
	}
}

// TestExpertsOnCPUNotPrefetched: under synthetic routing a decode step
// guesses that a block chooses what it chose at the position before and
// prefetches that guess; the experts the CPU computed there are left to
// the CPU, not uploaded a token later. With every miss on the CPU
// (always), decode moves no expert bytes over the link (on the H200, auto
// moved 3.00 GiB a token with 114 experts on the CPU where never moved
// 3.07: 112 of them uploaded by the next token's prefetch).
func TestExpertsOnCPUNotPrefetched(t *testing.T) {
	lm := smallMoE(t)
	cfg := lm.Config
	const steps = 24
	r := newExpertRigFor(t, lm, Source(lm), paging.StrategyBalanced, cfg.NumLayers*cfg.MoE.Experts/4, false, paging.Options{ExpertsCPU: paging.ExpertCPUAlways}, steps+8)
	c := lm.Config.Clone()
	c.MoE.Synthetic = &arch.SyntheticRouting{Seed: 7} // uniform, each token anew
	m, err := New(c, r.b, r.budget, r.pager)
	if err != nil {
		t.Fatal(err)
	}
	cpu := tensor.NewCPU(2)
	defer cpu.Close()
	m.SetExpertCPU(cpu)
	s := promptedSession(t, m, steps)
	ctx := context.Background()
	before := r.pager.Stats()
	for i := range steps {
		if _, err := s.Forward(ctx, []int32{int32(i % cfg.VocabSize)}, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	r.pager.SettleExperts()
	st := r.pager.Stats()
	onCPU, moved, prefetches := st.ExpertsOnCPU-before.ExpertsOnCPU, st.ExpertBytesMoved-before.ExpertBytesMoved, st.ExpertPrefetches-before.ExpertPrefetches
	guessed, _ := m.ExpertGuesses()
	t.Logf("%d decode steps: %d experts on the CPU, %d guessed, %d prefetched, %d expert bytes moved", steps, onCPU, guessed, prefetches, moved)
	if onCPU == 0 || guessed == 0 {
		t.Fatalf("%d experts on the CPU, %d guessed: nothing to check", onCPU, guessed)
	}
	if moved != 0 || prefetches != 0 {
		t.Errorf("decode moved %d expert bytes (%d prefetches) with every miss on the CPU, want none", moved, prefetches)
	}
}

// smallMoE synthesises a Qwen3-MoE of 4 sparse blocks of 16 experts, 2 a
// token, closed when the test ends.
func smallMoE(t *testing.T) *loader.Model {
	t.Helper()
	cfg, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cfg.SetFamily(arch.Qwen3MoE)
	cfg.NumLayers, cfg.VocabSize, cfg.MaxPositions = 4, 97, 256
	cfg.MoE = &arch.MoE{Experts: 16, ExpertsPerToken: 2, ExpertSize: 16, SparseStep: 1, NormTopK: true}
	lm, err := loader.SynthesizeOpen(context.Background(), t.TempDir(), cfg, loader.SynthOptions{DType: tensor.F16, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	return lm
}

// promptedSession is a session of m with room for steps decode steps
// after the 8-token prompt it has run, closed when the test ends.
func promptedSession(t *testing.T, m *Model, steps int) *Session {
	t.Helper()
	s, err := m.NewSession(steps+8, expertChunk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if _, err := s.Forward(context.Background(), []int32{1, 2, 3, 4, 5, 6, 7, 8}, false, nil); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestPrefetchHeldAtChance: a block's guesses are prefetched
// (PrefetchExperts called with them) while at least half of the experts
// guessed lately are chosen. Under uniform
// synthetic routing (a guess right by chance, 2 of 16) the prefetches stop
// after the first guesses, which are still made and scored; under routing
// that keeps most of its experts from one position to the next they go on.
func TestPrefetchHeldAtChance(t *testing.T) {
	lm := smallMoE(t)
	cfg := lm.Config
	const warm, steps = 16, 48
	for _, rc := range []struct {
		name           string
		skew, locality float64
		prefetch       bool
	}{
		{"uniform", 0, 0, false},
		{"skew 1.2, locality 0.9", 1.2, 0.9, true},
	} {
		t.Run(rc.name, func(t *testing.T) {
			r := newExpertRigFor(t, lm, Source(lm), paging.StrategyBalanced, cfg.NumLayers*cfg.MoE.Experts/4, false, paging.Options{}, steps+8)
			c := lm.Config.Clone()
			c.MoE.Synthetic = &arch.SyntheticRouting{Skew: rc.skew, Locality: rc.locality, Seed: 5}
			o := &orderLog{}
			m, err := New(c, r.b, r.budget, orderWeights{r.pager, o})
			if err != nil {
				t.Fatal(err)
			}
			s := promptedSession(t, m, steps)
			ctx := context.Background()
			var guessed0, right0 int64
			for i := range steps {
				if i == warm {
					o.mu.Lock()
					o.on = true // the calls to PrefetchExperts from here
					o.mu.Unlock()
					guessed0, right0 = m.ExpertGuesses()
				}
				if _, err := s.Forward(ctx, []int32{int32(i % cfg.VocabSize)}, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			guessed, right := m.ExpertGuesses()
			guessed, right = guessed-guessed0, right-right0
			o.mu.Lock()
			prefetches := 0
			for _, ev := range o.log {
				if strings.HasPrefix(ev, "prefetch ") {
					prefetches++
				}
			}
			o.mu.Unlock()
			t.Logf("steps %d-%d: %d experts guessed, %d right (%.2f), %d prefetched", warm, steps, guessed, right, float64(right)/float64(max(guessed, 1)), prefetches)
			if guessed == 0 {
				t.Fatal("no guesses after the warm-up: nothing to check")
			}
			if rc.prefetch && (prefetches == 0 || 2*right < guessed) {
				t.Errorf("%d prefetches with %d of %d guesses right, want prefetches at over half right", prefetches, right, guessed)
			}
			if !rc.prefetch && (prefetches != 0 || 2*right >= guessed) {
				t.Errorf("%d prefetches with %d of %d guesses right, want none at chance", prefetches, right, guessed)
			}
		})
	}
}

// panicCPU is a CPU backend whose products panic.
type panicCPU struct{ tensor.Backend }

func (panicCPU) MatMul(out, x, w, bias *tensor.Tensor) error { panic("panicCPU: MatMul") }

// TestExpertsOnCPUPanic: a panic of the CPU that computes a sparse block's
// experts, which run on goroutines of their own, is raised again on the
// goroutine that called Forward, where its caller can recover it, rather
// than ending the process.
func TestExpertsOnCPUPanic(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyQwen3MoEF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	k := lm.Config.MoE.ExpertsPerToken
	r := newExpertRig(t, lm, Source(lm), paging.StrategyBalanced, 2*k, false, paging.Options{ExpertsCPU: paging.ExpertCPUAlways})
	m, err := New(lm.Config, r.b, r.budget, r.pager)
	if err != nil {
		t.Fatal(err)
	}
	cpu := tensor.NewCPU(2)
	defer cpu.Close()
	m.SetExpertCPU(panicCPU{cpu})
	s, err := m.NewSession(expertMaxPos, expertChunk)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got := func() (p any) {
		defer func() { p = recover() }()
		_, _ = s.Forward(context.Background(), expertPrompt, false, nil)
		return nil
	}()
	if got != "panicCPU: MatMul" {
		t.Fatalf("Forward with a panicking CPU for the experts: recovered %v, want the CPU's panic", got)
	}
}
