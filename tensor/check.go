package tensor

import (
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/strata-llm/strata/tensor/quant"
)

// The argument checks of every operation of Kernels and GradOps, written
// once: Checked runs them in front of a backend, whose kernels then assume
// well-formed arguments. They cover what the contract says of an operation
// (dtypes, shapes, ranges, which operands may share storage), not where the
// operands live: a backend checks that its operands are its own memory, and
// any limit of its own kernels (the CUDA attention's head size, say).

// CheckShape returns an error naming op if t is nil or not of dtype dt (use
// Invalid to accept any float type) and shape want (-1 matches any size).
func CheckShape(op, name string, t *Tensor, dt DType, want ...int) error {
	if t == nil {
		return fmt.Errorf("tensor: %s: %s is nil", op, name)
	}
	if t.dtype.IsQuantized() && t.dtype != dt {
		return quantizedOperand(op, name, t, onlyWeights)
	}
	if dt == Invalid && !t.dtype.IsFloat() || dt != Invalid && t.dtype != dt {
		return fmt.Errorf("tensor: %s: %s has dtype %v", op, name, t.dtype)
	}
	if len(want) != len(t.shape) {
		return fmt.Errorf("tensor: %s: %s has shape %v, want %d dimensions", op, name, t.shape, len(want))
	}
	for i, w := range want {
		if w >= 0 && t.shape[i] != w {
			return fmt.Errorf("tensor: %s: %s has shape %v, want dimension %d = %d", op, name, t.shape, i, w)
		}
	}
	return nil
}

const onlyWeights = "only MatMul's w and Embed's table may be quantized"

// quantizedOperand is the error of a quantized operand where op takes a
// float one; why says what op would take.
func quantizedOperand(op, name string, t *Tensor, why string) error {
	return fmt.Errorf("tensor: %s: %s has dtype %v: %w (%s)", op, name, t.dtype, ErrQuantized, why)
}

// checkWeight is CheckShape for MatMul's w and Embed's table, [rows,
// cols]: a float type, or a quantized one with a product (all but Q8_K,
// ggml's format of the activations in the K formats' products).
func checkWeight(op, name string, t *Tensor, rows, cols int) error {
	if t == nil || !t.dtype.IsQuantized() {
		return CheckShape(op, name, t, Invalid, rows, cols)
	}
	if q, _ := t.dtype.Quant(); !quant.IntegerProduct(q) {
		return fmt.Errorf("tensor: %s: %s has dtype %v, ggml's format of activations in the K formats' products, not of weights", op, name, t.dtype)
	}
	return CheckShape(op, name, t, t.dtype, rows, cols)
}

// checkFloatWeight refuses a quantized weight w of a training operation.
func checkFloatWeight(op, name string, w *Tensor) error {
	if w != nil && w.dtype.IsQuantized() {
		return quantizedOperand(op, name, w, "training needs float weights")
	}
	return nil
}

// checkLike returns an error naming op unless t is a tensor of dtype dt and
// of like's shape.
func checkLike(op, name string, t *Tensor, dt DType, like Shape) error {
	if t == nil {
		return fmt.Errorf("tensor: %s: %s is nil", op, name)
	}
	if t.dtype.IsQuantized() && t.dtype != dt {
		return quantizedOperand(op, name, t, onlyWeights)
	}
	if t.dtype != dt {
		return fmt.Errorf("tensor: %s: %s has dtype %v", op, name, t.dtype)
	}
	if !t.shape.Equal(like) {
		return fmt.Errorf("tensor: %s: %s has shape %v, want %v", op, name, t.shape, like)
	}
	return nil
}

// Addr is the address of t's first byte: its host storage or its device
// address; 0 when it has none (empty, a freed host tensor, or nil). Two
// tensors that start at one Addr start at the same byte: what a captured
// decode graph checks before it replays over a layer's weights.
func (t *Tensor) Addr() uintptr {
	if t == nil {
		return 0
	}
	if t.data != nil {
		return uintptr(unsafe.Pointer(unsafe.SliceData(t.data)))
	}
	return t.ptr
}

// Overlap reports whether a and b share any byte of storage, host or
// device. Tensors without storage overlap nothing. It is the aliasing test
// of every check; a backend's own operations beyond the contract use it
// too.
func Overlap(a, b *Tensor) bool {
	if a == nil || b == nil || a.bytes == 0 || b.bytes == 0 {
		return false
	}
	a0, b0 := a.Addr(), b.Addr()
	if a0 == 0 || b0 == 0 {
		return false
	}
	return a0 < b0+uintptr(b.bytes) && b0 < a0+uintptr(a.bytes)
}

