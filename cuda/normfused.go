//go:build cuda

package cuda

import (
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// The decode step's norms and residual adds fused into its products
// (tensor.NormFuser): the normed and adding twins of the PDL split GEMVs
// (kernels/gemv_split.cuh, GEMV_NORM and GEMV_ACC). A decoder block's two
// norm kernels go: the o and down products add to the residual stream
// themselves, and the q/k/v and gate-up products norm it as they read it.
// Each gives the bits of the kernels it replaces (the norm as rmsnorm_*
// sums it, the add as add_f32 and add_rmsnorm_* round it). FoldEnv turns
// them off.

var _ tensor.NormFuser = (*Backend)(nil)

// normKernels are the names of v's normed MatMul, adding MatMul and
// normed gate-up kernels for weights with suffix sfx.
func (v *gemvVariant) normKernels(sfx string) (norm, acc, gateUp string) {
	return fmt.Sprintf("gemv_split_pdl_norm_%s_r%du%ds%d", sfx, v.r, v.u, v.s),
		fmt.Sprintf("gemv_split_pdl_acc_%s_r%du%ds%d", sfx, v.r, v.u, v.s),
		fmt.Sprintf("gemv_gate_up_split_pdl_norm_%s_u%ds%d", sfx, v.gu, v.gs)
}

// normedGrid is the grid of the normed kernel name over units blocks'
// worth of rows: at most as many blocks as the device runs at once, each
// taking several units of rows and norming x once. A block a unit (3,072
// for the 7B's q, k and v), each norming x again, read 74 MB from L2 and
// made the 7B's decode 17% slower (210.5 against 253.8 tok/s), where
// TinyLlama's 320 blocks gained. The blocks a multiprocessor runs come
// from the driver's occupancy of the kernel (registers, shared memory),
// asked once a kernel. The caller holds opsMu.
func (b *Backend) normedGrid(name string, units [3]uint32) ([3]uint32, error) {
	per, ok := b.normBlocks[name]
	if !ok {
		f, ok := b.kernels[name]
		if !ok {
			return units, fmt.Errorf("%s: no kernel %s", b.name, name)
		}
		n, err := blocksPerSM(f, gemvSplitThreads)
		if err != nil {
			return units, fmt.Errorf("%s: %s: occupancy: %w", b.name, name, err)
		}
		per = uint32(max(n, 1))
		b.normBlocks[name] = per
	}
	units[0] = min(units[0], uint32(max(b.info.SMs, 1))*per)
	return units, nil
}

// runNormed launches the normed kernel name of v on its normedGrid over
// units blocks' worth of rows; the caller holds opsMu.
func (b *Backend) runNormed(v *gemvVariant, name string, units [3]uint32, a *args) error {
	grid, err := b.normedGrid(name, units)
	if err != nil {
		return err
	}
	return b.runVariant(v, name, grid, a)
}

// fusedVariant returns the variant one row of x times ws (F16 or BF16,
// one dtype, rows 16-byte aligned, x's row too) runs on when the backend
// has the fused kernels for it, with the weights' suffix; nil when it
// does not (folding off, a variant without PDL, F32 weights, another
// shape). g, when given, is a norm's weights: of the weights' dtype, x's
// length, 8-byte aligned, x at most gemvNormMaxK and foldMaxK long.
func (b *Backend) fusedVariant(x, g *tensor.Tensor, ws ...*tensor.Tensor) (*gemvVariant, string) {
	if !b.fold || x.DType() != tensor.F32 || len(x.Shape()) != 2 || x.Shape()[0] != 1 || x.Ptr()%16 != 0 || len(ws) == 0 {
		return nil, ""
	}
	k, dt := x.Shape()[1], ws[0].DType()
	if dt != tensor.F16 && dt != tensor.BF16 || k <= 0 || k%8 != 0 {
		return nil, ""
	}
	for _, w := range ws {
		if w.DType() != dt || len(w.Shape()) != 2 || w.Shape()[1] != k || w.Ptr()%16 != 0 {
			return nil, ""
		}
	}
	if g != nil && (g.DType() != dt || g.Len() != k || g.Ptr()%8 != 0 || k > min(gemvNormMaxK, b.foldMaxK)) {
		return nil, ""
	}
	sfx := suffix(dt)
	// A PDL variant is in use only where its modules load (Open refuses
	// one below compute capability 9.0), the fused kernels with them.
	v := b.splitFor(sfx)
	if v == nil || !v.pdl {
		return nil, ""
	}
	return v, sfx
}

// Folds reports whether NormMatMulMany and NormGateUpSiLU (g set) or
// MatMulAdd (g nil) take these operands (fusedVariant).
func (b *Backend) Folds(x, g *tensor.Tensor, ws ...*tensor.Tensor) bool {
	v, _ := b.fusedVariant(x, g, ws...)
	return v != nil
}

// NormMatMulMany computes outs[i] = RMSNorm(x, g, eps)·ws[i]ᵀ for one row
// of x in one launch, the normed row never written; it reports false for
// operands the fused kernels do not take (fusedVariant, up to three
// products).
func (b *Backend) NormMatMulMany(outs []*tensor.Tensor, x, g *tensor.Tensor, eps float32, ws []*tensor.Tensor) (bool, error) {
	const op = "NormMatMulMany"
	if len(ws) > 3 || len(outs) != len(ws) {
		return false, nil
	}
	v, sfx := b.fusedVariant(x, g, ws...)
	if v == nil {
		return false, nil
	}
	for i := range outs {
		if err := b.devices(op, []string{"out", "x", "g", "w"}, outs[i], x, g, ws[i]); err != nil {
			return false, err
		}
	}
	o, w, n, rows := splitOperands(outs, ws)
	if rows == 0 {
		return true, nil
	}
	k := x.Shape()[1]
	return true, b.ops(op, func() error {
		v := v.forShape(rows, k)
		name, _, _ := v.normKernels(sfx)
		a := new(args).ptr(o[0]).ptr(o[1]).ptr(o[2]).ptr(x.Ptr()).ptr(w[0]).ptr(w[1]).ptr(w[2]).i32(n[0]).i32(n[1]).i32(n[2]).i32(k).ptr(g.Ptr()).f32(eps)
		return b.runNormed(v, name, v.grid(rows), a)
	})
}

// NormGateUpSiLU computes out = silu(h·wGateᵀ) * (h·wUpᵀ), h =
// RMSNorm(x, g, eps), for one row of x in one launch; false as
// NormMatMulMany.
func (b *Backend) NormGateUpSiLU(out, x, g *tensor.Tensor, eps float32, wGate, wUp *tensor.Tensor) (bool, error) {
	const op = "NormGateUpSiLU"
	v, sfx := b.fusedVariant(x, g, wGate, wUp)
	if v == nil {
		return false, nil
	}
	if err := b.devices(op, []string{"out", "x", "g", "wGate", "wUp"}, out, x, g, wGate, wUp); err != nil {
		return false, err
	}
	n, k := wGate.Shape()[0], x.Shape()[1]
	if n == 0 {
		return true, nil
	}
	return true, b.ops(op, func() error {
		v := v.forShape(n, k)
		_, _, name := v.normKernels(sfx)
		a := new(args).ptr(out.Ptr()).ptr(x.Ptr()).ptr(wGate.Ptr()).ptr(wUp.Ptr()).i32(n).i32(k).ptr(g.Ptr()).f32(eps)
		return b.runNormed(v, name, v.gateUpGrid(n), a)
	})
}

// MatMulAdd computes out += x·wᵀ for one row of x in one launch; false as
// NormMatMulMany.
func (b *Backend) MatMulAdd(out, x, w *tensor.Tensor) (bool, error) {
	const op = "MatMulAdd"
	v, sfx := b.fusedVariant(x, nil, w)
	if v == nil {
		return false, nil
	}
	if err := b.devices(op, []string{"out", "x", "w"}, out, x, w); err != nil {
		return false, err
	}
	n, k := w.Shape()[0], x.Shape()[1]
	if n == 0 {
		return true, nil
	}
	return true, b.ops(op, func() error {
		v := v.forShape(n, k)
		_, name, _ := v.normKernels(sfx)
		a := new(args).ptr(out.Ptr()).ptr(0).ptr(0).ptr(x.Ptr()).ptr(w.Ptr()).ptr(0).ptr(0).i32(n).i32(0).i32(0).i32(k)
		return b.runVariant(v, name, v.grid(n), a)
	})
}
