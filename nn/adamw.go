package nn

import "math"

// adamConsts are the per-step constants of the AdamW update, in the order
// the assembly reads them.
type adamConsts struct {
	b1, c1     float32 // Beta1, 1-Beta1
	b2, c2     float32 // Beta2, 1-Beta2
	decay      float32 // 1 - LR·WeightDecay
	stepSize   float32 // LR / (1-Beta1ᵗ)
	invSqrtBC2 float32 // 1 / sqrt(1-Beta2ᵗ)
	eps        float32
}

// adamUpdate applies one AdamW update to w, m and v from the gradient g, in
// float32 arithmetic as torch.optim.AdamW does for float32 parameters:
//
//	m ← b1·m + (1−b1)·g
//	v ← b2·v + (1−b2)·g²
//	w ← w·decay − stepSize·m / (sqrt(v)/sqrt(bc2) + eps)
//
// with the vector kernel where the machine has one.
func adamUpdate(w, g, m, v []float32, c *adamConsts) {
	n := len(w)
	g, m, v = g[:n], m[:n], v[:n]
	done := adamUpdateArch(w, g, m, v, c)
	adamUpdateGo(w[done:], g[done:], m[done:], v[done:], c)
}

// adamUpdateGo is the portable adamUpdate.
func adamUpdateGo(w, g, m, v []float32, c *adamConsts) {
	for i, gi := range g {
		mi := c.b1*m[i] + c.c1*gi
		vi := c.b2*v[i] + c.c2*gi*gi
		m[i], v[i] = mi, vi
		denom := float32(math.Sqrt(float64(vi)))*c.invSqrtBC2 + c.eps
		w[i] = w[i]*c.decay - c.stepSize*(mi/denom)
	}
}
