package tensortest_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// The references are checked against values worked out by hand.

func near(t *testing.T, what string, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %v, want %v", what, got, want)
	}
	for i := range got {
		if math.Abs(got[i]-want[i]) > 1e-12 {
			t.Fatalf("%s: %v, want %v", what, got, want)
		}
	}
}

func TestRefMatMul(t *testing.T) {
	x := []float64{1, 2, 3, 4}       // [2, 2]
	w := []float64{1, 0, 1, 1, 0, 2} // [3, 2]: out cols x0, x0+x1, 2·x1
	near(t, "no bias", tensortest.RefMatMul(x, w, nil, 2, 3, 2), []float64{1, 3, 4, 3, 7, 8})
	near(t, "bias", tensortest.RefMatMul(x, w, []float64{10, 20, 30}, 2, 3, 2), []float64{11, 23, 34, 13, 27, 38})
}

func TestRefRMSNorm(t *testing.T) {
	// mean(3², 4²) = 12.5
	r := 1 / math.Sqrt(12.5)
	near(t, "eps 0", tensortest.RefRMSNorm([]float64{3, 4}, []float64{1, 2}, 1, 2, 0), []float64{3 * r, 8 * r})
	r = 1 / math.Sqrt(12.5+0.5)
	near(t, "eps 0.5", tensortest.RefRMSNorm([]float64{3, 4}, []float64{1, 1}, 1, 2, 0.5), []float64{3 * r, 4 * r})
}

func TestRefRope(t *testing.T) {
	// headDim 4: pairs (0, 2) and (1, 3). Position 1 turns pair 0 by 90°
	// and leaves pair 1 alone; position 0 is the identity.
	cos := []float64{1, 1, 0, 1}
	sin := []float64{0, 0, 1, 0}
	x := []float64{1, 2, 3, 4, 1, 2, 3, 4} // T=2, one head
	near(t, "rope", tensortest.RefRope(x, cos, sin, 2, 1, 4, 0), []float64{1, 2, 3, 4, -3, 2, 1, 4})
	near(t, "rope pos0=1", tensortest.RefRope(x[:4], cos, sin, 1, 1, 4, 1), []float64{-3, 2, 1, 4})

	c, s := tensortest.RopeTables(3, 4, 10000)
	// Pair 0 turns by the position itself; pair 1 by position/100.
	near(t, "tables cos", c, []float64{1, 1, math.Cos(1), math.Cos(0.01), math.Cos(2), math.Cos(0.02)})
	near(t, "tables sin", s, []float64{0, 0, math.Sin(1), math.Sin(0.01), math.Sin(2), math.Sin(0.02)})
}

func TestRefSiLUMul(t *testing.T) {
	got := tensortest.RefSiLUMul([]float64{0, 1, -1, 40}, []float64{5, 2, 2, 0.5})
	near(t, "silu", got, []float64{0, 2 / (1 + math.Exp(-1)), -2 / (1 + math.E), 20})
}

func TestRefEmbed(t *testing.T) {
	table := []float64{0, 1, 10, 11, 20, 21}
	near(t, "embed", tensortest.RefEmbed(table, 2, []int32{2, 0, 2}), []float64{20, 21, 0, 1, 20, 21})
}

func TestRefAttention(t *testing.T) {
	// One head of dimension 2, q = 0: every visible position weighs the
	// same, so row r is the mean of v rows 0..pos0+r.
	q := make([]float64, 4) // T=2
	k := []float64{1, 2, 3, 4, 5, 6}
	v := []float64{2, 0, 4, 2, 9, 9}
	near(t, "prefill", tensortest.RefAttention(q, k, v, 2, 1, 1, 2, 0, 1), []float64{2, 0, 3, 1})
	near(t, "decode", tensortest.RefAttention(q[:2], k, v, 1, 1, 1, 2, 2, 1), []float64{5, 11.0 / 3})

	// Scores 0 and ln 3 (q·k with scale 1): weights 1/4 and 3/4.
	q1 := []float64{math.Log(3), 0}
	k1 := []float64{0, 0, 1, 0}
	v1 := []float64{4, 0, 0, 8}
	near(t, "softmax", tensortest.RefAttention(q1, k1, v1, 1, 1, 1, 2, 1, 1), []float64{1, 6})

	// Grouped: heads 0 and 1 read KV head 0, heads 2 and 3 read KV head 1.
	qg := make([]float64, 4) // 4 heads of dimension 1
	kg := []float64{0, 0}    // one position, 2 KV heads
	vg := []float64{7, -7}
	near(t, "gqa", tensortest.RefAttention(qg, kg, vg, 1, 4, 2, 1, 0, 1), []float64{7, 7, -7, -7})
}

