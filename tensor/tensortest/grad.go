package tensortest

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestGradOps checks b's backward operations (tensor.GradOps) against the
// float64 references in this package (RefMatMulGradX, RefAttentionGrad,
// ...), which the package's own tests check against finite differences of
// the forward references. It fails at once if b does not implement
// tensor.GradOps. Like TestBackend it moves data only through the Backend
// interface, calls the operations through tensor.Checked, and takes the
// same options.
//
// Destinations that an operation adds into are filled with random values
// first, so that the check covers the accumulation; those it sets are filled
// with NaN, so that an element left unwritten fails. Weights are compared
// with references computed on their stored (rounded) values.
func TestGradOps(t *testing.T, b tensor.Backend, opts ...Option) {
	g, ok := tensor.CheckedGrad(b)
	if !ok {
		t.Fatalf("backend %s (%T) does not implement tensor.GradOps", b.Name(), b)
	}
	s := &gradSuite{suite: &suite{b: tensor.Checked(b), cfg: newConfig(opts)}, g: g}
	t.Run("MatMulPrecise", s.testMatMulPrecise)
	t.Run("Zero", s.testZero)
	t.Run("MatMulGradX", s.testMatMulGradX)
	t.Run("MatMulGradW", s.testMatMulGradW)
	t.Run("BiasGrad", s.testBiasGrad)
	t.Run("RMSNormGrad", s.testRMSNormGrad)
	t.Run("SiLUMulGrad", s.testSiLUMulGrad)
	t.Run("AttentionGrad", s.testAttentionGrad)
	t.Run("CrossEntropyGrad", s.testCrossEntropyGrad)
	t.Run("RopeInverse", s.testRopeInverse)
	t.Run("Errors", s.testGradErrors)
	t.Run("Aliasing", s.testGradAliasing)
	t.Run("Quantized", s.testGradQuantized)
}

// testGradQuantized checks that the backward operations refuse quantized
// operands, weights above all, with an error wrapping tensor.ErrQuantized:
// training needs float weights.
func (s *gradSuite) testGradQuantized(t *testing.T) {
	mk := func(dt tensor.DType) func(shape ...int) *tensor.Tensor {
		return func(shape ...int) *tensor.Tensor {
			x, _ := s.put(t, dt, shape, make([]float32, tensor.Shape(shape).NumElements()))
			return x
		}
	}
	f32s, q8s, q4k := mk(tensor.F32), mk(tensor.Q8_0), mk(tensor.Q4_K)
	g := s.g
	x, dy := f32s(2, 256), f32s(2, 3)
	for _, c := range []struct {
		name   string
		call   func() error
		weight bool // a quantized weight: the error says training needs float ones
	}{
		{"MatMulPrecise/w", func() error { return g.MatMulPrecise(f32s(2, 3), x, q4k(3, 256), nil) }, true},
		{"MatMulGradX/w", func() error { return g.MatMulGradX(f32s(2, 256), dy, q4k(3, 256)) }, true},
		{"RMSNormGrad/w", func() error { return g.RMSNormGrad(f32s(2, 256), nil, f32s(2, 256), x, q8s(256), 1e-5) }, true},
		{"MatMulGradW/dw", func() error { return g.MatMulGradW(q8s(3, 256), dy, x) }, false},
		{"MatMulGradW/x", func() error { return g.MatMulGradW(f32s(3, 256), dy, q8s(2, 256)) }, false},
		{"BiasGrad/dy", func() error { return g.BiasGrad(f32s(32), q8s(2, 32)) }, false},
		{"SiLUMulGrad/gate", func() error {
			return g.SiLUMulGrad(f32s(2, 32), f32s(2, 32), f32s(2, 32), q8s(2, 32), f32s(2, 32))
		}, false},
		{"AttentionGrad/k", func() error {
			return g.AttentionGrad(tensor.AttnGrad{DQ: f32s(3, 64), DK: f32s(3, 32), DV: f32s(3, 32), DOut: f32s(3, 64), Out: f32s(3, 64)},
				tensor.Attn{Q: f32s(3, 64), K: q8s(3, 32), V: f32s(3, 32), Heads: 2, KVHeads: 1, HeadDim: 32, Scale: 0.2})
		}, false},
		{"CrossEntropyGrad/logits", func() error { _, err := g.CrossEntropyGrad(q8s(2, 32), []int32{0, 1}, 1); return err }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("panicked instead of returning an error: %v", p)
				}
			}()
			err := c.call()
			switch {
			case !errors.Is(err, tensor.ErrQuantized):
				t.Fatalf("error %v, want one wrapping tensor.ErrQuantized", err)
			case c.weight && !strings.Contains(err.Error(), "training needs float weights"):
				t.Fatalf("error %v, want one saying that training needs float weights", err)
			}
			t.Logf("error: %v", err)
		})
	}
}

