package paging

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"testing"
)

// TestPinLayer pins every layer of a tied model (the head borrows the
// embedding's table) under budgets that keep all of it and part of it
// resident, and none of it (aggressive, a ring of three layers in which
// streamed parts land in other places from pass to pass), and checks that each pin appends the addresses of
// exactly the tensors an Acquire of the layer hands out at that moment
// (so the bytes change when a part moves, and only then), and that each
// pin holds the layer as an Acquire does: released as often as pinned,
// every layer ends unpinned with no bad release.
func TestPinLayer(t *testing.T) {
	const blocks, vocab, hidden = 5, 256, 64
	src := tiedSynth(blocks, hidden, 96, 32, vocab)
	info := smallDims(src, blocks)
	n := src.NumLayers()
	W, _ := totalAndMax(info)
	for _, tc := range []struct {
		strategy Strategy
		frac     float64 // of the weights, beside the reserve
	}{{StrategyBalanced, 2}, {StrategyBalanced, 0.5}, {StrategyAggressive, 0.4}} {
		frac := tc.frac
		t.Run(fmt.Sprintf("%s/%.0f%%", tc.strategy, 100*frac), func(t *testing.T) {
			p0, err := Plan(info, 1<<40, StrategyAggressive, 32, 1)
			if err != nil {
				t.Fatal(err)
			}
			budget := max(p0.KVCacheBytes+p0.ActivationBytes+p0.WorkspaceBytes+int64(frac*float64(W)), p0.MinBudgetBytes+int64(vocab*hidden*2))
			plan, err := Plan(info, budget, tc.strategy, 32, 1)
			if err != nil {
				t.Fatal(err)
			}
			bg := newBudget(t, newFake(), budget, "fake")
			defer nnReserve(t, bg, plan)()
			pg, err := NewPager(src, bg, plan, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer pg.Close()
			ctx := context.Background()
			moved := 0
			last := map[int][]byte{}
			// Passes in other orders put streamed parts in other slots.
			orders := [][]int{forward(n), forward(n), reverse(n), slices.Delete(forward(n), 1, 2), forward(n)}
			for pass, order := range orders {
				for _, l := range order {
					fp, err := pg.PinLayer(ctx, l, []byte("x"))
					if err != nil {
						t.Fatalf("pass %d, layer %d: %v", pass, l, err)
					}
					ws, err := pg.Acquire(ctx, l)
					if err != nil {
						t.Fatal(err)
					}
					if fp[0] != 'x' || (len(fp)-1)%8 != 0 {
						t.Fatalf("layer %d: PinLayer gave %d bytes after the 1 it was given, want 8 a tensor after it", l, len(fp)-1)
					}
					var got, want []uint64
					for i := 1; i < len(fp); i += 8 {
						got = append(got, binary.LittleEndian.Uint64(fp[i:]))
					}
					for _, w := range ws {
						want = append(want, uint64(w.Addr()))
					}
					slices.Sort(got)
					slices.Sort(want)
					if !slices.Equal(got, want) {
						t.Fatalf("pass %d, layer %d: pinned addresses %x, the acquired tensors' %x", pass, l, got, want)
					}
					if prev, ok := last[l]; ok && string(prev) != string(fp) {
						moved++
					}
					last[l] = fp
					if e := pg.layers[l]; e.pins < 2 {
						t.Fatalf("layer %d: %d pins after a pin and an acquire", l, e.pins)
					}
					pg.Release(l)
					pg.Release(l)
				}
				waitIdle(pg)
			}
			for l, e := range pg.layers {
				if e.pins != 0 || e.lentPins != 0 {
					t.Errorf("layer %d: %d pins, %d lent, after every pin was released", l, e.pins, e.lentPins)
				}
			}
			if st := pg.Stats(); st.BadReleases != 0 {
				t.Errorf("%d bad releases", st.BadReleases)
			}
			t.Logf("streamed %d bytes a pass; %d pins found their layer moved", plan.StreamedBytes, moved)
			if plan.StreamedBytes == 0 && moved != 0 || tc.strategy == StrategyAggressive && moved == 0 {
				t.Errorf("%s: %d bytes stream a pass, and %d pins found a layer moved", plan, plan.StreamedBytes, moved)
			}
		})
	}
}