func TestRelErr(t *testing.T) {
	if e := tensortest.RelErr([]float32{3, 4}, []float64{3, 4}); e != 0 {
		t.Errorf("exact: %g", e)
	}
	// ||(0, 1)|| / ||(3, 4)|| = 0.2
	if e := tensortest.RelErr([]float32{3, 5}, []float64{3, 4}); math.Abs(e-0.2) > 1e-12 {
		t.Errorf("RelErr = %g, want 0.2", e)
	}
	if e := tensortest.RelErr([]float32{float32(math.NaN()), 4}, []float64{3, 4}); !math.IsInf(e, 1) {
		t.Errorf("NaN: %g, want +Inf", e)
	}
	if e := tensortest.RelErr([]float32{1}, []float64{1, 2}); !math.IsInf(e, 1) {
		t.Errorf("length mismatch: %g, want +Inf", e)
	}
}

func TestStored(t *testing.T) {
	for _, c := range []struct {
		dt   tensor.DType
		want float64
	}{
		{tensor.F32, float64(float32(1.0 / 3))},
		{tensor.F16, 0.333251953125}, // 0x3555
		{tensor.BF16, 0.333984375},   // 0x3eab
	} {
		got, err := tensortest.Stored(c.dt, []float32{1.0 / 3})
		if err != nil {
			t.Fatal(err)
		}
		if got[0] != c.want {
			t.Errorf("%v: 1/3 stored as %v, want %v", c.dt, got[0], c.want)
		}
	}
	if _, err := tensortest.Stored(tensor.I32, []float32{1}); err == nil {
		t.Error("Stored(I32) succeeded")
	}
}

// TestStoredQuantized checks the quantized values of a Q8_0 block worked
// out by hand (the scale is 127/127 = 1, so the values round to integers,
// halves away from zero), and a block of the rounded activations of a
// product with Q4_0 weights (16-bit quants, ties to even).
func TestStoredQuantized(t *testing.T) {
	v := make([]float32, 32)
	copy(v, []float32{127, 1.4, -63.5, 0.49})
	want := make([]float64, 32)
	copy(want, []float64{127, 1, -64, 0})
	got, err := tensortest.Stored(tensor.Q8_0, v)
	if err != nil {
		t.Fatal(err)
	}
	near(t, "Stored(Q8_0)", got, want)
	a := make([]float32, 32) // a step of 1: ties go to the even integer
	copy(a, []float32{quant.ActMax, 1.4, -63.5, 0.5, 2.5, -0.49})
	wantA := make([]float64, 32)
	copy(wantA, []float64{quant.ActMax, 1, -64, 0, 2, 0})
	got, err = tensortest.RoundActivations(tensor.Q4_0, append(a, a...), 2, 32)
	if err != nil {
		t.Fatal(err)
	}
	near(t, "RoundActivations(Q4_0)", got, append(wantA, wantA...))
	if _, err := tensortest.Stored(tensor.Q8_0, v[:31]); err == nil {
		t.Error("Stored(Q8_0) of 31 values succeeded")
	}
	if _, err := tensortest.RoundActivations(tensor.F16, v, 1, 32); err == nil {
		t.Error("RoundActivations for F16 weights succeeded")
	}
}

// TestRandomBlocks checks that random blocks decode to finite weights of
// order one in every quantized weight type, and that other types and
// partial blocks are refused.
func TestRandomBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, dt := range tensortest.QuantWeightTypes() {
		n := 64 * dt.BlockSize()
		b, err := tensortest.RandomBlocks(r, dt, n)
		if err != nil {
			t.Fatal(err)
		}
		v, err := tensortest.Decode(dt, b)
		if err != nil || len(v) != n {
			t.Fatalf("%v: %d values, %v", dt, len(v), err)
		}
		var ss float64
		for i, x := range v {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
				t.Fatalf("%v: element %d is %v", dt, i, x)
			}
			ss += float64(x) * float64(x)
		}
		if rms := math.Sqrt(ss / float64(n)); rms < 0.1 || rms > 10 {
			t.Errorf("%v: RMS %g, want weights of order one", dt, rms)
		}
	}
	for _, c := range []struct {
		dt tensor.DType
		n  int
	}{{tensor.Q8_K, 256}, {tensor.F16, 32}, {tensor.Q4_K, 255}} {
		if _, err := tensortest.RandomBlocks(r, c.dt, c.n); err == nil {
			t.Errorf("RandomBlocks(%v, %d) succeeded", c.dt, c.n)
		}
	}
}

