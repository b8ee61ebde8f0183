package tensor

import (
	"math"
	"sync"
)

// The backward operations of training (GradOps) on the CPU backend. They
// keep the arithmetic of the forward where it matters: F32 products with
// float64 accumulation of the sums that decide a whole row (the RMS norm,
// the softmax normaliser, the loss). Every operation spreads its work over
// the backend's pool in tasks that own disjoint parts of the outputs, and
// sums partial results in a fixed order, so that the result does not depend
// on the number of threads.

var _ GradOps = (*CPU)(nil)

// Zero sets every element of t, of any dtype, to zero.
func (c *CPU) Zero(t *Tensor) error {
	if err := operands("Zero", t); err != nil {
		return err
	}
	clear(t.data)
	return nil
}

// MatMulGradX adds dy[M,N] · w[N,K] into dx[M,K]. dy and dx are F32; w may
// be F32, F16 or BF16 and is converted to F32 a block at a time. dx must
// not overlap dy or w.
func (c *CPU) MatMulGradX(dx, dy, w *Tensor) error {
	if err := operands("MatMulGradX", dx, dy, w); err != nil {
		return err
	}
	m, n, k := dy.shape[0], dy.shape[1], w.shape[1]
	g := gradMM{rows: m, inner: n, cols: k, a: dy.F32(), lda: n, bdt: w.dtype, out: dx.F32()}
	if w.dtype == F32 {
		g.b32 = w.F32()
	} else {
		g.b16 = w.U16()
	}
	c.gradMatMul(&g)
	return nil
}

// MatMulGradW adds dy[M,N]ᵀ · x[M,K] into dw[N,K], all F32. dw must not
// overlap dy or x.
func (c *CPU) MatMulGradW(dw, dy, x *Tensor) error {
	if err := operands("MatMulGradW", dw, dy, x); err != nil {
		return err
	}
	m, n, k := dy.shape[0], dy.shape[1], x.shape[1]
	g := gradMM{rows: n, inner: m, cols: k, a: dy.F32(), lda: n, aT: true, bdt: F32, b32: x.F32(), out: dw.F32()}
	c.gradMatMul(&g)
	return nil
}

// Blocking of the gradient matrix products (see gradMM).
const (
	// gradRowBlock bounds the rows of out per task: the B block a task
	// converts is used by this many rows.
	gradRowBlock = 256
	// gradColPanels bounds the panels of nr columns per task: the A block
	// a task packs (MatMulGradW's transposed dy) serves this many panels.
	gradColPanels = 16
)

// gradMM is one call of out[R,C] += A[R,L] · B[L,C], the form of both
// matrix-product gradients:
//
//	MatMulGradX: dx[M,K] += dy[M,N] · w[N,K]   (A = dy, B = w)
//	MatMulGradW: dw[N,K] += dy[M,N]ᵀ · x[M,K]  (A = dyᵀ, B = x)
//
// A is F32, row-major with rows lda apart or, when aT, stored transposed
// (A[r,l] = a[l*lda+r]); B is row-major [L,C] in any float type.
//
// It runs on the prefill micro-kernel (kernels.gemm), which computes an
// mr×nr tile of out from a group of mr rows of A and a panel of B packed
// l-major, nr columns wide. A task computes a block of rows × columns of
// out: for each chunk of kc along L it packs (and converts) its columns of
// B into panels and, where A is transposed, its rows of A; then it
// multiplies every panel with every group of rows, the panel's chunk staying
// in the L1 cache, into tiles that are added to out at the end. Row-major
// A is read in place except for a last group of fewer than mr rows, which
// is copied with zero padding.
type gradMM struct {
	gemm            func(a []float32, lda int, b, c []float32, kc int)
	cvtF16, cvtBF16 func(dst []float32, src []uint16)
	mr, nr, kc      int

	rows, inner, cols int // R, L, C
	a                 []float32
	lda               int
	aT                bool
	bdt               DType
	b32               []float32
	b16               []uint16
	out               []float32

	rb, cb, cBlocks int // rows and columns of out per task; blocks along C
}

// gradScratch is a gradMM task's packed operands and output tiles.
type gradScratch struct{ a, b, line, acc []float32 }

var gradScratchPool = sync.Pool{New: func() any { return new(gradScratch) }}

