package tensor

import (
	"fmt"
	"math"
	"sync"

	"github.com/strata-llm/strata/tensor/quant"
)

// scoreBufs recycles the per-task score rows of Attention.
var scoreBufs = sync.Pool{New: func() any { return new([]float32) }}

// kvTile is how many positions of a narrow cache (F16, BF16, Q8_0, Q8_B8) a task
// widens to F32 at a time, for the vector kernels to read.
const kvTile = 64

// Attention computes causal grouped-query attention for the T rows of q at
// positions pos0..pos0+T-1 against the key and value caches k and v
// [maxPos, kvHeads*headDim], which hold positions 0..pos0+T-1. q and out are
// F32 [T, heads*headDim]; the caches are F32, F16, BF16, Q8_0 or Q8_B8. Query row
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
	q, k, v, heads, kvHeads, headDim, scale := at.Q, at.K, at.V, at.Heads, at.KVHeads, at.HeadDim, at.Scale
	if err := operands(op, out, q, k, v); err != nil {
		return err
	}
	pos0, err := hostPosition(op, at.Pos0, at.PosAt)
	if err != nil {
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
	attendHead(a.k, a.out[t*qw+h*d:t*qw+(h+1)*d], a.q[t*qw+h*d:t*qw+(h+1)*d], a.kc[kh*d:], a.vc[kh*d:], kw, n, a.scale)
}