// testGradAliasing checks that outputs sharing storage with an operand
// where the contract forbids it are errors saying so, and that SiLUMulGrad
// works in place.
func (s *gradSuite) testGradAliasing(t *testing.T) {
	f32s := func(shape ...int) *tensor.Tensor {
		x, _ := s.put(t, tensor.F32, shape, make([]float32, tensor.Shape(shape).NumElements()))
		return x
	}
	g := s.g
	sq, a, b, x := f32s(4, 4), f32s(4, 4), f32s(4, 4), f32s(4, 4)
	top, _ := a.Rows(0, 3)
	low, _ := a.Rows(1, 3)
	norm := f32s(4)
	q, k, v, o, dq, dk, dv := f32s(3, 8), f32s(3, 4), f32s(3, 4), f32s(3, 8), f32s(3, 8), f32s(3, 4), f32s(3, 4)
	attn := func(dq, dk, dv, dout, q, k, v, out *tensor.Tensor) error {
		return g.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: out}, tensor.Attn{Q: q, K: k, V: v, Heads: 2, KVHeads: 1, HeadDim: 4, Scale: 0.5})
	}
	for _, c := range []struct {
		name string
		call func() error
	}{
		{"MatMulGradX/dx is dy", func() error { return g.MatMulGradX(sq, sq, b) }},
		{"MatMulGradX/dx is w", func() error { return g.MatMulGradX(sq, b, sq) }},
		{"MatMulGradW/dw is x", func() error { return g.MatMulGradW(sq, b, sq) }},
		{"MatMulGradW/dw is dy", func() error { return g.MatMulGradW(sq, sq, b) }},
		{"BiasGrad/db in dy", func() error { r, _ := sq.Rows(0, 1); d, _ := r.Reshape(tensor.Shape{4}); return g.BiasGrad(d, sq) }},
		{"RMSNormGrad/dx is x", func() error { return g.RMSNormGrad(x, nil, b, x, norm, 1e-5) }},
		{"RMSNormGrad/dx is dy", func() error { return g.RMSNormGrad(x, nil, x, b, norm, 1e-5) }},
		{"RMSNormGrad/dw is w", func() error { return g.RMSNormGrad(x, norm, b, sq, norm, 1e-5) }},
		{"SiLUMulGrad/dup is dout", func() error { return g.SiLUMulGrad(x, b, b, sq, sq) }},
		{"SiLUMulGrad/dgate is gate", func() error { return g.SiLUMulGrad(x, b, sq, x, sq) }},
		{"SiLUMulGrad/dgate partly dout", func() error { return g.SiLUMulGrad(low, f32s(3, 4), top, f32s(3, 4), f32s(3, 4)) }},
		{"SiLUMulGrad/dgate is dup", func() error { return g.SiLUMulGrad(x, x, b, sq, sq) }},
		{"AttentionGrad/dq is q", func() error { return attn(q, dk, dv, o, q, k, v, o) }},
		{"AttentionGrad/dq is dout", func() error { return attn(o, dk, dv, o, q, k, v, f32s(3, 8)) }},
		{"AttentionGrad/dk is dv", func() error { return attn(dq, dk, dk, o, q, k, v, f32s(3, 8)) }},
		{"AttentionGrad/dv is v", func() error { return attn(dq, dk, v, o, q, k, v, f32s(3, 8)) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			if err == nil || !strings.Contains(err.Error(), "overlaps") {
				t.Fatalf("error %v, want one about overlapping operands", err)
			}
		})
	}
	if err := g.SiLUMulGrad(x, b, x, sq, sq); err != nil {
		t.Errorf("SiLUMulGrad in place: %v", err)
	}
}

type gradSuite struct {
	*suite
	g tensor.GradOps
}

func (s *gradSuite) testZero(t *testing.T) {
	for _, dt := range weightTypes {
		t.Run(dt.String(), func(t *testing.T) {
			r := rng(t)
			x, xv := s.put(t, dt, tensor.Shape{5, 37}, uniform(r, 5*37, 1, 2))
			// Rows 1 and 2 only, through a view.
			mid, err := x.Rows(1, 2)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.g.Zero(mid); err != nil {
				t.Fatal(err)
			}
			got := s.get(t, x)
			for i, v := range got {
				want := xv[i]
				if row := i / 37; row == 1 || row == 2 {
					want = 0
				}
				if float64(v) != want {
					t.Fatalf("after Zero of rows 1..2, element %d (row %d) is %v, want %v", i, i/37, v, want)
				}
			}
			if err := s.g.Zero(x); err != nil {
				t.Fatal(err)
			}
			for i, v := range s.get(t, x) {
				if v != 0 {
					t.Fatalf("after Zero, element %d is %v", i, v)
				}
			}
		})
	}
}

// matMulGradCases are the shapes of the matrix-product gradients: sizes
// that are not multiples of the tile sizes of any kernel, and one larger.
var matMulGradCases = []struct{ m, n, k int }{
	{1, 5, 7}, {3, 130, 257}, {67, 5, 7}, {67, 130, 257}, {1, 130, 7},
	{3, 5, 257}, {12, 96, 256}, {64, 512, 384},
}

