package tensor

import (
	"errors"
	"fmt"
)

// Fused operations: optional capabilities that do in one pass what a
// decode step otherwise does in two or three, each with a helper that
// checks the arguments once (as Checked does for Kernels) and takes the
// unfused path through Kernels when the backend lacks the capability. Call
// the helpers, not the methods: they look behind a front from Checked.

// AddRMSNormer adds the residual and normalises in one pass:
// x += d, then out = RMSNorm(x, w, eps) (see Kernels.RMSNorm).
type AddRMSNormer interface {
	AddRMSNorm(out, x, d, w *Tensor, eps float32) error
}

// RopeKVer rotates the queries and keys of a chunk and appends its keys
// and values to the caches in one pass (see RopeKV).
type RopeKVer interface {
	RopeKV(q, k, v, kc, vc *Tensor, r Rotary) error
}

// GateUpper computes a gated MLP's first half in one pass over both
// weights (see GateUpSiLU).
type GateUpper interface {
	GateUpSiLU(out, up, x, wGate, wUp *Tensor) error
}

// ManyMatMuler computes several products of one x in one pass (see
// MatMulMany).
type ManyMatMuler interface {
	MatMulMany(outs []*Tensor, x *Tensor, ws []*Tensor) error
}

// NormFuser folds a one-row decode step's RMS norms and residual adds
// into its products (see NormMatMulMany, NormGateUpSiLU, MatMulAdd): each
// method reports false, having done nothing, for operands it does not
// fold, and the caller takes the separate operations. What it folds has
// the bits of those operations on the same backend.
type NormFuser interface {
	// Folds reports whether the methods fold one-row products of x
	// times ws, normed with weights g (nil: added, MatMulAdd).
	Folds(x, g *Tensor, ws ...*Tensor) bool
	NormMatMulMany(outs []*Tensor, x, g *Tensor, eps float32, ws []*Tensor) (bool, error)
	NormGateUpSiLU(out, x, g *Tensor, eps float32, wGate, wUp *Tensor) (bool, error)
	MatMulAdd(out, x, w *Tensor) (bool, error)
}

// FoldsNorms reports whether b folds the norm with weights g into the
// products of x's one row with ws (NormMatMulMany, NormGateUpSiLU), or,
// g nil, the add into the product (MatMulAdd): a caller that must know
// before it starts (a decoder block, whose output is added to the
// residual or left for the next norm to add) asks here.
func FoldsNorms(b Backend, x, g *Tensor, ws ...*Tensor) bool {
	f, ok := capability[NormFuser](b)
	return ok && f.Folds(x, g, ws...)
}

// NormMatMulMany computes outs[i] = RMSNorm(x, g, eps)·ws[i]ᵀ without
// writing the normed row, where b folds it (NormFuser), and reports
// whether it did; where not, it does nothing and the caller runs RMSNorm
// and MatMulMany. The operands are MatMulMany's with g the norm's weights
// [D] (RMSNorm's w); the outputs are apart from x and g.
func NormMatMulMany(b Backend, outs []*Tensor, x, g *Tensor, eps float32, ws []*Tensor) (bool, error) {
	f, ok := capability[NormFuser](b)
	if !ok {
		return false, nil
	}
	if err := checkMatMulMany(outs, x, ws); err != nil {
		return false, err
	}
	if err := checkNormWeights("NormMatMulMany", x, g, outs...); err != nil {
		return false, err
	}
	return f.NormMatMulMany(outs, x, g, eps, ws)
}

// NormGateUpSiLU computes out = silu(h·wGateᵀ) * (h·wUpᵀ) with h =
// RMSNorm(x, g, eps), h never written, where b folds it (NormFuser), and
// reports whether it did; where not, the caller runs RMSNorm and
// GateUpSiLU. out is apart from x and g.
func NormGateUpSiLU(b Backend, out, x, g *Tensor, eps float32, wGate, wUp *Tensor) (bool, error) {
	f, ok := capability[NormFuser](b)
	if !ok {
		return false, nil
	}
	if err := checkMatMulMany([]*Tensor{out}, x, []*Tensor{wGate}); err != nil {
		return false, err
	}
	if err := CheckShape("NormGateUpSiLU", "wUp", wUp, wGate.dtype, wGate.shape[0], wGate.shape[1]); err != nil {
		return false, err
	}
	if err := checkNormWeights("NormGateUpSiLU", x, g, out); err != nil {
		return false, err
	}
	return f.NormGateUpSiLU(out, x, g, eps, wGate, wUp)
}

