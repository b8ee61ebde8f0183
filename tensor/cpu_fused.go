package tensor

import "fmt"

// The CPU backend's fused operations (fused.go): the same arithmetic as
// the unfused operations, in the same order, so that they are bit for bit
// the same.

var (
	_ AddRMSNormer = (*CPU)(nil)
	_ RopeKVer     = (*CPU)(nil)
)

// AddRMSNorm computes x += d, then out = RMSNorm(x, w, eps), one row at a
// time while the row is in cache.
func (c *CPU) AddRMSNorm(out, x, d, w *Tensor, eps float32) error {
	if err := operands("AddRMSNorm", out, x, d, w); err != nil {
		return err
	}
	m, n := x.shape[0], x.shape[1]
	if m == 0 || n == 0 {
		return nil
	}
	xs, ds := x.F32(), d.F32()
	for i := range xs[:m*n] {
		xs[i] += ds[i]
	}
	e := elemPool.Get().(*elemOp)
	*e = elemOp{kind: elemRMSNorm, n: m, o: out.F32(), a: xs, w: newFvec(w), d: n, eps: eps}
	c.parallelRange(e, max(1, minParallelElems/n))
	return nil
}

// RopeKV rotates q and k by r and copies k's and v's rows into the caches
// at r's position (read from r.PosAt when set).
func (c *CPU) RopeKV(q, k, v, kc, vc *Tensor, r Rotary) error {
	const op = "RopeKV"
	if err := operands(op, q, k, v, kc, vc); err != nil {
		return err
	}
	if kc.dtype != k.dtype {
		return fmt.Errorf("tensor: cpu: %s: the caches are %v; this backend appends F32 rows to F32 caches only", op, kc.dtype)
	}
	p, err := hostPosition(op, r.Pos0, r.PosAt)
	if err != nil {
		return err
	}
	r.Pos0, r.PosAt = p, nil
	if err := c.Rope(q, r); err != nil {
		return err
	}
	r.Heads = k.shape[1] / r.HeadDim
	if err := c.Rope(k, r); err != nil {
		return err
	}
	t := q.shape[0]
	if err := c.CopyRows(kc, p, k, 0, t); err != nil {
		return err
	}
	return c.CopyRows(vc, p, v, 0, t)
}
