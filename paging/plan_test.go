package paging

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"testing"
)

func TestKVAndActivationBytes(t *testing.T) {
	// Llama-2-7B: 32 blocks, 32 KV heads of 128, F32 cache of 4096
	// positions: 2*32*4096*4096*4 bytes = 4 GiB.
	if got := KVCacheBytes(32, 4096, 32, 128, 1); got != 4<<30 {
		t.Errorf("KV cache = %d, want 4 GiB", got)
	}
	if got := KVCacheBytes(32, 4096, 8, 128, 2); got != 2<<30 {
		t.Errorf("GQA KV cache, batch 2 = %d, want 2 GiB", got)
	}
	// 512 rows of x, norm, projection, q, attn (4096 each), k, v (4096),
	// gate, up (11008), logits (32000): 82688 floats a row.
	if got := ActivationBytes(4096, 11008, 32, 32, 128, 32000, 512); got != 82688*4*512 {
		t.Errorf("activations = %d, want %d", got, 82688*4*512)
	}
	// cos and sin, 4096 positions x 64 floats each
	if got := RopeBytes(4096, 128); got != 2*4096*64*4 {
		t.Errorf("rope tables = %d", got)
	}
}

func planModel() ModelInfo {
	return smallDims(llamaSynth(8, 64, 172, 32, 256), 8)
}

func TestPlanStrategies(t *testing.T) {
	info := planModel()
	W, lmax := totalAndMax(info)
	fixed := KVCacheBytes(info.NumLayers, 64, info.NumKVHeads, info.HeadDim, 1) +
		ActivationBytes(info.HiddenSize, info.IntermediateSize, info.NumHeads, info.NumKVHeads, info.HeadDim, info.VocabSize, 64) +
		RopeBytes(64, info.HeadDim)
	for _, frac := range []float64{0.15, 0.4, 0.7, 0.95, 1.2} {
		budget := fixed + int64(frac*float64(W))
		budget = max(budget, fixed+lmax)
		X := max(0, W-(budget-fixed))
		for _, s := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive, StrategyNone} {
			p, err := Plan(info, budget, s, 64, 1)
			if s == StrategyNone {
				if frac < 1 {
					if !errors.Is(err, ErrBudgetTooSmall) {
						t.Errorf("none at %.0f%%: err %v, want ErrBudgetTooSmall", 100*frac, err)
					}
					continue
				}
			}
			if err != nil {
				t.Fatalf("%s at %.0f%%: %v", s, 100*frac, err)
			}
			if p.KVCacheBytes+p.ActivationBytes+p.WorkspaceBytes != fixed {
				t.Errorf("%s: reserve %d, want %d", s, p.KVCacheBytes+p.ActivationBytes+p.WorkspaceBytes, fixed)
			}
			if p.PredictedPeakBytes > budget || p.ResidentBytes+p.RingBytes+fixed != p.PredictedPeakBytes {
				t.Errorf("%s at %.0f%%: peak %d, resident %d + ring %d + %d, budget %d", s, 100*frac, p.PredictedPeakBytes, p.ResidentBytes, p.RingBytes, fixed, budget)
			}
			if p.ResidentBytes+p.StreamedBytes != W {
				t.Errorf("%s: resident %d + streamed %d != weights %d", s, p.ResidentBytes, p.StreamedBytes, W)
			}
			// the ring must hold RingSlots consecutive streamed parts
			for i := range p.Layers {
				var win int64
				for j := 0; j < p.RingSlots; j++ {
					win += p.Layers[(i+j)%len(p.Layers)].StreamedBytes
				}
				if win > p.RingBytes {
					t.Errorf("%s: layers %d..+%d stream %d, ring %d", s, i, p.RingSlots, win, p.RingBytes)
				}
			}
			switch s {
			case StrategyNone:
				if p.StreamedBytes != 0 || p.RingBytes != 0 {
					t.Errorf("none streams %d", p.StreamedBytes)
				}
			case StrategyAggressive:
				if p.ResidentBytes != 0 || p.HostCacheBytes != 0 {
					t.Errorf("aggressive keeps %d resident, %d host", p.ResidentBytes, p.HostCacheBytes)
				}
			case StrategyMinimal, StrategyBalanced:
				if X == 0 && p.StreamedBytes != 0 {
					t.Errorf("%s streams %d though everything fits", s, p.StreamedBytes)
				}
				if bound := X + X/20 + lmax; X > 0 && p.StreamedBytes > bound {
					t.Errorf("%s at %.0f%%: streams %d per pass, bound %d (X %d)", s, 100*frac, p.StreamedBytes, bound, X)
				}
				if s == StrategyMinimal && p.PrefetchDepth != 0 {
					t.Errorf("minimal prefetches %d", p.PrefetchDepth)
				}
			}
		}
	}
	// with room for it, balanced prefetches
	p, err := Plan(info, fixed+W*6/10, StrategyBalanced, 64, 1)
	if err != nil || p.PrefetchDepth < 1 {
		t.Errorf("balanced at 60%%: depth %v, %v", p, err)
	}
}