// testMatMulPrecise holds MatMulPrecise to the suite's tolerance (1e-5 by
// default), which an x rounded to F16 or BF16 would miss: about 3e-4 and
// 2e-3 relative.
func (s *gradSuite) testMatMulPrecise(t *testing.T) {
	for _, dt := range weightTypes {
		for i, c := range matMulGradCases {
			t.Run(fmt.Sprintf("%v/M%d_N%d_K%d", dt, c.m, c.n, c.k), func(t *testing.T) {
				r := rng(t)
				x, xv := s.put(t, tensor.F32, tensor.Shape{c.m, c.k}, uniform(r, c.m*c.k, -1, 1))
				w, wv := s.put(t, dt, tensor.Shape{c.n, c.k}, uniform(r, c.n*c.k, -1, 1))
				var bias *tensor.Tensor
				var bv []float64
				if i%2 == 1 {
					bias, bv = s.put(t, dt, tensor.Shape{c.n}, uniform(r, c.n, -1, 1))
				}
				out := s.poisoned(t, tensor.Shape{c.m, c.n})
				if err := s.g.MatMulPrecise(out, x, w, bias); err != nil {
					t.Fatal(err)
				}
				s.compare(t, "out", s.get(t, out), RefMatMul(xv, wv, bv, c.m, c.n, c.k))
			})
		}
	}
}

func (s *gradSuite) testMatMulGradX(t *testing.T) {
	for _, dt := range weightTypes {
		for _, c := range matMulGradCases {
			t.Run(fmt.Sprintf("%v/M%d_N%d_K%d", dt, c.m, c.n, c.k), func(t *testing.T) {
				r := rng(t)
				dy, dyv := s.put(t, tensor.F32, tensor.Shape{c.m, c.n}, uniform(r, c.m*c.n, -1, 1))
				w, wv := s.put(t, dt, tensor.Shape{c.n, c.k}, uniform(r, c.n*c.k, -1, 1))
				dx, dx0 := s.put(t, tensor.F32, tensor.Shape{c.m, c.k}, uniform(r, c.m*c.k, -1, 1))
				if err := s.g.MatMulGradX(dx, dy, w); err != nil {
					t.Fatal(err)
				}
				s.compare(t, "dx", s.get(t, dx), RefAdd(dx0, RefMatMulGradX(dyv, wv, c.m, c.n, c.k)))
			})
		}
	}
}

func (s *gradSuite) testMatMulGradW(t *testing.T) {
	for _, c := range matMulGradCases {
		t.Run(fmt.Sprintf("M%d_N%d_K%d", c.m, c.n, c.k), func(t *testing.T) {
			r := rng(t)
			dy, dyv := s.put(t, tensor.F32, tensor.Shape{c.m, c.n}, uniform(r, c.m*c.n, -1, 1))
			x, xv := s.put(t, tensor.F32, tensor.Shape{c.m, c.k}, uniform(r, c.m*c.k, -1, 1))
			dw, dw0 := s.put(t, tensor.F32, tensor.Shape{c.n, c.k}, uniform(r, c.n*c.k, -1, 1))
			if err := s.g.MatMulGradW(dw, dy, x); err != nil {
				t.Fatal(err)
			}
			want := RefAdd(dw0, RefMatMulGradW(dyv, xv, c.m, c.n, c.k))
			s.compare(t, "dw", s.get(t, dw), want)
			// A second call adds the gradient again.
			if err := s.g.MatMulGradW(dw, dy, x); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "dw after two calls", s.get(t, dw), RefAdd(want, RefMatMulGradW(dyv, xv, c.m, c.n, c.k)))
		})
	}
}

func (s *gradSuite) testBiasGrad(t *testing.T) {
	for _, c := range []struct{ m, n int }{{1, 5}, {67, 130}, {300, 33}, {4, 1000}, {2, 1}} {
		t.Run(fmt.Sprintf("M%d_N%d", c.m, c.n), func(t *testing.T) {
			r := rng(t)
			dy, dyv := s.put(t, tensor.F32, tensor.Shape{c.m, c.n}, uniform(r, c.m*c.n, -1, 1))
			db, db0 := s.put(t, tensor.F32, tensor.Shape{c.n}, uniform(r, c.n, -1, 1))
			if err := s.g.BiasGrad(db, dy); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "db", s.get(t, db), RefAdd(db0, RefBiasGrad(dyv, c.m, c.n)))
		})
	}
}

