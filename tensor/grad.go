package tensor

// GradOps are the backward operations of training, an optional capability of
// a Backend, found checked with CheckedGrad. Gradients (dx, dw, db, dy, ...) are F32
// tensors of the backend; weight operands (w) may be F32, F16 or BF16 and are
// read in their stored type, widened to F32 exactly. Shapes are [rows,
// columns], contiguous and row-major, as in Kernels. "Adds into" means the
// result is accumulated into the destination, which the caller zeroes (with
// Zero) when it wants the plain gradient. An operation that "sets" its
// destinations overwrites them. No operand may be quantized: training needs
// float weights, and MatMulPrecise, MatMulGradX and RMSNormGrad refuse
// quantized ones with an error wrapping ErrQuantized.
//
// The rotary embedding needs no backward of its own: the gradient of
// Rope(x, Rotary{Cos: cos, Sin: sin, ...}) is Rope(dy, Rotary{Cos: cos,
// Sin: -sin, ...}), the inverse rotation.
type GradOps interface {
	// MatMulPrecise is MatMul with every product in F32: w widened
	// exactly and x never rounded to a narrower type, as a training
	// forward needs for gradients that match an F32 reference. A backend
	// whose MatMul already works so implements it as MatMul.
	MatMulPrecise(out, x, w, bias *Tensor) error
	// Zero sets every element of t to zero.
	Zero(t *Tensor) error
	// MatMulGradX adds dy[M,N] · w[N,K] into dx[M,K]: the gradient of
	// MatMul's x. dx and dy are F32.
	MatMulGradX(dx, dy, w *Tensor) error
	// MatMulGradW adds dy[M,N]ᵀ · x[M,K] into dw[N,K]: the gradient of
	// MatMul's w. All three are F32.
	MatMulGradW(dw, dy, x *Tensor) error
	// BiasGrad adds the column sums of dy[M,N] into db[N], both F32: the
	// gradient of MatMul's bias.
	BiasGrad(db, dy *Tensor) error
	// RMSNormGrad is the backward of RMSNorm(out, x, w, eps): given dy
	// [M,H], the gradient of out, it adds the gradient of x into dx [M,H]
	// and, when dw is non-nil, that of w into dw [H] (F32). dx must not
	// overlap dy or x.
	RMSNormGrad(dx, dw, dy, x, w *Tensor, eps float32) error
	// SiLUMulGrad is the backward of SiLUMul(out, gate, up): given dout,
	// the gradient of out, it sets dgate and dup, the gradients of gate and
	// up. All are F32 of one shape; dgate may be dout (in place), no other
	// operands may overlap.
	SiLUMulGrad(dgate, dup, dout, gate, up *Tensor) error
	// AttentionGrad is the backward of Attention(g.Out, a) over T
	// positions from 0 (a.Pos0 is 0), where a.Q and g.Out are [T,
	// Heads*HeadDim] and a.K and a.V are F32 [T, KVHeads*HeadDim]
	// (exactly T rows). Given g.DOut, the gradient of the forward's
	// g.Out, it sets g.DQ, g.DK and g.DV (shaped as a.Q, a.K and a.V).
	// The attention probabilities are recomputed; nothing of size T² is
	// kept.
	AttentionGrad(g AttnGrad, a Attn) error
	// CrossEntropyGrad takes logits [rows, V] (F32) and targets (len rows,
	// on the host) and returns the sum over the rows of the cross-entropy
	// -log softmax(logits[i])[targets[i]]. It overwrites logits with the
	// gradient of scale times that sum. A negative target leaves its row
	// out: no loss, and a zero gradient. A target >= V is an error.
	CrossEntropyGrad(logits *Tensor, targets []int32, scale float32) (float64, error)
}

// AttnGrad are the gradients of AttentionGrad: DOut, the gradient of the
// forward's output Out (given), and DQ, DK and DV, which it sets. No
// gradient it sets may overlap another operand.
type AttnGrad struct {
	DQ, DK, DV *Tensor
	DOut, Out  *Tensor
}
