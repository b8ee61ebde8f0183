package nn

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/paging"
)

// BenchmarkCUDATrain measures one forward and backward pass (LossAndGrads)
// on the GPU of a synthesised model, after one untimed pass: with the weights resident for each
// number of checkpoint segments, and, when a budget is given, with the
// weights paging under it. It reports tokens per second, the forward and
// backward milliseconds (and the part of them spent copying gradients to
// the host), the peak activation and device gradient bytes, and
// for the paged runs the bytes moved to the device per step.
//
//	STRATA_TRAIN_SHAPE     a loader preset (default tinyllama-1.1b)
//	STRATA_TRAIN_TOKENS    positions per pass (default 512)
//	STRATA_TRAIN_SEGMENTS  comma-separated segment counts (default 1,2,sqrt(L),L)
//	STRATA_TRAIN_BUDGET    a device budget for the paged runs (e.g. 4GiB; default none)
//	STRATA_TRAIN_RESIDENT  0 skips the resident runs
//
//	bin/nn.test -test.run '^$' -test.bench CUDATrain -test.benchtime 3x
func BenchmarkCUDATrain(b *testing.B) {
	be := openCUDA(b)
	ctx := context.Background()
	shape := envOr("STRATA_TRAIN_SHAPE", "tinyllama-1.1b")
	tokens, err := strconv.Atoi(envOr("STRATA_TRAIN_TOKENS", "512"))
	if err != nil || tokens < 2 {
		b.Fatalf("STRATA_TRAIN_TOKENS: %v", err)
	}
	lc, err := arch.Preset(shape)
	if err != nil {
		b.Fatal(err)
	}
	lm, err := loader.SynthesizeOpen(ctx, b.TempDir(), lc, loader.SynthOptions{Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	L := cfg.NumLayers
	segs := []int{1, 2, int(math.Round(math.Sqrt(float64(L)))), L}
	if s := os.Getenv("STRATA_TRAIN_SEGMENTS"); s != "" {
		segs = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil {
				b.Fatalf("STRATA_TRAIN_SEGMENTS: %v", err)
			}
			segs = append(segs, n)
		}
	}
	rng := rand.New(rand.NewPCG(1, 1))
	ids := make([]int32, tokens+1)
	for i := range ids {
		ids[i] = int32(rng.IntN(cfg.VocabSize))
	}
	inputs, targets := NextToken(ids)

	pass := func(b *testing.B, m *Model, budget *paging.Budget, segments int, moved func() int64) {
		tr, err := CheckpointSequential(m, segments)
		if err != nil {
			b.Fatal(err)
		}
		defer tr.Close()
		g := Grads{}
		// One pass first, untimed: it grows the device allocator, pins the
		// staging buffers and faults in the host gradients' pages.
		if _, err := tr.LossAndGrads(ctx, inputs, targets, g, 1); err != nil {
			b.Fatal(err)
		}
		var st StepStats
		var fwd, bwd, cp float64
		m0 := moved()
		for b.Loop() {
			g.Zero()
			if st, err = tr.LossAndGrads(ctx, inputs, targets, g, 1); err != nil {
				b.Fatal(err)
			}
			fwd += float64(st.Forward.Microseconds()) / 1e3
			bwd += float64(st.Backward.Microseconds()) / 1e3
			cp += float64(st.GradCopy.Microseconds()) / 1e3
		}
		n := float64(b.N)
		b.ReportMetric(float64(tokens)*n/b.Elapsed().Seconds(), "tok/s")
		b.ReportMetric(fwd/n, "fwd-ms")
		b.ReportMetric(bwd/n, "bwd-ms")
		b.ReportMetric(cp/n, "gradcopy-ms")
		b.ReportMetric(float64(st.PeakActivationBytes)/(1<<20), "act-MiB")
		b.ReportMetric(float64(categoryPeak(budget, paging.Gradients))/(1<<20), "grad-MiB")
		b.ReportMetric(float64(budget.Peak())/(1<<20), "peak-MiB")
		if mv := moved() - m0; mv > 0 {
			b.ReportMetric(float64(mv)/n/(1<<30), "moved-GiB/op")
		}
		if math.IsNaN(st.Loss) || st.Loss <= 0 {
			b.Fatalf("loss %v", st.Loss)
		}
	}

	if os.Getenv("STRATA_TRAIN_RESIDENT") != "0" {
		hw, err := LoadWeights(ctx, lm, be, nil)
		if err != nil {
			b.Fatal(err)
		}
		for _, segments := range segs {
			b.Run(fmt.Sprintf("%s/T=%d/resident/segments=%d", shape, tokens, segments), func(b *testing.B) {
				budget := newBudget(b, be, 1<<40, be.Name())
				defer budget.Close()
				m, err := New(cfg, be, budget, hw)
				if err != nil {
					b.Fatal(err)
				}
				pass(b, m, budget, segments, func() int64 { return 0 })
			})
		}
		hw.Close()
	}

	limitStr := os.Getenv("STRATA_TRAIN_BUDGET")
	if limitStr == "" {
		return
	}
	limit, err := paging.ParseSize(limitStr)
	if err != nil {
		b.Fatal(err)
	}
	info, err := ModelInfo(lm, cfg)
	if err != nil {
		b.Fatal(err)
	}
	for _, segments := range segs {
		b.Run(fmt.Sprintf("%s/T=%d/budget=%s/segments=%d", shape, tokens, limitStr, segments), func(b *testing.B) {
			info := info
			info.Reserve = TrainReserve(cfg, tokens, segments, true)
			plan, err := paging.Plan(info, limit, paging.StrategyBalanced, 1, 1, paging.WithDevice(be))
			if err != nil {
				b.Skipf("%d segments: %v", segments, err)
			}
			budget := newBudget(b, be, limit, be.Name())
			defer budget.Close()
			pager, err := paging.NewPager(Source(lm), budget, plan, paging.Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer pager.Close()
			m, err := New(cfg, be, budget, pager)
			if err != nil {
				b.Fatal(err)
			}
			pass(b, m, budget, segments, func() int64 { return pager.Stats().BytesHostToDevice })
		})
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
