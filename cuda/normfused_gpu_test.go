//go:build cuda

package cuda

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestNormFuser: on every PDL GEMV variant (and auto), F16 and BF16
// weights, the folded norms and adds (normfused.go) give the bits of the
// operations they replace: NormMatMulMany of RMSNorm then MatMulMany,
// NormGateUpSiLU of RMSNorm then GateUpSiLU, MatMulAdd of MatMul then Add
// (and of AddRMSNorm's add). Rows of 4096 and 2048 (the 7B's and 1.1B's
// hidden sizes), of 2056 (the norm's threads not a whole number of the
// GEMV's blocks), 11008 (the down product, added only). Folds declines F32
// weights, a norm of more than 8192 values (more than foldMaxK by
// default) and two rows of x, and STRATA_CUDA_FOLD=0 (fold off) all of
// them.
func TestNormFuser(t *testing.T) {
	be := openGPU(t)
	if !be.Folds(mustPut(t, be, tensor.F32, tensor.Shape{1, 64}), nil, mustPut(t, be, tensor.F16, tensor.Shape{8, 64})) {
		t.Skipf("%s folds nothing (the PDL GEMVs need compute capability 9.0)", be.Name())
	}
	if be.Folds(mustPut(t, be, tensor.F32, tensor.Shape{1, 4096}), mustPut(t, be, tensor.F16, tensor.Shape{4096}), mustPut(t, be, tensor.F16, tensor.Shape{8, 4096})) {
		t.Errorf("folds a norm of 4096 values by default (foldMaxK %d)", foldMaxK)
	}
	// The kernels take rows up to gemvNormMaxK; the default folds the
	// shorter ones only (foldMaxK).
	be.foldMaxK = gemvNormMaxK
	defer func() { be.foldMaxK = foldMaxK }()
	r := newRand(t)
	prev := be.gemvSplit
	t.Cleanup(func() { be.gemvSplit = prev })
	variants := []*gemvVariant{gemvShaped, gemvPDL[0], gemvPDL[1], gemvPDL[2]}
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		for _, k := range []int{4096, 2048, 2056, 11008} {
			x := mustPut(t, be, tensor.F32, tensor.Shape{1, k}, uniform(r, k, -2, 2)...)
			g := mustPut(t, be, dt, tensor.Shape{k}, uniform(r, k, 0.5, 1.5)...)
			ns := []int{k, 512, 256}
			var ws []*tensor.Tensor
			for _, n := range ns {
				ws = append(ws, mustPut(t, be, dt, tensor.Shape{n, k}, uniform(r, n*k, -0.05, 0.05)...))
			}
			wu := mustPut(t, be, dt, tensor.Shape{ns[1], k}, uniform(r, ns[1]*k, -0.05, 0.05)...)
			h := mustPut(t, be, tensor.F32, tensor.Shape{1, k})
			outs := func() []*tensor.Tensor {
				var o []*tensor.Tensor
				for _, n := range ns {
					o = append(o, mustPut(t, be, tensor.F32, tensor.Shape{1, n}, slices.Repeat([]float32{float32(math.NaN())}, n)...))
				}
				return o
			}
			for _, v := range variants {
				be.gemvSplit = v
				name := fmt.Sprintf("%v/K%d/%s", dt, k, v.name)
				same := func(what string, got, want *tensor.Tensor) {
					t.Helper()
					a, b := get(t, be, got), get(t, be, want)
					for i := range a {
						if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
							t.Errorf("%s: %s: value %d is %v folded, %v unfolded", name, what, i, a[i], b[i])
							return
						}
					}
				}
				const eps = 1e-5
				if k <= gemvNormMaxK {
					folded, unfolded := outs(), outs()
					ok, err := tensor.NormMatMulMany(be, folded, x, g, eps, ws)
					if err != nil || !ok {
						t.Fatalf("%s: NormMatMulMany: %v, %v", name, ok, err)
					}
					if err := be.RMSNorm(h, x, g, eps); err != nil {
						t.Fatal(err)
					}
					if err := tensor.MatMulMany(be, unfolded, h, ws); err != nil {
						t.Fatal(err)
					}
					for i := range folded {
						same(fmt.Sprintf("NormMatMulMany's product %d", i), folded[i], unfolded[i])
					}
					gate, want, up := outs()[1], outs()[1], outs()[1]
					ok, err = tensor.NormGateUpSiLU(be, gate, x, g, eps, ws[1], wu)
					if err != nil || !ok {
						t.Fatalf("%s: NormGateUpSiLU: %v, %v", name, ok, err)
					}
					if err := tensor.GateUpSiLU(be, want, up, h, ws[1], wu); err != nil {
						t.Fatal(err)
					}
					same("NormGateUpSiLU", gate, want)
				} else if be.Folds(x, g, ws[0]) {
					t.Errorf("%s: folds a norm of %d values", name, k)
				}
				// out += x·wᵀ over the product's rows n, from the same start.
				n := ns[1]
				start := uniform(r, n, -1, 1)
				acc := mustPut(t, be, tensor.F32, tensor.Shape{1, n}, start...)
				want := mustPut(t, be, tensor.F32, tensor.Shape{1, n}, start...)
				p := mustPut(t, be, tensor.F32, tensor.Shape{1, n})
				ok, err := tensor.MatMulAdd(be, acc, x, ws[1])
				if err != nil || !ok {
					t.Fatalf("%s: MatMulAdd: %v, %v", name, ok, err)
				}
				if err := be.MatMul(p, x, ws[1], nil); err != nil {
					t.Fatal(err)
				}
				want2 := mustPut(t, be, tensor.F32, tensor.Shape{1, n}, start...)
				if err := be.Add(want, want, p); err != nil {
					t.Fatal(err)
				}
				same("MatMulAdd against Add", acc, want)
				if n%4 == 0 {
					hn := mustPut(t, be, tensor.F32, tensor.Shape{1, n})
					gn := mustPut(t, be, dt, tensor.Shape{n}, uniform(r, n, 0.5, 1.5)...)
					if err := tensor.AddRMSNorm(be, hn, want2, p, gn, eps); err != nil {
						t.Fatal(err)
					}
					same("MatMulAdd against AddRMSNorm's add", acc, want2)
				}
			}
			be.gemvSplit = prev
			if be.Folds(x, nil, mustPut(t, be, tensor.F32, tensor.Shape{8, k})) {
				t.Errorf("K%d: folds F32 weights", k)
			}
			if be.Folds(mustPut(t, be, tensor.F32, tensor.Shape{2, k}), nil, ws[0]) {
				t.Errorf("K%d: folds two rows of x", k)
			}
		}
	}
	be.fold = false
	defer func() { be.fold = true }()
	if be.Folds(mustPut(t, be, tensor.F32, tensor.Shape{1, 64}), nil, mustPut(t, be, tensor.F16, tensor.Shape{8, 64})) {
		t.Errorf("folds with %s=0", FoldEnv)
	}
}

// mustPut uploads v (zeros when empty) as a tensor of dt and shape.
func mustPut(t testing.TB, be *Backend, dt tensor.DType, shape tensor.Shape, v ...float32) *tensor.Tensor {
	t.Helper()
	if len(v) == 0 {
		v = make([]float32, shape.NumElements())
	}
	x, _ := put(t, be, dt, shape, v)
	return x
}
