package nn

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestAdamUpdate checks the AdamW update (the vector kernel where the
// machine has one, and the portable loop) against the same update in
// float64, for lengths that leave every tail, with gradients, moments and
// weights of many magnitudes.
func TestAdamUpdate(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	c := &adamConsts{b1: 0.9, c1: 0.1, b2: 0.999, c2: 0.001, decay: 1 - 1e-3*0.01, stepSize: 1e-3 / (1 - 0.9*0.9), invSqrtBC2: float32(1 / math.Sqrt(1-0.999*0.999)), eps: 1e-8}
	for _, n := range []int{0, 1, 7, 8, 9, 31, 64, 1000} {
		w, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
		for i := range n {
			e := float32(math.Pow(10, float64(r.IntN(9)-6)))
			w[i] = (r.Float32()*2 - 1) * e * 100
			g[i] = (r.Float32()*2 - 1) * e
			m[i] = (r.Float32()*2 - 1) * e
			v[i] = r.Float32() * e * e
		}
		// The float64 results, and the size of the terms each is a sum of:
		// float32 rounding is relative to those, not to a sum that cancels.
		var w64, m64, v64, wScale, mScale []float64
		for i := range n {
			bm, cg := float64(c.b1)*float64(m[i]), float64(c.c1)*float64(g[i])
			mi := bm + cg
			vi := float64(c.b2)*float64(v[i]) + float64(c.c2)*float64(g[i])*float64(g[i])
			wd, step := float64(w[i])*float64(c.decay), float64(c.stepSize)*mi/(math.Sqrt(vi)*float64(c.invSqrtBC2)+float64(c.eps))
			w64, m64, v64 = append(w64, wd-step), append(m64, mi), append(v64, vi)
			wScale = append(wScale, math.Abs(wd)+math.Abs(step)+float64(c.stepSize)*math.Abs(cg)/(math.Sqrt(vi)*float64(c.invSqrtBC2)+float64(c.eps)))
			mScale = append(mScale, math.Abs(bm)+math.Abs(cg))
		}
		for _, impl := range []struct {
			name string
			f    func(w, g, m, v []float32, c *adamConsts)
		}{{"adamUpdate", adamUpdate}, {"adamUpdateGo", adamUpdateGo}} {
			ww, mm, vv := append([]float32(nil), w...), append([]float32(nil), m...), append([]float32(nil), v...)
			impl.f(ww, g, mm, vv, c)
			for i := range n {
				for _, x := range []struct {
					what        string
					got         float32
					want, scale float64
				}{{"w", ww[i], w64[i], wScale[i]}, {"m", mm[i], m64[i], mScale[i]}, {"v", vv[i], v64[i], v64[i]}} {
					if d := math.Abs(float64(x.got) - x.want); d > 4e-7*x.scale+1e-30 {
						t.Fatalf("%s n=%d: %s[%d] = %.9g, float64 %.9g", impl.name, n, x.what, i, x.got, x.want)
					}
				}
			}
		}
	}
	if !hasAVX2FMA {
		t.Log("no AVX2/FMA here: only the portable update ran")
	}
}
