package engine

import (
	"context"
	"testing"

	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
)

// TestOpenNewFamilies: the Qwen3, Mixtral and Qwen3-MoE fixtures through
// the engine on one and two CPU devices, with budgets small enough that
// layers stream or experts page one by one, give logits
// bit-identical to the model run directly in chunks of the same size (an
// expert's rows in a chunk depend on the chunk, and the CPU's product of one
// row rounds otherwise than that of several).
func TestOpenNewFamilies(t *testing.T) {
	for _, name := range []string{fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			lm := openFixture(t, name)
			prompt := []int32{1, 5, 9, 200, 3, 77, 18}
			const steps = 5
			want := reference(t, lm, prompt, steps)
			w := lm.WeightBytes()
			for _, tc := range []struct {
				name    string
				devices int
				budget  int64
				st      paging.Strategy
			}{
				{"one device, no budget", 1, 0, ""},
				{"one device, minimal", 1, w / 2, paging.StrategyMinimal},
				{"one device, balanced", 1, w * 3 / 5, paging.StrategyBalanced},
				{"two devices, balanced", 2, w * 2 / 5, paging.StrategyBalanced},
			} {
				t.Run(tc.name, func(t *testing.T) {
					o := Options{Backends: cpus(tc.devices), Context: len(prompt) + steps, Chunk: 8,
						Memory: Memory{Strategy: tc.st}}
					if tc.budget > 0 {
						o.Memory.Budgets = []int64{tc.budget}
					}
					e, err := Open(context.Background(), lm, o)
					if err != nil {
						t.Fatal(err)
					}
					defer func() {
						if err := e.Close(); err != nil {
							t.Error(err)
						}
					}()
					s, err := e.NewSession()
					if err != nil {
						t.Fatal(err)
					}
					got := decode(t, s, prompt, steps)
					for i := range want {
						for j := range want[i] {
							if got[i][j] != want[i][j] {
								t.Fatalf("step %d logit %d: %v, direct %v", i, j, got[i][j], want[i][j])
							}
						}
					}
					if tc.budget > 0 {
						// A dense model's layers stream; a mixture of
						// experts pages its experts too, loading only
						// those chosen.
						st := e.Stats()
						if tc.devices == 1 && st.BytesHostToDevice <= w && st.ExpertEvictions == 0 {
							t.Errorf("%d bytes moved for %d of weights and no expert evicted: nothing paged under the budget", st.BytesHostToDevice, w)
						}
						for _, d := range e.Devices() {
							if d.PeakDeviceBytes > tc.budget {
								t.Errorf("%s peaked at %d over its budget %d", d.Name, d.PeakDeviceBytes, tc.budget)
							}
						}
					}
				})
			}
		})
	}
}