func TestFromToF32(t *testing.T) {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16} {
		x, err := tensortest.FromF32(cpu, dt, tensor.Shape{2, 2}, []float32{1, -2, 0.5, 8})
		if err != nil {
			t.Fatal(err)
		}
		got, err := tensortest.ToF32(cpu, x)
		if err != nil {
			t.Fatal(err)
		}
		if got[0] != 1 || got[1] != -2 || got[2] != 0.5 || got[3] != 8 {
			t.Errorf("%v round trip: %v", dt, got)
		}
	}
	if _, err := tensortest.FromF32(cpu, tensor.F32, tensor.Shape{3}, []float32{1}); err == nil {
		t.Error("FromF32 with too few values succeeded")
	}
}

// The backward references are checked against central finite differences
// of the forward references: for a fixed upstream gradient dy, the gradient
// of Σ dy·f(inputs) with respect to each input element.

// numGrad returns d/dx_i of f at x for every i by central differences.
func numGrad(x []float64, f func() float64) []float64 {
	const h = 1e-6
	g := make([]float64, len(x))
	for i := range x {
		old := x[i]
		x[i] = old + h
		up := f()
		x[i] = old - h
		down := f()
		x[i] = old
		g[i] = (up - down) / (2 * h)
	}
	return g
}

// dotF64 returns Σ a·b.
func dotF64(a, b []float64) float64 {
	var s float64
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// randF64 returns n values uniform in [-scale, scale).
func randF64(r *rand.Rand, n int, scale float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = (2*r.Float64() - 1) * scale
	}
	return v
}

// nearGrad fails t unless the analytic gradient got is within a relative
// error of 1e-7 of the finite differences want.
func nearGrad(t *testing.T, what string, got, want []float64) {
	t.Helper()
	var num, den float64
	for i := range got {
		num += (got[i] - want[i]) * (got[i] - want[i])
		den += want[i] * want[i]
	}
	if len(got) != len(want) || den == 0 || math.Sqrt(num/den) > 1e-7 {
		t.Fatalf("%s: relative error %.3g against finite differences (%d vs %d elements)", what, math.Sqrt(num/den), len(got), len(want))
	}
}

func TestRefMatMulGrad(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	const m, n, k = 3, 4, 5
	x, w, b, dy := randF64(r, m*k, 1), randF64(r, n*k, 1), randF64(r, n, 1), randF64(r, m*n, 1)
	loss := func() float64 { return dotF64(dy, tensortest.RefMatMul(x, w, b, m, n, k)) }
	nearGrad(t, "dx", tensortest.RefMatMulGradX(dy, w, m, n, k), numGrad(x, loss))
	nearGrad(t, "dw", tensortest.RefMatMulGradW(dy, x, m, n, k), numGrad(w, loss))
	nearGrad(t, "db", tensortest.RefBiasGrad(dy, m, n), numGrad(b, loss))
}

func TestRefRMSNormGrad(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 2))
	for _, c := range []struct {
		m, d int
		eps  float64
		xMax float64
	}{{3, 7, 1e-5, 2}, {2, 16, 1e-2, 0.1}} {
		x, w, dy := randF64(r, c.m*c.d, c.xMax), randF64(r, c.d, 1.5), randF64(r, c.m*c.d, 1)
		loss := func() float64 { return dotF64(dy, tensortest.RefRMSNorm(x, w, c.m, c.d, c.eps)) }
		dx, dw := tensortest.RefRMSNormGrad(dy, x, w, c.m, c.d, c.eps)
		nearGrad(t, "dx", dx, numGrad(x, loss))
		nearGrad(t, "dw", dw, numGrad(w, loss))
	}
}