func TestPlanTooSmall(t *testing.T) {
	info := planModel()
	W, lmax := totalAndMax(info)
	ctx := 128
	fixed := KVCacheBytes(info.NumLayers, ctx, info.NumKVHeads, info.HeadDim, 2) +
		ActivationBytes(info.HiddenSize, info.IntermediateSize, info.NumHeads, info.NumKVHeads, info.HeadDim, info.VocabSize, 2*128) +
		2*RopeBytes(ctx, info.HeadDim)
	min := fixed + lmax
	for _, s := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive} {
		_, err := Plan(info, min-1, s, ctx, 2)
		var be *BudgetError
		if !errors.Is(err, ErrBudgetTooSmall) || !errors.As(err, &be) || be.Needed != min {
			t.Fatalf("%s at min-1: %v, want BudgetError needing %d", s, err, min)
		}
		p, err := Plan(info, be.Needed, s, ctx, 2)
		if err != nil {
			t.Fatalf("%s at the named minimum: %v", s, err)
		}
		if p.PredictedPeakBytes > min || p.MinBudgetBytes != min {
			t.Errorf("%s at minimum: peak %d, min %d", s, p.PredictedPeakBytes, p.MinBudgetBytes)
		}
	}
	_, err := Plan(info, fixed+W-1, StrategyNone, ctx, 2)
	var be *BudgetError
	if !errors.As(err, &be) || be.Needed != fixed+W {
		t.Fatalf("none one byte short: %v", err)
	}
	if _, err := Plan(info, be.Needed, StrategyNone, ctx, 2); err != nil {
		t.Errorf("none at the named size: %v", err)
	}
}

func TestPlanBadInput(t *testing.T) {
	info := planModel()
	if _, err := Plan(info, 1<<30, "lazy", 64, 1); err == nil {
		t.Error("unknown strategy accepted")
	}
	if _, err := Plan(ModelInfo{}, 1<<30, StrategyMinimal, 64, 1); err == nil {
		t.Error("empty model accepted")
	}
	if _, err := Plan(info, 1<<30, StrategyMinimal, 0, 1); err == nil {
		t.Error("zero context accepted")
	}
	bad := info
	bad.Layers = append([]LayerInfo(nil), info.Layers...)
	bad.Layers[1].Bytes++
	if _, err := Plan(bad, 1<<30, StrategyMinimal, 64, 1); err == nil {
		t.Error("layer bytes that disagree with its tensors accepted")
	}
}

func TestPlanJSON(t *testing.T) {
	info := planModel()
	W, _ := totalAndMax(info)
	p, err := Plan(info, W/2+(1<<20), StrategyBalanced, 64, 1, WithChunkTokens(16))
	if err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var back PlanResult
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	if back.PredictedPeakBytes != p.PredictedPeakBytes || back.Strategy != p.Strategy || len(back.Layers) != len(p.Layers) || back.ChunkTokens != 16 {
		t.Errorf("plan JSON round trip: %s", data)
	}
}

func TestPlanRandomModels(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for it := range 200 {
		src := randomSynth(rng, 2+rng.IntN(12), 6, 64)
		info := smallDims(src, src.NumLayers())
		W, lmax := totalAndMax(info)
		p0, err := Plan(info, 1<<40, StrategyMinimal, 8, 1)
		if err != nil {
			t.Fatal(err)
		}
		fixed := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes
		budget := fixed + lmax + rng.Int64N(W+1)
		X := max(0, W-(budget-fixed))
		for _, s := range []Strategy{StrategyMinimal, StrategyBalanced, StrategyAggressive} {
			p, err := Plan(info, budget, s, 8, 1)
			if err != nil {
				t.Fatalf("iteration %d %s: %v", it, s, err)
			}
			if p.PredictedPeakBytes > budget {
				t.Fatalf("iteration %d %s: peak %d > budget %d", it, s, p.PredictedPeakBytes, budget)
			}
			if s != StrategyAggressive && p.StreamedBytes > X+X/20+lmax {
				t.Errorf("iteration %d %s: streams %d, bound %d (X %d, lmax %d)", it, s, p.StreamedBytes, X+X/20+lmax, X, lmax)
			}
		}
	}
}