// gradMatMul plans g for this backend and runs it on the pool.
func (c *CPU) gradMatMul(g *gradMM) {
	if g.rows == 0 || g.cols == 0 || g.inner == 0 {
		return
	}
	if c.k.gemm != nil {
		g.gemm, g.mr, g.nr, g.kc = c.k.gemm, c.k.mr, c.k.nr, c.k.kc
	} else {
		g.gemm, g.mr, g.nr, g.kc = gemm4x4Go, 4, 4, 256
	}
	g.cvtF16, g.cvtBF16 = c.k.cvtF16, c.k.cvtBF16
	mr, nr := g.mr, g.nr
	// Blocks of equal size, at most about gradRowBlock rows.
	g.rb = roundUp(blocks(g.rows, blocks(g.rows, gradRowBlock)), mr)
	g.cb = min(roundUp(g.cols, nr), gradColPanels*nr)
	// Smaller blocks until there are about four tasks per thread.
	for blocks(g.rows, g.rb)*blocks(g.cols, g.cb) < 4*c.threads {
		if g.cb > 2*nr {
			g.cb = roundUp(g.cb/2, nr)
		} else if g.rb > 4*mr {
			g.rb = roundUp(g.rb/2, mr)
		} else {
			break
		}
	}
	g.cBlocks = blocks(g.cols, g.cb)
	small := g.rows*g.cols*g.inner < minParallel
	c.runMaybe(small, blocks(g.rows, g.rb)*g.cBlocks, g)
}

func roundUp(n, m int) int { return (n + m - 1) / m * m }
func blocks(n, b int) int  { return (n + b - 1) / b }

// run computes the task's block of out.
func (g *gradMM) run(t int) {
	mr, nr, kc := g.mr, g.nr, g.kc
	r0, c0 := t/g.cBlocks*g.rb, t%g.cBlocks*g.cb
	r1, c1 := min(g.rows, r0+g.rb), min(g.cols, c0+g.cb)
	groups, panels := blocks(r1-r0, mr), blocks(c1-c0, nr)
	tile := mr * nr

	sc := gradScratchPool.Get().(*gradScratch)
	bp := grow(&sc.b, panels*kc*nr)
	line := grow(&sc.line, panels*nr)
	acc := grow(&sc.acc, groups*panels*tile)
	clear(acc)
	// Groups [0, direct) are read from A in place, the others packed.
	direct := (r1 - r0) / mr
	if g.aT {
		direct = 0
	}
	ap := grow(&sc.a, (groups-direct)*mr*kc)
	for l0 := 0; l0 < g.inner; l0 += kc {
		ll := min(kc, g.inner-l0)
		g.packB(bp[:panels*ll*nr], line, c0, c1, l0, ll)
		packed := ap[:(groups-direct)*mr*ll]
		g.packA(packed, r0+direct*mr, r1, l0, ll)
		for p := range panels {
			b := bp[p*ll*nr : (p+1)*ll*nr]
			for q := range groups {
				var a []float32
				lda := ll
				if q < direct {
					a, lda = g.a[(r0+q*mr)*g.lda+l0:], g.lda
				} else {
					a = packed[(q-direct)*mr*ll:]
				}
				g.gemm(a, lda, b, acc[(q*panels+p)*tile:(q*panels+p+1)*tile], ll)
			}
		}
	}
	for r := r0; r < r1; r++ {
		q, i := (r-r0)/mr, (r-r0)%mr
		o := g.out[r*g.cols : (r+1)*g.cols]
		for p := range panels {
			cs := c0 + p*nr
			dst := o[cs:min(c1, cs+nr)]
			src := acc[(q*panels+p)*tile+i*nr:]
			src = src[:len(dst)]
			for j, v := range src {
				dst[j] += v
			}
		}
	}
	gradScratchPool.Put(sc)
}

