package nn

import (
	"context"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// TestCUDADecodeGraphs decodes 150 greedy steps of each fixture on the GPU
// with graphs (each stretch of consecutive dense blocks, all resident,
// captured once as one graph and replayed, the position read from device
// memory) and without, and checks the logits of every step agree within
// 1e-5 (the graphs run the same kernels; only where the position comes
// from differs). Positions 6..155 cross the buckets of 64 and 128
// positions, so every stretch is captured three times. It logs, for each
// path, the launches per token (kernels, copies, cuBLAS calls, graph
// replays) and the wall time per token, and the graphs' counts; the
// mixtures of experts' sparse blocks stay eager. Greedy, which finds each
// id on the device, gives the argmax of the graphs' logits every step.
func TestCUDADecodeGraphs(t *testing.T) {
	b := openCUDA(t)
	if _, ok := tensor.Graphs(b); !ok {
		t.Fatalf("%s has no graph capture", b.Name())
	}
	ctx := context.Background()
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16, fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16} {
		t.Run(name, func(t *testing.T) {
			lm, hw := fixtureWeights(t, b, name)
			m, err := New(lm.Config, b, nil, hw)
			if err != nil {
				t.Fatal(err)
			}
			const steps, maxPos = 150, 160
			prompt := []int32{1, 42, 71, 345, 81, 14}
			run := func(graphs bool) ([][]float32, tensor.Launches, time.Duration, GraphStats) {
				m.SetGraphs(graphs)
				s, err := m.NewSession(maxPos, 8)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				logits, err := s.Forward(ctx, prompt, false, nil)
				if err != nil {
					t.Fatal(err)
				}
				var all [][]float32
				l0, _ := tensor.CountLaunches(b)
				t0 := time.Now()
				for range steps {
					all = append(all, append([]float32(nil), logits...))
					if logits, err = s.Forward(ctx, []int32{int32(Argmax(logits))}, false, nil); err != nil {
						t.Fatal(err)
					}
				}
				el := time.Since(t0)
				l1, _ := tensor.CountLaunches(b)
				return append(all, logits), l1.Sub(l0), el, s.GraphStats()
			}
			want, le, te, _ := run(false)
			got, lg, tg, st := run(true)
			worst := 0.0
			for i := range want {
				worst = max(worst, maxAbsDiff(got[i], want[i]))
			}
			per := func(l tensor.Launches) float64 { return float64(l.Total()) / steps }
			t.Logf("eager: %.1f launches per token (%+v), %.1f us per token", per(le), le, float64(te.Microseconds())/steps)
			t.Logf("graphs: %.1f launches per token (%+v), %.1f us per token; %+v", per(lg), lg, float64(tg.Microseconds())/steps, st)
			t.Logf("logits: max abs difference over %d steps %.3g", steps, worst)
			if worst > 1e-5 {
				t.Errorf("graph decode differs from eager decode by %g, want <= 1e-5", worst)
			}
			// Greedy, the argmax found on the device, gives the ids of
			// the logits the graphs gave.
			s, err := m.NewSession(maxPos, 8)
			if err != nil {
				t.Fatal(err)
			}
			next, err := s.Greedy(ctx, prompt)
			for i := 0; err == nil && i <= steps; i++ {
				if want := int32(Argmax(got[i])); next != want {
					t.Fatalf("Greedy step %d: id %d, the graphs' logits' argmax %d", i, next, want)
				}
				if i < steps {
					next, err = s.Greedy(ctx, []int32{next})
				}
			}
			s.Close()
			if err != nil {
				t.Fatalf("Greedy: %v", err)
			}
			dense, stretches := 0, 0
			for i := range lm.Config.NumLayers {
				if !lm.Config.Sparse(i) {
					dense++
					if i == 0 || lm.Config.Sparse(i-1) {
						stretches++
					}
				}
			}
			switch {
			case dense == 0 && st.Replays != 0:
				t.Errorf("sparse blocks replayed graphs: %+v", st)
			case dense > 0 && (st.Captures != int64(3*stretches) || lg.Graphs == 0):
				t.Errorf("%d dense blocks in %d stretches: %+v, %+v; want %d captures and graph launches", dense, stretches, st, lg, 3*stretches)
			case dense == lm.Config.NumLayers && st.RunBlocks != int64(dense)*st.RunReplays:
				t.Errorf("every block dense: %+v; want every replay a run of all %d", st, dense)
			case dense == lm.Config.NumLayers && per(lg) >= per(le)/2:
				t.Errorf("graphs: %.1f launches per token, eager %.1f: want at most half", per(lg), per(le))
			}
		})
	}
}
