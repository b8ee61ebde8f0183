package tensor

import (
	"fmt"
	"math"
	"sync"
)

// scoreBufs recycles the per-task score rows of Attention.
var scoreBufs = sync.Pool{New: func() any { return new([]float32) }}

// Attention computes causal grouped-query attention for the T rows of q at
// positions pos0..pos0+T-1 against the key and value caches k and v
// [maxPos, kvHeads*headDim], which hold positions 0..pos0+T-1. q and out are
// F32 [T, heads*headDim]; the caches must be F32 here (the contract allows
// any float type). Query row t attends to positions 0..pos0+t; query
// head h reads KV head h/(heads/kvHeads). The work is spread over (head,
// row) pairs on the pool.
func (c *CPU) Attention(out *Tensor, at Attn) error {
	const op = "Attention"
	q, k, v, heads, kvHeads, headDim, scale := at.Q, at.K, at.V, at.Heads, at.KVHeads, at.HeadDim, at.Scale
	if err := operands(op, out, q, k, v); err != nil {
		return err
	}
	pos0, err := hostPosition(op, at.Pos0, at.PosAt)
	if err != nil {
		return err
	}
	if k.dtype != F32 {
		return fmt.Errorf("tensor: cpu: %s: the caches are %v; this backend reads F32 caches only", op, k.dtype)
	}
	t := q.shape[0]
	if t == 0 {
		return nil
	}
	a := attentionPool.Get().(*attention)
	*a = attention{
		k: c.k, q: q.F32(), kc: k.F32(), vc: v.F32(), out: out.F32(),
		heads: heads, group: heads / kvHeads, kvHeads: kvHeads, d: headDim, pos0: pos0, scale: scale,
	}
	work := t * heads * (pos0 + t) * headDim
	c.runMaybe(work < minParallel, t*heads, a)
	*a = attention{}
	attentionPool.Put(a)
	return nil
}

// attention is one Attention call's operands; recycled through
// attentionPool so that a call allocates nothing.
type attention struct {
	k               *kernels
	q, kc, vc, out  []float32
	heads, group, d int
	kvHeads, pos0   int
	scale           float32
}

var attentionPool = sync.Pool{New: func() any { return new(attention) }}

// run computes task i: head i%heads of query row i/heads.
func (a *attention) run(i int) { a.row(i/a.heads, i%a.heads) }

// row computes head h of query row t.
func (a *attention) row(t, h int) {
	d, n := a.d, a.pos0+t+1 // positions 0..pos0+t
	qw, kw := a.heads*d, a.kvHeads*d
	kh := h / a.group
	q := a.q[t*qw+h*d : t*qw+(h+1)*d]
	o := a.out[t*qw+h*d : t*qw+(h+1)*d]
	kc, vc := a.kc[kh*d:], a.vc[kh*d:] // position j's head at [j*kw, j*kw+d)

	bp := scoreBufs.Get().(*[]float32)
	if cap(*bp) < n+d {
		// Geometric growth: decode lengthens n by one every step.
		*bp = make([]float32, max(n+d, 2*cap(*bp), 1024))
	}
	s, qs := (*bp)[:n], (*bp)[n:n+d]
	for i, v := range q {
		qs[i] = v * a.scale
	}
	a.k.scores(s, qs, kc, kw)
	mx := float32(math.Inf(-1))
	for _, x := range s {
		mx = max(mx, x)
	}
	sum := a.k.expSum(s, mx)
	a.k.wsum(o, vc, kw, s)
	inv := 1 / sum
	for i := range o {
		o[i] *= inv
	}
	scoreBufs.Put(bp)
}
