package nn

import (
	"math"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// testParams makes Params of one layer from host tensors.
func testParams(t testing.TB, ts map[string]*tensor.Tensor) *Params {
	t.Helper()
	p := &Params{byName: map[string]*param{}}
	var layer []*param
	for name, x := range ts {
		pr := &param{name: name, work: x}
		if x.DType() == tensor.F32 {
			pr.master = x.F32()
		} else {
			pr.master = x.ToF32()
		}
		p.byName[name] = pr
		p.names = append(p.names, name)
		layer = append(layer, pr)
	}
	p.layers = [][]*param{layer}
	return p
}

func f32Tensor(v ...float32) *tensor.Tensor {
	t, _ := tensor.FromF32(tensor.Shape{len(v)}, append([]float32(nil), v...))
	return t
}

func near(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	for i := range want {
		if math.Abs(float64(got[i])-want[i]) > tol {
			t.Errorf("%s: element %d is %.9g, want %.9g", what, i, got[i], want[i])
		}
	}
}

func TestSGD(t *testing.T) {
	// Plain: w - lr·g.
	p := testParams(t, map[string]*tensor.Tensor{"w": f32Tensor(1, -2, 0.5)})
	g := Grads{"w": f32Tensor(0.1, 0.2, -0.4)}
	if err := (&SGD{LR: 0.1}).Step(p, g); err != nil {
		t.Fatal(err)
	}
	near(t, "plain", p.Master("w"), []float64{0.99, -2.02, 0.54}, 1e-7)

	// Momentum 0.9 and weight decay 0.01, two steps with the same
	// gradient, worked by hand:
	// step 1: d = g + 0.01w = (0.11, 0.18, -0.395) = b; w -= 0.1b.
	// step 2: d = g + 0.01w = (0.10989, 0.17982, -0.394605);
	//         b = 0.9b + d = (0.20889, 0.34182, -0.750105); w -= 0.1b.
	p = testParams(t, map[string]*tensor.Tensor{"w": f32Tensor(1, -2, 0.5)})
	opt := &SGD{LR: 0.1, Momentum: 0.9, WeightDecay: 0.01}
	for range 2 {
		if err := opt.Step(p, g); err != nil {
			t.Fatal(err)
		}
	}
	near(t, "momentum", p.Master("w"), []float64{0.968111, -2.052182, 0.6145105}, 1e-6)
}

func TestAdamW(t *testing.T) {
	// The expected values follow torch.optim.AdamW's update, worked in
	// float64 outside this code: lr 0.1, betas (0.9, 0.999), eps 1e-8,
	// weight decay 0.01, gradients (0.1, 0.2, -0.4) then (-0.2, 0.2, 0).
	p := testParams(t, map[string]*tensor.Tensor{"w": f32Tensor(1, -2, 0.5)})
	opt := &AdamW{LR: 0.1, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01}
	if err := opt.Step(p, Grads{"w": f32Tensor(0.1, 0.2, -0.4)}); err != nil {
		t.Fatal(err)
	}
	near(t, "step 1", p.Master("w"), []float64{0.899000009999999, -2.0979999950000003, 0.5994999975}, 1e-7)
	if err := opt.Step(p, Grads{"w": f32Tensor(-0.2, 0.2, 0)}); err != nil {
		t.Fatal(err)
	}
	near(t, "step 2", p.Master("w"), []float64{0.9347113603784888, -2.195901990005, 0.6659063205465476}, 2e-7)
	if opt.Steps() != 2 {
		t.Errorf("Steps() = %d, want 2", opt.Steps())
	}
	d := NewAdamW(1e-3)
	if d.Beta1 != 0.9 || d.Beta2 != 0.999 || d.Eps != 1e-8 || d.WeightDecay != 0.01 {
		t.Errorf("NewAdamW defaults %+v", d)
	}
}

// TestMixedPrecisionMaster checks that an F16 parameter is updated in its
// F32 master copy and that the working copy is the master rounded to F16:
// updates smaller than the F16 spacing accumulate in the master.
func TestMixedPrecisionMaster(t *testing.T) {
	w := tensor.New(tensor.F16, tensor.Shape{2})
	tensor.F32ToF16(w.U16(), []float32{1, 2})
	p := testParams(t, map[string]*tensor.Tensor{"w": w})
	// F16 spacing at 1 is 2⁻¹⁰ ≈ 0.00098; steps of 0.0001 vanish in F16.
	opt := &SGD{LR: 1}
	for range 30 {
		if err := opt.Step(p, Grads{"w": f32Tensor(0.0001, 0)}); err != nil {
			t.Fatal(err)
		}
	}
	master := p.Master("w")
	if math.Abs(float64(master[0])-(1-0.003)) > 1e-6 {
		t.Errorf("master %v, want 0.997", master[0])
	}
	if got, want := p.Tensor("w").U16()[0], tensor.F16FromF32(master[0]); got != want {
		t.Errorf("working copy %#x, want the master rounded to F16 %#x", got, want)
	}
	if tensor.F16ToF32One(p.Tensor("w").U16()[0]) == 1 {
		t.Error("the working copy did not move although the master did by 3 F16 steps")
	}
	if p.Tensor("w").U16()[1] != tensor.F16FromF32(2) {
		t.Error("a parameter with zero gradient changed")
	}
}

func TestOptimizerErrors(t *testing.T) {
	p := testParams(t, map[string]*tensor.Tensor{"w": f32Tensor(1, 2)})
	bad := Grads{"w": f32Tensor(1, 2, 3)}
	if err := (&SGD{LR: 0.1}).Step(p, bad); err == nil {
		t.Error("SGD took a gradient of the wrong size")
	}
	if err := NewAdamW(0.1).Step(p, bad); err == nil {
		t.Error("AdamW took a gradient of the wrong size")
	}
	if err := (&AdamW{LR: 0.1, Beta1: 1, Beta2: 0.9, Eps: 1e-8}).Step(p, Grads{}); err == nil {
		t.Error("AdamW took beta1 = 1")
	}
	if err := (&SGD{LR: math.NaN()}).Step(p, Grads{}); err == nil {
		t.Error("SGD took a NaN learning rate")
	}
}

func TestLossScaler(t *testing.T) {
	s := NewLossScaler(1024, 3)
	finite := func() Grads { return Grads{"w": f32Tensor(2048, -1024)} }

	// An infinity: skip and halve, gradients left alone.
	g := Grads{"w": f32Tensor(1, float32(math.Inf(1)))}
	if s.Unscale(g) {
		t.Fatal("gradients with an infinity were accepted")
	}
	if s.Scale != 512 || s.Skipped() != 1 {
		t.Fatalf("after an overflow: scale %v, skipped %d; want 512, 1", s.Scale, s.Skipped())
	}
	// A NaN too.
	if s.Unscale(Grads{"w": f32Tensor(float32(math.NaN()))}) || s.Scale != 256 {
		t.Fatalf("a NaN: scale %v, want 256 and a skip", s.Scale)
	}
	// Good steps unscale; the third in a row doubles the scale.
	for i := 1; i <= 3; i++ {
		g := finite()
		if !s.Unscale(g) {
			t.Fatalf("good step %d skipped", i)
		}
		if v := g["w"].F32(); v[0] != 8 || v[1] != -4 {
			t.Fatalf("good step %d: unscaled gradients %v, want [8 -4]", i, v)
		}
		want := float32(256)
		if i == 3 {
			want = 512
		}
		if s.Scale != want {
			t.Fatalf("after good step %d the scale is %v, want %v", i, s.Scale, want)
		}
	}
	// An overflow resets the count of good steps.
	for range 2 {
		s.Unscale(finite())
	}
	s.Unscale(Grads{"w": f32Tensor(float32(math.Inf(-1)))})
	for range 2 {
		s.Unscale(finite())
	}
	if s.Scale != 256 {
		t.Errorf("scale %v after 2 good, an overflow and 2 good steps, want 256 (no growth)", s.Scale)
	}
	// The scale never falls below MinScale.
	s.MinScale = 200
	s.Unscale(Grads{"w": f32Tensor(float32(math.Inf(1)))})
	if s.Scale != 200 {
		t.Errorf("scale %v, want the minimum 200", s.Scale)
	}
}

// BenchmarkOptimizerStep times one training step's host work after the
// backward on 32M F16 parameters in 8 tensors: unscaling and checking the
// gradients, their norm, and AdamW's update with the rounding into the
// working copy. It reports parameters per second.
//
//	go test ./nn -run '^$' -bench OptimizerStep -benchtime 5x
func BenchmarkOptimizerStep(b *testing.B) {
	const tensors, per = 8, 4 << 20
	ts := map[string]*tensor.Tensor{}
	g := Grads{}
	for i := range tensors {
		name := string(rune('a' + i))
		ts[name] = tensor.New(tensor.F16, tensor.Shape{per})
		gt := tensor.New(tensor.F32, tensor.Shape{per})
		for j, v := range gt.F32() {
			gt.F32()[j] = float32(j%7)*1e-3 - 3e-3 + v
		}
		g[name] = gt
	}
	p := testParams(b, ts)
	opt := NewAdamW(1e-4)
	scaler := NewLossScaler(1024, 1000)
	for b.Loop() {
		if !scaler.Unscale(g) {
			b.Fatal("gradients not finite")
		}
		g.Scale(1024)
		_ = g.ClipNorm(1)
		if err := opt.Step(p, g); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(tensors*per)*float64(b.N)/b.Elapsed().Seconds()/1e6, "Mparams/s")
}
