//go:build cuda

package cuda

import "github.com/strata-llm/strata/tensor"

// The fused operations of a decode step (tensor.AddRMSNorm, RopeKV,
// GateUpSiLU; kernels/fused.cu and kernels/gemv.cuh).
var (
	_ tensor.AddRMSNormer = (*Backend)(nil)
	_ tensor.RopeKVer     = (*Backend)(nil)
	_ tensor.GateUpper    = (*Backend)(nil)
	_ tensor.ManyMatMuler = (*Backend)(nil)
)

// MatMulMany computes outs[i] = x·ws[i]ᵀ. Up to three products of one row
// of x with F32, F16 or BF16 weights of one dtype whose rows are 16-byte
// aligned run as one GEMV launch over all their rows (gemv_many_*); with
// quantized weights that have direct kernels (Q4_K, Q5_K), x is rounded
// once and one launch takes all their rows (gemvd_*); any other call is a
// MatMul for each.
func (b *Backend) MatMulMany(outs []*tensor.Tensor, x *tensor.Tensor, ws []*tensor.Tensor) error {
	const op = "MatMulMany"
	for i := range outs {
		if err := b.devices(op, []string{"out", "x", "w"}, outs[i], x, ws[i]); err != nil {
			return err
		}
	}
	m, k := x.Shape()[0], x.Shape()[1]
	fused := m == 1 && len(ws) >= 1 && len(ws) <= 3 && k > 0 && x.Ptr()%16 == 0
	for _, w := range ws {
		dt := w.DType()
		fused = fused && dt == ws[0].DType() && !dt.IsQuantized() && k%(16/dt.Size()) == 0 && w.Ptr()%16 == 0
	}
	if f, ok := b.directOK(ws); ok && m == 1 && !fused {
		return b.ops(op, func() error { return b.manyDirect(op, outs, x, ws, f, k) })
	}
	if !fused {
		for i := range outs {
			if err := b.MatMul(outs[i], x, ws[i], nil); err != nil {
				return err
			}
		}
		return nil
	}
	o, w, n, rows := splitOperands(outs, ws)
	if rows == 0 {
		return nil
	}
	const warpsPerBlock = 8
	return b.ops(op, func() error {
		if v := b.splitFor(suffix(ws[0].DType())); v != nil {
			return b.gemvSplitRun(v, suffix(ws[0].DType()), o, w, n, x.Ptr(), k)
		}
		a := new(args).ptr(o[0]).ptr(o[1]).ptr(o[2]).ptr(x.Ptr()).ptr(w[0]).ptr(w[1]).ptr(w[2]).i32(n[0]).i32(n[1]).i32(n[2]).i32(k)
		grid := [3]uint32{uint32((rows + warpsPerBlock - 1) / warpsPerBlock), 1, 1}
		return b.run("gemv_many_"+suffix(ws[0].DType()), grid, [3]uint32{32 * warpsPerBlock, 1, 1}, a)
	})
}

// manyDirect is MatMulMany's one row of x times quantized weights on the
// direct kernels; the caller holds opsMu and has entered the context.
func (b *Backend) manyDirect(op string, outs []*tensor.Tensor, x *tensor.Tensor, ws []*tensor.Tensor, f quantFormat, k int) error {
	lay := x16Layout(1, k)
	p, release, err := b.scratch(op, lay.bytes)
	if err != nil {
		return err
	}
	defer release() // stream order keeps the levels for the kernel
	o := make([]uintptr, len(outs))
	for i, t := range outs {
		o[i] = t.Ptr()
	}
	return b.gemvDirect(o, x.Ptr(), p, p+uintptr(lay.d), p+uintptr(lay.s), ws, f, k)
}

// AddRMSNorm computes x += d, then out = RMSNorm(x, w, eps), in one kernel
// that reads each row once and writes the new residual and the normed row.
func (b *Backend) AddRMSNorm(out, x, d, w *tensor.Tensor, eps float32) error {
	const op = "AddRMSNorm"
	if err := b.devices(op, []string{"out", "x", "d", "w"}, out, x, d, w); err != nil {
		return err
	}
	m, n := x.Shape()[0], x.Shape()[1]
	if m == 0 || n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		a := new(args).ptr(out.Ptr()).ptr(x.Ptr()).ptr(d.Ptr()).ptr(w.Ptr()).i32(n).f32(eps)
		return b.runStep("add_rmsnorm_"+suffix(w.DType()), [3]uint32{uint32(m), 1, 1}, [3]uint32{normThreads(n), 1, 1}, a)
	})
}