// partial reports whether a and b overlap without being the same storage:
// an output that is exactly an input is computed in place, one that
// partly overlaps it is not.
func partial(a, b *Tensor) bool {
	return Overlap(a, b) && (a.Addr() != b.Addr() || a.bytes != b.bytes)
}

// disjoint returns an error naming op if out, called name, shares storage
// with any of ins (named by names).
func disjoint(op, name string, out *Tensor, names []string, ins ...*Tensor) error {
	for i, in := range ins {
		if Overlap(out, in) {
			return fmt.Errorf("tensor: %s: %s overlaps %s", op, name, names[i])
		}
	}
	return nil
}

// notPartial returns an error naming op if out partly overlaps in.
func notPartial(op, name string, out *Tensor, inName string, in *Tensor) error {
	if partial(out, in) {
		return fmt.Errorf("tensor: %s: %s partially overlaps %s", op, name, inName)
	}
	return nil
}

func checkMatMul(out, x, w, bias *Tensor) error {
	const op = "MatMul"
	if err := CheckShape(op, "x", x, F32, -1, -1); err != nil {
		return err
	}
	m, k := x.shape[0], x.shape[1]
	if err := checkWeight(op, "w", w, -1, k); err != nil {
		return err
	}
	n := w.shape[0]
	if err := CheckShape(op, "out", out, F32, m, n); err != nil {
		return err
	}
	if bias != nil {
		if err := CheckShape(op, "bias", bias, Invalid, n); err != nil {
			return err
		}
	}
	return disjoint(op, "out", out, []string{"x", "w", "bias"}, x, w, bias)
}

func checkRMSNorm(out, x, w *Tensor) error {
	const op = "RMSNorm"
	if err := CheckShape(op, "x", x, F32, -1, -1); err != nil {
		return err
	}
	m, d := x.shape[0], x.shape[1]
	if err := CheckShape(op, "w", w, Invalid, d); err != nil {
		return err
	}
	if err := CheckShape(op, "out", out, F32, m, d); err != nil {
		return err
	}
	if err := disjoint(op, "out", out, []string{"w"}, w); err != nil {
		return err
	}
	return notPartial(op, "out", out, "x", x)
}

func checkRope(x *Tensor, r Rotary) error {
	const op = "Rope"
	if err := checkRotary(op, x, r); err != nil {
		return err
	}
	if t, maxPos := x.shape[0], r.Cos.shape[0]; r.Pos0+t > maxPos {
		return fmt.Errorf("tensor: %s: positions %d..%d beyond the %d-position tables", op, r.Pos0, r.Pos0+t-1, maxPos)
	}
	return nil
}

// checkRotary checks what Rope and RopeRows share: x, the tables and
// PosAt, not the rows' positions.
func checkRotary(op string, x *Tensor, r Rotary) error {
	cos, sin, heads, headDim, pos0 := r.Cos, r.Sin, r.Heads, r.HeadDim, r.Pos0
	if heads <= 0 || headDim <= 0 || headDim%2 != 0 || pos0 < 0 {
		return fmt.Errorf("tensor: %s: invalid heads %d, headDim %d (must be even) or pos0 %d", op, heads, headDim, pos0)
	}
	half := headDim / 2
	if err := CheckShape(op, "x", x, F32, -1, heads*headDim); err != nil {
		return err
	}
	if err := CheckShape(op, "cos", cos, F32, -1, half); err != nil {
		return err
	}
	maxPos := cos.shape[0]
	if err := CheckShape(op, "sin", sin, F32, maxPos, half); err != nil {
		return err
	}
	if Overlap(x, cos) || Overlap(x, sin) {
		return fmt.Errorf("tensor: %s: x overlaps the tables", op)
	}
	if err := checkPosAt(op, r.PosAt); err != nil {
		return err
	}
	if Overlap(x, r.PosAt) {
		return fmt.Errorf("tensor: %s: x overlaps PosAt", op)
	}
	return nil
}

