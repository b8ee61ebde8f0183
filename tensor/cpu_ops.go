package tensor

import (
	"fmt"
	"math"
	"sync"

	"github.com/strata-llm/strata/tensor/quant"
)

// minParallelElems is the element count below which an elementwise
// operation runs on the calling goroutine alone.
const minParallelElems = 1 << 16

// elemOp is one call of an elementwise operation (RMSNorm, SiLUMul, Add),
// split into ranges of rows or elements that run as tasks on the pool. It
// is recycled through elemPool, so that a call allocates nothing.
type elemOp struct {
	kind    elemKind
	n, per  int       // range [0, n) in tasks of per
	k       *kernels  // SiLUMul
	o, a, b []float32 // out and the inputs (RMSNorm: a = x)
	w       fvec      // RMSNorm weight
	d       int       // RMSNorm and SiLUMul row length
	eps     float32
}

type elemKind int

const (
	elemRMSNorm elemKind = iota
	elemSiLUMul
	elemAdd
)

var elemPool = sync.Pool{New: func() any { return new(elemOp) }}

// parallelRange splits [0, e.n) into chunks of at least grain and runs e on
// each chunk on the pool, then recycles e.
func (c *CPU) parallelRange(e *elemOp, grain int) {
	tasks := 1
	if e.n >= grain*2 {
		tasks = min(e.n/grain, 4*c.threads)
	}
	e.per = (e.n + tasks - 1) / tasks
	c.pool.runTask(tasks, e)
	*e = elemOp{}
	elemPool.Put(e)
}

func (e *elemOp) run(t int) {
	lo := t * e.per
	if lo >= e.n {
		return
	}
	hi := min(e.n, lo+e.per)
	switch e.kind {
	case elemRMSNorm:
		e.rmsNorm(lo, hi)
	case elemSiLUMul:
		// Row by row: the kernels' vector body and scalar tail round
		// differently, so each element's kernel depends on its place in
		// its row alone, never on where a task's range ends.
		d := e.d
		for i := lo; i < hi; i++ {
			e.k.siluMul(e.o[i*d:(i+1)*d], e.a[i*d:(i+1)*d], e.b[i*d:(i+1)*d])
		}
	default:
		o, x, y := e.o[lo:hi], e.a[lo:hi], e.b[lo:hi]
		for i := range o {
			o[i] = x[i] + y[i]
		}
	}
}

// rmsNorm normalises rows [lo, hi).
func (e *elemOp) rmsNorm(lo, hi int) {
	d, xs, os, wv := e.d, e.a, e.o, e.w
	for i := lo; i < hi; i++ {
		xr, or := xs[i*d:(i+1)*d], os[i*d:(i+1)*d]
		var ss float64
		for _, v := range xr {
			ss += float64(v) * float64(v)
		}
		r := float32(1 / math.Sqrt(ss/float64(d)+float64(e.eps)))
		switch wv.dt {
		case F32:
			wr := wv.f32[:d]
			for j, v := range xr {
				or[j] = v * r * wr[j]
			}
		case F16:
			wr := wv.u16[:d]
			for j, v := range xr {
				or[j] = v * r * f16ToF32Table[wr[j]]
			}
		default:
			wr := wv.u16[:d]
			for j, v := range xr {
				or[j] = v * r * bf16ToF32(wr[j])
			}
		}
	}
}

// RMSNorm computes out[i,:] = x[i,:] / sqrt(mean(x[i,:]²) + eps) * w. x and
// out are F32 [M, D] (out may alias x); w is [D] in any float type.
func (c *CPU) RMSNorm(out, x, w *Tensor, eps float32) error {
	if err := operands("RMSNorm", out, x, w); err != nil {
		return err
	}
	m, d := x.shape[0], x.shape[1]
	if m == 0 || d == 0 {
		return nil
	}
	e := elemPool.Get().(*elemOp)
	*e = elemOp{kind: elemRMSNorm, n: m, o: out.F32(), a: x.F32(), w: newFvec(w), d: d, eps: eps}
	c.parallelRange(e, max(1, minParallelElems/d))
	return nil
}

