package tensor

import (
	"math"
	"sync"

	"github.com/strata-llm/strata/tensor/quant"
)

// scoreBufs recycles the per-task score rows of Attention.
var scoreBufs = sync.Pool{New: func() any { return new([]float32) }}

// kvTile is how many positions of a narrow cache (F16, BF16, Q8_0) a task
// widens to F32 at a time, for the vector kernels to read.
const kvTile = 64

// Attention computes causal grouped-query attention for the T rows of q at
// positions pos0..pos0+T-1 against the key and value caches k and v
// [maxPos, kvHeads*headDim], which hold positions 0..pos0+T-1. q and out are
// F32 [T, heads*headDim]; the caches are F32, F16, BF16 or Q8_0. Query row
// t attends to positions 0..pos0+t; query head h reads KV head
// h/(heads/kvHeads). The work is spread over (head, row) pairs on the pool.
// A narrow cache is widened to F32 kvTile positions at a time beside the
// task's scores, so the same vector kernels compute the dot products and
// the weighted sums.
func (c *CPU) Attention(out *Tensor, at Attn) error {
	const op = "Attention"
	q, k, v, heads, kvHeads, headDim, pos0, scale := at.Q, at.K, at.V, at.Heads, at.KVHeads, at.HeadDim, at.Pos0, at.Scale
	if err := operands(op, out, q, k, v); err != nil {
		return err
	}
	t := q.shape[0]
	if t == 0 {
		return nil
	}
	a := attentionPool.Get().(*attention)
	*a = attention{
		k: c.k, q: q.F32(), kt: k, vt: v, out: out.F32(), dt: k.dtype,
		heads: heads, group: heads / kvHeads, kvHeads: kvHeads, d: headDim, pos0: pos0, scale: scale,
	}
	if k.dtype == F32 {
		a.kc, a.vc = k.F32(), v.F32()
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
	q, kc, vc, out  []float32 // kc and vc: F32 caches only
	kt, vt          *Tensor
	dt              DType
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

	narrow := a.dt != F32
	need := n + d
	if narrow {
		// The widened tile, a partial sum of V, and for Q8_0 one row's
		// blocks that cover the head.
		need += kvTile*d + d + d + 64
	}
	bp := scoreBufs.Get().(*[]float32)
	if cap(*bp) < need {
		// Geometric growth: decode lengthens n by one every step.
		*bp = make([]float32, max(need, 2*cap(*bp), 1024))
	}
	s, qs := (*bp)[:n], (*bp)[n:n+d]
	for i, v := range q {
		qs[i] = v * a.scale
	}
	if !narrow {
		a.k.scores(s, qs, a.kc[kh*d:], kw) // position j's head at [j*kw, j*kw+d)
	} else {
		tile, rest := (*bp)[n+d:n+d+kvTile*d], (*bp)[n+d+kvTile*d:]
		for j0 := 0; j0 < n; j0 += kvTile {
			m := min(kvTile, n-j0)
			a.widen(tile, rest[d:], a.kt, kh, j0, m)
			a.k.scores(s[j0:j0+m], qs, tile, d)
		}
	}
	mx := float32(math.Inf(-1))
	for _, x := range s {
		mx = max(mx, x)
	}
	sum := a.k.expSum(s, mx)
	if !narrow {
		a.k.wsum(o, a.vc[kh*d:], kw, s)
	} else {
		tile, rest := (*bp)[n+d:n+d+kvTile*d], (*bp)[n+d+kvTile*d:]
		part := rest[:d]
		clear(o)
		for j0 := 0; j0 < n; j0 += kvTile {
			m := min(kvTile, n-j0)
			a.widen(tile, rest[d:], a.vt, kh, j0, m)
			a.k.wsum(part, tile, d, s[j0:j0+m])
			for i, x := range part {
				o[i] += x
			}
		}
	}
	inv := 1 / sum
	for i := range o {
		o[i] *= inv
	}
	scoreBufs.Put(bp)
}

// widen writes KV head kh of the m positions from j0 of the narrow cache c
// into tile as F32 rows of d; blk is room for the Q8_0 blocks that cover
// one head (d+64 values).
func (a *attention) widen(tile, blk []float32, c *Tensor, kh, j0, m int) {
	d, kw := a.d, a.kvHeads*a.d
	switch a.dt {
	case F16, BF16:
		u := c.U16()
		conv := F16ToF32
		if a.dt == BF16 {
			conv = BF16ToF32
		}
		for j := range m {
			off := (j0+j)*kw + kh*d
			conv(tile[j*d:(j+1)*d], u[off:off+d])
		}
	case Q8_0:
		rb := kw / 32 * 34
		b0, b1 := kh*d/32, (kh*d+d+31)/32 // the blocks that cover the head
		skip := kh*d - 32*b0
		for j := range m {
			row := c.data[(j0+j)*rb:]
			w := blk[:32*(b1-b0)]
			quant.DequantizeQ8_0(w, row[34*b0:34*b1])
			copy(tile[j*d:(j+1)*d], w[skip:skip+d])
		}
	}
}