// MatMulAdd computes out += x·wᵀ (MatMul's operands, no bias) where b
// folds the add into the product (NormFuser), and reports whether it did;
// where not, the caller runs MatMul into a scratch tensor and Add. out is
// apart from x and w.
func MatMulAdd(b Backend, out, x, w *Tensor) (bool, error) {
	f, ok := capability[NormFuser](b)
	if !ok {
		return false, nil
	}
	if err := checkMatMulMany([]*Tensor{out}, x, []*Tensor{w}); err != nil {
		return false, err
	}
	if err := disjoint("MatMulAdd", "out", out, []string{"x", "w"}, x, w); err != nil {
		return false, err
	}
	return f.MatMulAdd(out, x, w)
}

// checkNormWeights checks a folded norm's weights g against its rows x
// [M, D], and that the outputs are apart from both.
func checkNormWeights(op string, x, g *Tensor, outs ...*Tensor) error {
	if err := CheckShape(op, "g", g, Invalid, x.shape[1]); err != nil {
		return err
	}
	for _, o := range outs {
		if err := disjoint(op, "out", o, []string{"x", "g"}, x, g); err != nil {
			return err
		}
	}
	return nil
}

// RowCombiner sums weighted rows of a tensor in one pass (see
// CombineRows).
type RowCombiner interface {
	CombineRows(out, src, w *Tensor, idx []int32, k int) error
}

// CanCombineRows reports whether b has CombineRows; without it the caller
// scales and adds the rows with other operations.
func CanCombineRows(b Backend) bool {
	_, ok := capability[RowCombiner](b)
	return ok
}

// CombineRows computes each row t of out [T, D] as the sum over j < k of
// w[r]·src[r], r = idx[t*k+j]: src is F32 [R, D], w F32 [R, 1] (a weight
// for each row of src), idx has T*k rows of src. The sum is taken in the
// order of j and each product is rounded before it is added, so the
// result has the bits of scaling src's rows by w and adding them up with
// Add, one row after another (a sparse block's expert outputs weighted by
// their routing weights, in one pass instead of a gather and an add per
// expert a token chose). out is apart from src and w. It fails on a
// backend without the capability (CanCombineRows).
func CombineRows(b Backend, out, src, w *Tensor, idx []int32, k int) error {
	if err := checkCombineRows(out, src, w, idx, k); err != nil {
		return err
	}
	f, ok := capability[RowCombiner](b)
	if !ok {
		return fmt.Errorf("CombineRows: %s cannot combine rows: %w", b.Name(), errors.ErrUnsupported)
	}
	return f.CombineRows(out, src, w, idx, k)
}

func checkCombineRows(out, src, w *Tensor, idx []int32, k int) error {
	const op = "CombineRows"
	if err := CheckShape(op, "src", src, F32, -1, -1); err != nil {
		return err
	}
	r, d := src.shape[0], src.shape[1]
	if err := CheckShape(op, "w", w, F32, r, 1); err != nil {
		return err
	}
	if err := CheckShape(op, "out", out, F32, -1, d); err != nil {
		return err
	}
	if k < 1 || len(idx) != out.shape[0]*k {
		return fmt.Errorf("%s: %d row indices for %d rows of %d", op, len(idx), out.shape[0], k)
	}
	for i, x := range idx {
		if x < 0 || int(x) >= r {
			return fmt.Errorf("%s: index %d is row %d of src's %d", op, i, x, r)
		}
	}
	return disjoint(op, "out", out, []string{"src", "w"}, src, w)
}

// MatMulMany computes outs[i] = x·ws[i]ᵀ for every i, each as MatMul
// computes it (no bias): a decoder block's q, k and v projections, which a
// backend may run as one launch over all the weights' rows. outs and ws
// have the same length; the outputs are apart from each other and from
// the inputs.
func MatMulMany(b Backend, outs []*Tensor, x *Tensor, ws []*Tensor) error {
	if err := checkMatMulMany(outs, x, ws); err != nil {
		return err
	}
	if f, ok := capability[ManyMatMuler](b); ok {
		return f.MatMulMany(outs, x, ws)
	}
	for i := range outs {
		if err := b.MatMul(outs[i], x, ws[i], nil); err != nil {
			return err
		}
	}
	return nil
}

