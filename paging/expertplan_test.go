package paging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// moeSynth is a synthSource laid out like a mixture of experts: an
// embedding, blocks of attention, a router and experts of three tensors,
// and a head. fail makes reads of the named tensors fail.
type moeSynth struct {
	*synthSource
	experts [][][]string
	routing [][]string

	mu   sync.Mutex
	fail map[string]int // tensor name -> reads left to fail
}

var errExpertRead = errors.New("injected read failure")

func newMoESynth(blocks, experts, hidden, inter int) *moeSynth {
	ls := [][]TensorSpec{{spec("embed", tensor.F16, tensor.Shape{32, hidden})}}
	m := &moeSynth{experts: [][][]string{nil}, routing: [][]string{nil}, fail: map[string]int{}}
	for i := range blocks {
		p := fmt.Sprintf("b%d.", i)
		l := []TensorSpec{
			spec(p+"norm", tensor.F16, tensor.Shape{hidden}),
			spec(p+"q", tensor.F16, tensor.Shape{hidden, hidden}),
			spec(p+"o", tensor.F16, tensor.Shape{hidden, hidden}),
			spec(p+"router", tensor.F16, tensor.Shape{experts, hidden}),
		}
		var xs [][]string
		for e := range experts {
			q := fmt.Sprintf("%se%d.", p, e)
			l = append(l, spec(q+"gate", tensor.F16, tensor.Shape{inter, hidden}),
				spec(q+"up", tensor.F16, tensor.Shape{inter, hidden}),
				spec(q+"down", tensor.F16, tensor.Shape{hidden, inter}))
			xs = append(xs, []string{q + "gate", q + "up", q + "down"})
		}
		ls = append(ls, l)
		m.experts = append(m.experts, xs)
		m.routing = append(m.routing, []string{p + "router"})
	}
	ls = append(ls, []TensorSpec{spec("norm", tensor.F16, tensor.Shape{hidden}), spec("head", tensor.F16, tensor.Shape{32, hidden})})
	m.experts, m.routing = append(m.experts, nil), append(m.routing, nil)
	m.synthSource = newSynth(ls)
	return m
}

func (m *moeSynth) LayerExperts(l int) [][]string { return m.experts[l] }
func (m *moeSynth) LayerRouting(l int) []string   { return m.routing[l] }

func (m *moeSynth) ReadTensor(ctx context.Context, l int, name string, dst []byte) error {
	m.mu.Lock()
	if m.fail[name] > 0 {
		m.fail[name]--
		m.mu.Unlock()
		return fmt.Errorf("moe synth: %s: %w", name, errExpertRead)
	}
	m.mu.Unlock()
	return m.synthSource.ReadTensor(ctx, l, name, dst)
}

// expertBytes is one expert's bytes.
func (m *moeSynth) expertBytes() int64 {
	var n int64
	for _, name := range m.experts[1][0] {
		for _, s := range m.layers[1] {
			if s.Name == name {
				n += s.Bytes
			}
		}
	}
	return n
}

// checkExpert verifies that an acquired expert's tensors hold its bytes.
func (m *moeSynth) checkExpert(b tensor.Memory, l, x int, ws map[string]*tensor.Tensor) error {
	if len(ws) != len(m.experts[l][x]) {
		return fmt.Errorf("layer %d expert %d: %d tensors, want %d", l, x, len(ws), len(m.experts[l][x]))
	}
	for _, name := range m.experts[l][x] {
		t := ws[name]
		if t == nil {
			return fmt.Errorf("layer %d expert %d: tensor %s missing", l, x, name)
		}
		got := make([]byte, t.NumBytes())
		if err := b.Download(got, t); err != nil {
			return err
		}
		if !bytes.Equal(got, m.pattern(l, name, t.NumBytes())) {
			return fmt.Errorf("layer %d expert %d: tensor %s holds other bytes", l, x, name)
		}
	}
	return nil
}

// moeBudget is the budget that fits the model's layers without their
// experts resident, with room for slots experts.
func moeBudget(t *testing.T, m *moeSynth, slots int, contextLen int) (ModelInfo, int64) {
	t.Helper()
	info := smallDims(m, len(m.layers)-2)
	p, err := Plan(info, 1<<40, StrategyBalanced, contextLen, 1, WithExpertCache(1))
	if err != nil {
		t.Fatal(err)
	}
	return info, p.PredictedPeakBytes - p.ExpertCacheBytes + int64(slots)*p.ExpertSlotBytes
}