// packA writes rows [r0, r1) of A, columns [l0, l0+ll), into dst with rows
// ll apart; rows of dst past r1-r0 are zeroed.
func (g *gradMM) packA(dst []float32, r0, r1, l0, ll int) {
	n := r1 - r0
	clear(dst[n*ll:])
	if !g.aT {
		for i := range n {
			copy(dst[i*ll:(i+1)*ll], g.a[(r0+i)*g.lda+l0:])
		}
		return
	}
	// Transposed: row l of the stored matrix holds column l of A. Four
	// columns at a time, so that each row of dst is written in runs.
	l := 0
	for ; l+4 <= ll; l += 4 {
		s0 := g.a[(l0+l)*g.lda+r0 : (l0+l)*g.lda+r1]
		s1 := g.a[(l0+l+1)*g.lda+r0 : (l0+l+1)*g.lda+r1]
		s2 := g.a[(l0+l+2)*g.lda+r0 : (l0+l+2)*g.lda+r1]
		s3 := g.a[(l0+l+3)*g.lda+r0 : (l0+l+3)*g.lda+r1]
		s1, s2, s3 = s1[:len(s0)], s2[:len(s0)], s3[:len(s0)]
		for i, v := range s0 {
			d := dst[i*ll+l : i*ll+l+4 : i*ll+l+4]
			d[0], d[1], d[2], d[3] = v, s1[i], s2[i], s3[i]
		}
	}
	for ; l < ll; l++ {
		for i, v := range g.a[(l0+l)*g.lda+r0 : (l0+l)*g.lda+r1] {
			dst[i*ll+l] = v
		}
	}
}

// packB writes rows [l0, l0+ll) and columns [c0, c1) of B, converted to
// F32, into dst as panels of nr columns: panel p holds element (l, j) at
// (p*ll+l)*nr+j. Columns past c1 are zeroed. Each row's run of columns is
// converted in one call into line (of at least c1-c0 elements), then split
// into the panels: B's rows are far apart, and a whole run read at once
// keeps several cache misses in flight.
func (g *gradMM) packB(dst, line []float32, c0, c1, l0, ll int) {
	nr := g.nr
	w := c1 - c0
	panels := blocks(w, nr)
	line = line[:panels*nr]
	clear(line[w:])
	for l := range ll {
		row := (l0+l)*g.cols + c0
		switch g.bdt {
		case F32:
			copy(line, g.b32[row:row+w])
		case F16:
			g.cvtF16(line, g.b16[row:row+w])
		default:
			g.cvtBF16(line, g.b16[row:row+w])
		}
		for p := range panels {
			copy(dst[(p*ll+l)*nr:(p*ll+l+1)*nr], line[p*nr:(p+1)*nr])
		}
	}
}

// gemm4x4Go is the portable micro-kernel of the gradient products, for
// kernel tables without one: c[i*4+j] += Σ_k a[i*lda+k]·b[k*4+j] for i, j < 4,
// k < kc.
func gemm4x4Go(a []float32, lda int, b, c []float32, kc int) {
	if kc <= 0 {
		return
	}
	a0, a1, a2, a3 := a[:kc], a[lda:lda+kc], a[2*lda:2*lda+kc], a[3*lda:3*lda+kc]
	b = b[:4*kc]
	c = c[:16]
	c00, c01, c02, c03 := c[0], c[1], c[2], c[3]
	c10, c11, c12, c13 := c[4], c[5], c[6], c[7]
	c20, c21, c22, c23 := c[8], c[9], c[10], c[11]
	c30, c31, c32, c33 := c[12], c[13], c[14], c[15]
	for k := range kc {
		bk := b[4*k : 4*k+4 : 4*k+4]
		b0, b1, b2, b3 := bk[0], bk[1], bk[2], bk[3]
		x := a0[k]
		c00, c01, c02, c03 = c00+x*b0, c01+x*b1, c02+x*b2, c03+x*b3
		x = a1[k]
		c10, c11, c12, c13 = c10+x*b0, c11+x*b1, c12+x*b2, c13+x*b3
		x = a2[k]
		c20, c21, c22, c23 = c20+x*b0, c21+x*b1, c22+x*b2, c23+x*b3
		x = a3[k]
		c30, c31, c32, c33 = c30+x*b0, c31+x*b1, c32+x*b2, c33+x*b3
	}
	c[0], c[1], c[2], c[3] = c00, c01, c02, c03
	c[4], c[5], c[6], c[7] = c10, c11, c12, c13
	c[8], c[9], c[10], c[11] = c20, c21, c22, c23
	c[12], c[13], c[14], c[15] = c30, c31, c32, c33
}

