//go:build cuda

package cuda

import (
	"fmt"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// gemvShapes are the decode shapes of the 7B and 1.1B models, and odd ones:
// N not a multiple of a block's rows (the last group's rows read row N-1
// and write nothing), K whose chunks do not fill a batch or a split, one
// row, one chunk.
var gemvShapes = []struct{ n, k int }{
	{4096, 4096}, {11008, 4096}, {4096, 11008}, {2048, 2048}, {5632, 2048}, {2048, 5632},
	{4097, 512}, {33, 2056}, {1, 8}, {7, 24}, {301, 4104},
}

// TestGEMVVariants checks every candidate M = 1 GEMV (gemvVariants) on
// F16 and BF16 weights against the float64 product of the stored weights
// (norm-wise relative error at most 1e-5: F32 sums of up to 11008
// products) and against the default kernels: bit for bit where the
// variant sums a row in one warp (s = 1), within 1e-6 where warps split
// it. MatMul, MatMulMany over three matrices of uneven rows, and
// GateUpSiLU against silu(g)*u; it logs the largest errors it saw.
func TestGEMVVariants(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		for _, s := range gemvShapes {
			xv := uniform(r, s.k, -1, 1)
			x, xs := put(t, b, tensor.F32, tensor.Shape{1, s.k}, xv)
			w, ws := put(t, b, dt, tensor.Shape{s.n, s.k}, uniform(r, s.n*s.k, -1, 1))
			u, us := put(t, b, dt, tensor.Shape{s.n, s.k}, uniform(r, s.n*s.k, -1, 1))
			want := tensortest.RefMatMul(xs, ws, nil, 1, s.n, s.k)
			wantU := tensortest.RefMatMul(xs, us, nil, 1, s.n, s.k)
			wantGU := make([]float64, s.n)
			for i := range wantGU {
				wantGU[i] = want[i] / (1 + math.Exp(-want[i])) * wantU[i]
			}
			// The three of MatMulMany: w, then u's first rows, then w's
			// last rows (views: rows of a matrix at an offset, 16-byte
			// aligned as K is a multiple of 8).
			n1, n2 := max(1, s.n/4), max(1, s.n/3)
			u1, err := u.Rows(0, n1)
			if err != nil {
				t.Fatal(err)
			}
			w2, err := w.Rows(s.n-n2, n2)
			if err != nil {
				t.Fatal(err)
			}
			run := func(v *gemvVariant) (mm, many0, many1, many2, gu []float32) {
				b.gemvSplit = v
				defer func() { b.gemvSplit = nil }()
				out, _ := put(t, b, tensor.F32, tensor.Shape{1, s.n}, nanSlice(s.n))
				o1, _ := put(t, b, tensor.F32, tensor.Shape{1, n1}, nanSlice(n1))
				o2, _ := put(t, b, tensor.F32, tensor.Shape{1, n2}, nanSlice(n2))
				g, _ := put(t, b, tensor.F32, tensor.Shape{1, s.n}, nanSlice(s.n))
				up, _ := put(t, b, tensor.F32, tensor.Shape{1, s.n}, nanSlice(s.n))
				if err := b.MatMul(out, x, w, nil); err != nil {
					t.Fatal(err)
				}
				mm = get(t, b, out)
				if err := b.MatMulMany([]*tensor.Tensor{out, o1, o2}, x, []*tensor.Tensor{w, u1, w2}); err != nil {
					t.Fatal(err)
				}
				many0, many1, many2 = get(t, b, out), get(t, b, o1), get(t, b, o2)
				if err := b.GateUpSiLU(g, up, x, w, u); err != nil {
					t.Fatal(err)
				}
				return mm, many0, many1, many2, get(t, b, g)
			}
			dmm, d0, d1, d2, dgu := run(nil)
			for i := range gemvVariants {
				v := &gemvVariants[i]
				if v.pdl && b.info.Major < 9 {
					continue // pdlKernels are not loaded
				}
				name := fmt.Sprintf("%v/N%d_K%d/%s", dt, s.n, s.k, v.name)
				mm, m0, m1, m2, gu := run(v)
				worst := 0.0
				for _, c := range []struct {
					what string
					got  []float32
					want []float64
				}{
					{"MatMul", mm, want}, {"MatMulMany[0]", m0, want}, {"MatMulMany[1]", m1, wantU[:n1]},
					{"MatMulMany[2]", m2, want[s.n-n2:]}, {"GateUpSiLU", gu, wantGU},
				} {
					e := tensortest.RelErr(c.got, c.want)
					if !(e <= 1e-5) {
						t.Errorf("%s: %s differs from the float64 product by %.3g", name, c.what, e)
					}
					worst = max(worst, e)
				}
				same := 0.0
				for _, c := range []struct {
					what      string
					got, dflt []float32
				}{{"MatMul", mm, dmm}, {"MatMulMany[0]", m0, d0}, {"MatMulMany[1]", m1, d1}, {"MatMulMany[2]", m2, d2}, {"GateUpSiLU", gu, dgu}} {
					d := make([]float64, len(c.dflt))
					for j, x := range c.dflt {
						d[j] = float64(x)
					}
					e := tensortest.RelErr(c.got, d)
					split := v.s > 1 || c.what == "GateUpSiLU" && v.gs > 1
					if !split && e != 0 || !(e <= 1e-6) {
						t.Errorf("%s: %s differs from the default kernel's by %.3g (split across warps: %v)", name, c.what, e, split)
					}
					same = max(same, e)
				}
				t.Logf("%s: error %.2g against float64, %.2g against the default kernels", name, worst, same)
			}
		}
	}
}

