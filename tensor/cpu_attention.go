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
	if at.KPool.dtype != F32 {
		return fmt.Errorf("tensor: cpu: %s: the pools are %v; this backend reads F32 pools only", op, at.KPool.dtype)
	}
	a := blocksPool.Get().(*attnBlocks)
	defer func() {
		*a = attnBlocks{tasks: a.tasks[:0], first: a.first[:0]}
		blocksPool.Put(a)
	}()
	*a = attnBlocks{
		k: c.k, q: at.Q.F32(), kin: at.K.F32(), vin: at.V.F32(), kp: at.KPool.F32(), vp: at.VPool.F32(), out: out.F32(),
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
	q, kin, vin, kp, vp, out []float32
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
			src, dst := (a.first[i]+r)*kw, a.slot(s, s.Pos0+r)*kw
			copy(a.kp[dst:dst+kw], a.kin[src:src+kw])
			copy(a.vp[dst:dst+kw], a.vin[src:src+kw])
		}
		return
	}
	t := a.tasks[i]
	s := &a.seqs[t.seq]
	d, n := a.d, s.Pos0+t.r1 // the positions the task's last row sees
	bp := gatherBufs.Get().(*[]float32)
	if cap(*bp) < 2*n*d {
		*bp = make([]float32, max(2*n*d, 2*cap(*bp)))
	}
	kg, vg := (*bp)[:n*d], (*bp)[n*d:2*n*d]
	for j := range n {
		src := a.slot(s, j)*kw + t.kvh*d
		copy(kg[j*d:(j+1)*d], a.kp[src:src+d])
		copy(vg[j*d:(j+1)*d], a.vp[src:src+d])
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
