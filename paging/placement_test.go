package paging

import (
	"math/rand/v2"
	"testing"
)

func TestPlaceLayers(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := 0; trial < 200; trial++ {
		blocks := 1 + rng.IntN(40)
		info := ModelInfo{NumLayers: blocks}
		var total int64
		for l := 0; l < blocks+2; l++ {
			b := int64(100 + rng.IntN(1000))
			info.Layers = append(info.Layers, LayerInfo{Bytes: b})
			total += b
		}
		n := 1 + rng.IntN(min(blocks, 5))
		budgets := make([]int64, n)
		var sum int64
		for d := range budgets {
			budgets[d] = int64(1 + rng.IntN(10))
			sum += budgets[d]
		}
		ps, err := PlaceLayers(info, budgets)
		if err != nil {
			t.Fatal(err)
		}
		// Contiguous cover of every layer, one block at least per device.
		next, seen := 0, 0
		for d, p := range ps {
			if p.FirstBlock != next || p.EndBlock <= p.FirstBlock {
				t.Fatalf("trial %d: device %d blocks [%d,%d), want a non-empty range from %d", trial, d, p.FirstBlock, p.EndBlock, next)
			}
			next = p.EndBlock
			var bytes int64
			for _, l := range p.Layers {
				if l != seen {
					t.Fatalf("trial %d: device %d layers %v, expected layer %d next", trial, d, p.Layers, seen)
				}
				seen++
				bytes += info.Layers[l].Bytes
			}
			if bytes != p.Bytes {
				t.Fatalf("bytes %d, sum %d", p.Bytes, bytes)
			}
			st := info.Stage(p)
			if st.NumLayers != p.EndBlock-p.FirstBlock || len(st.Layers) != len(p.Layers) {
				t.Fatalf("stage info %d blocks, %d layers", st.NumLayers, len(st.Layers))
			}
		}
		if next != blocks || seen != blocks+2 {
			t.Fatalf("trial %d: placed %d blocks and %d layers of %d", trial, next, seen, blocks)
		}
		// Shares follow the budgets to within a layer or two when blocks
		// are plentiful.
		if blocks >= 8*n {
			for d, p := range ps {
				want := float64(total) * float64(budgets[d]) / float64(sum)
				if diff := float64(p.Bytes) - want; diff > 2200 || diff < -2200 {
					t.Errorf("trial %d: device %d holds %d bytes, its share is %.0f (budgets %v)", trial, d, p.Bytes, want, budgets)
				}
			}
		}
	}
	if _, err := PlaceLayers(ModelInfo{NumLayers: 1, Layers: make([]LayerInfo, 3)}, []int64{1, 1}); err == nil {
		t.Error("two devices for one block")
	}
}