// TestGEMVVariantsSuite runs the shared backend suite with each candidate
// GEMV in place of the default kernels.
func TestGEMVVariantsSuite(t *testing.T) {
	b := openGPU(t)
	for i := range gemvVariants {
		v := &gemvVariants[i]
		t.Run(v.name, func(t *testing.T) {
			if v.pdl && b.info.Major < 9 {
				t.Skipf("compute capability %d.%d: the PDL kernels need 9.0", b.info.Major, b.info.Minor)
			}
			b.gemvSplit = v
			defer func() { b.gemvSplit = nil }()
			tensortest.TestBackend(t, b, tensortest.Tolerance(1e-2))
		})
	}
}

// TestGEMVEnv checks that GEMVEnv picks the kernels at Open and that a
// name of none is refused, naming the ones there are.
func TestGEMVEnv(t *testing.T) {
	for _, c := range []struct {
		val   string
		split string
		rows  int
		err   bool
	}{{"", "", 0, false}, {"shape", "", 0, false}, {"m1", "", -1, false}, {"r2", "", 2, false}, {"s2", "s2", 0, false}, {"b16", "b16", 0, false}, {"fast", "", 0, true}} {
		v, rows, err := gemvVariantNamed(c.val)
		if c.err {
			if err == nil || !strings.Contains(err.Error(), GEMVEnv+`="fast"`) || !strings.Contains(err.Error(), "m1, r1, r2, shape, b8, b16") {
				t.Errorf("%s=%q: error %v, want one naming the variable, the value and the kernels", GEMVEnv, c.val, err)
			}
			continue
		}
		name := ""
		if v != nil {
			name = v.name
		}
		if err != nil || name != c.split || rows != c.rows {
			t.Errorf("%s=%q: variant %q, rows %d, error %v; want %q, %d", GEMVEnv, c.val, name, rows, err, c.split, c.rows)
		}
	}
	if os.Getenv(GEMVEnv) != "" {
		t.Skipf("%s is set in the environment", GEMVEnv)
	}
	t.Setenv(GEMVEnv, "")
	b := openGPU(t)
	if want := defaultGEMV; b.info.Major < 9 {
		if b.gemvSplit != nil {
			t.Errorf("Open with %s unset on compute capability %d.%d: variant %s, want the per-shape kernels", GEMVEnv, b.info.Major, b.info.Minor, b.gemvSplit.name)
		}
	} else if b.gemvSplit == nil || b.gemvSplit.name != want {
		t.Errorf("Open with %s unset: variant %v, want %s", GEMVEnv, b.gemvSplit, want)
	}
	t.Setenv(GEMVEnv, "shape")
	if b = openGPU(t); b.gemvSplit != nil {
		t.Errorf("Open with %s=shape: variant %s, want the per-shape kernels", GEMVEnv, b.gemvSplit.name)
	}
	t.Setenv(GEMVEnv, "s4")
	b = openGPU(t)
	if b.gemvSplit == nil || b.gemvSplit.name != "s4" {
		t.Errorf("Open with %s=s4 left the GEMV variant %v", GEMVEnv, b.gemvSplit)
	}
	t.Setenv(GEMVEnv, "nope")
	if b, err := Open(0); err == nil {
		b.Close()
		t.Errorf("Open with %s=nope succeeded", GEMVEnv)
	}
}