// checkElementwise checks the operands of SiLUMul and Add: F32 tensors of
// one shape, out either identical to or disjoint from each input.
func checkElementwise(op string, out, a, b *Tensor, an, bn string) error {
	if a == nil {
		return fmt.Errorf("tensor: %s: %s is nil", op, an)
	}
	if err := checkLike(op, an, a, F32, a.shape); err != nil {
		return err
	}
	if err := checkLike(op, bn, b, F32, a.shape); err != nil {
		return err
	}
	if err := checkLike(op, "out", out, F32, a.shape); err != nil {
		return err
	}
	if err := notPartial(op, "out", out, an, a); err != nil {
		return err
	}
	return notPartial(op, "out", out, bn, b)
}

func checkSiLUMul(out, gate, up *Tensor) error {
	return checkElementwise("SiLUMul", out, gate, up, "gate", "up")
}

func checkAdd(out, a, b *Tensor) error {
	return checkElementwise("Add", out, a, b, "a", "b")
}

func checkEmbed(out, table *Tensor, ids []int32) error {
	const op = "Embed"
	if err := checkWeight(op, "table", table, -1, -1); err != nil {
		return err
	}
	v, d := table.shape[0], table.shape[1]
	if err := CheckShape(op, "out", out, F32, len(ids), d); err != nil {
		return err
	}
	if err := disjoint(op, "out", out, []string{"table"}, table); err != nil {
		return err
	}
	for i, id := range ids {
		if id < 0 || int(id) >= v {
			return fmt.Errorf("tensor: %s: id %d at index %d outside the table of %d rows", op, id, i, v)
		}
	}
	return nil
}

func checkCopyRows(dst *Tensor, dstRow int, src *Tensor, srcRow, n int) error {
	const op = "CopyRows"
	if dst == nil || src == nil {
		return fmt.Errorf("tensor: %s: nil tensor", op)
	}
	if src.dtype.IsQuantized() && src.dtype != dst.dtype {
		return quantizedOperand(op, "src", src, onlyWeights+" (and a cache Q8_0)")
	}
	if dst.dtype != src.dtype && !(src.dtype == F32 && IsCacheDType(dst.dtype)) {
		return fmt.Errorf("tensor: %s: dst is %v, src is %v", op, dst.dtype, src.dtype)
	}
	if dst.dtype.IsQuantized() && !IsCacheDType(dst.dtype) {
		return quantizedOperand(op, "dst", dst, onlyWeights+" (and a cache Q8_0)")
	}
	if len(dst.shape) == 0 || len(src.shape) == 0 {
		return fmt.Errorf("tensor: %s: dst %v and src %v must have rows", op, dst.shape, src.shape)
	}
	if dst.shape[1:].NumElements() != src.shape[1:].NumElements() {
		return fmt.Errorf("tensor: %s: dst rows of %v and src rows of %v differ in length", op, dst.shape, src.shape)
	}
	if bs := int64(dst.dtype.BlockSize()); bs > 1 && dst.shape[1:].NumElements()%bs != 0 {
		return fmt.Errorf("tensor: %s: rows of %v are not whole %v blocks of %d", op, dst.shape, dst.dtype, bs)
	}
	if dst.dtype != src.dtype {
		// A conversion writes dst from src's values: they must not share storage.
		if err := disjoint(op, "dst", dst, []string{"src"}, src); err != nil {
			return err
		}
	}
	if n < 0 || dstRow < 0 || srcRow < 0 || dstRow+n > dst.shape[0] || srcRow+n > src.shape[0] {
		return fmt.Errorf("tensor: %s: %d rows from row %d of %v to row %d of %v out of range", op, n, srcRow, src.shape, dstRow, dst.shape)
	}
	return nil
}

