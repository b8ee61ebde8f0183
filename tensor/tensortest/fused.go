package tensortest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// FusedTolerance sets the largest relative error accepted between a fused
// operation (tensor.AddRMSNorm, RopeKV, GateUpSiLU) and the unfused
// operations it replaces on the same backend, and between an operation
// given its position in PosAt and the same one given Pos0 (default 1e-5;
// 0 asks for the same bits).
func FusedTolerance(rel float64) Option { return func(c *config) { c.fusedTol = rel } }

// position uploads p as the I32 [1] tensor an operation's PosAt reads.
func (s *suite) position(t *testing.T, p int) *tensor.Tensor {
	t.Helper()
	at, err := s.b.Alloc(tensor.I32, tensor.Shape{1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.b.Free(at) })
	var buf [4]byte
	binary.LittleEndian.PutUint32(buf[:], uint32(int32(p)))
	if err := s.b.Upload(at, 0, buf[:]); err != nil {
		t.Fatal(err)
	}
	return at
}

// same fails t unless got equals want within the fused tolerance (bit for
// bit at 0).
func (s *suite) same(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if s.cfg.fusedTol == 0 {
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("%s: element %d is %v, the unfused path's %v (want the same bits)", what, i, got[i], want[i])
			}
		}
		return
	}
	w := make([]float64, len(want))
	for i, v := range want {
		w[i] = float64(v)
	}
	compare(t, s.cfg.fusedTol, what, got, w)
}

// testPosAt checks Rope and Attention given their position in PosAt: the
// reference's result at that position, and the same result as with Pos0,
// while Pos0 is a larger bound and the cache rows past the position hold
// NaN.
func (s *suite) testPosAt(t *testing.T) {
	cases := []struct{ t, heads, kvHeads, headDim, pos, bound int }{
		{1, 4, 2, 16, 0, 8}, {1, 8, 8, 64, 37, 63}, {3, 4, 1, 32, 5, 9}, {1, 6, 2, 128, 100, 100},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("T%d_H%d_KV%d_D%d_pos%d_bound%d", c.t, c.heads, c.kvHeads, c.headDim, c.pos, c.bound), func(t *testing.T) {
			r := rng(t)
			maxPos := c.bound + c.t
			cos64, sin64 := RopeTables(maxPos, c.headDim, 10000)
			half := tensor.Shape{maxPos, c.headDim / 2}
			cos, cv := s.put(t, tensor.F32, half, f32(cos64))
			sin, sv := s.put(t, tensor.F32, half, f32(sin64))
			at := s.position(t, c.pos)
			qw, kw := c.heads*c.headDim, c.kvHeads*c.headDim
			xs := uniform(r, c.t*qw, -2, 2)
			x1, xv := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, xs)
			x2, _ := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, xs)
			rot := tensor.Rotary{Cos: cos, Sin: sin, Heads: c.heads, HeadDim: c.headDim, Pos0: c.bound, PosAt: at}
			if err := s.b.Rope(x1, rot); err != nil {
				t.Fatal(err)
			}
			rot.Pos0, rot.PosAt = c.pos, nil
			if err := s.b.Rope(x2, rot); err != nil {
				t.Fatal(err)
			}
			got := s.get(t, x1)
			s.compare(t, "Rope with PosAt", got, RefRope(xv, cv, sv, c.t, c.heads, c.headDim, c.pos))
			s.same(t, "Rope with PosAt against Pos0", got, s.get(t, x2))

			filled := (c.pos + c.t) * kw
			kvals := append(uniform(r, filled, -1, 1), nans(maxPos*kw-filled)...)
			vvals := append(uniform(r, filled, -1, 1), nans(maxPos*kw-filled)...)
			k, kv := s.put(t, tensor.F32, tensor.Shape{maxPos, kw}, kvals)
			v, vv := s.put(t, tensor.F32, tensor.Shape{maxPos, kw}, vvals)
			q, qv := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -1, 1))
			out1, out2 := s.poisoned(t, tensor.Shape{c.t, qw}), s.poisoned(t, tensor.Shape{c.t, qw})
			scale := float32(1 / math.Sqrt(float64(c.headDim)))
			a := tensor.Attn{Q: q, K: k, V: v, Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, Pos0: c.bound, Scale: scale, PosAt: at}
			if err := s.b.Attention(out1, a); err != nil {
				t.Fatal(err)
			}
			a.Pos0, a.PosAt = c.pos, nil
			if err := s.b.Attention(out2, a); err != nil {
				t.Fatal(err)
			}
			got = s.get(t, out1)
			s.compare(t, "Attention with PosAt", got, RefAttention(qv, kv[:filled], vv[:filled], c.t, c.heads, c.kvHeads, c.headDim, c.pos, float64(scale)))
			s.same(t, "Attention with PosAt against Pos0", got, s.get(t, out2))
		})
	}
	t.Run("malformed", func(t *testing.T) {
		cos, _ := s.put(t, tensor.F32, tensor.Shape{8, 8}, make([]float32, 64))
		sin, _ := s.put(t, tensor.F32, tensor.Shape{8, 8}, make([]float32, 64))
		x, _ := s.put(t, tensor.F32, tensor.Shape{1, 32}, make([]float32, 32))
		f, _ := s.put(t, tensor.F32, tensor.Shape{1}, []float32{1})
		for _, at := range []*tensor.Tensor{f, x} {
			if err := s.b.Rope(x, tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16, Pos0: 3, PosAt: at}); err == nil {
				t.Errorf("Rope with PosAt %v: no error", at)
			}
		}
	})
}