// TestGEMVVariantsChain runs 24 decode steps of a TinyLlama-1.1B block
// (norm, q/k/v as one MatMulMany, RopeKV, attention, o product,
// AddRMSNorm, GateUpSiLU, down product, residual) with each candidate
// GEMV and with auto (each product's by its shape), eagerly and replayed
// as a graph, against the per-shape kernels:
// the products of one step feed the next kernels, so a PDL variant
// (b8p, s2p, s4p) that read its input or wrote its output before the
// kernel before it had finished would differ. The residual must agree
// within 1e-5 (relative) at every step; it logs the largest difference.
func TestGEMVVariantsChain(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	weights := randomWeights(r)
	x0 := uniform(r, tinyLlama.d, -1, 1)
	const steps = 24
	b.gemvSplit = nil // the per-shape kernels
	want := newMiniStep(t, b, tinyLlama, x0, weights)
	var wants [][]float64
	for p := range steps {
		if err := want.run(p, -1); err != nil {
			t.Fatal(err)
		}
		x := get(t, b, want.x)
		w := make([]float64, len(x))
		for i, v := range x {
			w[i] = float64(v)
		}
		wants = append(wants, w)
	}
	variants := []*gemvVariant{gemvShaped}
	for i := range gemvVariants {
		variants = append(variants, &gemvVariants[i])
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			if v.pdl && b.info.Major < 9 {
				t.Skipf("compute capability %d.%d: the PDL kernels need 9.0", b.info.Major, b.info.Minor)
			}
			b.gemvSplit = v
			defer func() { b.gemvSplit = nil }()
			eager, graphed := newMiniStep(t, b, tinyLlama, x0, weights), newMiniStep(t, b, tinyLlama, x0, weights)
			g, err := b.Capture(func() error { return graphed.run(0, steps-1) })
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			worst := 0.0
			for p := range steps {
				if err := eager.run(p, -1); err != nil {
					t.Fatal(err)
				}
				if err := b.SetPosition(graphed.pos, p); err != nil {
					t.Fatal(err)
				}
				if err := g.Replay(); err != nil {
					t.Fatal(err)
				}
				for _, c := range []struct {
					what string
					s    *miniStep
				}{{"eager", eager}, {"graph", graphed}} {
					e := tensortest.RelErr(get(t, b, c.s.x), wants[p])
					if !(e <= 1e-5) {
						t.Fatalf("%s step %d: the residual differs from the per-shape kernels' by %.3g", c.what, p, e)
					}
					worst = max(worst, e)
				}
			}
			t.Logf("%s: %d steps, eager and graph, largest difference from the per-shape kernels %.2g", v.name, steps, worst)
		})
	}
}

// TestRowsPerWarp checks the M = 1 MatMul kernel chosen by shape: r1 up
// to 2048 rows, m1 above, and gemvRows when set (-1: m1 everywhere).
func TestRowsPerWarp(t *testing.T) {
	for _, c := range []struct{ rows, n, want int }{
		{0, 1, 1}, {0, 2048, 1}, {0, 2049, 0}, {0, 4096, 0}, {0, 11008, 0},
		{-1, 2048, 0}, {-1, 4096, 0}, {1, 4096, 1}, {2, 2048, 2},
	} {
		b := &Backend{gemvRows: c.rows}
		if got := b.rowsPerWarp(c.n); got != c.want {
			t.Errorf("gemvRows %d, N = %d: %d rows per warp, want %d", c.rows, c.n, got, c.want)
		}
	}
}
