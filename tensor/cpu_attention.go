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
//
// A narrow cache is widened to F32 kvTile positions at a time (the kernel
// table's vector conversions for F16 and BF16), once for all the query
// heads of a KV head, so that the same vector kernels compute the dot
// products and weighted sums: its tasks are (row, KV head, part of the
// group), the group cut into parts only when there are fewer (row, KV
// head) pairs than twice the threads.
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
	work := t * heads * (pos0 + t) * headDim
	tasks := t * heads
	if k.dtype == F32 {
		a.kc, a.vc = k.F32(), v.F32()
	} else {
		a.parts = min(a.group, max(1, (2*c.threads+t*kvHeads-1)/(t*kvHeads)))
		a.per = (a.group + a.parts - 1) / a.parts
		a.parts = (a.group + a.per - 1) / a.per
		tasks = t * kvHeads * a.parts
	}
	c.runMaybe(work < minParallel, tasks, a)
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
	// A narrow cache's tasks: the group of query heads of a KV head in
	// parts of per heads.
	parts, per int
}

var attentionPool = sync.Pool{New: func() any { return new(attention) }}

// run computes task i: for an F32 cache head i%heads of query row
// i/heads; for a narrow one part i%parts of the query heads of KV head
// (i/parts)%kvHeads of row i/(parts*kvHeads).
func (a *attention) run(i int) {
	if a.dt == F32 {
		a.row(i/a.heads, i%a.heads)
		return
	}
	part, kh, t := i%a.parts, (i/a.parts)%a.kvHeads, i/(a.parts*a.kvHeads)
	h0 := kh*a.group + part*a.per
	a.rowNarrow(t, kh, h0, min(h0+a.per, (kh+1)*a.group))
}

// row computes head h of query row t over an F32 cache.
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

// rowNarrow computes query heads h0..h1-1 (of KV head kh) of query row t
// over a narrow cache, widening each tile of K and of V once for them all.
func (a *attention) rowNarrow(t, kh, h0, h1 int) {
	d, n, g := a.d, a.pos0+t+1, h1-h0
	qw := a.heads * d
	// Scores of each head, its scaled query, the widened tile, a partial
	// weighted sum, and room for the Q8_0 blocks that cover a head.
	need := g*n + g*d + kvTile*d + d + d + 64
	bp := scoreBufs.Get().(*[]float32)
	if cap(*bp) < need {
		*bp = make([]float32, max(need, 2*cap(*bp), 1024))
	}
	buf := (*bp)[:need]
	s, qs, buf := buf[:g*n], buf[g*n:g*n+g*d], buf[g*n+g*d:]
	tile, part, blk := buf[:kvTile*d], buf[kvTile*d:kvTile*d+d], buf[kvTile*d+d:]
	for i := range g {
		q := a.q[t*qw+(h0+i)*d : t*qw+(h0+i+1)*d]
		for j, v := range q {
			qs[i*d+j] = v * a.scale
		}
	}
	for j0 := 0; j0 < n; j0 += kvTile {
		m := min(kvTile, n-j0)
		a.widen(tile, blk, a.kt, kh, j0, m)
		for i := range g {
			a.k.scores(s[i*n+j0:i*n+j0+m], qs[i*d:(i+1)*d], tile, d)
		}
	}
	sums := qs[:g] // the scaled queries are spent
	for i := range g {
		si := s[i*n : (i+1)*n]
		mx := float32(math.Inf(-1))
		for _, x := range si {
			mx = max(mx, x)
		}
		sums[i] = a.k.expSum(si, mx)
		clear(a.out[t*qw+(h0+i)*d : t*qw+(h0+i+1)*d])
	}
	for j0 := 0; j0 < n; j0 += kvTile {
		m := min(kvTile, n-j0)
		a.widen(tile, blk, a.vt, kh, j0, m)
		for i := range g {
			a.k.wsum(part, tile, d, s[i*n+j0:i*n+j0+m])
			o := a.out[t*qw+(h0+i)*d : t*qw+(h0+i+1)*d]
			for j, x := range part {
				o[j] += x
			}
		}
	}
	for i := range g {
		inv := 1 / sums[i]
		o := a.out[t*qw+(h0+i)*d : t*qw+(h0+i+1)*d]
		for j := range o {
			o[j] *= inv
		}
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
		conv := a.k.cvtF16
		if a.dt == BF16 {
			conv = a.k.cvtBF16
		}
		for j := range m {
			off := (j0+j)*kw + kh*d
			conv(tile[j*d:(j+1)*d], u[off:off+d])
		}
	case Q8_0:
		rb := kw / 32 * 34
		b0, b1 := kh*d/32, (kh*d+d+31)/32 // the blocks that cover the head
		skip := kh*d - 32*b0
		w := blk[:32*(b1-b0)]
		for j := range m {
			row := c.data[(j0+j)*rb:]
			if skip == 0 && d%32 == 0 {
				quant.DequantizeQ8_0(tile[j*d:(j+1)*d], row[34*b0:34*b1])
				continue
			}
			quant.DequantizeQ8_0(w, row[34*b0:34*b1])
			copy(tile[j*d:(j+1)*d], w[skip:skip+d])
		}
	}
}