func TestRefSiLUMulGrad(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	gate, up, dout := randF64(r, 40, 8), randF64(r, 40, 2), randF64(r, 40, 1)
	gate[0], gate[1] = -30, 30 // saturated tails
	loss := func() float64 { return dotF64(dout, tensortest.RefSiLUMul(gate, up)) }
	dg, du := tensortest.RefSiLUMulGrad(dout, gate, up)
	nearGrad(t, "dgate", dg, numGrad(gate, loss))
	nearGrad(t, "dup", du, numGrad(up, loss))
	// Far tails: silu' is 0 below and 1 above, without overflow.
	dg, du = tensortest.RefSiLUMulGrad([]float64{1, 1}, []float64{-800, 800}, []float64{1, 1})
	near(t, "tails", append(dg, du...), []float64{0, 1, 0, 800})
}

func TestRefRopeGrad(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 4))
	const tt, heads, headDim, pos0 = 3, 2, 8, 2
	cos, sin := tensortest.RopeTables(pos0+tt, headDim, 10000)
	x, dy := randF64(r, tt*heads*headDim, 1), randF64(r, tt*heads*headDim, 1)
	loss := func() float64 { return dotF64(dy, tensortest.RefRope(x, cos, sin, tt, heads, headDim, pos0)) }
	dx := tensortest.RefRopeGrad(dy, cos, sin, tt, heads, headDim, pos0)
	nearGrad(t, "dx", dx, numGrad(x, loss))
	// The gradient is the rotation by the negated angle (GradOps' doc).
	neg := make([]float64, len(sin))
	for i, s := range sin {
		neg[i] = -s
	}
	near(t, "Rope with -sin", tensortest.RefRope(dy, cos, neg, tt, heads, headDim, pos0), dx)
}

func TestRefAttentionGrad(t *testing.T) {
	for _, c := range []struct{ heads, kvHeads int }{{2, 2}, {4, 2}, {3, 1}} {
		r := rand.New(rand.NewPCG(5, uint64(c.heads*10+c.kvHeads)))
		const tt, d = 5, 3
		qw, kw := c.heads*d, c.kvHeads*d
		scale := 1 / math.Sqrt(d)
		q, k, v, dout := randF64(r, tt*qw, 1.5), randF64(r, tt*kw, 1.5), randF64(r, tt*kw, 1), randF64(r, tt*qw, 1)
		loss := func() float64 {
			return dotF64(dout, tensortest.RefAttention(q, k, v, tt, c.heads, c.kvHeads, d, 0, scale))
		}
		dq, dk, dv := tensortest.RefAttentionGrad(dout, q, k, v, tt, c.heads, c.kvHeads, d, scale)
		nearGrad(t, "dq", dq, numGrad(q, loss))
		nearGrad(t, "dk", dk, numGrad(k, loss))
		nearGrad(t, "dv", dv, numGrad(v, loss))
	}
}

func TestRefCrossEntropy(t *testing.T) {
	// Logits 0 and ln 3: probabilities 1/4 and 3/4.
	z := []float64{0, math.Log(3), 0, math.Log(3)}
	loss := tensortest.RefCrossEntropy(z, []int32{1, 0}, 2)
	if want := math.Log(4.0/3) + math.Log(4); math.Abs(loss-want) > 1e-12 {
		t.Fatalf("loss %v, want %v", loss, want)
	}
	g, l := tensortest.RefCrossEntropyGrad(z, []int32{1, -1}, 2, 2)
	near(t, "grad", g, []float64{0.5, -0.5, 0, 0})
	if math.Abs(l-math.Log(4.0/3)) > 1e-12 {
		t.Fatalf("loss %v with a row left out, want %v", l, math.Log(4.0/3))
	}

	r := rand.New(rand.NewPCG(6, 6))
	const rows, v, scale = 4, 11, 0.375
	logits := randF64(r, rows*v, 5)
	targets := []int32{3, -1, 0, 10}
	grad, l := tensortest.RefCrossEntropyGrad(logits, targets, v, scale)
	if want := tensortest.RefCrossEntropy(logits, targets, v); math.Abs(l-want) > 1e-12*want {
		t.Fatalf("loss %v, want %v", l, want)
	}
	nearGrad(t, "d logits", grad, numGrad(logits, func() float64 {
		return scale * tensortest.RefCrossEntropy(logits, targets, v)
	}))
}
