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

// gemvNormMaxK is GEMV_NORM_MAX_K, the longest row the normed kernels
// norm.
const gemvNormMaxK = 8192

// foldMaxK is the longest row whose norm the backend folds by default
// (Backend.foldMaxK): rows of up to 2048 values (TinyLlama's 2048) decode
// faster folded, 946 -> 1,007-1,021 tok/s on the H200, where the 7B's
// rows of 4096 decoded slower (253.9 -> 231.9-235.7). The normed kernels
// of the u8 variants hold their first batch of weights through the norm
// and take 99-122 registers, two blocks a multiprocessor where the plain
// ones run four: the 7B's q, k and v (3,072 units of s2p) then run at
// half the warps, in two waves of a grid sized for four. Rows of 2048
// take b8p, whose normed kernels gained all the same.
const foldMaxK = 2048

// normBlocksPerSM is how many blocks of a normed kernel a multiprocessor
// runs at once (256 threads of about 64 registers: 4). A normed grid is
// that many blocks a multiprocessor, each taking several units of rows
// and norming x once: a block a unit (3,072 for the 7B's q, k and v)
// each norming x again read 74 MB from L2 and made the 7B's decode 17%
// slower (210.5 against 253.8 tok/s), where TinyLlama's 320 blocks gained.
const normBlocksPerSM = 4

// normedGrid is a normed kernel's grid over units blocks' worth of rows.
func (b *Backend) normedGrid(units [3]uint32) [3]uint32 {
	units[0] = min(units[0], uint32(max(b.info.SMs, 1)*normBlocksPerSM))
	return units
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
		return b.runVariant(v, name, b.normedGrid(v.grid(rows)), a)
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
		return b.runVariant(v, name, b.normedGrid(v.gateUpGrid(n)), a)
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