func checkAttention(out *Tensor, a Attn) error {
	const op = "Attention"
	q, k, v, heads, kvHeads, headDim, pos0 := a.Q, a.K, a.V, a.Heads, a.KVHeads, a.HeadDim, a.Pos0
	if heads <= 0 || kvHeads <= 0 || heads%kvHeads != 0 || headDim <= 0 || pos0 < 0 {
		return fmt.Errorf("tensor: %s: invalid heads %d, kvHeads %d (must divide heads), headDim %d or pos0 %d", op, heads, kvHeads, headDim, pos0)
	}
	if math.IsNaN(float64(a.Scale)) {
		return fmt.Errorf("tensor: %s: scale is NaN", op)
	}
	if err := CheckShape(op, "q", q, F32, -1, heads*headDim); err != nil {
		return err
	}
	t := q.shape[0]
	if err := CheckShape(op, "out", out, F32, t, heads*headDim); err != nil {
		return err
	}
	kdt := Invalid
	if k != nil && IsCacheDType(k.dtype) {
		kdt = k.dtype
	}
	if err := CheckShape(op, "k", k, kdt, -1, kvHeads*headDim); err != nil {
		return err
	}
	maxPos := k.shape[0]
	if err := CheckShape(op, "v", v, k.dtype, maxPos, kvHeads*headDim); err != nil {
		return err
	}
	if bs := k.dtype.BlockSize(); bs > 1 && kvHeads*headDim%bs != 0 {
		return fmt.Errorf("tensor: %s: cache rows of %d are not whole %v blocks of %d", op, kvHeads*headDim, k.dtype, bs)
	}
	if pos0+t > maxPos {
		return fmt.Errorf("tensor: %s: positions %d..%d beyond the %d-position cache", op, pos0, pos0+t-1, maxPos)
	}
	if err := checkPosAt(op, a.PosAt); err != nil {
		return err
	}
	return disjoint(op, "out", out, []string{"q", "k", "v", "PosAt"}, q, k, v, a.PosAt)
}

func checkAttentionBlocks(out *Tensor, a AttnBlocks) error {
	const op = "AttentionBlocks"
	heads, kvHeads, headDim, bs := a.Heads, a.KVHeads, a.HeadDim, a.BlockSize
	if heads <= 0 || kvHeads <= 0 || heads%kvHeads != 0 || headDim <= 0 || bs <= 0 {
		return fmt.Errorf("tensor: %s: invalid heads %d, kvHeads %d (must divide heads), headDim %d or block size %d", op, heads, kvHeads, headDim, bs)
	}
	if math.IsNaN(float64(a.Scale)) {
		return fmt.Errorf("tensor: %s: scale is NaN", op)
	}
	qw, kw := heads*headDim, kvHeads*headDim
	if err := CheckShape(op, "q", a.Q, F32, -1, qw); err != nil {
		return err
	}
	t := a.Q.shape[0]
	for _, o := range [...]struct {
		t     *Tensor
		name  string
		width int
	}{{out, "out", qw}, {a.K, "k", kw}, {a.V, "v", kw}} {
		if err := CheckShape(op, o.name, o.t, F32, t, o.width); err != nil {
			return err
		}
	}
	pdt := Invalid
	if a.KPool != nil && IsCacheDType(a.KPool.dtype) {
		pdt = a.KPool.dtype
	}
	if err := CheckShape(op, "kPool", a.KPool, pdt, -1, kw); err != nil {
		return err
	}
	rows := a.KPool.shape[0]
	if err := CheckShape(op, "vPool", a.VPool, a.KPool.dtype, rows, kw); err != nil {
		return err
	}
	if b := a.KPool.dtype.BlockSize(); b > 1 && kw%b != 0 {
		return fmt.Errorf("tensor: %s: pool rows of %d are not whole %v blocks of %d", op, kw, a.KPool.dtype, b)
	}
	if rows%bs != 0 {
		return fmt.Errorf("tensor: %s: pools of %d rows are not whole blocks of %d", op, rows, bs)
	}
	if err := disjoint(op, "out", out, []string{"q", "k", "v", "kPool", "vPool"}, a.Q, a.K, a.V, a.KPool, a.VPool); err != nil {
		return err
	}
	if err := disjoint(op, "kPool", a.KPool, []string{"q", "k", "v", "vPool"}, a.Q, a.K, a.V, a.VPool); err != nil {
		return err
	}
	if err := disjoint(op, "vPool", a.VPool, []string{"q", "k", "v"}, a.Q, a.K, a.V); err != nil {
		return err
	}
	return checkBlockTables(op, a.Seqs, t, rows/bs, bs)
}

// blockOwners is checkBlockTables' scratch: for each block of the pools,
// the sequence (plus one) that reads it first, or -1 once two do.
var blockOwners = sync.Pool{New: func() any { return new([]int32) }}