// RopeKV rotates q in place and k into the key cache, and copies v into
// the value cache, in one kernel; the caches may be F32, F16 or BF16 (the
// rows are rounded to nearest even), or Q8_0 or Q8_B8 (each block
// quantized as CopyRows quantizes it). The position is r.Pos0, or read
// from r.PosAt when the kernel runs (clamped to [0, r.Pos0]). k is left as
// it was.
func (b *Backend) RopeKV(q, k, v, kc, vc *tensor.Tensor, r tensor.Rotary) error {
	const op = "RopeKV"
	if err := b.devices(op, []string{"q", "k", "v", "kc", "vc", "cos", "sin", "PosAt"}, q, k, v, kc, vc, r.Cos, r.Sin, r.PosAt); err != nil {
		return err
	}
	t := q.Shape()[0]
	if t == 0 {
		return nil
	}
	kvHeads := k.Shape()[1] / r.HeadDim
	half := r.HeadDim / 2
	// A thread a pair of q and k and a value of v; for the quantized
	// caches a thread a value of k and v, in whole warps (a block's lanes
	// find its scale together), then a pair of q.
	n := int64(t)*int64(r.Heads+kvHeads)*int64(half) + int64(t)*int64(k.Shape()[1])
	if dt := kc.DType(); dt == tensor.Q8_0 || dt == tensor.Q8_B8 {
		n = (2*int64(t)*int64(k.Shape()[1])+31)/32*32 + int64(t)*int64(r.Heads)*int64(half)
	}
	return b.ops(op, func() error {
		a := new(args).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).ptr(kc.Ptr()).ptr(vc.Ptr()).ptr(r.Cos.Ptr()).ptr(r.Sin.Ptr()).
			i32(t).i32(r.Heads).i32(kvHeads).i32(r.HeadDim).i32(r.Pos0).ptr(posPtr(r.PosAt))
		return b.runStep1D("rope_kv_"+cacheSuffix(kc.DType()), n, a)
	})
}

// posPtr is the device address of a PosAt operand, or 0 for none.
func posPtr(at *tensor.Tensor) uintptr {
	if at == nil {
		return 0
	}
	return at.Ptr()
}

// GateUpSiLU computes out = silu(x·wGateᵀ) * (x·wUpᵀ). For one or two rows
// of x and F32, F16 or BF16 weights whose rows are 16-byte aligned, one
// GEMV kernel reads both weights' rows and writes the product; for one
// row and quantized weights with direct kernels it is MatMulMany (one
// launch for both) and SiLUMul; otherwise (prefill, other quantized
// weights) it is MatMul, MatMul and SiLUMul, with up as the second
// product's output.
func (b *Backend) GateUpSiLU(out, up, x, wGate, wUp *tensor.Tensor) error {
	const op = "GateUpSiLU"
	if err := b.devices(op, []string{"out", "up", "x", "wGate", "wUp"}, out, up, x, wGate, wUp); err != nil {
		return err
	}
	m, k, n := x.Shape()[0], x.Shape()[1], wGate.Shape()[0]
	dt := wGate.DType()
	fused := m >= 1 && m <= min(2, b.gemvMaxRows) && !dt.IsQuantized() && k > 0 &&
		k%(16/dt.Size()) == 0 && wGate.Ptr()%16 == 0 && wUp.Ptr()%16 == 0 && x.Ptr()%16 == 0
	if _, ok := b.directOK([]*tensor.Tensor{wGate, wUp}); ok && m == 1 {
		// One rounding of x and one launch for both products.
		if err := b.MatMulMany([]*tensor.Tensor{out, up}, x, []*tensor.Tensor{wGate, wUp}); err != nil {
			return err
		}
		return b.SiLUMul(out, out, up)
	}
	if !fused {
		if err := b.MatMul(out, x, wGate, nil); err != nil {
			return err
		}
		if err := b.MatMul(up, x, wUp, nil); err != nil {
			return err
		}
		return b.SiLUMul(out, out, up)
	}
	if n == 0 {
		return nil
	}
	const warpsPerBlock = 8
	return b.ops(op, func() error {
		a := new(args).ptr(out.Ptr()).ptr(x.Ptr()).ptr(wGate.Ptr()).ptr(wUp.Ptr()).i32(n).i32(k)
		if v := b.splitFor(suffix(dt)); v != nil && m == 1 {
			v = v.forShape(n, k)
			return b.runVariant(v, v.gateUpKernel(suffix(dt)), v.gateUpGrid(n), a)
		}
		name := "gemv_gate_up_" + suffix(dt) + "_m1"
		if m == 2 {
			name = "gemv_gate_up_" + suffix(dt) + "_m2"
		}
		return b.run(name, [3]uint32{uint32((n + warpsPerBlock - 1) / warpsPerBlock), 1, 1}, [3]uint32{32 * warpsPerBlock, 1, 1}, a)
	})
}