func (s *gradSuite) testRMSNormGrad(t *testing.T) {
	cases := []struct {
		m, d int
		eps  float32
		xMax float32 // inputs in [-xMax, xMax)
	}{
		{1, 64, 1e-5, 2}, {12, 172, 1e-6, 2}, {3, 1000, 1e-5, 2}, {5, 7, 1e-5, 2}, {67, 130, 1e-6, 1},
		{4, 64, 1e-5, 0.01}, // mean square comparable to eps
	}
	for _, dt := range weightTypes {
		for _, c := range cases {
			for _, withDW := range []bool{true, false} {
				name := fmt.Sprintf("%v/M%d_D%d_x%g", dt, c.m, c.d, c.xMax)
				if !withDW {
					name += "/no-dw"
				}
				t.Run(name, func(t *testing.T) {
					r := rng(t)
					x, xv := s.put(t, tensor.F32, tensor.Shape{c.m, c.d}, uniform(r, c.m*c.d, -c.xMax, c.xMax))
					w, wv := s.put(t, dt, tensor.Shape{c.d}, uniform(r, c.d, 0.5, 1.5))
					dy, dyv := s.put(t, tensor.F32, tensor.Shape{c.m, c.d}, uniform(r, c.m*c.d, -1, 1))
					dx, dx0 := s.put(t, tensor.F32, tensor.Shape{c.m, c.d}, uniform(r, c.m*c.d, -1, 1))
					var dw *tensor.Tensor
					var dw0 []float64
					if withDW {
						dw, dw0 = s.put(t, tensor.F32, tensor.Shape{c.d}, uniform(r, c.d, -1, 1))
					}
					if err := s.g.RMSNormGrad(dx, dw, dy, x, w, c.eps); err != nil {
						t.Fatal(err)
					}
					wantDX, wantDW := RefRMSNormGrad(dyv, xv, wv, c.m, c.d, float64(c.eps))
					s.compare(t, "dx", s.get(t, dx), RefAdd(dx0, wantDX))
					if withDW {
						s.compare(t, "dw", s.get(t, dw), RefAdd(dw0, wantDW))
					}
				})
			}
		}
	}
}

func (s *gradSuite) testSiLUMulGrad(t *testing.T) {
	for _, shape := range elementwiseShapes {
		for _, inPlace := range []bool{false, true} {
			name := fmt.Sprint(shape)
			if inPlace {
				name += "/in-place"
			}
			t.Run(name, func(t *testing.T) {
				r := rng(t)
				n := int(shape.NumElements())
				g := uniform(r, n, -8, 8)
				for i := 0; i < n; i += 17 { // saturated tails of the sigmoid
					g[i] = []float32{-30, 30, -90, 90}[i/17%4]
				}
				gate, gv := s.put(t, tensor.F32, shape, g)
				up, uv := s.put(t, tensor.F32, shape, uniform(r, n, -2, 2))
				dout, dv := s.put(t, tensor.F32, shape, uniform(r, n, -1, 1))
				dgate, dup := dout, s.poisoned(t, shape)
				if !inPlace {
					dgate = s.poisoned(t, shape)
				}
				if err := s.g.SiLUMulGrad(dgate, dup, dout, gate, up); err != nil {
					t.Fatal(err)
				}
				wantDG, wantDU := RefSiLUMulGrad(dv, gv, uv)
				s.compare(t, "dgate", s.get(t, dgate), wantDG)
				s.compare(t, "dup", s.get(t, dup), wantDU)
			})
		}
	}
}

// attentionGradCases are the layouts of the attention backward: MHA, GQA
// and MQA, head dimensions 16, 64 and 128, and sequence lengths that are
// not multiples of any block size.
var attentionGradCases = []attentionCase{
	{name: "MHA", heads: 4, kvHeads: 4, headDim: 16, t: 1},
	{name: "MHA", heads: 4, kvHeads: 4, headDim: 64, t: 7},
	{name: "MHA", heads: 2, kvHeads: 2, headDim: 128, t: 130},
	{name: "GQA", heads: 6, kvHeads: 2, headDim: 16, t: 33},
	{name: "GQA", heads: 6, kvHeads: 2, headDim: 64, t: 130},
	{name: "GQA", heads: 8, kvHeads: 2, headDim: 64, t: 33},
	{name: "GQA", heads: 8, kvHeads: 2, headDim: 128, t: 7},
	{name: "GQA", heads: 8, kvHeads: 2, headDim: 16, t: 1},
	{name: "MQA", heads: 4, kvHeads: 1, headDim: 128, t: 33},
	{name: "MQA", heads: 4, kvHeads: 1, headDim: 16, t: 130},
	// Scores of up to about ±150: softmax overflows float32 without
	// subtracting the maximum.
	{name: "large-scores", heads: 4, kvHeads: 2, headDim: 64, t: 33, qScale: 4, scale: 1},
}

func (s *gradSuite) testAttentionGrad(t *testing.T) {
	for _, c := range attentionGradCases {
		t.Run(fmt.Sprintf("%s/H%d_KV%d_D%d_T%d", c.name, c.heads, c.kvHeads, c.headDim, c.t), func(t *testing.T) {
			r := rng(t)
			qs := c.qScale
			if qs == 0 {
				qs = 1
			}
			scale := c.scale
			if scale == 0 {
				scale = 1 / math.Sqrt(float64(c.headDim))
			}
			scale = float64(float32(scale))
			qw, kw := c.heads*c.headDim, c.kvHeads*c.headDim
			q, qv := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -qs, qs))
			k, kv := s.put(t, tensor.F32, tensor.Shape{c.t, kw}, uniform(r, c.t*kw, -qs, qs))
			v, vv := s.put(t, tensor.F32, tensor.Shape{c.t, kw}, uniform(r, c.t*kw, -1, 1))
			dout, dov := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -1, 1))
			outv := RefAttention(qv, kv, vv, c.t, c.heads, c.kvHeads, c.headDim, 0, scale)
			out, _ := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, f32(outv))
			dq := s.poisoned(t, tensor.Shape{c.t, qw})
			dk := s.poisoned(t, tensor.Shape{c.t, kw})
			dv := s.poisoned(t, tensor.Shape{c.t, kw})
			if err := s.g.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: out}, tensor.Attn{Q: q, K: k, V: v, Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, Scale: float32(scale)}); err != nil {
				t.Fatal(err)
			}
			wantDQ, wantDK, wantDV := RefAttentionGrad(dov, qv, kv, vv, c.t, c.heads, c.kvHeads, c.headDim, scale)
			s.compare(t, "dq", s.get(t, dq), wantDQ)
			s.compare(t, "dk", s.get(t, dk), wantDK)
			s.compare(t, "dv", s.get(t, dv), wantDV)
		})
	}
}

