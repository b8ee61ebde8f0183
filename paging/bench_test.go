package paging

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

// lruBytesPerToken simulates a plain LRU cache of whole layers with
// capacity bytes on a cyclic scan and returns the bytes it loads per token
// in the steady state.
func lruBytesPerToken(sizes []int64, capacity int64) int64 {
	var cache []int
	var used, moved int64
	for tok := range 3 {
		for l, sz := range sizes {
			if i := indexOf(cache, l); i >= 0 {
				cache = append(append(cache[:i:i], cache[i+1:]...), l)
				continue
			}
			for used+sz > capacity && len(cache) > 0 {
				used -= sizes[cache[0]]
				cache = cache[1:]
			}
			cache = append(cache, l)
			used += sz
			if tok == 2 {
				moved += sz
			}
		}
	}
	return moved
}

// BenchmarkBytesPerToken decodes on a synthetic Llama-shaped model with
// budgets from 10% to 100% of its weights (plus the KV cache and
// activations) and reports the bytes moved to the device per token against
// the optimum (the weight bytes that do not fit) and against a plain LRU.
//
//	go test -run - -bench BytesPerToken -v ./paging
func BenchmarkBytesPerToken(b *testing.B) {
	src := llamaSynth(16, 128, 344, 64, 512)
	info := smallDims(src, 16)
	W, lmax := totalAndMax(info)
	sizes := make([]int64, len(info.Layers))
	for i, l := range info.Layers {
		sizes[i] = l.Bytes
	}
	var table strings.Builder
	fmt.Fprintf(&table, "weights %d B, largest layer %d B\n%-9s %5s %10s %10s %10s %7s %10s %10s\n", W, lmax,
		"strategy", "budget", "optimum", "moved", "bound", "ratio", "LRU", "prefetch")
	for _, s := range []Strategy{StrategyMinimal, StrategyBalanced} {
		for pct := 10; pct <= 100; pct += 10 {
			p0, _ := Plan(info, 1<<40, s, 32, 1)
			fixed := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes
			budget := max(fixed+W*int64(pct)/100, p0.MinBudgetBytes)
			plan, err := Plan(info, budget, s, 32, 1)
			if err != nil {
				b.Fatal(err)
			}
			opt := max(0, W-(budget-fixed))
			var perToken float64
			b.Run(fmt.Sprintf("%s/%d%%", s, pct), func(b *testing.B) {
				bg := newBudget(b, newFake(), budget, "fake")
				defer bg.Close()
				free := nnReserve(b, bg, plan)
				defer free()
				pg, err := NewPager(src, bg, plan, Options{})
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				tok := func() {
					for l := range src.NumLayers() {
						if _, err := pg.Acquire(ctx, l); err != nil {
							b.Fatal(err)
						}
						pg.Release(l)
					}
					waitIdle(pg)
					pg.MarkStep()
				}
				tok() // warm-up
				for b.Loop() {
					tok()
				}
				perToken = pg.Stats().BytesPerStep
				b.ReportMetric(perToken, "B/token")
				if opt > 0 {
					b.ReportMetric(perToken/float64(opt), "x-optimum")
				}
			})
			ratio := "-"
			if opt > 0 {
				ratio = fmt.Sprintf("%.3f", perToken/float64(opt))
			}
			fmt.Fprintf(&table, "%-9s %4d%% %10d %10.0f %10d %7s %10d %10d\n", s, pct, opt, perToken, opt+opt/20+lmax, ratio,
				lruBytesPerToken(sizes, budget-fixed), plan.PrefetchDepth)
		}
	}
	b.Log("\n" + table.String())
}