// AddRMSNorm computes x += d, then out = x / sqrt(mean(x²) + eps) * w, row
// by row: x and d are F32 [M, D], w is [D] in any float type, out is F32
// [M, D] apart from the others. It is exactly Add(x, x, d) followed by
// RMSNorm(out, x, w, eps) on the CPU, and within rounding on a device.
func AddRMSNorm(b Backend, out, x, d, w *Tensor, eps float32) error {
	if err := checkAddRMSNorm(out, x, d, w); err != nil {
		return err
	}
	if f, ok := capability[AddRMSNormer](b); ok {
		return f.AddRMSNorm(out, x, d, w, eps)
	}
	if err := b.Add(x, x, d); err != nil {
		return err
	}
	return b.RMSNorm(out, x, w, eps)
}

// RopeKV rotates q [T, r.Heads*r.HeadDim] in place by r, rotates k [T,
// kvHeads*r.HeadDim] the same way, and writes k's and v's T rows into rows
// p..p+T-1 of the caches kc and vc [maxPos, kvHeads*r.HeadDim] (one cache
// dtype, IsCacheDType; p is r.Pos0, or the value of r.PosAt): Rope(q),
// Rope(k) and two CopyRows, which convert the rows to the caches' dtype.
// k's rows are unspecified afterwards (a backend may or may not rotate
// them in place). Without the capability, a PosAt in device memory
// is an error: the unfused CopyRows takes its row from the host.
func RopeKV(b Backend, q, k, v, kc, vc *Tensor, r Rotary) error {
	if err := checkRopeKV(q, k, v, kc, vc, r); err != nil {
		return err
	}
	if f, ok := capability[RopeKVer](b); ok {
		return f.RopeKV(q, k, v, kc, vc, r)
	}
	p := r.Pos0
	if r.PosAt != nil {
		var err error
		if p, err = hostPosition("RopeKV", r.Pos0, r.PosAt); err != nil {
			return fmt.Errorf("tensor: RopeKV on %s reads its position on the host: %w", b.Name(), err)
		}
	}
	rq := r
	rq.Pos0, rq.PosAt = p, nil
	if err := b.Rope(q, rq); err != nil {
		return err
	}
	rq.Heads = k.shape[1] / r.HeadDim
	if err := b.Rope(k, rq); err != nil {
		return err
	}
	t := q.shape[0]
	if err := b.CopyRows(kc, p, k, 0, t); err != nil {
		return err
	}
	return b.CopyRows(vc, p, v, 0, t)
}

// GateUpSiLU computes out = silu(x·wGateᵀ) * (x·wUpᵀ): x is F32 [M, K],
// wGate and wUp are [N, K] of one dtype (float or quantized, as MatMul's
// w), out and up are F32 [M, N], apart from each other and the inputs. up
// is scratch: the unfused path (two MatMuls and SiLUMul) leaves x·wUpᵀ in
// it, a fused one may leave anything.
func GateUpSiLU(b Backend, out, up, x, wGate, wUp *Tensor) error {
	if err := checkGateUpSiLU(out, up, x, wGate, wUp); err != nil {
		return err
	}
	if f, ok := capability[GateUpper](b); ok {
		return f.GateUpSiLU(out, up, x, wGate, wUp)
	}
	if err := b.MatMul(out, x, wGate, nil); err != nil {
		return err
	}
	if err := b.MatMul(up, x, wUp, nil); err != nil {
		return err
	}
	return b.SiLUMul(out, out, up)
}

