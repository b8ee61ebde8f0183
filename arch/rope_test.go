package arch

import (
	"math"
	"testing"
)

func TestContextLength(t *testing.T) {
	for _, c := range []struct{ maxPos, window, want int }{
		{0, 0, 0}, {256, 0, 256}, {256, 8, 8}, {0, 8, 8}, {4, 8, 4}, {8, 8, 8},
	} {
		cfg := Config{MaxPositions: c.maxPos, SlidingWindow: c.window}
		if got := cfg.ContextLength(); got != c.want {
			t.Errorf("max positions %d, window %d: ContextLength %d, want %d", c.maxPos, c.window, got, c.want)
		}
	}
}

// TestInvFreq checks the rotary frequencies against float64 formulas: the
// plain ones, and llama3's, which keeps short wavelengths, slows long ones
// by Factor and blends in between; and the tables against cos and sin of
// position times frequency.
func TestInvFreq(t *testing.T) {
	llama3 := &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 64}
	for _, tc := range []struct {
		name    string
		theta   float64
		scaling *RopeScaling
	}{
		{"default", 10000, nil},
		{"theta 500k", 500000, nil},
		{"llama3", 500000, llama3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Config{HeadDim: 64, RopeTheta: tc.theta, RopeScaling: tc.scaling}
			inv := c.InvFreq()
			if len(inv) != 32 {
				t.Fatalf("%d frequencies for head_dim 64", len(inv))
			}
			kept, slowed, blended := 0, 0, 0
			for i, got := range inv {
				want := math.Pow(tc.theta, -float64(2*i)/64)
				if s := tc.scaling; s != nil {
					ratio := float64(s.OriginalMaxPositions) * want / (2 * math.Pi)
					switch {
					case ratio > s.HighFreqFactor:
						kept++
					case ratio < s.LowFreqFactor:
						want /= s.Factor
						slowed++
					default:
						smooth := (ratio - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
						want = (1-smooth)*want/s.Factor + smooth*want
						blended++
					}
				}
				if math.Abs(float64(got)-want) > 1e-6*want {
					t.Errorf("inv_freq[%d] = %g, want %g", i, got, want)
				}
			}
			if tc.scaling != nil && (kept == 0 || slowed == 0 || blended == 0) {
				t.Errorf("llama3 case covers %d kept, %d slowed, %d blended frequencies; want each", kept, slowed, blended)
			}
			cos, sin := c.RopeTables(5)
			if len(cos) != 5*32 || len(sin) != 5*32 {
				t.Fatalf("tables of %d and %d for 5 positions", len(cos), len(sin))
			}
			for p := range 5 {
				for i, f := range inv {
					a := float64(float32(p) * f)
					if cos[p*32+i] != float32(math.Cos(a)) || sin[p*32+i] != float32(math.Sin(a)) {
						t.Errorf("position %d, frequency %d: cos %g sin %g, want %g %g", p, i, cos[p*32+i], sin[p*32+i], math.Cos(a), math.Sin(a))
					}
				}
			}
		})
	}
}