// testFused checks the fused operations against the unfused ones on the
// same backend, and against the float64 references.
func (s *suite) testFused(t *testing.T) {
	for _, dt := range weightTypes {
		for _, sh := range []struct{ m, d int }{{1, 64}, {1, 4096}, {3, 1000}, {2, 5}, {2, 8192}, {1, 8200}, {64, 128}} {
			t.Run(fmt.Sprintf("AddRMSNorm/%v_M%d_D%d", dt, sh.m, sh.d), func(t *testing.T) {
				r := rng(t)
				n := sh.m * sh.d
				xs, ds := uniform(r, n, -2, 2), uniform(r, n, -1, 1)
				w, wv := s.put(t, dt, tensor.Shape{sh.d}, uniform(r, sh.d, 0.5, 1.5))
				x1, xv := s.put(t, tensor.F32, tensor.Shape{sh.m, sh.d}, xs)
				d1, dv := s.put(t, tensor.F32, tensor.Shape{sh.m, sh.d}, ds)
				x2, _ := s.put(t, tensor.F32, tensor.Shape{sh.m, sh.d}, xs)
				d2, _ := s.put(t, tensor.F32, tensor.Shape{sh.m, sh.d}, ds)
				out1, out2 := s.poisoned(t, tensor.Shape{sh.m, sh.d}), s.poisoned(t, tensor.Shape{sh.m, sh.d})
				if err := tensor.AddRMSNorm(s.b, out1, x1, d1, w, 1e-5); err != nil {
					t.Fatal(err)
				}
				if err := s.b.Add(x2, x2, d2); err != nil {
					t.Fatal(err)
				}
				if err := s.b.RMSNorm(out2, x2, w, 1e-5); err != nil {
					t.Fatal(err)
				}
				sum := RefAdd(xv, dv)
				s.compare(t, "AddRMSNorm's x", s.get(t, x1), sum)
				s.compare(t, "AddRMSNorm's out", s.get(t, out1), RefRMSNorm(sum, wv, sh.m, sh.d, 1e-5))
				s.same(t, "AddRMSNorm's x against Add", s.get(t, x1), s.get(t, x2))
				s.same(t, "AddRMSNorm's out against RMSNorm", s.get(t, out1), s.get(t, out2))
			})
		}
		for _, sh := range []struct{ m, n, k int }{{1, 96, 64}, {1, 344, 4096}, {2, 40, 72}, {3, 17, 64}, {1, 5, 7}} {
			t.Run(fmt.Sprintf("GateUpSiLU/%v_M%d_N%d_K%d", dt, sh.m, sh.n, sh.k), func(t *testing.T) {
				r := rng(t)
				x, xv := s.put(t, tensor.F32, tensor.Shape{sh.m, sh.k}, uniform(r, sh.m*sh.k, -1, 1))
				wg, gv := s.put(t, dt, tensor.Shape{sh.n, sh.k}, uniform(r, sh.n*sh.k, -0.2, 0.2))
				wu, uv := s.put(t, dt, tensor.Shape{sh.n, sh.k}, uniform(r, sh.n*sh.k, -0.2, 0.2))
				out1, up1 := s.poisoned(t, tensor.Shape{sh.m, sh.n}), s.poisoned(t, tensor.Shape{sh.m, sh.n})
				out2, up2 := s.poisoned(t, tensor.Shape{sh.m, sh.n}), s.poisoned(t, tensor.Shape{sh.m, sh.n})
				if err := tensor.GateUpSiLU(s.b, out1, up1, x, wg, wu); err != nil {
					t.Fatal(err)
				}
				if err := s.b.MatMul(out2, x, wg, nil); err != nil {
					t.Fatal(err)
				}
				if err := s.b.MatMul(up2, x, wu, nil); err != nil {
					t.Fatal(err)
				}
				if err := s.b.SiLUMul(out2, out2, up2); err != nil {
					t.Fatal(err)
				}
				got := s.get(t, out1)
				want := RefSiLUMul(RefMatMul(xv, gv, nil, sh.m, sh.n, sh.k), RefMatMul(xv, uv, nil, sh.m, sh.n, sh.k))
				s.compare(t, "GateUpSiLU", got, want)
				s.same(t, "GateUpSiLU against MatMul, MatMul, SiLUMul", got, s.get(t, out2))
			})
		}
	}
	for _, dt := range weightTypes {
		for _, sh := range []struct {
			m, k int
			ns   []int
		}{{1, 64, []int{96, 32, 32}}, {1, 4096, []int{512, 128, 128}}, {2, 72, []int{40, 8, 8}}, {1, 64, []int{17}}, {3, 16, []int{5, 7}}, {1, 7, []int{3, 3, 3}}} {
			t.Run(fmt.Sprintf("MatMulMany/%v_M%d_K%d_N%v", dt, sh.m, sh.k, sh.ns), func(t *testing.T) {
				r := rng(t)
				x, xv := s.put(t, tensor.F32, tensor.Shape{sh.m, sh.k}, uniform(r, sh.m*sh.k, -1, 1))
				var outs, ws []*tensor.Tensor
				var wvs [][]float64
				for _, n := range sh.ns {
					w, wv := s.put(t, dt, tensor.Shape{n, sh.k}, uniform(r, n*sh.k, -0.5, 0.5))
					ws, wvs = append(ws, w), append(wvs, wv)
					outs = append(outs, s.poisoned(t, tensor.Shape{sh.m, n}))
				}
				if err := tensor.MatMulMany(s.b, outs, x, ws); err != nil {
					t.Fatal(err)
				}
				for i, n := range sh.ns {
					one := s.poisoned(t, tensor.Shape{sh.m, n})
					if err := s.b.MatMul(one, x, ws[i], nil); err != nil {
						t.Fatal(err)
					}
					got := s.get(t, outs[i])
					s.compare(t, fmt.Sprintf("MatMulMany's product %d", i), got, RefMatMul(xv, wvs[i], nil, sh.m, n, sh.k))
					s.same(t, fmt.Sprintf("MatMulMany's product %d against MatMul", i), got, s.get(t, one))
				}
			})
		}
	}
	for _, sh := range []struct{ t, k, d int }{{1, 8, 2048}, {1, 2, 4096}, {3, 2, 64}, {5, 4, 6}, {2, 1, 10}} {
		t.Run(fmt.Sprintf("CombineRows/T%d_K%d_D%d", sh.t, sh.k, sh.d), func(t *testing.T) {
			if !tensor.CanCombineRows(s.b) {
				t.Skipf("%s has no CombineRows", s.b.Name())
			}
			r := rng(t)
			rows := sh.t * sh.k
			srcVals, wVals := uniform(r, rows*sh.d, -2, 2), uniform(r, rows, 0, 1)
			idx := make([]int32, rows)
			for i, p := range r.Perm(rows) { // each row once, in an order of its own
				idx[i] = int32(p)
			}
			src, sv := s.put(t, tensor.F32, tensor.Shape{rows, sh.d}, srcVals)
			w, wv := s.put(t, tensor.F32, tensor.Shape{rows, 1}, wVals)
			out := s.poisoned(t, tensor.Shape{sh.t, sh.d})
			if err := tensor.CombineRows(s.b, out, src, w, idx, sh.k); err != nil {
				t.Fatal(err)
			}
			want := make([]float64, sh.t*sh.d)
			for i := range sh.t {
				for j := range sh.k {
					row := int(idx[i*sh.k+j])
					for c := range sh.d {
						want[i*sh.d+c] += wv[row] * sv[row*sh.d+c]
					}
				}
			}
			got := s.get(t, out)
			s.compare(t, "CombineRows", got, want)

			// The unfused path: scale src's rows by w (a Rope whose cosine
			// is w and sine zero), then gather and add a slot at a time.
			scaled, _ := s.put(t, tensor.F32, tensor.Shape{rows, sh.d}, srcVals)
			zero, _ := s.put(t, tensor.F32, tensor.Shape{rows, 1}, make([]float32, rows))
			if sh.d%2 == 0 {
				if err := s.b.Rope(scaled, tensor.Rotary{Cos: w, Sin: zero, Heads: sh.d / 2, HeadDim: 2}); err != nil {
					t.Fatal(err)
				}
				sum, tmp := s.poisoned(t, tensor.Shape{sh.t, sh.d}), s.poisoned(t, tensor.Shape{sh.t, sh.d})
				ids := make([]int32, sh.t)
				for j := range sh.k {
					for i := range sh.t {
						ids[i] = idx[i*sh.k+j]
					}
					dst := sum
					if j > 0 {
						dst = tmp
					}
					if err := s.b.Embed(dst, scaled, ids); err != nil {
						t.Fatal(err)
					}
					if j > 0 {
						if err := s.b.Add(sum, sum, tmp); err != nil {
							t.Fatal(err)
						}
					}
				}
				s.same(t, "CombineRows against Rope, Embed and Add", got, s.get(t, sum))
			}
		})
	}
	t.Run("CombineRows/malformed", func(t *testing.T) {
		src, _ := s.put(t, tensor.F32, tensor.Shape{4, 8}, make([]float32, 32))
		w, _ := s.put(t, tensor.F32, tensor.Shape{4, 1}, make([]float32, 4))
		w3, _ := s.put(t, tensor.F32, tensor.Shape{3, 1}, make([]float32, 3))
		out, _ := s.put(t, tensor.F32, tensor.Shape{2, 8}, make([]float32, 16))
		for _, c := range []struct {
			name     string
			out, src *tensor.Tensor
			w        *tensor.Tensor
			idx      []int32
			k        int
		}{
			{"an index past src", out, src, w, []int32{0, 1, 2, 4}, 2},
			{"a negative index", out, src, w, []int32{0, -1, 2, 3}, 2},
			{"too few indices", out, src, w, []int32{0, 1, 2}, 2},
			{"k of 0", out, src, w, nil, 0},
			{"a weight short of src's rows", out, src, w3, []int32{0, 1, 2, 3}, 2},
			{"out is src", src, src, w, []int32{0, 1, 2, 3, 0, 1, 2, 3}, 2},
		} {
			if err := tensor.CombineRows(s.b, c.out, c.src, c.w, c.idx, c.k); err == nil {
				t.Errorf("CombineRows with %s: no error", c.name)
			}
		}
	})
	t.Run("MatMulMany/malformed", func(t *testing.T) {
		x, _ := s.put(t, tensor.F32, tensor.Shape{1, 8}, make([]float32, 8))
		w, _ := s.put(t, tensor.F32, tensor.Shape{4, 8}, make([]float32, 32))
		o1, _ := s.put(t, tensor.F32, tensor.Shape{1, 4}, make([]float32, 4))
		o2, _ := s.put(t, tensor.F32, tensor.Shape{1, 5}, make([]float32, 5))
		for _, c := range []struct {
			name     string
			outs, ws []*tensor.Tensor
		}{
			{"lengths", []*tensor.Tensor{o1}, []*tensor.Tensor{w, w}},
			{"same output twice", []*tensor.Tensor{o1, o1}, []*tensor.Tensor{w, w}},
			{"output of the wrong width", []*tensor.Tensor{o1, o2}, []*tensor.Tensor{w, w}},
			{"output is x", []*tensor.Tensor{x}, []*tensor.Tensor{w}},
		} {
			if err := tensor.MatMulMany(s.b, c.outs, x, c.ws); err == nil {
				t.Errorf("MatMulMany with %s: no error", c.name)
			}
		}
	})
	for _, c := range []struct {
		t, heads, kvHeads, headDim, pos int
		posAt                           bool
		cache                           tensor.DType
	}{
		{1, 8, 2, 64, 9, false, tensor.F32}, {1, 8, 2, 64, 9, true, tensor.F32}, {5, 4, 4, 16, 0, false, tensor.F32}, {3, 6, 2, 128, 11, true, tensor.F32},
		// A Q8_0 cache: the fused operation quantizes the rotated keys
		// as CopyRows does.
		{1, 8, 2, 64, 9, true, tensor.Q8_0}, {5, 4, 2, 16, 2, false, tensor.Q8_0},
		// Q8_B8: blocks of 8, heads of 12 start inside one.
		{1, 8, 2, 64, 9, true, tensor.Q8_B8}, {3, 4, 2, 12, 5, false, tensor.Q8_B8},
	} {
		if c.cache != tensor.F32 && !slices.Contains(s.cfg.cacheTypes, c.cache) {
			continue
		}
		t.Run(fmt.Sprintf("RopeKV/%v/T%d_H%d_KV%d_D%d_pos%d_posAt=%v", c.cache, c.t, c.heads, c.kvHeads, c.headDim, c.pos, c.posAt), func(t *testing.T) {
			r := rng(t)
			maxPos := c.pos + c.t + 4
			cos64, sin64 := RopeTables(maxPos, c.headDim, 10000)
			half := tensor.Shape{maxPos, c.headDim / 2}
			cos, _ := s.put(t, tensor.F32, half, f32(cos64))
			sin, _ := s.put(t, tensor.F32, half, f32(sin64))
			qw, kw := c.heads*c.headDim, c.kvHeads*c.headDim
			qs, ks, vs := uniform(r, c.t*qw, -1, 1), uniform(r, c.t*kw, -1, 1), uniform(r, c.t*kw, -1, 1)
			cache := uniform(r, maxPos*kw, -1, 1)
			var q, k, v, kc, vc [2]*tensor.Tensor
			for i := range 2 {
				q[i], _ = s.put(t, tensor.F32, tensor.Shape{c.t, qw}, qs)
				k[i], _ = s.put(t, tensor.F32, tensor.Shape{c.t, kw}, ks)
				v[i], _ = s.put(t, tensor.F32, tensor.Shape{c.t, kw}, vs)
				kc[i], _ = s.put(t, c.cache, tensor.Shape{maxPos, kw}, cache)
				vc[i], _ = s.put(t, c.cache, tensor.Shape{maxPos, kw}, cache)
			}
			rot := tensor.Rotary{Cos: cos, Sin: sin, Heads: c.heads, HeadDim: c.headDim, Pos0: c.pos}
			fused := rot
			if c.posAt {
				fused.Pos0, fused.PosAt = maxPos-c.t, s.position(t, c.pos)
			}
			if err := tensor.RopeKV(s.b, q[0], k[0], v[0], kc[0], vc[0], fused); err != nil {
				t.Fatal(err)
			}
			if err := s.b.Rope(q[1], rot); err != nil {
				t.Fatal(err)
			}
			rot.Heads = c.kvHeads
			if err := s.b.Rope(k[1], rot); err != nil {
				t.Fatal(err)
			}
			if err := s.b.CopyRows(kc[1], c.pos, k[1], 0, c.t); err != nil {
				t.Fatal(err)
			}
			if err := s.b.CopyRows(vc[1], c.pos, v[1], 0, c.t); err != nil {
				t.Fatal(err)
			}
			s.same(t, "RopeKV's q against Rope", s.get(t, q[0]), s.get(t, q[1]))
			s.same(t, "RopeKV's key cache against Rope and CopyRows", s.get(t, kc[0]), s.get(t, kc[1]))
			s.same(t, "RopeKV's value cache against CopyRows", s.get(t, vc[0]), s.get(t, vc[1]))
		})
	}
	t.Run("RopeKV/position-beyond-bound", func(t *testing.T) {
		cos, _ := s.put(t, tensor.F32, tensor.Shape{8, 8}, make([]float32, 64))
		sin, _ := s.put(t, tensor.F32, tensor.Shape{8, 8}, make([]float32, 64))
		q, _ := s.put(t, tensor.F32, tensor.Shape{1, 32}, make([]float32, 32))
		k, _ := s.put(t, tensor.F32, tensor.Shape{1, 16}, make([]float32, 16))
		v, _ := s.put(t, tensor.F32, tensor.Shape{1, 16}, make([]float32, 16))
		kc, _ := s.put(t, tensor.F32, tensor.Shape{8, 16}, make([]float32, 128))
		vc, _ := s.put(t, tensor.F32, tensor.Shape{8, 16}, make([]float32, 128))
		bad := []struct {
			name string
			r    tensor.Rotary
			kc   *tensor.Tensor
		}{
			{"past the cache", tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16, Pos0: 8}, kc},
			{"cache is q", tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16, Pos0: 0}, q},
			{"odd head", tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 15, Pos0: 0}, kc},
		}
		for _, b := range bad {
			if err := tensor.RopeKV(s.b, q, k, v, b.kc, vc, b.r); err == nil {
				t.Errorf("RopeKV %s: no error", b.name)
			}
		}
		if on := s.position(t, 5); on.OnHost() {
			// Only the CPU can see a position above its bound; a device
			// clamps it.
			err := tensor.RopeKV(s.b, q, k, v, kc, vc, tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16, Pos0: 3, PosAt: on})
			if !errors.Is(err, tensor.ErrPosition) {
				t.Errorf("RopeKV with PosAt 5 above Pos0 3: %v, want ErrPosition", err)
			}
		}
	})
}