func checkMatMulMany(outs []*Tensor, x *Tensor, ws []*Tensor) error {
	const op = "MatMulMany"
	if len(outs) != len(ws) {
		return fmt.Errorf("tensor: %s: %d outputs for %d weights", op, len(outs), len(ws))
	}
	for i := range outs {
		if err := checkMatMul(outs[i], x, ws[i], nil); err != nil {
			return fmt.Errorf("%w (%s's product %d)", err, op, i)
		}
		for j := range i {
			if Overlap(outs[i], outs[j]) {
				return fmt.Errorf("tensor: %s: outputs %d and %d overlap", op, j, i)
			}
			if Overlap(outs[i], ws[j]) || Overlap(outs[j], ws[i]) {
				return fmt.Errorf("tensor: %s: an output overlaps a weight", op)
			}
		}
	}
	return nil
}

func checkAddRMSNorm(out, x, d, w *Tensor) error {
	const op = "AddRMSNorm"
	if err := CheckShape(op, "x", x, F32, -1, -1); err != nil {
		return err
	}
	m, n := x.shape[0], x.shape[1]
	if err := CheckShape(op, "d", d, F32, m, n); err != nil {
		return err
	}
	if err := CheckShape(op, "w", w, Invalid, n); err != nil {
		return err
	}
	if err := CheckShape(op, "out", out, F32, m, n); err != nil {
		return err
	}
	if err := disjoint(op, "x", x, []string{"d", "w"}, d, w); err != nil {
		return err
	}
	return disjoint(op, "out", out, []string{"x", "d", "w"}, x, d, w)
}

func checkRopeKV(q, k, v, kc, vc *Tensor, r Rotary) error {
	const op = "RopeKV"
	if err := checkRope(q, r); err != nil {
		return fmt.Errorf("%w (%s's q)", err, op)
	}
	if err := CheckShape(op, "k", k, F32, q.shape[0], -1); err != nil {
		return err
	}
	kvDim := k.shape[1]
	if kvDim == 0 || kvDim%r.HeadDim != 0 {
		return fmt.Errorf("tensor: %s: k has shape %v, want whole heads of %d", op, k.shape, r.HeadDim)
	}
	rk := r
	rk.Heads = kvDim / r.HeadDim
	if err := checkRope(k, rk); err != nil {
		return fmt.Errorf("%w (%s's k)", err, op)
	}
	if err := CheckShape(op, "v", v, F32, q.shape[0], kvDim); err != nil {
		return err
	}
	kdt := Invalid
	if kc != nil && IsCacheDType(kc.dtype) {
		kdt = kc.dtype // a Q8_0 cache too
	}
	if err := CheckShape(op, "kc", kc, kdt, -1, kvDim); err != nil {
		return err
	}
	maxPos := kc.shape[0]
	if bs := kc.dtype.BlockSize(); bs > 1 && kvDim%bs != 0 {
		return fmt.Errorf("tensor: %s: cache rows of %d are not whole %v blocks of %d", op, kvDim, kc.dtype, bs)
	}
	if err := CheckShape(op, "vc", vc, kc.dtype, maxPos, kvDim); err != nil {
		return err
	}
	if t := q.shape[0]; r.Pos0+t > maxPos {
		return fmt.Errorf("tensor: %s: positions %d..%d beyond the %d-position cache", op, r.Pos0, r.Pos0+t-1, maxPos)
	}
	names := []string{"q", "k", "v", "cos", "sin", "PosAt"}
	ins := []*Tensor{q, k, v, r.Cos, r.Sin, r.PosAt}
	if err := disjoint(op, "kc", kc, names, ins...); err != nil {
		return err
	}
	if err := disjoint(op, "vc", vc, append(names, "kc"), append(ins, kc)...); err != nil {
		return err
	}
	return disjoint(op, "q", q, []string{"k", "v"}, k, v)
}

func checkGateUpSiLU(out, up, x, wGate, wUp *Tensor) error {
	const op = "GateUpSiLU"
	if err := checkMatMul(out, x, wGate, nil); err != nil {
		return fmt.Errorf("%w (%s's gate)", err, op)
	}
	if err := checkMatMul(up, x, wUp, nil); err != nil {
		return fmt.Errorf("%w (%s's up)", err, op)
	}
	if wUp.dtype != wGate.dtype || !wUp.shape.Equal(wGate.shape) {
		return fmt.Errorf("tensor: %s: wGate is %v %v, wUp %v %v", op, wGate.dtype, wGate.shape, wUp.dtype, wUp.shape)
	}
	return disjoint(op, "out", out, []string{"up", "wUp"}, up, wUp)
}