// BiasGrad adds the column sums of dy[M,N] into db[N], both F32. Each
// column is summed in float64.
func (c *CPU) BiasGrad(db, dy *Tensor) error {
	if err := operands("BiasGrad", db, dy); err != nil {
		return err
	}
	m, n := dy.shape[0], dy.shape[1]
	if m == 0 || n == 0 {
		return nil
	}
	const width = 512 // columns per task
	d, ys := db.F32(), dy.F32()
	c.runMaybe(m*n < minParallelElems, blocks(n, width), funcTask(func(t int) {
		c0, c1 := t*width, min(n, (t+1)*width)
		acc := make([]float64, c1-c0)
		for r := range m {
			for j, v := range ys[r*n+c0 : r*n+c1] {
				acc[j] += float64(v)
			}
		}
		for j, v := range acc {
			d[c0+j] = float32(float64(d[c0+j]) + v)
		}
	}))
	return nil
}

// RMSNormGrad is the backward of RMSNorm(out, x, w, eps): with r =
// 1/sqrt(mean(x²)+eps) per row, it adds r·dy·w - r³·(Σ dy·w·x)/H·x into dx
// and, when dw is non-nil, Σ over the rows of dy·x·r into dw. x, dy and dx
// are F32 [M,H]; w [H] is F32, F16 or BF16; dw is F32 [H]. No output may
// overlap another operand.
func (c *CPU) RMSNormGrad(dx, dw, dy, x, w *Tensor, eps float32) error {
	if err := operands("RMSNormGrad", dx, dw, dy, x, w); err != nil {
		return err
	}
	m, h := x.shape[0], x.shape[1]
	if m == 0 || h == 0 {
		return nil
	}
	wf := make([]float32, h)
	switch w.dtype {
	case F32:
		copy(wf, w.F32())
	case F16:
		c.k.cvtF16(wf, w.U16())
	default:
		c.k.cvtBF16(wf, w.U16())
	}
	// Tasks of whole rows, their number fixed by the shape alone, each with
	// its own float64 partial sums of dw, added in task order.
	tasks := min(m, 64, max(1, m*h/(1<<14)))
	per := blocks(m, tasks)
	tasks = blocks(m, per)
	var partial []float64
	if dw != nil {
		partial = make([]float64, tasks*h)
	}
	xs, gs, ds := x.F32(), dy.F32(), dx.F32()
	c.runMaybe(m*h < minParallelElems, tasks, funcTask(func(t int) {
		var pdw []float64
		if partial != nil {
			pdw = partial[t*h : (t+1)*h]
		}
		for r := t * per; r < min(m, (t+1)*per); r++ {
			xr, gr, dr := xs[r*h:(r+1)*h], gs[r*h:(r+1)*h], ds[r*h:(r+1)*h]
			var ss, dot float64
			for i, v := range xr {
				ss += float64(v) * float64(v)
				dot += float64(gr[i]) * float64(wf[i]) * float64(v)
			}
			inv := 1 / math.Sqrt(ss/float64(h)+float64(eps))
			k := inv * inv * inv * dot / float64(h)
			for i, v := range xr {
				dr[i] += float32(inv*float64(gr[i])*float64(wf[i]) - k*float64(v))
			}
			if pdw != nil {
				for i, v := range xr {
					pdw[i] += float64(gr[i]) * float64(v) * inv
				}
			}
		}
	}))
	if dw != nil {
		d := dw.F32()
		for i := range h {
			s := float64(d[i])
			for t := range tasks {
				s += partial[t*h+i]
			}
			d[i] = float32(s)
		}
	}
	return nil
}

// SiLUMulGrad is the backward of out = silu(gate)·up: with σ the logistic
// function, it sets dup = dout·silu(gate) and dgate = dout·up·σ(gate)·(1 +
// gate·(1-σ(gate))). All are F32 of one shape; dgate may be dout (in
// place); no other output may overlap another operand.
func (c *CPU) SiLUMulGrad(dgate, dup, dout, gate, up *Tensor) error {
	if err := operands("SiLUMulGrad", dgate, dup, dout, gate, up); err != nil {
		return err
	}
	dg, du, d, gs, us := dgate.F32(), dup.F32(), dout.F32(), gate.F32(), up.F32()
	n := len(gs)
	const grain = minParallelElems / 4
	c.runMaybe(n < 2*grain, blocks(n, grain), funcTask(func(t int) {
		lo, hi := t*grain, min(n, (t+1)*grain)
		dg, du, d, us := dg[lo:hi], du[lo:hi], d[lo:hi], us[lo:hi]
		for i, g := range gs[lo:hi] {
			sig := float32(1 / (1 + math.Exp(-float64(g))))
			di := d[i]
			du[i] = di * g * sig
			dg[i] = di * us[i] * sig * (1 + g*(1-sig))
		}
	}))
	return nil
}

