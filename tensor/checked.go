package tensor

// Checked returns b behind a front that checks each operation's arguments
// (the rules of Kernels and GradOps: dtypes, shapes, ranges, aliasing) and
// calls b's kernel only when they hold, so that a malformed call is an
// error naming the operation and the operand, the same on every backend.
// Backends' kernels check nothing but what their own memory safety needs
// (that operands are their memory); code that computes calls them through
// Checked.
//
// The front forwards everything else to b unchanged. When b implements
// GradOps the front does too, with every backward operation checked:
// CheckedGrad returns it. Optional capabilities are found through the front
// by the helpers of this package (Sync, Pinned, ...), which look behind it;
// a plain type assertion on the front finds only GradOps. Checked of a
// front returns that front; Checked(nil) is nil.
func Checked(b Backend) Backend {
	switch b.(type) {
	case nil:
		return nil
	case *checked, *checkedGrad:
		return b
	}
	c := checked{b: b}
	if g, ok := b.(GradOps); ok {
		return &checkedGrad{checked: c, g: g}
	}
	return &c
}

// CheckedGrad returns the checked backward operations of b (b itself when
// it is a front from Checked), or false when b has none.
func CheckedGrad(b Backend) (GradOps, bool) {
	g, ok := Checked(b).(GradOps)
	return g, ok
}

// checked is the front of a backend without GradOps.
type checked struct{ b Backend }

// checkedGrad is the front of a backend with GradOps.
type checkedGrad struct {
	checked
	g GradOps
}

var (
	_ Backend = (*checked)(nil)
	_ GradOps = (*checkedGrad)(nil)
)

// Unwrap returns the backend behind the front.
func (c *checked) Unwrap() Backend { return c.b }

func (c *checked) Name() string { return c.b.Name() }

func (c *checked) Alloc(dt DType, shape Shape) (*Tensor, error) { return c.b.Alloc(dt, shape) }

func (c *checked) Free(t *Tensor) { c.b.Free(t) }

func (c *checked) Upload(dst *Tensor, off int64, src []byte) error { return c.b.Upload(dst, off, src) }

func (c *checked) Download(dst []byte, src *Tensor) error { return c.b.Download(dst, src) }

func (c *checked) Close() error { return c.b.Close() }

func (c *checked) MatMul(out, x, w, bias *Tensor) error {
	if err := checkMatMul(out, x, w, bias); err != nil {
		return err
	}
	return c.b.MatMul(out, x, w, bias)
}

func (c *checked) RMSNorm(out, x, w *Tensor, eps float32) error {
	if err := checkRMSNorm(out, x, w); err != nil {
		return err
	}
	return c.b.RMSNorm(out, x, w, eps)
}

func (c *checked) Rope(x *Tensor, r Rotary) error {
	if err := checkRope(x, r); err != nil {
		return err
	}
	return c.b.Rope(x, r)
}

func (c *checked) SiLUMul(out, gate, up *Tensor) error {
	if err := checkSiLUMul(out, gate, up); err != nil {
		return err
	}
	return c.b.SiLUMul(out, gate, up)
}

func (c *checked) Add(out, a, b *Tensor) error {
	if err := checkAdd(out, a, b); err != nil {
		return err
	}
	return c.b.Add(out, a, b)
}

func (c *checked) Embed(out, table *Tensor, ids []int32) error {
	if err := checkEmbed(out, table, ids); err != nil {
		return err
	}
	return c.b.Embed(out, table, ids)
}

func (c *checked) CopyRows(dst *Tensor, dstRow int, src *Tensor, srcRow, n int) error {
	if err := checkCopyRows(dst, dstRow, src, srcRow, n); err != nil {
		return err
	}
	return c.b.CopyRows(dst, dstRow, src, srcRow, n)
}

func (c *checked) Attention(out *Tensor, a Attn) error {
	if err := checkAttention(out, a); err != nil {
		return err
	}
	return c.b.Attention(out, a)
}

func (c *checked) AttentionBlocks(out *Tensor, a AttnBlocks) error {
	if err := checkAttentionBlocks(out, a); err != nil {
		return err
	}
	return c.b.AttentionBlocks(out, a)
}

func (c *checkedGrad) MatMulPrecise(out, x, w, bias *Tensor) error {
	if err := checkMatMulPrecise(out, x, w, bias); err != nil {
		return err
	}
	return c.g.MatMulPrecise(out, x, w, bias)
}

func (c *checkedGrad) Zero(t *Tensor) error {
	if err := checkZero(t); err != nil {
		return err
	}
	return c.g.Zero(t)
}

func (c *checkedGrad) MatMulGradX(dx, dy, w *Tensor) error {
	if err := checkMatMulGradX(dx, dy, w); err != nil {
		return err
	}
	return c.g.MatMulGradX(dx, dy, w)
}

func (c *checkedGrad) MatMulGradW(dw, dy, x *Tensor) error {
	if err := checkMatMulGradW(dw, dy, x); err != nil {
		return err
	}
	return c.g.MatMulGradW(dw, dy, x)
}

func (c *checkedGrad) BiasGrad(db, dy *Tensor) error {
	if err := checkBiasGrad(db, dy); err != nil {
		return err
	}
	return c.g.BiasGrad(db, dy)
}

func (c *checkedGrad) RMSNormGrad(dx, dw, dy, x, w *Tensor, eps float32) error {
	if err := checkRMSNormGrad(dx, dw, dy, x, w); err != nil {
		return err
	}
	return c.g.RMSNormGrad(dx, dw, dy, x, w, eps)
}

func (c *checkedGrad) SiLUMulGrad(dgate, dup, dout, gate, up *Tensor) error {
	if err := checkSiLUMulGrad(dgate, dup, dout, gate, up); err != nil {
		return err
	}
	return c.g.SiLUMulGrad(dgate, dup, dout, gate, up)
}

func (c *checkedGrad) AttentionGrad(g AttnGrad, a Attn) error {
	if err := checkAttentionGrad(g, a); err != nil {
		return err
	}
	return c.g.AttentionGrad(g, a)
}

func (c *checkedGrad) CrossEntropyGrad(logits *Tensor, targets []int32, scale float32) (float64, error) {
	if err := checkCrossEntropyGrad(logits, targets); err != nil {
		return 0, err
	}
	return c.g.CrossEntropyGrad(logits, targets, scale)
}