// checkBlockTables checks the sequences of AttentionBlocks against T rows
// and a pool of nb blocks of bs positions: their rows add up to T, each
// table covers its sequence's positions with blocks of the pool, listed
// once, and no block written by one sequence is read by another.
func checkBlockTables(op string, seqs []SeqBlocks, t, nb, bs int) error {
	total := 0
	for i, s := range seqs {
		if s.Rows < 0 || s.Pos0 < 0 || s.Rows > t {
			return fmt.Errorf("tensor: %s: sequence %d has %d rows from position %d", op, i, s.Rows, s.Pos0)
		}
		if need := (s.Pos0 + s.Rows + bs - 1) / bs; s.Rows > 0 && len(s.Blocks) < need {
			return fmt.Errorf("tensor: %s: sequence %d: positions 0..%d need %d blocks of %d, its table lists %d", op, i, s.Pos0+s.Rows-1, need, bs, len(s.Blocks))
		}
		total += s.Rows
	}
	if total != t {
		return fmt.Errorf("tensor: %s: the sequences hold %d rows, q has %d", op, total, t)
	}
	op2 := blockOwners.Get().(*[]int32)
	defer blockOwners.Put(op2)
	if cap(*op2) < nb {
		*op2 = make([]int32, nb)
	}
	owner := (*op2)[:nb]
	// Only the entries set below are cleared at the end: the scratch stays
	// zero between calls.
	defer func() {
		for _, s := range seqs {
			if s.Rows == 0 {
				continue
			}
			for _, b := range s.Blocks[:(s.Pos0+s.Rows+bs-1)/bs] {
				if b >= 0 && int(b) < nb {
					owner[b] = 0
				}
			}
		}
	}()
	for i, s := range seqs {
		if s.Rows == 0 {
			continue
		}
		for j, b := range s.Blocks[:(s.Pos0+s.Rows+bs-1)/bs] {
			switch {
			case b < 0 || int(b) >= nb:
				return fmt.Errorf("tensor: %s: sequence %d: block %d of its table is %d, outside the pool of %d blocks", op, i, j, b, nb)
			case owner[b] == int32(i+1):
				return fmt.Errorf("tensor: %s: sequence %d lists block %d twice", op, i, b)
			case owner[b] == 0:
				owner[b] = int32(i + 1)
			default:
				owner[b] = -1 // read by two sequences
			}
		}
	}
	for i, s := range seqs {
		if s.Rows == 0 {
			continue
		}
		for j := s.Pos0 / bs; j <= (s.Pos0+s.Rows-1)/bs; j++ {
			if b := s.Blocks[j]; owner[b] == -1 {
				return fmt.Errorf("tensor: %s: sequence %d writes block %d, which another sequence reads", op, i, b)
			}
		}
	}
	return nil
}

func checkZero(t *Tensor) error {
	if t == nil {
		return fmt.Errorf("tensor: Zero: t is nil")
	}
	return nil
}

// checkMatMulPrecise checks MatMul's arguments for its training form,
// which needs float weights.
func checkMatMulPrecise(out, x, w, bias *Tensor) error {
	const op = "MatMulPrecise"
	if err := checkFloatWeight(op, "w", w); err != nil {
		return err
	}
	return checkMatMul(out, x, w, bias)
}

func checkMatMulGradX(dx, dy, w *Tensor) error {
	const op = "MatMulGradX"
	if err := checkFloatWeight(op, "w", w); err != nil {
		return err
	}
	if err := CheckShape(op, "dy", dy, F32, -1, -1); err != nil {
		return err
	}
	m, n := dy.shape[0], dy.shape[1]
	if err := CheckShape(op, "w", w, Invalid, n, -1); err != nil {
		return err
	}
	if err := CheckShape(op, "dx", dx, F32, m, w.shape[1]); err != nil {
		return err
	}
	return disjoint(op, "dx", dx, []string{"dy", "w"}, dy, w)
}

func checkMatMulGradW(dw, dy, x *Tensor) error {
	const op = "MatMulGradW"
	if err := CheckShape(op, "dy", dy, F32, -1, -1); err != nil {
		return err
	}
	m, n := dy.shape[0], dy.shape[1]
	if err := CheckShape(op, "x", x, F32, m, -1); err != nil {
		return err
	}
	if err := CheckShape(op, "dw", dw, F32, n, x.shape[1]); err != nil {
		return err
	}
	return disjoint(op, "dw", dw, []string{"dy", "x"}, dy, x)
}

func checkBiasGrad(db, dy *Tensor) error {
	const op = "BiasGrad"
	if err := CheckShape(op, "dy", dy, F32, -1, -1); err != nil {
		return err
	}
	if err := CheckShape(op, "db", db, F32, dy.shape[1]); err != nil {
		return err
	}
	return disjoint(op, "db", db, []string{"dy"}, dy)
}