// Rope rotates the pairs (j, j+headDim/2) of every head of x[T,
// heads*headDim] in place by the angles of positions pos0..pos0+T-1, read
// from the F32 tables cos and sin [maxPos, headDim/2] (the fields of r).
func (c *CPU) Rope(x *Tensor, r Rotary) error {
	cos, sin := r.Cos, r.Sin
	if err := operands("Rope", x, cos, sin); err != nil {
		return err
	}
	pos0, err := hostPosition("Rope", r.Pos0, r.PosAt)
	if err != nil {
		return err
	}
	xs, cs, ss := x.F32(), cos.F32(), sin.F32()
	for row := range x.shape[0] {
		ropeRow(xs, cs, ss, r.Heads, r.HeadDim, row, pos0+row)
	}
	return nil
}

// RopeRows rotates each row t of x as Rope does at position pos[t]
// (RowRoper): the same bits, in one call.
func (c *CPU) RopeRows(x *Tensor, r Rotary, pos []int32) error {
	if err := operands("RopeRows", x, r.Cos, r.Sin); err != nil {
		return err
	}
	xs, cs, ss := x.F32(), r.Cos.F32(), r.Sin.F32()
	for row, p := range pos {
		ropeRow(xs, cs, ss, r.Heads, r.HeadDim, row, int(p))
	}
	return nil
}

// ropeRow rotates row row of xs (rows of heads*headDim) at position p of
// the tables cs and ss (rows of headDim/2).
func ropeRow(xs, cs, ss []float32, heads, headDim, row, p int) {
	half, width := headDim/2, heads*headDim
	xs = xs[row*width : (row+1)*width]
	cr, sr := cs[p*half:(p+1)*half], ss[p*half:(p+1)*half]
	for h := range heads {
		v := xs[h*headDim : (h+1)*headDim]
		lo, hi := v[:half], v[half:headDim]
		for j := range half {
			a, b := lo[j], hi[j]
			lo[j] = a*cr[j] - b*sr[j]
			hi[j] = b*cr[j] + a*sr[j]
		}
	}
}

// SiLUMul computes out = silu(gate) * up elementwise, silu(g) = g/(1+e^-g).
// All three are F32 of one shape; out may alias gate or up. Rows (of the
// last dimension) are computed whole, so an element's bits do not depend on
// how many rows share the call.
func (c *CPU) SiLUMul(out, gate, up *Tensor) error {
	if err := operands("SiLUMul", out, gate, up); err != nil {
		return err
	}
	e := elemPool.Get().(*elemOp)
	*e = elemOp{kind: elemSiLUMul, k: c.k, o: out.F32(), a: gate.F32(), b: up.F32()}
	if len(e.o) == 0 {
		*e = elemOp{}
		elemPool.Put(e)
		return nil
	}
	e.d = len(e.o)
	if sh := out.shape; len(sh) > 0 && sh[len(sh)-1] > 0 {
		e.d = sh[len(sh)-1]
	}
	e.n = len(e.o) / e.d
	c.parallelRange(e, max(1, minParallelElems/4/e.d))
	return nil
}

// Add computes out = a + b elementwise; all F32 of one shape. out may alias
// a or b.
func (c *CPU) Add(out, a, b *Tensor) error {
	if err := operands("Add", out, a, b); err != nil {
		return err
	}
	e := elemPool.Get().(*elemOp)
	*e = elemOp{kind: elemAdd, o: out.F32(), a: a.F32(), b: b.F32()}
	e.n = len(e.o)
	c.parallelRange(e, minParallelElems*4)
	return nil
}

