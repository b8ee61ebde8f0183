//go:build cuda

package cuda

import "github.com/strata-llm/strata/tensor"

// The fused operations of a decode step (tensor.AddRMSNorm, RopeKV,
// GateUpSiLU; kernels/fused.cu and kernels/gemv.cuh).
var (
	_ tensor.AddRMSNormer = (*Backend)(nil)
	_ tensor.RopeKVer     = (*Backend)(nil)
	_ tensor.GateUpper    = (*Backend)(nil)
)

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
		return b.run("add_rmsnorm_"+suffix(w.DType()), [3]uint32{uint32(m), 1, 1}, [3]uint32{256, 1, 1}, a)
	})
}

// RopeKV rotates q in place and k into the key cache, and copies v into
// the value cache, in one kernel; the caches may be F32, F16 or BF16 (the
// rows are rounded to nearest even). The position is r.Pos0, or read from
// r.PosAt when the kernel runs (clamped to [0, r.Pos0]). k is left as it
// was.
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
	n := int64(t)*int64(r.Heads+kvHeads)*int64(half) + int64(t)*int64(k.Shape()[1])
	return b.ops(op, func() error {
		a := new(args).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).ptr(kc.Ptr()).ptr(vc.Ptr()).ptr(r.Cos.Ptr()).ptr(r.Sin.Ptr()).
			i32(t).i32(r.Heads).i32(kvHeads).i32(r.HeadDim).i32(r.Pos0).ptr(posPtr(r.PosAt))
		return b.run1D("rope_kv_"+suffix(kc.DType()), n, a)
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
// GEMV kernel reads both weights' rows and writes the product; otherwise
// (prefill, quantized weights) it is MatMul, MatMul and SiLUMul, with up
// as the second product's output.
func (b *Backend) GateUpSiLU(out, up, x, wGate, wUp *tensor.Tensor) error {
	const op = "GateUpSiLU"
	if err := b.devices(op, []string{"out", "up", "x", "wGate", "wUp"}, out, up, x, wGate, wUp); err != nil {
		return err
	}
	m, k, n := x.Shape()[0], x.Shape()[1], wGate.Shape()[0]
	dt := wGate.DType()
	fused := m >= 1 && m <= min(2, b.gemvMaxRows) && !dt.IsQuantized() && k > 0 &&
		k%(16/dt.Size()) == 0 && wGate.Ptr()%16 == 0 && wUp.Ptr()%16 == 0 && x.Ptr()%16 == 0
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
		name := "gemv_gate_up_" + suffix(dt) + "_m1"
		if m == 2 {
			name = "gemv_gate_up_" + suffix(dt) + "_m2"
		}
		return b.run(name, [3]uint32{uint32((n + warpsPerBlock - 1) / warpsPerBlock), 1, 1}, [3]uint32{32 * warpsPerBlock, 1, 1}, a)
	})
}