// attendHead computes one query head q's attention into o over n
// positions of keys kc and values vc, position j's at [j*ld, j*ld+len(q)).
// Its arithmetic depends on nothing else, so a row's result is the same
// whatever the cache's layout (Attention's rows, AttentionBlocks'
// gathered blocks).
func attendHead(k *kernels, o, q, kc, vc []float32, ld, n int, scale float32) {
	d := len(q)
	bp := scoreBufs.Get().(*[]float32)
	if cap(*bp) < n+d {
		// Geometric growth: decode lengthens n by one every step.
		*bp = make([]float32, max(n+d, 2*cap(*bp), 1024))
	}
	s, qs := (*bp)[:n], (*bp)[n:n+d]
	for i, v := range q {
		qs[i] = v * scale
	}
	k.scores(s, qs, kc, ld)
	mx := float32(math.Inf(-1))
	for _, x := range s {
		mx = max(mx, x)
	}
	sum := k.expSum(s, mx)
	k.wsum(o, vc, ld, s)
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
// into tile as F32 rows of d; blk is room for the blocks that cover one
// head (d+64 values).
func (a *attention) widen(tile, blk []float32, c *Tensor, kh, j0, m int) {
	d := a.d
	for j := range m {
		widenHead(a.k, tile[j*d:(j+1)*d], blk, c, j0+j, kh*d)
	}
}

// widenHead writes the len(dst) values of row row of the cache c [rows,
// width] from element off into dst as F32: copied, widened from F16 or
// BF16 by the kernel table's vector conversions, or dequantized from the
// Q8_0 or Q8_B8 blocks that cover them (blk is room for those blocks: at
// least len(dst)+64 values).
func widenHead(k *kernels, dst, blk []float32, c *Tensor, row, off int) {
	d, kw := len(dst), int(c.shape[1:].NumElements())
	switch c.dtype {
	case F32:
		copy(dst, c.F32()[row*kw+off:row*kw+off+d])
	case F16:
		k.cvtF16(dst, c.U16()[row*kw+off:row*kw+off+d])
	case BF16:
		k.cvtBF16(dst, c.U16()[row*kw+off:row*kw+off+d])
	case Q8_0, Q8_B8:
		bs, bb := c.dtype.BlockSize(), c.dtype.BlockBytes()
		deq := quant.DequantizeQ8_0
		if c.dtype == Q8_B8 {
			deq = quant.DequantizeQ8B8
		}
		b0, b1 := off/bs, (off+d+bs-1)/bs // the blocks that cover the head
		skip := off - bs*b0
		r := c.data[row*(kw/bs*bb):]
		if skip == 0 && d%bs == 0 {
			deq(dst, r[bb*b0:bb*b1])
			return
		}
		w := blk[:bs*(b1-b0)]
		deq(w, r[bb*b0:bb*b1])
		copy(dst, w[skip:skip+d])
	}
}

// AttentionBlocks writes the rows' keys and values into the pools, then
// computes each sequence's attention (see AttnBlocks): tasks of up to
// blockTaskRows rows of one sequence and one KV head each gather the
// sequence's keys and values of that head into contiguous rows and
// attend to them as Attention does, so that every row's result has the
// bits Attention gives it over a contiguous cache. The pools must be F32
// here (the contract allows any float type).
func (c *CPU) AttentionBlocks(out *Tensor, at AttnBlocks) error {
	const op = "AttentionBlocks"
	if err := operands(op, out, at.Q, at.K, at.V, at.KPool, at.VPool); err != nil {
		return err
	}
	if at.KPool.dtype != at.VPool.dtype {
		return fmt.Errorf("tensor: cpu: %s: kPool is %v, vPool %v", op, at.KPool.dtype, at.VPool.dtype)
	}
	if !IsCacheDType(at.KPool.dtype) {
		return fmt.Errorf("tensor: cpu: %s: the pools are %v, not a cache dtype", op, at.KPool.dtype)
	}
	a := blocksPool.Get().(*attnBlocks)
	defer func() {
		*a = attnBlocks{tasks: a.tasks[:0], first: a.first[:0]}
		blocksPool.Put(a)
	}()
	*a = attnBlocks{
		k: c.k, q: at.Q.F32(), kin: at.K.F32(), vin: at.V.F32(), kpt: at.KPool, vpt: at.VPool, out: out.F32(),
		seqs: at.Seqs, heads: at.Heads, kvHeads: at.KVHeads, group: at.Heads / at.KVHeads, d: at.HeadDim, bs: at.BlockSize,
		scale: at.Scale, tasks: a.tasks[:0], first: a.first[:0],
	}
	work, row := 0, 0
	for i, s := range at.Seqs {
		a.first = append(a.first, row)
		for r := 0; r < s.Rows; r += blockTaskRows {
			for kh := range at.KVHeads {
				a.tasks = append(a.tasks, blockTask{seq: i, kvh: kh, r0: r, r1: min(s.Rows, r+blockTaskRows)})
			}
		}
		work += s.Rows * at.Heads * (s.Pos0 + s.Rows) * at.HeadDim
		row += s.Rows
	}
	// The keys and values first: a sequence's rows attend to each other's.
	a.writing = true
	c.runMaybe(row*a.kvHeads*a.d < minParallel, len(at.Seqs), a)
	a.writing = false
	c.runMaybe(work < minParallel, len(a.tasks), a)
	return nil
}

// blockTaskRows is the most rows of one sequence an AttentionBlocks task
// computes; a prompt's chunk spreads over several tasks, each gathering
// the positions its last row sees.
const blockTaskRows = 32

// attnBlocks is one AttentionBlocks call; recycled through blocksPool.
type attnBlocks struct {
	k                        *kernels
	q, kin, vin, out         []float32
	kpt, vpt                 *Tensor // the pools
	seqs                     []SeqBlocks
	heads, kvHeads, group, d int
	bs                       int
	scale                    float32
	tasks                    []blockTask
	first                    []int // each sequence's first row
	writing                  bool  // the tasks write the keys and values, one sequence each
}

// blockTask is rows [r0, r1) of sequence seq, KV head kvh.
type blockTask struct{ seq, kvh, r0, r1 int }

var (
	blocksPool = sync.Pool{New: func() any { return new(attnBlocks) }}
	gatherBufs = sync.Pool{New: func() any { return new([]float32) }}
)

// slot is the pool row of position p of s.
func (a *attnBlocks) slot(s *SeqBlocks, p int) int {
	return int(s.Blocks[p/a.bs])*a.bs + p%a.bs
}

func (a *attnBlocks) run(i int) {
	kw := a.kvHeads * a.d
	if a.writing {
		s := &a.seqs[i]
		for r := range s.Rows {
			src, dst := (a.first[i]+r)*kw, a.slot(s, s.Pos0+r)
			// Checked: the rows are whole blocks of the pools' dtype.
			_ = storeRows(a.kpt, dst, a.kin[src:src+kw])
			_ = storeRows(a.vpt, dst, a.vin[src:src+kw])
		}
		return
	}
	t := a.tasks[i]
	s := &a.seqs[t.seq]
	d, n := a.d, s.Pos0+t.r1 // the positions the task's last row sees
	bp := gatherBufs.Get().(*[]float32)
	if need := 2*n*d + d + 64; cap(*bp) < need {
		*bp = make([]float32, max(need, 2*cap(*bp)))
	}
	kg, vg, blk := (*bp)[:n*d], (*bp)[n*d:2*n*d], (*bp)[2*n*d:2*n*d+d+64]
	for j := range n {
		row := a.slot(s, j)
		widenHead(a.k, kg[j*d:(j+1)*d], blk, a.kpt, row, t.kvh*d)
		widenHead(a.k, vg[j*d:(j+1)*d], blk, a.vpt, row, t.kvh*d)
	}
	qw := a.heads * d
	for r := t.r0; r < t.r1; r++ {
		row := a.first[t.seq] + r
		for h := t.kvh * a.group; h < (t.kvh+1)*a.group; h++ {
			o := row*qw + h*d
			attendHead(a.k, a.out[o:o+d], a.q[o:o+d], kg, vg, d, s.Pos0+r+1, a.scale)
		}
	}
	gatherBufs.Put(bp)
}