// Embed gathers rows of table [V, D] (any float type, or quantized: the
// rows are dequantized) into out [len(ids), D] F32. (Checked refuses an id
// outside [0, V) before anything is written.)
func (c *CPU) Embed(out, table *Tensor, ids []int32) error {
	if err := operands("Embed", out, table); err != nil {
		return err
	}
	if table.dtype.IsQuantized() {
		return embedQuant(out, table, ids)
	}
	d := table.shape[1]
	o := out.F32()
	rows := func(lo, hi int) {
		for i := lo; i < hi; i++ {
			row := int(ids[i])
			dst := o[i*d : (i+1)*d]
			switch table.dtype {
			case F32:
				copy(dst, table.F32()[row*d:(row+1)*d])
			case F16:
				F16ToF32(dst, table.U16()[row*d:(row+1)*d])
			default:
				BF16ToF32(dst, table.U16()[row*d:(row+1)*d])
			}
		}
	}
	// A prompt's chunk (a hybrid placement embeds it on the CPU, 512 rows
	// of 4096 in about a millisecond on one thread, while the link waits
	// for the first block) converts its rows on every thread; a decode
	// step's row stays on the calling goroutine.
	n := len(ids)
	if n < 2 || n*d < minParallelElems || c.threads == 1 {
		rows(0, n)
		return nil
	}
	tasks := min(n, 4*c.threads)
	per := (n + tasks - 1) / tasks
	c.pool.run(tasks, func(t int) { rows(t*per, min(n, (t+1)*per)) })
	return nil
}

// CopyRows copies n rows of src from row srcRow into dst from row dstRow.
// The tensors have the same dtype and row length (the product of all but
// the first dimension); they may be the same tensor.
func (c *CPU) CopyRows(dst *Tensor, dstRow int, src *Tensor, srcRow, n int) error {
	if err := operands("CopyRows", dst, src); err != nil {
		return err
	}
	dl := int(dst.shape[1:].NumElements())
	if dst.dtype != src.dtype { // a cache append: convert F32 rows
		return storeRows(dst, dstRow, src.F32()[srcRow*dl:(srcRow+n)*dl])
	}
	rb := int(dst.NumBytes()) / max(dst.shape[0], 1)
	copy(dst.data[dstRow*rb:(dstRow+n)*rb], src.data[srcRow*rb:(srcRow+n)*rb])
	return nil
}

// storeRows writes the F32 values x, whole rows of dst, into dst's rows
// from row dstRow converted to its dtype (a cache dtype, IsCacheDType): F16
// and BF16 rounded to nearest even, Q8_0 and Q8_B8 quantized block by block.
func storeRows(dst *Tensor, dstRow int, x []float32) error {
	dl := int(dst.shape[1:].NumElements())
	n := len(x) / max(dl, 1)
	switch dst.dtype {
	case F32:
		copy(dst.F32()[dstRow*dl:(dstRow+n)*dl], x)
	case F16:
		F32ToF16(dst.U16()[dstRow*dl:(dstRow+n)*dl], x)
	case BF16:
		F32ToBF16(dst.U16()[dstRow*dl:(dstRow+n)*dl], x)
	case Q8_0:
		rb := dl / 32 * 34
		quant.QuantizeQ8_0(dst.data[dstRow*rb:(dstRow+n)*rb], x)
	case Q8_B8:
		rb := dl / quant.QB8 * quant.BlockBytesQ8B8
		quant.QuantizeQ8B8(dst.data[dstRow*rb:(dstRow+n)*rb], x)
	default:
		return fmt.Errorf("tensor: cpu: no conversion from F32 to %v", dst.dtype)
	}
	return nil
}

// CombineRows computes out[t] = Σ_j w[r]·src[r], r = idx[t*k+j]
// (tensor.CombineRows): each product rounded, then added in the order of j.
func (c *CPU) CombineRows(out, src, w *Tensor, idx []int32, k int) error {
	if err := operands("CombineRows", out, src, w); err != nil {
		return err
	}
	d := src.shape[1]
	o, s, ws := out.F32(), src.F32(), w.F32()
	for t := range out.shape[0] {
		dst := o[t*d : (t+1)*d]
		for j, r := range idx[t*k : (t+1)*k] {
			wr, row := ws[r], s[int(r)*d:int(r+1)*d]
			if j == 0 {
				for i, v := range row {
					dst[i] = wr * v
				}
				continue
			}
			for i, v := range row {
				dst[i] += float32(wr * v) // rounded before the add: no fused multiply-add
			}
		}
	}
	return nil
}
