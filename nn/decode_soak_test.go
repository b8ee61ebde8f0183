package nn

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// BenchmarkSoak decodes for as many steps as the benchmark asks (run it with
// -benchtime 5000x or more) with every layer paged through the smallest
// budget the planner accepts, starting the sequence over whenever the
// context fills, and compares memory after warm-up with memory at the end:
// the budget's accounts (its snapshot), the pager's host cache and pinned
// bytes, and the Go heap after a collection. Everything but the heap must
// not move at all; the heap's drift is reported.
//
//	go test -run '^$' -bench BenchmarkSoak -benchtime 5000x ./nn/
func BenchmarkSoak(b *testing.B) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		b.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	info, err := ModelInfo(lm, cfg)
	if err != nil {
		b.Fatal(err)
	}
	const maxPos, chunk = 128, 8
	_, err = paging.Plan(info, 1, paging.StrategyBalanced, maxPos, 1, paging.WithChunkTokens(chunk))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		b.Fatalf("a 1-byte budget planned: %v", err)
	}
	plan, err := paging.Plan(info, be.Needed, paging.StrategyBalanced, maxPos, 1, paging.WithChunkTokens(chunk))
	if err != nil {
		b.Fatal(err)
	}
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	budget := newBudget(b, cpu, be.Needed, "cpu")
	defer budget.Close()
	pager, err := paging.NewPager(Source(lm), budget, plan, paging.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer pager.Close()
	m, err := New(cfg, cpu, budget, pager)
	if err != nil {
		b.Fatal(err)
	}
	s, err := m.NewSession(maxPos, chunk)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	logits, err := s.Forward(ctx, prompt, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	step := func() {
		if s.Pos() == s.MaxPos() {
			s.Reset()
			if logits, err = s.Forward(ctx, prompt, false, nil); err != nil {
				b.Fatal(err)
			}
		}
		if logits, err = s.Forward(ctx, []int32{int32(Argmax(logits))}, false, nil); err != nil {
			b.Fatal(err)
		}
		pager.MarkStep()
	}
	for range 2 * maxPos { // warm-up: two trips through the context
		step()
	}
	measure := func() (heap uint64, snap *paging.Snapshot, st paging.Stats) {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc, budget.Snapshot(), pager.Stats()
	}
	heap0, snap0, st0 := measure()
	start := time.Now()
	steps := 0
	for b.Loop() {
		step()
		steps++
	}
	elapsed := time.Since(start)
	heap1, snap1, st1 := measure()

	if snap1.Used != snap0.Used {
		b.Errorf("budget use moved from %d to %d bytes over %d steps", snap0.Used, snap1.Used, steps)
	}
	for i, c := range snap1.Categories {
		if c0 := snap0.Categories[i]; c.Allocated != c0.Allocated || c.Reserved != c0.Reserved {
			b.Errorf("%s moved from %d/%d to %d/%d bytes allocated/reserved", c.Category, c0.Allocated, c0.Reserved, c.Allocated, c.Reserved)
		}
	}
	if snap1.Peak > budget.Limit() {
		b.Errorf("budget peak %d over the limit %d", snap1.Peak, budget.Limit())
	}
	if st1.HostCacheBytes != st0.HostCacheBytes || st1.PinnedHostBytes != st0.PinnedHostBytes || st1.PinnedLayers != 0 {
		b.Errorf("host cache %d -> %d, pinned host %d -> %d, %d layers pinned", st0.HostCacheBytes, st1.HostCacheBytes, st0.PinnedHostBytes, st1.PinnedHostBytes, st1.PinnedLayers)
	}
	b.ReportMetric(float64(steps), "steps")
	b.ReportMetric(float64(steps)/elapsed.Seconds(), "tok/s")
	b.ReportMetric(float64(int64(heap1)-int64(heap0)), "heap-drift-B")
	b.ReportMetric(float64(snap1.Used-snap0.Used), "budget-drift-B")
	b.ReportMetric(float64(st1.BytesHostToDevice-st0.BytesHostToDevice)/float64(max(steps, 1)), "B-moved/step")
}