func (s *gradSuite) testCrossEntropyGrad(t *testing.T) {
	cases := []struct {
		name    string
		v       int
		targets []int32 // -2 is replaced by a random target
		zMax    float32 // logits in [-zMax, zMax)
		scale   float32
	}{
		{"small", 11, []int32{3, -1, 0, 10}, 5, 1.0 / 3},
		{"vocab", 1000, []int32{-2, -2, -1, -2, 999, 0, -2}, 10, 0.25},
		{"odd-vocab", 5003, []int32{-2, -1, -2}, 4, 1},
		{"large-logits", 130, []int32{-2, -2, -2, -1, 7}, 80, 0.5},
		{"huge-logits", 77, []int32{-2, 5, -2}, 200, 2},
		{"one-logit", 1, []int32{0, -1}, 3, 1},
		{"all-ignored", 40, []int32{-1, -7}, 3, 1},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/V%d_rows%d", c.name, c.v, len(c.targets)), func(t *testing.T) {
			r := rng(t)
			rows := len(c.targets)
			targets := append([]int32(nil), c.targets...)
			for i, y := range targets {
				if y == -2 {
					targets[i] = int32(r.IntN(c.v))
				}
			}
			z := uniform(r, rows*c.v, -c.zMax, c.zMax)
			if c.name == "large-logits" { // a row at the top of the range
				for j := range c.v {
					z[j] = 80 - float32(j%3)
				}
			}
			logits, zv := s.put(t, tensor.F32, tensor.Shape{rows, c.v}, z)
			loss, err := s.g.CrossEntropyGrad(logits, targets, c.scale)
			if err != nil {
				t.Fatal(err)
			}
			want, wantLoss := RefCrossEntropyGrad(zv, targets, c.v, float64(c.scale))
			if d := math.Abs(loss - wantLoss); !(d <= s.cfg.tol*math.Max(1, math.Abs(wantLoss))) {
				t.Fatalf("loss %v, want %v", loss, wantLoss)
			}
			got := s.get(t, logits)
			s.compare(t, "d logits", got, want)
			for i, y := range targets {
				if y >= 0 {
					continue
				}
				for j, g := range got[i*c.v : (i+1)*c.v] {
					if g != 0 {
						t.Fatalf("row %d (target %d) has gradient %v at %d, want 0", i, y, g, j)
					}
				}
			}
		})
	}
}

// testRopeInverse checks the identity GradOps documents for the rotary
// embedding's backward: Rope with the sine table negated turns each pair
// back, so Rope(Rope(x, cos, sin), cos, -sin) = x, and Rope(dy, cos, -sin)
// is the gradient of x.
func (s *gradSuite) testRopeInverse(t *testing.T) {
	cases := []struct{ t, heads, headDim, pos0 int }{
		{1, 4, 16, 37}, {7, 6, 128, 5}, {33, 2, 64, 0},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("T%d_H%d_D%d_pos%d", c.t, c.heads, c.headDim, c.pos0), func(t *testing.T) {
			r := rng(t)
			maxPos := c.pos0 + c.t
			cos64, sin64 := RopeTables(maxPos, c.headDim, 10000)
			neg64 := make([]float64, len(sin64))
			for i, v := range sin64 {
				neg64[i] = -v
			}
			half := tensor.Shape{maxPos, c.headDim / 2}
			cos, cv := s.put(t, tensor.F32, half, f32(cos64))
			sin, sv := s.put(t, tensor.F32, half, f32(sin64))
			neg, _ := s.put(t, tensor.F32, half, f32(neg64))
			shape := tensor.Shape{c.t, c.heads * c.headDim}
			n := c.t * c.heads * c.headDim
			x, xv := s.put(t, tensor.F32, shape, uniform(r, n, -2, 2))
			if err := s.b.Rope(x, tensor.Rotary{Cos: cos, Sin: sin, Heads: c.heads, HeadDim: c.headDim, Pos0: c.pos0}); err != nil {
				t.Fatal(err)
			}
			if err := s.b.Rope(x, tensor.Rotary{Cos: cos, Sin: neg, Heads: c.heads, HeadDim: c.headDim, Pos0: c.pos0}); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "Rope(Rope(x, cos, sin), cos, -sin)", s.get(t, x), xv)

			dy, dyv := s.put(t, tensor.F32, shape, uniform(r, n, -1, 1))
			if err := s.b.Rope(dy, tensor.Rotary{Cos: cos, Sin: neg, Heads: c.heads, HeadDim: c.headDim, Pos0: c.pos0}); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "Rope(dy, cos, -sin)", s.get(t, dy), RefRopeGrad(dyv, cv, sv, c.t, c.heads, c.headDim, c.pos0))
		})
	}
}