func checkRMSNormGrad(dx, dw, dy, x, w *Tensor) error {
	const op = "RMSNormGrad"
	if err := checkFloatWeight(op, "w", w); err != nil {
		return err
	}
	if err := CheckShape(op, "x", x, F32, -1, -1); err != nil {
		return err
	}
	m, h := x.shape[0], x.shape[1]
	if err := CheckShape(op, "dy", dy, F32, m, h); err != nil {
		return err
	}
	if err := CheckShape(op, "w", w, Invalid, h); err != nil {
		return err
	}
	if err := CheckShape(op, "dx", dx, F32, m, h); err != nil {
		return err
	}
	if err := disjoint(op, "dx", dx, []string{"dy", "x", "w"}, dy, x, w); err != nil {
		return err
	}
	if dw == nil {
		return nil
	}
	if err := CheckShape(op, "dw", dw, F32, h); err != nil {
		return err
	}
	return disjoint(op, "dw", dw, []string{"dx", "dy", "x", "w"}, dx, dy, x, w)
}

func checkSiLUMulGrad(dgate, dup, dout, gate, up *Tensor) error {
	const op = "SiLUMulGrad"
	if gate == nil {
		return fmt.Errorf("tensor: %s: gate is nil", op)
	}
	if err := checkLike(op, "gate", gate, F32, gate.shape); err != nil {
		return err
	}
	if err := checkLike(op, "up", up, F32, gate.shape); err != nil {
		return err
	}
	if err := checkLike(op, "dout", dout, F32, gate.shape); err != nil {
		return err
	}
	if err := checkLike(op, "dgate", dgate, F32, gate.shape); err != nil {
		return err
	}
	if err := checkLike(op, "dup", dup, F32, gate.shape); err != nil {
		return err
	}
	if err := notPartial(op, "dgate", dgate, "dout", dout); err != nil {
		return err
	}
	if err := disjoint(op, "dgate", dgate, []string{"gate", "up", "dup"}, gate, up, dup); err != nil {
		return err
	}
	return disjoint(op, "dup", dup, []string{"dout", "gate", "up"}, dout, gate, up)
}

func checkAttentionGrad(g AttnGrad, a Attn) error {
	const op = "AttentionGrad"
	dq, dk, dv, dout, out := g.DQ, g.DK, g.DV, g.DOut, g.Out
	q, k, v, heads, kvHeads, headDim := a.Q, a.K, a.V, a.Heads, a.KVHeads, a.HeadDim
	if heads <= 0 || kvHeads <= 0 || heads%kvHeads != 0 || headDim <= 0 {
		return fmt.Errorf("tensor: %s: invalid heads %d, kvHeads %d (must divide heads) or headDim %d", op, heads, kvHeads, headDim)
	}
	if a.Pos0 != 0 {
		return fmt.Errorf("tensor: %s: pos0 is %d; the backward covers positions from 0", op, a.Pos0)
	}
	if math.IsNaN(float64(a.Scale)) {
		return fmt.Errorf("tensor: %s: scale is NaN", op)
	}
	qw, kw := heads*headDim, kvHeads*headDim
	if err := CheckShape(op, "q", q, F32, -1, qw); err != nil {
		return err
	}
	t := q.shape[0]
	for _, o := range [...]struct {
		t     *Tensor
		name  string
		width int
	}{{k, "k", kw}, {v, "v", kw}, {out, "out", qw}, {dout, "dout", qw}, {dq, "dq", qw}, {dk, "dk", kw}, {dv, "dv", kw}} {
		if err := CheckShape(op, o.name, o.t, F32, t, o.width); err != nil {
			return err
		}
	}
	if err := disjoint(op, "dq", dq, []string{"dout", "q", "k", "v", "out", "dk", "dv"}, dout, q, k, v, out, dk, dv); err != nil {
		return err
	}
	if err := disjoint(op, "dk", dk, []string{"dout", "q", "k", "v", "out", "dv"}, dout, q, k, v, out, dv); err != nil {
		return err
	}
	return disjoint(op, "dv", dv, []string{"dout", "q", "k", "v", "out"}, dout, q, k, v, out)
}

func checkCrossEntropyGrad(logits *Tensor, targets []int32) error {
	const op = "CrossEntropyGrad"
	if err := CheckShape(op, "logits", logits, F32, len(targets), -1); err != nil {
		return err
	}
	v := logits.shape[1]
	for i, y := range targets {
		if int(y) >= v {
			return fmt.Errorf("tensor: %s: target %d of row %d outside the %d logits", op, y, i, v)
		}
	}
	return nil
}