// AttentionGrad is the backward of causal grouped-query attention over T
// positions from 0 (see GradOps). It sets dq, dk and dv. The probabilities
// are recomputed row by row as in the forward (scores of the scaled query,
// softmax with float64 normaliser); out is checked but not needed. One
// task per query head; when several query heads share a KV head, each adds
// its part of dk and dv into a buffer of its own, and the buffers are summed
// in head order.
func (c *CPU) AttentionGrad(g AttnGrad, at Attn) error {
	dq, dk, dv, dout, out := g.DQ, g.DK, g.DV, g.DOut, g.Out
	q, k, v, heads, kvHeads, headDim, scale := at.Q, at.K, at.V, at.Heads, at.KVHeads, at.HeadDim, at.Scale
	if err := operands("AttentionGrad", dq, dk, dv, dout, q, k, v, out); err != nil {
		return err
	}
	t := q.shape[0]
	if t == 0 {
		return nil
	}
	a := &attnGrad{
		k: c.k, dq: dq.F32(), dk: dk.F32(), dv: dv.F32(), dout: dout.F32(), q: q.F32(), kc: k.F32(), vc: v.F32(),
		t: t, heads: heads, group: heads / kvHeads, kvHeads: kvHeads, d: headDim, scale: scale,
	}
	if a.group > 1 {
		a.kbuf = make([]float32, heads*t*headDim)
		a.vbuf = make([]float32, heads*t*headDim)
	} else {
		clear(a.dk)
		clear(a.dv)
	}
	small := heads*t*t*headDim < minParallel
	c.runMaybe(small, heads, a)
	if a.group > 1 {
		c.runMaybe(small, kvHeads, funcTask(a.reduce))
	}
	return nil
}

// attnGrad is one AttentionGrad call's operands.
type attnGrad struct {
	k                           *kernels
	dq, dk, dv, dout, q, kc, vc []float32
	t, heads, group, kvHeads, d int
	scale                       float32
	kbuf, vbuf                  []float32 // group > 1: per query head [heads][T][d]
}

// attnBlock is the number of query rows whose contributions to dk and dv
// are gathered before they are added: each position's rows of dk and dv
// then take one weighted sum (the wsum kernel) per block of queries instead
// of one update per query.
const attnBlock = 16

// run computes query head h: its rows of dq, and its part of dk and dv.
func (a *attnGrad) run(h int) {
	const tb = attnBlock
	d, T := a.d, a.t
	qw, kw := a.heads*d, a.kvHeads*d
	qo, ko := h*d, h/a.group*d
	dkh, dvh, ld := a.dk[ko:], a.dv[ko:], kw
	if a.group > 1 {
		dkh, dvh, ld = a.kbuf[h*T*d:(h+1)*T*d], a.vbuf[h*T*d:(h+1)*T*d], d
	}
	kc, vc := a.kc[ko:], a.vc[ko:]  // position s's head at [s*kw, s*kw+d)
	qh, oh := a.q[qo:], a.dout[qo:] // row t's head at [t*qw, t*qw+d)

	// Scratch: one query's probabilities and score gradients, the scaled
	// query, a row of dk or dv, and the block's probabilities and score
	// gradients by position (pT[s*tb+j] for query t0+j).
	bp := scoreBufs.Get().(*[]float32)
	need := 2*T + 2*d + 2*T*tb
	if cap(*bp) < need {
		*bp = make([]float32, need)
	}
	buf := (*bp)[:need]
	qs, tmp := buf[2*T:2*T+d], buf[2*T+d:2*T+2*d]
	pT, dsT := buf[2*T+2*d:2*T+2*d+T*tb], buf[2*T+2*d+T*tb:]
	for t0 := 0; t0 < T; t0 += tb {
		t1 := min(T, t0+tb)
		for j := range t1 - t0 {
			t := t0 + j
			n := t + 1
			p, ds := buf[:n], buf[T:T+n]
			qt, ot := qh[t*qw:t*qw+d], oh[t*qw:t*qw+d]
			for i, x := range qt {
				qs[i] = x * a.scale
			}
			a.k.scores(p, qs, kc, kw)
			mx := float32(math.Inf(-1))
			for _, x := range p {
				mx = max(mx, x)
			}
			a.k.expSum(p, mx)
			var sum float64
			for _, e := range p {
				sum += float64(e)
			}
			inv := float32(1 / sum)
			a.k.scores(ds, ot, vc, kw) // dp[s] = dout_t · v_s
			var D float64              // Σ p·dp = dout_t · out_t
			for s := range p {
				p[s] *= inv
				D += float64(p[s]) * float64(ds[s])
			}
			for s := range ds {
				ds[s] = p[s] * (ds[s] - float32(D)) * a.scale
			}
			a.k.wsum(a.dq[t*qw+qo:t*qw+qo+d], kc, kw, ds)
			for s := range n {
				pT[s*tb+j], dsT[s*tb+j] = p[s], ds[s]
			}
			for s := n; s < t1; s++ { // causal: t does not see s
				pT[s*tb+j], dsT[s*tb+j] = 0, 0
			}
		}
		// dk_s += Σ_t ds[t,s]·q_t and dv_s += Σ_t p[t,s]·dout_t over the
		// block's queries.
		nb := t1 - t0
		for s := range t1 {
			a.k.wsum(tmp, qh[t0*qw:], qw, dsT[s*tb:s*tb+nb])
			add(dkh[s*ld:s*ld+d], tmp)
			a.k.wsum(tmp, oh[t0*qw:], qw, pT[s*tb:s*tb+nb])
			add(dvh[s*ld:s*ld+d], tmp)
		}
	}
	scoreBufs.Put(bp)
}

