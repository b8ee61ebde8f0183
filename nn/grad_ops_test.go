package nn

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// Every backward is checked against central finite differences of an
// independent float64 forward: for a random upstream gradient dy, the
// derivative of Σ dy·f(x) with respect to each input element.

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

func TestLinearBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	const M, N, K = 5, 7, 300 // K spans two column blocks
	x, w, dy := randVec(rng, M*K, 1), randVec(rng, N*K, 0.1), randVec(rng, M*N, 1)
	ref := func(x, w []float64) float64 { // Σ dy · (x wᵀ + b)
		s := 0.0
		for m := range M {
			for n := range N {
				a := 0.0
				for k := range K {
					a += x[m*K+k] * w[n*K+k]
				}
				s += float64(dy[m*N+n]) * a
			}
		}
		return s
	}
	x64, w64 := to64(x), to64(w)
	wantDX := numGrad(x64, func(v []float64) float64 { return ref(v, w64) })
	wantDW := numGrad(w64, func(v []float64) float64 { return ref(x64, v) })
	p := newPar(3)
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16} {
		// The weight in its dtype; the reference reads the rounded values.
		wt := tensor.New(dt, tensor.Shape{N, K})
		switch dt {
		case tensor.F32:
			copy(wt.F32(), w)
		case tensor.F16:
			tensor.F32ToF16(wt.U16(), w)
		case tensor.BF16:
			tensor.F32ToBF16(wt.U16(), w)
		}
		wr := to64(wt.ToF32())
		want := numGrad(append([]float64(nil), x64...), func(v []float64) float64 { return ref(v, wr) })
		dx := make([]float32, M*K)
		linearBackX(p, dx, dy, wt, M)
		checkGrad(t, "dx ("+dt.String()+" weight)", dx, want, 1e-5)
	}
	wt, _ := tensor.FromF32(tensor.Shape{N, K}, w)
	dx := make([]float32, M*K)
	linearBackX(p, dx, dy, wt, M)
	checkGrad(t, "dx", dx, wantDX, 1e-5)
	dw := make([]float32, N*K)
	linearBackW(p, dw, dy, x, M, N, K)
	checkGrad(t, "dw", dw, wantDW, 1e-5)
	// Accumulation: a second call doubles the gradient.
	linearBackW(p, dw, dy, x, M, N, K)
	for i := range wantDW {
		wantDW[i] *= 2
	}
	checkGrad(t, "dw accumulated", dw, wantDW, 1e-5)
	// The bias: d Σ dy·(xwᵀ+b) / db = column sums of dy.
	db := make([]float32, N)
	biasBack(db, dy, M)
	wantDB := make([]float64, N)
	for m := range M {
		for n := range N {
			wantDB[n] += float64(dy[m*N+n])
		}
	}
	checkGrad(t, "db", db, wantDB, 1e-6)
}

func TestRMSNormBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	const M, H, eps = 6, 40, 1e-5
	x, w, dy := randVec(rng, M*H, 2), randVec(rng, H, 1), randVec(rng, M*H, 1)
	ref := func(x, w []float64) float64 {
		s := 0.0
		for m := range M {
			ss := 0.0
			for i := range H {
				ss += x[m*H+i] * x[m*H+i]
			}
			r := 1 / math.Sqrt(ss/H+eps)
			for i := range H {
				s += float64(dy[m*H+i]) * x[m*H+i] * r * w[i]
			}
		}
		return s
	}
	x64, w64 := to64(x), to64(w)
	wantDX := numGrad(x64, func(v []float64) float64 { return ref(v, w64) })
	wantDW := numGrad(w64, func(v []float64) float64 { return ref(x64, v) })
	for _, threads := range []int{1, 4} {
		dx, dw := make([]float32, M*H), make([]float32, H)
		rmsNormBack(newPar(threads), dx, dy, x, w, dw, H, eps)
		checkGrad(t, "dx", dx, wantDX, 1e-5)
		checkGrad(t, "dw", dw, wantDW, 1e-5)
	}
}

func TestRopeBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	cfg := Config{HeadDim: 8, RopeTheta: 10000}
	const T, heads, pos0 = 5, 3, 2
	w := heads * cfg.HeadDim
	cos, sin := cfg.RopeTables(pos0 + T)
	x, dy := randVec(rng, T*w, 1), randVec(rng, T*w, 1)
	half := cfg.HeadDim / 2
	ref := func(x []float64) float64 {
		s := 0.0
		for t := range T {
			for h := range heads {
				for i := range half {
					c, sn := float64(cos[(pos0+t)*half+i]), float64(sin[(pos0+t)*half+i])
					o := t*w + h*cfg.HeadDim
					x0, x1 := x[o+i], x[o+i+half]
					s += float64(dy[o+i])*(x0*c-x1*sn) + float64(dy[o+i+half])*(x1*c+x0*sn)
				}
			}
		}
		return s
	}
	want := numGrad(to64(x), ref)
	got := append([]float32(nil), dy...)
	ropeBack(got, cos, sin, heads, cfg.HeadDim, pos0)
	checkGrad(t, "rope", got, want, 1e-6)
}

func TestSiLUMulBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	const n = 50
	gate, up, dy := randVec(rng, n, 6), randVec(rng, n, 2), randVec(rng, n, 1)
	ref := func(g, u []float64) float64 {
		s := 0.0
		for i := range g {
			s += float64(dy[i]) * g[i] / (1 + math.Exp(-g[i])) * u[i]
		}
		return s
	}
	g64, u64 := to64(gate), to64(up)
	wantDG := numGrad(g64, func(v []float64) float64 { return ref(v, u64) })
	wantDU := numGrad(u64, func(v []float64) float64 { return ref(g64, v) })
	dg, du := append([]float32(nil), dy...), make([]float32, n)
	siluMulBack(dg, du, gate, up)
	checkGrad(t, "d gate", dg, wantDG, 1e-5)
	checkGrad(t, "d up", du, wantDU, 1e-5)
}

func TestAttentionBackward(t *testing.T) {
	for _, tc := range []struct{ heads, kvHeads int }{{4, 2}, {3, 3}, {4, 1}} {
		rng := rand.New(rand.NewPCG(5, uint64(tc.heads*10+tc.kvHeads)))
		const T, d = 6, 4
		qw, kw := tc.heads*d, tc.kvHeads*d
		scale := float32(1 / math.Sqrt(d))
		q, k, v := randVec(rng, T*qw, 1.5), randVec(rng, T*kw, 1.5), randVec(rng, T*kw, 1)
		dout := randVec(rng, T*qw, 1)
		group := tc.heads / tc.kvHeads
		ref := func(q, k, v []float64) float64 {
			s := 0.0
			for t := range T {
				for h := range tc.heads {
					g := h / group
					sc := make([]float64, t+1)
					mx := math.Inf(-1)
					for j := 0; j <= t; j++ {
						a := 0.0
						for i := range d {
							a += q[t*qw+h*d+i] * k[j*kw+g*d+i]
						}
						sc[j] = a * float64(scale)
						mx = math.Max(mx, sc[j])
					}
					sum := 0.0
					for j := range sc {
						sc[j] = math.Exp(sc[j] - mx)
						sum += sc[j]
					}
					for j := range sc {
						for i := range d {
							s += float64(dout[t*qw+h*d+i]) * sc[j] / sum * v[j*kw+g*d+i]
						}
					}
				}
			}
			return s
		}
		q64, k64, v64 := to64(q), to64(k), to64(v)
		wantDQ := numGrad(q64, func(x []float64) float64 { return ref(x, k64, v64) })
		wantDK := numGrad(k64, func(x []float64) float64 { return ref(q64, x, v64) })
		wantDV := numGrad(v64, func(x []float64) float64 { return ref(q64, k64, x) })
		dq, dk, dv := make([]float32, T*qw), make([]float32, T*kw), make([]float32, T*kw)
		attentionBack(newPar(2), dq, dk, dv, dout, q, k, v, T, tc.heads, tc.kvHeads, d, scale)
		checkGrad(t, "dq", dq, wantDQ, 1e-5)
		checkGrad(t, "dk", dk, wantDK, 1e-5)
		checkGrad(t, "dv", dv, wantDV, 1e-5)
	}
}

func TestCrossEntropyBackward(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 6))
	const rows, V = 4, 11
	logits := randVec(rng, rows*V, 5)
	targets := []int32{3, -1, 0, 10}
	const scale, count = 8.0, 3
	ref := func(z []float64) float64 { // scale · mean loss over the counted rows
		s := 0.0
		for r, y := range targets {
			if y < 0 {
				continue
			}
			mx := math.Inf(-1)
			for _, v := range z[r*V : (r+1)*V] {
				mx = math.Max(mx, v)
			}
			sum := 0.0
			for _, v := range z[r*V : (r+1)*V] {
				sum += math.Exp(v - mx)
			}
			s += mx + math.Log(sum) - z[r*V+int(y)]
		}
		return scale * s / count
	}
	want := numGrad(to64(logits), ref)
	wantLoss := ref(to64(logits)) / scale * count
	got := append([]float32(nil), logits...)
	loss := crossEntropy(got, targets, V, scale, count)
	if math.Abs(loss-wantLoss) > 1e-9*wantLoss {
		t.Errorf("loss sum %.12g, want %.12g", loss, wantLoss)
	}
	checkGrad(t, "d logits", got, want, 1e-6)
	for _, v := range got[V : 2*V] {
		if v != 0 {
			t.Fatal("an ignored row has a gradient")
		}
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