// TestPlanExpertCache checks plans with an expert cache: the layers
// without their experts are placed first, resident as far as the budget
// goes, then the cache takes what is left in whole experts (at least the
// minimum asked for, at most every expert); the routing tensors are never
// streamed; the bytes add up and the peak stays within the budget.
func TestPlanExpertCache(t *testing.T) {
	m := newMoESynth(4, 8, 16, 24)
	info := smallDims(m, 4)
	const ctxLen, k = 16, 2
	full, err := Plan(info, 1<<40, StrategyNone, ctxLen, 1, WithExpertCache(k))
	if err != nil {
		t.Fatal(err)
	}
	if full.Experts != 32 || full.ExpertSlots != 32 || full.StreamedBytes != 0 {
		t.Fatalf("unbounded plan: %d of %d experts cached, %d bytes streamed", full.ExpertSlots, full.Experts, full.StreamedBytes)
	}
	if full.HostCacheBytes != 0 {
		t.Errorf("every expert cached: a host cache of %d bytes planned", full.HostCacheBytes)
	}
	slot := full.ExpertSlotBytes
	if want := alignUp(16*24*2) * 3; slot != want {
		t.Fatalf("expert slot %d bytes, want %d", slot, want)
	}
	_, err = Plan(info, 1, StrategyMinimal, ctxLen, 1, WithExpertCache(k))
	var be *BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("a 1-byte budget planned: %v", err)
	}
	minBudget := be.Needed
	layersOnly := full.PredictedPeakBytes - full.ExpertCacheBytes // every layer resident, no expert cached
	for _, st := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive, StrategyNone} {
		for _, budget := range []int64{minBudget, minBudget + slot/2, layersOnly - slot, layersOnly + k*slot, layersOnly + 5*slot + slot/3, full.PredictedPeakBytes} {
			if budget < minBudget {
				continue
			}
			p, err := Plan(info, budget, st, ctxLen, 1, WithExpertCache(k))
			if st == StrategyNone && budget < full.PredictedPeakBytes {
				if !errors.As(err, &be) || be.Needed != full.PredictedPeakBytes {
					t.Errorf("none at %d: %v, want a budget error needing %d", budget, err, full.PredictedPeakBytes)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s at %d: %v", st, budget, err)
			}
			if p.PredictedPeakBytes > budget {
				t.Errorf("%s at %d: peak %d", st, budget, p.PredictedPeakBytes)
			}
			if p.ResidentBytes+p.StreamedBytes+p.ExpertBytes != p.WeightBytes || p.WeightBytes != full.WeightBytes {
				t.Errorf("%s at %d: resident %d + streamed %d + experts %d != weights %d", st, budget, p.ResidentBytes, p.StreamedBytes, p.ExpertBytes, p.WeightBytes)
			}
			if p.ExpertSlots < k || p.ExpertSlots > p.Experts || p.ExpertCacheBytes != int64(p.ExpertSlots)*slot {
				t.Errorf("%s at %d: %d slots of %d experts, cache %d bytes", st, budget, p.ExpertSlots, p.Experts, p.ExpertCacheBytes)
			}
			if st != StrategyAggressive && p.ExpertSlots < p.Experts && p.HostCacheBytes < int64(p.Experts)*alignHost(16*24*2)*3 {
				t.Errorf("%s at %d: host cache %d bytes, less than the experts' host copies", st, budget, p.HostCacheBytes)
			}
			switch {
			case st == StrategyAggressive:
				if p.ExpertSlots != k || p.ResidentBytes != p.WeightBytes-p.StreamedBytes-p.ExpertBytes {
					t.Errorf("aggressive at %d: %d slots", budget, p.ExpertSlots)
				}
			case p.ExpertSlots < p.Experts && budget-p.PredictedPeakBytes >= slot:
				t.Errorf("%s at %d: %d slots with room for another (%d left)", st, budget, p.ExpertSlots, budget-p.PredictedPeakBytes)
			}
			if st != StrategyAggressive && p.StreamedBytes > 0 && p.ExpertSlots > k {
				t.Errorf("%s at %d: %d bytes of the layers streamed while the cache holds %d experts over the minimum %d", st, budget, p.StreamedBytes, p.ExpertSlots, k)
			}
			for l, lp := range p.Layers {
				for _, r := range m.routing[l] {
					if slices.Contains(lp.Streamed, r) {
						t.Errorf("%s at %d: routing tensor %s streamed", st, budget, r)
					}
				}
				for _, xs := range m.experts[l] {
					for _, x := range xs {
						if slices.Contains(lp.Streamed, x) {
							t.Errorf("%s at %d: expert tensor %s streamed", st, budget, x)
						}
					}
				}
				if lp.ResidentBytes+lp.StreamedBytes+lp.ExpertBytes != lp.Bytes || lp.Experts != len(m.experts[l]) {
					t.Errorf("%s at %d layer %d: %+v", st, budget, l, lp)
				}
			}
		}
	}
	// The smallest budget is the ring of the largest layer without its
	// experts, the routing and the smallest cache: below what the largest
	// layer with its experts takes.
	var withExperts int64
	for _, l := range info.Layers {
		withExperts = max(withExperts, l.Bytes)
	}
	if minBudget >= withExperts+reserveBytes(info, ctxLen, ctxLen, 1) {
		t.Errorf("smallest budget %d: not below a ring for a whole sparse layer (%d)", minBudget, withExperts)
	}
}

// TestPlanExpertCacheRefuses: the experts of a source must be its tensors,
// each in one expert, and an expert cache does not mix with layers
// streamed whole.
func TestPlanExpertCacheRefuses(t *testing.T) {
	m := newMoESynth(2, 4, 8, 8)
	info := smallDims(m, 2)
	if _, err := Plan(info, 1<<30, StrategyBalanced, 8, 1, WithExpertCache(2), WithStreamedWhole([]int{1})); err == nil {
		t.Error("an expert cache with layers streamed whole planned")
	}
	for _, tc := range []struct {
		name string
		edit func(m *moeSynth)
		want string
	}{
		{"unknown tensor", func(m *moeSynth) { m.experts[1][2] = []string{"b0.e2.gate", "nope"} }, "does not have"},
		{"tensor in two experts", func(m *moeSynth) { m.experts[1][2] = []string{"b0.e1.gate"} }, "listed by expert 1 and by expert 2"},
		{"routing inside an expert", func(m *moeSynth) { m.routing[1] = []string{"b0.e0.up"} }, "by expert 0 and by the routing"},
		{"empty expert", func(m *moeSynth) { m.experts[2][3] = nil }, "expert 3 has no tensors"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMoESynth(2, 4, 8, 8)
			tc.edit(m)
			_, err := DescribeSource(m)
			if err == nil || !bytes.Contains([]byte(err.Error()), []byte(tc.want)) {
				t.Errorf("DescribeSource: %v, want an error saying %q", err, tc.want)
			}
		})
	}
}
