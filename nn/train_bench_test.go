package nn

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

// BenchmarkTrainCheckpoint measures one forward and backward pass of a
// synthesised 16-block model of the fixtures' width over 256 tokens with 1,
// 2, 4 (= sqrt(16)), 8 and 16 checkpoint segments: the time per step and
// the peak activation bytes the allocator counted, and on Linux the CPU
// time per step, which holds steady on a busy machine (run with -cpu 1 for
// one thread).
//
//	go test ./nn -run '^$' -bench TrainCheckpoint -benchtime 5x -cpu 1
func BenchmarkTrainCheckpoint(b *testing.B) {
	cfg, err := arch.Preset("tiny")
	if err != nil {
		b.Fatal(err)
	}
	const layers, tokens = 16, 256
	cfg.NumLayers = layers
	lm, err := loader.SynthesizeOpen(context.Background(), b.TempDir(), cfg, loader.SynthOptions{Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer lm.Close()
	ncfg := lm.Config
	p, err := LoadParams(context.Background(), lm)
	if err != nil {
		b.Fatal(err)
	}
	be := tensor.NewCPU(runtime.GOMAXPROCS(0))
	defer be.Close()
	m, err := New(ncfg, be, nil, p)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 1))
	ids := make([]int32, tokens+1)
	for i := range ids {
		ids[i] = int32(rng.IntN(ncfg.VocabSize))
	}
	inputs, targets := NextToken(ids)
	sqrtL := int(math.Round(math.Sqrt(layers)))
	for _, segments := range []int{1, 2, sqrtL, 8, 16} {
		b.Run(fmt.Sprintf("segments=%d", segments), func(b *testing.B) {
			tr, err := CheckpointSequential(m, segments)
			if err != nil {
				b.Fatal(err)
			}
			g := Grads{}
			var st StepStats
			cpu0 := cpuTime()
			for b.Loop() {
				g.Zero()
				if st, err = tr.LossAndGrads(context.Background(), inputs, targets, g, 1); err != nil {
					b.Fatal(err)
				}
			}
			if cpu := cpuTime() - cpu0; cpu > 0 {
				b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu-ms/op")
			}
			b.ReportMetric(float64(st.PeakActivationBytes), "act-bytes")
			b.ReportMetric(float64(st.RecomputedBlocks), "recomputed-blocks")
			b.ReportMetric(float64(tokens)/(float64(b.Elapsed().Seconds())/float64(b.N)), "tok/s")
		})
	}
}
