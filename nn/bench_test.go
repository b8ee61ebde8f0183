package nn_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/tensor"
)

// BenchmarkDecode100M decodes with a synthesised model of about 134M
// parameters (the "100m" preset: hidden 768, 12 layers, vocab 32000) in
// F16 on the CPU backend, on one thread and on all: one op is one token.
func BenchmarkDecode100M(b *testing.B) {
	ctx := context.Background()
	cfg, err := arch.Preset("100m")
	if err != nil {
		b.Fatal(err)
	}
	lm, err := loader.SynthesizeOpen(ctx, b.TempDir(), cfg, loader.SynthOptions{DType: tensor.F16, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer lm.Close()
	ncfg := lm.Config
	for _, threads := range []int{1, 0} {
		cpu := tensor.NewCPU(threads)
		b.Run(fmt.Sprintf("threads=%d", cpu.Threads()), func(b *testing.B) {
			w, err := nn.LoadWeights(ctx, lm, cpu, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer w.Close()
			m, err := nn.New(ncfg, cpu, nil, w)
			if err != nil {
				b.Fatal(err)
			}
			s, err := m.NewSession(1024, 64)
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			logits, err := s.Forward(ctx, []int32{1, 2, 3, 4}, false, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			n := 0
			for b.Loop() {
				if s.Pos() == s.MaxPos() {
					s.Reset()
				}
				if logits, err = s.Forward(ctx, []int32{int32(nn.Argmax(logits))}, false, nil); err != nil {
					b.Fatal(err)
				}
				n++
			}
			tokS := float64(n) / b.Elapsed().Seconds()
			b.ReportMetric(tokS, "tok/s")
			b.ReportMetric(tokS*float64(lm.WeightBytes())/1e9, "weight-GB/s")
		})
		cpu.Close()
	}
}

// BenchmarkBatchDecode decodes 1, 4 and 16 sequences together with the
// "100m" synthesised model in F16 on the CPU backend, on all threads: each
// op is one step, a token for every sequence, and tok/s is the aggregate
// rate. The sequences start from prompts of different lengths, so their
// attention spans differ.
func BenchmarkBatchDecode(b *testing.B) {
	ctx := context.Background()
	cfg, err := arch.Preset("100m")
	if err != nil {
		b.Fatal(err)
	}
	lm, err := loader.SynthesizeOpen(ctx, b.TempDir(), cfg, loader.SynthOptions{DType: tensor.F16, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer lm.Close()
	cpu := tensor.NewCPU(0)
	defer cpu.Close()
	w, err := nn.LoadWeights(ctx, lm, cpu, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	m, err := nn.New(lm.Config, cpu, nil, w)
	if err != nil {
		b.Fatal(err)
	}
	const maxPos = 512
	for _, n := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("seqs=%d", n), func(b *testing.B) {
			bt, err := m.NewBatch(nn.BatchOptions{MaxPos: maxPos, MaxRows: 64, Blocks: n * maxPos / nn.DefaultBlockSize})
			if err != nil {
				b.Fatal(err)
			}
			defer bt.Close()
			works := make([]nn.Work, n)
			start := func() {
				for i := range works {
					if works[i].Seq != nil {
						works[i].Seq.Close()
					}
					s := bt.NewSeq()
					if err := s.Reserve(maxPos); err != nil {
						b.Fatal(err)
					}
					prompt := make([]int32, 4+3*i)
					for j := range prompt {
						prompt[j] = int32(1 + j)
					}
					if _, err := bt.Step(ctx, []nn.Work{{Seq: s, IDs: prompt}}); err != nil {
						b.Fatal(err)
					}
					works[i] = nn.Work{Seq: s, IDs: []int32{1}, Logits: true}
				}
			}
			start()
			b.ReportAllocs()
			steps := 0
			for b.Loop() {
				if works[n-1].Seq.Pos() == maxPos {
					start()
				}
				out, err := bt.Step(ctx, works)
				if err != nil {
					b.Fatal(err)
				}
				for i := range works {
					works[i].IDs[0] = int32(nn.Argmax(out[i]))
				}
				steps++
			}
			b.ReportMetric(float64(steps*n)/b.Elapsed().Seconds(), "tok/s")
		})
	}
}