// add adds x into y.
func add(y, x []float32) {
	x = x[:len(y)]
	for i, v := range x {
		y[i] += v
	}
}

// reduce sums the per-head buffers of KV head g into dk and dv.
func (a *attnGrad) reduce(g int) {
	d, T, kw := a.d, a.t, a.kvHeads*a.d
	for s := range T {
		dk, dv := a.dk[s*kw+g*d:s*kw+(g+1)*d], a.dv[s*kw+g*d:s*kw+(g+1)*d]
		h0 := g * a.group
		copy(dk, a.kbuf[(h0*T+s)*d:])
		copy(dv, a.vbuf[(h0*T+s)*d:])
		for h := h0 + 1; h < h0+a.group; h++ {
			kb, vb := a.kbuf[(h*T+s)*d:(h*T+s+1)*d], a.vbuf[(h*T+s)*d:(h*T+s+1)*d]
			for i := range dk {
				dk[i] += kb[i]
				dv[i] += vb[i]
			}
		}
	}
}

// CrossEntropyGrad returns the sum over the rows of logits [rows, V] of
// -log softmax(logits[i])[targets[i]] and overwrites logits with the
// gradient of scale times that sum: (softmax - onehot)·scale. A row with a
// negative target is left out and its gradient is zero; a target >= V is an
// error, and then logits are unchanged. Each row's softmax is normalised in
// float64; the rows' losses are summed in row order.
func (c *CPU) CrossEntropyGrad(logits *Tensor, targets []int32, scale float32) (float64, error) {
	if err := operands("CrossEntropyGrad", logits); err != nil {
		return 0, err
	}
	v := logits.shape[1]
	rows := len(targets)
	if rows == 0 {
		return 0, nil
	}
	zs, g := logits.F32(), float64(scale)
	loss := make([]float64, rows)
	c.runMaybe(rows*v < minParallelElems, rows, funcTask(func(i int) {
		z, y := zs[i*v:(i+1)*v], targets[i]
		if y < 0 {
			clear(z)
			return
		}
		mx := z[0]
		for _, x := range z {
			mx = max(mx, x)
		}
		zy := z[y]
		var sum float64
		for j, x := range z {
			e := math.Exp(float64(x - mx))
			sum += e
			z[j] = float32(e)
		}
		loss[i] = float64(mx) + math.Log(sum) - float64(zy)
		f := g / sum
		for j, e := range z {
			z[j] = float32(float64(e) * f)
		}
		z[y] = float32((math.Exp(float64(zy-mx))/sum - 1) * g)
	}))
	var total float64
	for _, l := range loss {
		total += l
	}
	return total, nil
}

// MatMulPrecise is MatMul, which on the CPU already widens w exactly and
// keeps x in F32.
func (c *CPU) MatMulPrecise(out, x, w, bias *Tensor) error { return c.MatMul(out, x, w, bias) }
