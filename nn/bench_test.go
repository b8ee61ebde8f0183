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