// testGradErrors checks that malformed calls return errors (and do not
// panic).
func (s *gradSuite) testGradErrors(t *testing.T) {
	mk := func(dt tensor.DType) func(shape ...int) *tensor.Tensor {
		return func(shape ...int) *tensor.Tensor {
			x, _ := s.put(t, dt, shape, make([]float32, tensor.Shape(shape).NumElements()))
			return x
		}
	}
	f32s, f16s := mk(tensor.F32), mk(tensor.F16)
	i32s := func(shape ...int) *tensor.Tensor {
		x, err := s.b.Alloc(tensor.I32, shape)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.b.Free(x) })
		return x
	}
	// MatMul gradients: dy [2,3], w [3,4], x [2,4].
	dy23, w34, x24, dx24, dw34 := f32s(2, 3), f32s(3, 4), f32s(2, 4), f32s(2, 4), f32s(3, 4)
	// RMSNorm: [2,8] rows, weight [8].
	n28, norm8 := f32s(2, 8), f16s(8)
	// Attention: T=3, 4 heads, 2 KV heads of 8.
	q, kv, dq, dk := f32s(3, 32), f32s(3, 16), f32s(3, 32), f32s(3, 16)
	attn := func(dq, dk, dv, dout, q, k, v, out *tensor.Tensor, heads, kvHeads, headDim int) func() error {
		return func() error {
			return s.g.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: out}, tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Scale: 0.35})
		}
	}
	g := s.g
	cases := []struct {
		name string
		call func() error
	}{
		{"Zero/nil", func() error { return g.Zero(nil) }},

		{"MatMulGradX/nil dy", func() error { return g.MatMulGradX(dx24, nil, w34) }},
		{"MatMulGradX/nil w", func() error { return g.MatMulGradX(dx24, dy23, nil) }},
		{"MatMulGradX/nil dx", func() error { return g.MatMulGradX(nil, dy23, w34) }},
		{"MatMulGradX/N mismatch", func() error { return g.MatMulGradX(dx24, dy23, f32s(4, 4)) }},
		{"MatMulGradX/dx rows", func() error { return g.MatMulGradX(f32s(3, 4), dy23, w34) }},
		{"MatMulGradX/dx columns", func() error { return g.MatMulGradX(f32s(2, 3), dy23, w34) }},
		{"MatMulGradX/F16 dy", func() error { return g.MatMulGradX(dx24, f16s(2, 3), w34) }},
		{"MatMulGradX/F16 dx", func() error { return g.MatMulGradX(f16s(2, 4), dy23, w34) }},
		{"MatMulGradX/I32 w", func() error { return g.MatMulGradX(dx24, dy23, i32s(3, 4)) }},
		{"MatMulGradX/1-D dy", func() error { return g.MatMulGradX(dx24, f32s(3), w34) }},

		{"MatMulGradW/nil x", func() error { return g.MatMulGradW(dw34, dy23, nil) }},
		{"MatMulGradW/nil dw", func() error { return g.MatMulGradW(nil, dy23, x24) }},
		{"MatMulGradW/x rows", func() error { return g.MatMulGradW(dw34, dy23, f32s(3, 4)) }},
		{"MatMulGradW/dw shape", func() error { return g.MatMulGradW(f32s(4, 4), dy23, x24) }},
		{"MatMulGradW/F16 x", func() error { return g.MatMulGradW(dw34, dy23, f16s(2, 4)) }},
		{"MatMulGradW/F16 dw", func() error { return g.MatMulGradW(f16s(3, 4), dy23, x24) }},

		{"BiasGrad/nil dy", func() error { return g.BiasGrad(f32s(3), nil) }},
		{"BiasGrad/nil db", func() error { return g.BiasGrad(nil, dy23) }},
		{"BiasGrad/db length", func() error { return g.BiasGrad(f32s(2), dy23) }},
		{"BiasGrad/F16 db", func() error { return g.BiasGrad(f16s(3), dy23) }},
		{"BiasGrad/2-D db", func() error { return g.BiasGrad(f32s(1, 3), dy23) }},

		{"RMSNormGrad/nil x", func() error { return g.RMSNormGrad(f32s(2, 8), nil, n28, nil, norm8, 1e-5) }},
		{"RMSNormGrad/nil w", func() error { return g.RMSNormGrad(f32s(2, 8), nil, n28, n28, nil, 1e-5) }},
		{"RMSNormGrad/nil dx", func() error { return g.RMSNormGrad(nil, nil, n28, n28, norm8, 1e-5) }},
		{"RMSNormGrad/w length", func() error { return g.RMSNormGrad(f32s(2, 8), nil, n28, n28, f16s(7), 1e-5) }},
		{"RMSNormGrad/dw length", func() error { return g.RMSNormGrad(f32s(2, 8), f32s(7), n28, n28, norm8, 1e-5) }},
		{"RMSNormGrad/F16 dw", func() error { return g.RMSNormGrad(f32s(2, 8), f16s(8), n28, n28, norm8, 1e-5) }},
		{"RMSNormGrad/dy shape", func() error { return g.RMSNormGrad(f32s(2, 8), nil, f32s(3, 8), n28, norm8, 1e-5) }},
		{"RMSNormGrad/dx shape", func() error { return g.RMSNormGrad(f32s(2, 7), nil, n28, n28, norm8, 1e-5) }},
		{"RMSNormGrad/F16 x", func() error { return g.RMSNormGrad(f32s(2, 8), nil, n28, f16s(2, 8), norm8, 1e-5) }},
		{"RMSNormGrad/I32 w", func() error { return g.RMSNormGrad(f32s(2, 8), nil, n28, n28, i32s(8), 1e-5) }},

		{"SiLUMulGrad/up shape", func() error { return g.SiLUMulGrad(f32s(2, 4), f32s(2, 4), x24, x24, f32s(2, 5)) }},
		{"SiLUMulGrad/dout shape", func() error { return g.SiLUMulGrad(f32s(2, 4), f32s(2, 4), f32s(4, 2), x24, x24) }},
		{"SiLUMulGrad/dgate shape", func() error { return g.SiLUMulGrad(f32s(2, 3), f32s(2, 4), x24, x24, x24) }},
		{"SiLUMulGrad/dup shape", func() error { return g.SiLUMulGrad(f32s(2, 4), f32s(8), x24, x24, x24) }},
		{"SiLUMulGrad/F16 gate", func() error { return g.SiLUMulGrad(f32s(2, 4), f32s(2, 4), x24, f16s(2, 4), x24) }},
		{"SiLUMulGrad/nil dup", func() error { return g.SiLUMulGrad(f32s(2, 4), nil, x24, x24, x24) }},
		{"SiLUMulGrad/nil gate", func() error { return g.SiLUMulGrad(f32s(2, 4), f32s(2, 4), x24, nil, x24) }},

		{"AttentionGrad/kvHeads not dividing", attn(f32s(3, 24), f32s(3, 16), f32s(3, 16), f32s(3, 24), f32s(3, 24), kv, kv, f32s(3, 24), 3, 2, 8)},
		{"AttentionGrad/zero heads", attn(dq, dk, f32s(3, 16), q, q, kv, kv, q, 0, 2, 8)},
		{"AttentionGrad/zero headDim", attn(dq, dk, f32s(3, 16), q, q, kv, kv, q, 4, 2, 0)},
		{"AttentionGrad/q width", attn(dq, dk, f32s(3, 16), q, q, kv, kv, q, 4, 2, 4)},
		{"AttentionGrad/k rows", attn(dq, dk, f32s(3, 16), q, q, f32s(4, 16), kv, q, 4, 2, 8)},
		{"AttentionGrad/v width", attn(dq, dk, f32s(3, 16), q, q, kv, f32s(3, 32), q, 4, 2, 8)},
		{"AttentionGrad/out shape", attn(dq, dk, f32s(3, 16), q, q, kv, kv, f32s(2, 32), 4, 2, 8)},
		{"AttentionGrad/dout shape", attn(dq, dk, f32s(3, 16), f32s(3, 16), q, kv, kv, q, 4, 2, 8)},
		{"AttentionGrad/dq shape", attn(f32s(3, 16), dk, f32s(3, 16), q, q, kv, kv, q, 4, 2, 8)},
		{"AttentionGrad/dk shape", attn(dq, f32s(3, 32), f32s(3, 16), q, q, kv, kv, q, 4, 2, 8)},
		{"AttentionGrad/dv shape", attn(dq, dk, f32s(2, 16), q, q, kv, kv, q, 4, 2, 8)},
		{"AttentionGrad/F16 dq", attn(f16s(3, 32), dk, f32s(3, 16), q, q, kv, kv, q, 4, 2, 8)},
		{"AttentionGrad/F16 k", attn(dq, dk, f32s(3, 16), q, q, f16s(3, 16), kv, q, 4, 2, 8)},
		{"AttentionGrad/nil out", attn(dq, dk, f32s(3, 16), q, q, kv, kv, nil, 4, 2, 8)},
		{"AttentionGrad/nil dv", attn(dq, dk, nil, q, q, kv, kv, q, 4, 2, 8)},
		{"AttentionGrad/pos0", func() error {
			a := tensor.Attn{Q: q, K: kv, V: kv, Heads: 4, KVHeads: 2, HeadDim: 8, Pos0: 1, Scale: 0.35}
			return g.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: f32s(3, 16), DOut: q, Out: q}, a)
		}},
		{"AttentionGrad/NaN scale", func() error {
			a := tensor.Attn{Q: q, K: kv, V: kv, Heads: 4, KVHeads: 2, HeadDim: 8, Scale: float32(math.NaN())}
			return g.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: f32s(3, 16), DOut: q, Out: q}, a)
		}},

		{"CrossEntropyGrad/target = V", func() error { _, err := g.CrossEntropyGrad(f32s(2, 5), []int32{0, 5}, 1); return err }},
		{"CrossEntropyGrad/target > V", func() error { _, err := g.CrossEntropyGrad(f32s(2, 5), []int32{1 << 30, 0}, 1); return err }},
		{"CrossEntropyGrad/rows", func() error { _, err := g.CrossEntropyGrad(f32s(2, 5), []int32{0, 1, 2}, 1); return err }},
		{"CrossEntropyGrad/F16 logits", func() error { _, err := g.CrossEntropyGrad(f16s(2, 5), []int32{0, 1}, 1); return err }},
		{"CrossEntropyGrad/nil logits", func() error { _, err := g.CrossEntropyGrad(nil, []int32{0}, 1); return err }},
		{"CrossEntropyGrad/1-D logits", func() error { _, err := g.CrossEntropyGrad(f32s(5), []int32{0}, 1); return err }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("panicked instead of returning an error: %v", p)
				}
			}()
			if err := c.call(); err == nil {
				t.Fatalf("no error")
			} else {
				t.Logf("error: %v", err)
			}
		})
	}
}

