package paging

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// unevenSynth makes n layers of 1..6 F16 tensors of 1 to 64 KiB each, a
// few of them larger, so that streamed parts and tensors differ in size
// from layer to layer and rarely come out aligned.
func unevenSynth(rng *rand.Rand, n int) *synthSource {
	var ls [][]TensorSpec
	for l := range n {
		var ts []TensorSpec
		for k := range 1 + rng.IntN(6) {
			rows := 1 + rng.IntN(64)
			if rng.IntN(8) == 0 {
				rows *= 4
			}
			ts = append(ts, spec(fmt.Sprintf("layers.%d.t%d", l, k), tensor.F16, tensor.Shape{rows, 257}))
		}
		ls = append(ls, ts)
	}
	return newSynth(ls)
}

// TestRingSteadyDecode decodes, forward and in reverse, with every
// streaming strategy and budgets from a fifth of the weights to nearly all
// of them, on models with even and uneven parts. Once warm, the pager
// allocates and frees nothing (streamed tensors are views into the ring),
// never drops a prefetch or loads a part outside the ring for lack of room
// in it, loads each streamed part once per token, and the budget peaks at
// exactly the plan's prediction.
func TestRingSteadyDecode(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	models := []struct {
		name string
		src  *synthSource
	}{
		{"llama", llamaSynth(10, 64, 172, 32, 256)},
		{"gqa", llamaSynth(12, 96, 256, 32, 300)},
		{"uneven", unevenSynth(rng, 14)},
		{"uneven2", unevenSynth(rng, 9)},
	}
	const tokens = 6
	var prefetched int
	for _, m := range models {
		n := m.src.NumLayers()
		info := smallDims(m.src, n)
		W, _ := totalAndMax(info)
		for _, s := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive} {
			for _, pct := range []int64{20, 45, 70, 90} {
				for _, rev := range []bool{false, true} {
					name := fmt.Sprintf("%s/%s/%d%%/reverse=%v", m.name, s, pct, rev)
					p0, _ := Plan(info, 1<<40, s, 16, 1)
					fixed := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes
					budget := max(fixed+W*pct/100, p0.MinBudgetBytes)
					plan, err := Plan(info, budget, s, 16, 1)
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					if plan.StreamedBytes == 0 {
						continue
					}
					if plan.PrefetchDepth > 0 {
						prefetched++
					}
					fb := newFake()
					bg := newBudget(t, fb, budget, "fake:0")
					free := nnReserve(t, bg, plan)
					pg, err := NewPager(m.src, bg, plan, Options{})
					if err != nil {
						t.Fatal(err)
					}
					order := forward(n)
					if rev {
						order = reverse(n)
						pg.SetOrder(Reverse)
					}
					for range 2 { // warm-up: residents load, the ring fills
						sweep(t, pg, m.src, order)
						waitIdle(pg)
						pg.MarkStep()
					}
					allocs, frees := fb.allocs.Load(), fb.frees.Load()
					before := pg.Stats()
					for range tokens {
						sweep(t, pg, m.src, order)
						waitIdle(pg)
						pg.MarkStep()
					}
					st := pg.Stats()
					if a, f := fb.allocs.Load()-allocs, fb.frees.Load()-frees; a != 0 || f != 0 {
						t.Errorf("%s: %d allocations and %d frees in %d tokens of steady decode", name, a, f, tokens)
					}
					if st.PrefetchNoRoom != 0 || st.OutsideRing != 0 {
						t.Errorf("%s: %d prefetches found no room in the ring, %d parts loaded outside it\n%s", name, st.PrefetchNoRoom, st.OutsideRing, pg.dump())
					}
					// Each streamed part loads once a token; the window
					// prefetched before the first mark and after the last
					// may differ by what the ring holds.
					moved := st.BytesHostToDevice - before.BytesHostToDevice
					if want := tokens * plan.StreamedBytes; moved > want+plan.RingBytes || moved < want-plan.RingBytes {
						t.Errorf("%s: moved %d bytes in %d tokens, plan streams %d a token (ring %d)", name, moved, tokens, plan.StreamedBytes, plan.RingBytes)
					}
					if peak := bg.Peak(); peak != plan.PredictedPeakBytes {
						t.Errorf("%s: peak %d, predicted %d", name, peak, plan.PredictedPeakBytes)
					}
					free()
					if err := pg.Close(); err != nil {
						t.Error(err)
					}
					if err := bg.Close(); err != nil {
						t.Error(err)
					}
					if nt, live, pinned := fb.outstanding(); nt != 0 || live != 0 || pinned != 0 {
						t.Errorf("%s: after Close %d tensors, %d bytes, %d pinned", name, nt, live, pinned)
					}
				}
			}
		}
	}
	if prefetched < 10 {
		t.Errorf("only %d configurations prefetch: the test does not exercise the window", prefetched)
	}
}

// TestRingLayout checks Pager.layout against wrapGaps: wherever a part
// starts, its tensors lie inside the ring, aligned, without overlapping
// one another, and the bytes it leaves unused before the end are at most
// what wrapGaps promises the planner.
func TestRingLayout(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	for it := range 300 {
		src := unevenSynth(rng, 1)
		specs := src.layers[0]
		e := &entry{specs: specs}
		var sizes []int64
		for i, s := range specs {
			e.str = append(e.str, i)
			e.strSlab += alignUp(s.Bytes)
			sizes = append(sizes, alignUp(s.Bytes))
		}
		e.orderForRing()
		anyGap, firstGap := wrapGaps(sizes)
		ringCap := alignUp(e.strSlab + rng.Int64N(2*e.strSlab))
		p := &Pager{ringCap: ringCap}
		for start := int64(0); start < ringCap; start += ringAlign * (1 + rng.Int64N(8)) {
			s, ok := p.layout(e, start)
			if !ok {
				if start+e.strSlab <= ringCap {
					t.Fatalf("iteration %d: a part of %d bytes does not fit at %d of %d", it, e.strSlab, start, ringCap)
				}
				continue
			}
			var used int64
			type span struct{ lo, hi int64 }
			var spans []span
			for k, i := range e.str {
				off, n := s.offs[k], specs[i].Bytes
				if off%ringAlign != 0 || off < 0 || off+n > ringCap {
					t.Fatalf("iteration %d: tensor of %d bytes at %d in a ring of %d", it, n, off, ringCap)
				}
				for _, o := range spans {
					if off < o.hi && o.lo < off+n {
						t.Fatalf("iteration %d: tensors overlap at %d", it, off)
					}
				}
				spans = append(spans, span{off, off + n})
				used += alignUp(n)
			}
			if used != e.strSlab {
				t.Fatalf("iteration %d: laid out %d of %d bytes", it, used, e.strSlab)
			}
			// The bytes left unused: inside the slot when some tensors
			// go before the end, before it when the part starts at 0.
			gap := s.end - s.start - e.strSlab
			if s.start != start {
				gap = ringCap - start
			}
			if s.end-s.start > ringCap || s.end-s.start < e.strSlab || gap > anyGap || s.start == start && gap > firstGap {
				t.Fatalf("iteration %d: start %d: slot [%d,%d) of a %d-byte part leaves %d unused, wrapGaps says %d (%d first), ring %d",
					it, start, s.start, s.end, e.strSlab, gap, anyGap, firstGap, ringCap)
			}
		}
	}
}
