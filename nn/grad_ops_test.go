package nn

import (
	"math/rand/v2"
	"testing"
)

// The backend's backward operations are checked by tensortest.TestGradOps;
// the embedding's, which runs on the host, against central finite
// differences here: for a random upstream gradient dy, the derivative of
// Σ dy·f(x) with respect to each input element.

func randVec(rng *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32((rng.Float64()*2 - 1) * scale)
	}
	return v
}

func to64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

func dot64(a []float64, b []float32) float64 {
	s := 0.0
	for i := range a {
		s += a[i] * float64(b[i])
	}
	return s
}

// numGrad returns d/dx_i of f at x for every i by central differences.
func numGrad(x []float64, f func([]float64) float64) []float64 {
	const h = 1e-5
	g := make([]float64, len(x))
	for i := range x {
		old := x[i]
		x[i] = old + h
		up := f(x)
		x[i] = old - h
		down := f(x)
		x[i] = old
		g[i] = (up - down) / (2 * h)
	}
	return g
}

// checkGrad asserts that got (F32, analytic) matches want (float64, finite
// differences) to a relative error of tol.
func checkGrad(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	if e := relErr(got, want); e > tol {
		t.Errorf("%s: relative error %.3g against finite differences, want <= %g", what, e, tol)
	}
}

func TestEmbeddingBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	const V, H = 5, 3
	ids := []int32{2, 0, 2, 4}
	dx := randVec(rng, len(ids)*H, 1)
	ref := func(table []float64) float64 { // Σ dx · table[ids]
		s := 0.0
		for t, id := range ids {
			for i := range H {
				s += float64(dx[t*H+i]) * table[int(id)*H+i]
			}
		}
		return s
	}
	want := numGrad(make([]float64, V*H), ref)
	got := make([]float32, V*H)
	embedBack(got, dx, ids, H)
	checkGrad(t, "d table", got, want, 1e-7)
}
