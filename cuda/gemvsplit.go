//go:build cuda

package cuda

import "github.com/strata-llm/strata/tensor"

// splitFor returns the variant the M = 1 products of weights with suffix
// sfx use, or nil for the default kernels: F32 weights always take the
// default.
func (b *Backend) splitFor(sfx string) *gemvVariant {
	if sfx == "f32" {
		return nil
	}
	return b.gemvSplit
}

// gemvSplitRun launches v's MatMul kernel over up to three matrices of
// rows n[i], outputs o[i] and weights w[i] laid end to end; the caller
// holds opsMu.
func (b *Backend) gemvSplitRun(v *gemvVariant, sfx string, o, w [3]uintptr, n [3]int, x uintptr, k int) error {
	v = v.forShape(n[0]+n[1]+n[2], k)
	a := new(args).ptr(o[0]).ptr(o[1]).ptr(o[2]).ptr(x).ptr(w[0]).ptr(w[1]).ptr(w[2]).i32(n[0]).i32(n[1]).i32(n[2]).i32(k)
	return b.runVariant(v, v.kernel(sfx), v.grid(n[0]+n[1]+n[2]), a)
}

// splitOperands lays the products outs[i] = x·ws[i]ᵀ (up to three) out as
// the split kernels take them: outputs, weights and rows, the matrices
// end to end over rows rows.
func splitOperands(outs, ws []*tensor.Tensor) (o, w [3]uintptr, n [3]int, rows int) {
	for i := range ws {
		o[i], w[i], n[i] = outs[i].Ptr(), ws[i].Ptr(), ws[i].Shape()[0]
		rows += n[i]
	}
	return o, w, n, rows
}

// runVariant launches kernel name of v, with programmatic dependent launch
// when v has it; the caller holds opsMu.
func (b *Backend) runVariant(v *gemvVariant, name string, grid [3]uint32, a *args) error {
	block := [3]uint32{gemvSplitThreads, 1, 1}
	if v.pdl {
		return b.runPDL(name, grid, block, a)
	}
	return b.run(name, grid, block, a)
}

// pdlKernels are the kernels of the PDL variants, in modules for compute
// capability 9.0 (kernels/gemv_pdl_*.cu), loaded only on such devices.
var pdlKernels = func() []string {
	var k []string
	for _, t := range []string{"f16", "bf16"} {
		for i := range gemvVariants {
			if gemvVariants[i].pdl {
				n, a, g := gemvVariants[i].normKernels(t) // normfused.go
				k = append(k, gemvVariants[i].kernel(t), gemvVariants[i].gateUpKernel(t), n, a, g)
			}
		}
	}
	return k
}()