// FuzzMatMulGrad fuzzes b's MatMulGradX and MatMulGradW against
// RefMatMulGradX and RefMatMulGradW over shapes M in [1, 70], N and K in [1,
// 600], every weight type. As in FuzzMatMul the error is measured against
// the products of the absolute values, the scale of float32 rounding error
// in a sum. Call it from a Fuzz function of the backend's package:
//
//	func FuzzCPUMatMulGrad(f *testing.F) { tensortest.FuzzMatMulGrad(f, tensor.NewCPU(0)) }
func FuzzMatMulGrad(f *testing.F, b tensor.Backend, opts ...Option) {
	cfg := newConfig(opts)
	g, ok := tensor.CheckedGrad(b)
	if !ok {
		f.Fatalf("backend %s (%T) does not implement tensor.GradOps", b.Name(), b)
	}
	b = tensor.Checked(b)
	for _, seed := range []struct {
		m        uint8
		n, k     uint16
		dt       uint8
		seedBits int64
	}{{1, 5, 7, 0, 1}, {67, 130, 257, 1, 2}, {3, 513, 172, 2, 3}, {40, 1, 1, 1, 4}, {13, 64, 600, 0, 5}} {
		f.Add(seed.m, seed.n, seed.k, seed.dt, seed.seedBits)
	}
	f.Fuzz(func(t *testing.T, m uint8, n, k uint16, dt uint8, seed int64) {
		M, N, K := 1+int(m)%70, 1+int(n)%600, 1+int(k)%600
		wdt := weightTypes[int(dt)%len(weightTypes)]
		s := &suite{b: b, cfg: cfg}
		r := newRand(uint64(seed))
		dy, dyv := s.put(t, tensor.F32, tensor.Shape{M, N}, uniform(r, M*N, -1, 1))
		w, wv := s.put(t, wdt, tensor.Shape{N, K}, uniform(r, N*K, -1, 1))
		x, xv := s.put(t, tensor.F32, tensor.Shape{M, K}, uniform(r, M*K, -1, 1))
		dx, dx0 := s.put(t, tensor.F32, tensor.Shape{M, K}, uniform(r, M*K, -1, 1))
		dw, dw0 := s.put(t, tensor.F32, tensor.Shape{N, K}, uniform(r, N*K, -1, 1))
		if err := g.MatMulGradX(dx, dy, w); err != nil {
			t.Fatalf("MatMulGradX M=%d N=%d K=%d %v: %v", M, N, K, wdt, err)
		}
		if err := g.MatMulGradW(dw, dy, x); err != nil {
			t.Fatalf("MatMulGradW M=%d N=%d K=%d: %v", M, N, K, err)
		}
		for _, c := range []struct {
			what       string
			got        []float32
			want, size []float64
		}{
			{"MatMulGradX", s.get(t, dx), RefAdd(dx0, RefMatMulGradX(dyv, wv, M, N, K)), RefAdd(abs(dx0), RefMatMulGradX(abs(dyv), abs(wv), M, N, K))},
			{"MatMulGradW", s.get(t, dw), RefAdd(dw0, RefMatMulGradW(dyv, xv, M, N, K)), RefAdd(abs(dw0), RefMatMulGradW(abs(dyv), abs(xv), M, N, K))},
		} {
			var num, den float64
			for i, v := range c.got {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					t.Fatalf("%s M=%d N=%d K=%d %v: element %d is %v", c.what, M, N, K, wdt, i, v)
				}
				d := float64(v) - c.want[i]
				num += d * d
				den += c.size[i] * c.size[i]
			}
			if e := math.Sqrt(num / den); !(e <= cfg.tol) {
				t.Fatalf("%s M=%d N=%d K=%d %v: error %.3g > %.3g relative to the absolute values", c.what, M, N, K, wdt, e, cfg.tol)
			}
		}
	})
}
