package tensor

import (
	"fmt"
	"sync"
)

// Blocking of the CPU matrix product.
const (
	// decodeRows is how many output columns (weight rows) one decode task
	// computes; a multiple of 4, the width of the gemv kernels.
	decodeRows = 64
	// prefillM and prefillN are the rows of x and of w in one task of the
	// Go prefill (kernels without gemm): each weight row is read (and
	// converted) once per prefillM rows of x.
	prefillM = 32
	prefillN = 64
	// prefillK is the chunk of the inner dimension the Go prefill converts
	// at a time; a chunk of prefillM rows of x (32 KiB) stays in the L1
	// cache while the task's weight rows pass over it.
	prefillK = 256
	// gemmMaxGroups bounds the groups of mr weight rows in one packed
	// prefill task, and gemmMaxBlock their bytes converted to F32.
	gemmMaxGroups = 8
	gemmMaxBlock  = 1 << 20
	// minParallel is the number of multiply-adds below which an operation
	// runs on the calling goroutine alone.
	minParallel = 1 << 15
)

// MatMul computes out[M,N] = x[M,K] · w[N,K]ᵀ (+ bias[N]). x and out are F32;
// w and bias may be F32, F16 or BF16 and are read in their stored type.
//
// One row of x (decode) streams the weights once through the gemv kernel,
// split across the pool in blocks of rows. Several rows (prefill) use the
// gemm micro-kernel where the kernel table has one: x is packed into panels
// of nr rows stored k-major, and each task converts a block of weight rows
// to F32 and multiplies it with every panel, keeping an mr×nr tile of out
// in registers.
//
// Quantized weights are multiplied in integers, x quantized to 8 bits per
// element (matMulQuant), except from quantGemmRows rows of x, where the
// gemm is faster: it dequantizes each block of weight rows to F32 as it
// converts F16 ones, and so computes the F32 product over the dequantized
// weights, without the error of rounding x.
func (c *CPU) MatMul(out, x, w, bias *Tensor) error {
	if err := operands("MatMul", out, x, w, bias); err != nil {
		return err
	}
	if w.dtype.IsQuantized() && (c.k.gemm == nil || x.shape[0] < quantGemmRows(w.dtype)) {
		return c.matMulQuant(out, x, w, bias)
	}
	m, k, n := x.shape[0], x.shape[1], w.shape[0]
	if m == 0 || n == 0 {
		return nil
	}
	mm := matmulPool.Get().(*matmul)
	defer mm.release()
	*mm = matmul{k: c.k, m: m, n: n, kd: k, x: x.F32(), out: out.F32(), wdt: w.dtype, scratch: mm.scratch}
	switch {
	case w.dtype.IsQuantized():
		mm.wq = w.data
	case w.dtype == F32:
		mm.w32 = w.F32()
	default:
		mm.w16 = w.U16()
	}
	if bias != nil {
		mm.bias = newFvec(bias)
		mm.hasBias = true
	}
	small := m*n*k < minParallel
	switch {
	case k == 0:
		mm.zeroK()
	case m == 1:
		mm.per = decodePer(n, k)
		mm.mode = modeDecode
		c.pool.runTask((n+mm.per-1)/mm.per, mm)
	case c.k.gemm != nil:
		mm.planPacked(c.threads)
		mm.mode = modePack
		c.runMaybe(small, mm.panels, mm)
		mm.mode = modeGemm
		c.runMaybe(small, mm.nBlocks, mm)
	default:
		mm.mode = modePrefillGo
		mm.bn = (n + prefillN - 1) / prefillN
		c.runMaybe(small, (m+prefillM-1)/prefillM*mm.bn, mm)
	}
	return nil
}

// decodePer is the weight rows of one task of a one-row product of n
// weight rows of k elements: a multiple of 4, the width of the gemv kernels.
func decodePer(n, k int) int {
	tasks := (n + decodeRows - 1) / decodeRows
	if n*k < minParallel {
		tasks = 1
	}
	per := (n + tasks - 1) / tasks
	return (per + 3) &^ 3
}

// MatMulRows is MatMul with each row of out computed as a one-row MatMul
// computes it (tensor.RowExact): the gemv kernels over the same blocks of
// weight rows, or for quantized weights the integer product over the same
// blocks, whatever the number of rows. A batch of sequences then gets, row
// for row, the bits each sequence gets alone; MatMul's several-row kernels
// (the gemm, the gemm over dequantized weights) round differently. Each
// task multiplies its block of weight rows with every row of x, so the
// block is read from memory once and from the cache for the other rows.
func (c *CPU) MatMulRows(out, x, w, bias *Tensor) error {
	if err := operands("MatMulRows", out, x, w, bias); err != nil {
		return err
	}
	if w.dtype.IsQuantized() {
		return c.matMulQuantRows(out, x, w, bias, true)
	}
	m, k, n := x.shape[0], x.shape[1], w.shape[0]
	if m == 0 || n == 0 {
		return nil
	}
	mm := matmulPool.Get().(*matmul)
	defer mm.release()
	*mm = matmul{k: c.k, m: m, n: n, kd: k, x: x.F32(), out: out.F32(), wdt: w.dtype, scratch: mm.scratch}
	if w.dtype == F32 {
		mm.w32 = w.F32()
	} else {
		mm.w16 = w.U16()
	}
	if bias != nil {
		mm.bias = newFvec(bias)
		mm.hasBias = true
	}
	if k == 0 {
		mm.zeroK()
		return nil
	}
	mm.per = decodePer(n, k)
	mm.mode = modeRows
	c.runMaybe(m*n*k < minParallel, (n+mm.per-1)/mm.per, mm)
	return nil
}

// runMaybe runs n tasks of t on the pool, or on the calling goroutine when
// the operation is too small to be worth spreading.
func (c *CPU) runMaybe(small bool, n int, t task) {
	if small {
		for i := range n {
			t.run(i)
		}
		return
	}
	c.pool.runTask(n, t)
}

// matmul is one MatMul call's operands and plan; recycled through
// matmulPool so that a call allocates nothing.
type matmul struct {
	k        *kernels
	m, n, kd int // M, N, K
	x, out   []float32
	wdt      DType
	w32      []float32 // F32 weights
	w16      []uint16  // F16 or BF16 weights
	wq       []byte    // quantized weights (packed prefill only)
	bias     fvec
	hasBias  bool

	mode mmMode
	per  int // decode: weight rows per task
	bn   int // Go prefill: blocks along N

	// Packed prefill: panels of nr rows of x, nb weight rows per task
	// (nBlocks tasks).
	panels, nb, nBlocks int
	xp                  []float32 // packed x: [panels][K][nr]
	scratch             *[]float32
}

type mmMode int

const (
	modeDecode mmMode = iota
	modeRows
	modePack
	modeGemm
	modePrefillGo
)

var matmulPool = sync.Pool{New: func() any { return new(matmul) }}

// release drops the operands (so that the pool keeps no tensor alive) and
// returns mm to the pool.
func (mm *matmul) release() {
	*mm = matmul{scratch: mm.scratch}
	matmulPool.Put(mm)
}

func (mm *matmul) run(t int) {
	switch mm.mode {
	case modeDecode:
		mm.decode(0, t*mm.per, min(mm.n, (t+1)*mm.per))
	case modeRows:
		for i := range mm.m {
			mm.decode(i, t*mm.per, min(mm.n, (t+1)*mm.per))
		}
	case modePack:
		mm.pack(t)
	case modeGemm:
		mm.gemmBlock(t)
	default:
		mm.prefill(t/mm.bn, t%mm.bn)
	}
}

func (mm *matmul) biasAt(j int) float32 {
	if !mm.hasBias {
		return 0
	}
	return mm.bias.at(j)
}

// zeroK handles K = 0: every dot product is empty.
func (mm *matmul) zeroK() {
	for i := range mm.m {
		for j := range mm.n {
			mm.out[i*mm.n+j] = mm.biasAt(j)
		}
	}
}

// decode computes output columns [j0, j1) of row i of x with the gemv
// kernels.
func (mm *matmul) decode(i, j0, j1 int) {
	k, row := mm.kd, mm.out[i*mm.n:(i+1)*mm.n]
	x, out := mm.x[i*k:(i+1)*k], row[j0:j1]
	switch mm.wdt {
	case F32:
		mm.k.gemvF32(out, x, mm.w32[j0*k:j1*k])
	case F16:
		mm.k.gemvF16(out, x, mm.w16[j0*k:j1*k])
	case BF16:
		mm.k.gemvBF16(out, x, mm.w16[j0*k:j1*k])
	default:
		panic(fmt.Sprintf("tensor: matmul with %v weights", mm.wdt)) // unreachable: checked by MatMul
	}
	if mm.hasBias {
		for j := j0; j < j1; j++ {
			row[j] += mm.bias.at(j)
		}
	}
}

// planPacked sizes the packed prefill for threads workers and takes the
// buffer for the packed x.
func (mm *matmul) planPacked(threads int) {
	mr, nr := mm.k.mr, mm.k.nr
	mm.panels = (mm.m + nr - 1) / nr
	// Blocks along N: about four tasks per thread, each of at most
	// gemmMaxGroups groups of mr rows and gemmMaxBlock converted bytes.
	groups := (mm.n + mr - 1) / mr
	g := (groups + 4*threads - 1) / (4 * threads)
	g = min(g, gemmMaxGroups, gemmMaxBlock/(mr*mm.kd*4))
	mm.nb = max(g, 1) * mr
	mm.nBlocks = (mm.n + mm.nb - 1) / mm.nb
	need := mm.panels * mm.kd * nr
	if mm.scratch == nil {
		mm.scratch = new([]float32)
	}
	if cap(*mm.scratch) < need {
		*mm.scratch = make([]float32, need)
	}
	mm.xp = (*mm.scratch)[:need]
}

// pack writes panel p of x: rows p*nr.. (zeros past M), k-major.
func (mm *matmul) pack(p int) {
	nr, kd := mm.k.nr, mm.kd
	dst := mm.xp[p*kd*nr : (p+1)*kd*nr]
	for j := range nr {
		row := p*nr + j
		if row >= mm.m {
			for i := range kd {
				dst[i*nr+j] = 0
			}
			continue
		}
		for i, v := range mm.x[row*kd : (row+1)*kd] {
			dst[i*nr+j] = v
		}
	}
}

// gemmScratch is a packed task's converted weights and output tiles.
type gemmScratch struct{ w, acc []float32 }

var gemmScratchPool = sync.Pool{New: func() any { return new(gemmScratch) }}

func grow(b *[]float32, n int) []float32 {
	if cap(*b) < n {
		*b = make([]float32, n)
	}
	return (*b)[:n]
}

// gemmBlock computes weight rows [bn*nb, ...) against every row of x. It
// converts the block's weights to F32 in one sequential pass (rows are
// contiguous, so the hardware prefetchers stream them at full speed), then
// for each chunk of K multiplies every panel of x with every group of mr
// rows, the panel's chunk staying in the L1 cache.
func (mm *matmul) gemmBlock(bn int) {
	k := mm.k
	mr, nr, kc := k.mr, k.nr, k.kc
	kd, n := mm.kd, mm.n
	n0, n1 := bn*mm.nb, min(n, (bn+1)*mm.nb)
	rows := n1 - n0
	groups := (rows + mr - 1) / mr
	np := mm.panels
	tile := mr * nr

	sc := gemmScratchPool.Get().(*gemmScratch)
	wbuf := grow(&sc.w, groups*mr*kd)
	acc := grow(&sc.acc, groups*np*tile)
	clear(acc)
	clear(wbuf[rows*kd:]) // padding rows of the last group
	switch mm.wdt {
	case F32:
		copy(wbuf, mm.w32[n0*kd:n1*kd])
	case F16:
		k.cvtF16(wbuf, mm.w16[n0*kd:n1*kd])
	case BF16:
		k.cvtBF16(wbuf, mm.w16[n0*kd:n1*kd])
	default:
		typ, _ := mm.wdt.Quant()
		rb := kd / typ.BlockSize() * typ.BlockBytes()
		if err := typ.Dequantize(wbuf[:rows*kd], mm.wq[n0*rb:n1*rb]); err != nil {
			panic(err) // unreachable: whole rows of whole blocks
		}
	}
	for k0 := 0; k0 < kd; k0 += kc {
		kl := min(kc, kd-k0)
		for p := range np {
			b := mm.xp[(p*kd+k0)*nr : (p*kd+k0+kl)*nr]
			for g := range groups {
				k.gemm(wbuf[g*mr*kd+k0:], kd, b, acc[(g*np+p)*tile:(g*np+p+1)*tile], kl)
			}
		}
	}
	// Write out row by row: each row of out gets a contiguous run of
	// columns, read across the tiles of the row's panel.
	for row := range mm.m {
		p, j := row/nr, row%nr
		o := mm.out[row*n+n0 : row*n+n1]
		full := rows / mr // groups of mr columns all inside the block
		for g := range full {
			t := acc[(g*np+p)*tile+j:]
			cols := o[g*mr : (g+1)*mr]
			if mr == 6 {
				t = t[:5*nr+1]
				cols[0], cols[1], cols[2], cols[3], cols[4], cols[5] = t[0], t[nr], t[2*nr], t[3*nr], t[4*nr], t[5*nr]
				continue
			}
			for i := range cols {
				cols[i] = t[i*nr]
			}
		}
		if full < groups {
			t := acc[(full*np+p)*tile+j:]
			for i, c := 0, full*mr; c < len(o); i, c = i+1, c+1 {
				o[c] = t[i*nr]
			}
		}
		if mm.hasBias {
			for c := range o {
				o[c] += mm.bias.at(n0 + c)
			}
		}
	}
	gemmScratchPool.Put(sc)
}

// prefill, the Go prefill, computes the block (bi, bj): rows [bi*prefillM,
// ...) of x against weight rows [bj*prefillN, ...). For each chunk of K,
// four weight rows at a time are converted to F32 (F16, BF16) into a stack buffer and multiplied
// with every row of the x block by the dot4F32 kernel. (Register-blocked
// 2x4 and 3x2 kernels measured no faster in Go: the compiler spills their
// accumulators.)
func (mm *matmul) prefill(bi, bj int) {
	k, n := mm.kd, mm.n
	i0, i1 := bi*prefillM, min(mm.m, (bi+1)*prefillM)
	j0, j1 := bj*prefillN, min(n, (bj+1)*prefillN)
	rows, cols := i1-i0, j1-j0

	// Buffers from the pool rather than the stack: slices passed to the
	// kernels through function values escape.
	sc := gemmScratchPool.Get().(*gemmScratch)
	defer gemmScratchPool.Put(sc)
	acc := grow(&sc.acc, prefillM*prefillN) // acc[r*prefillN+c] for out[i0+r, j0+c]
	clear(acc)
	buf := grow(&sc.w, 5*prefillK)
	clear(buf[4*prefillK:])
	wbuf := [4][]float32{buf[:prefillK], buf[prefillK : 2*prefillK], buf[2*prefillK : 3*prefillK], buf[3*prefillK : 4*prefillK]}
	zeros := buf[4*prefillK:]
	var w [4][]float32

	for k0 := 0; k0 < k; k0 += prefillK {
		k1 := min(k, k0+prefillK)
		kl := k1 - k0
		for c := 0; c < cols; c += 4 {
			for q := range 4 {
				j := j0 + c + q
				switch {
				case j >= j1:
					w[q] = zeros[:kl]
				case mm.wdt == F32:
					w[q] = mm.w32[j*k+k0 : j*k+k1]
				case mm.wdt == F16:
					mm.k.cvtF16(wbuf[q][:kl], mm.w16[j*k+k0:j*k+k1])
					w[q] = wbuf[q][:kl]
				default:
					mm.k.cvtBF16(wbuf[q][:kl], mm.w16[j*k+k0:j*k+k1])
					w[q] = wbuf[q][:kl]
				}
			}
			for r := range rows {
				x := mm.x[(i0+r)*k+k0 : (i0+r)*k+k1]
				a0, a1, a2, a3 := mm.k.dot4F32(x, w[0], w[1], w[2], w[3])
				p := acc[r*prefillN+c : r*prefillN+c+4 : r*prefillN+c+4]
				p[0] += a0
				p[1] += a1
				p[2] += a2
				p[3] += a3
			}
		}
	}
	for r := range rows {
		o := mm.out[(i0+r)*n+j0 : (i0+r)*n+j1]
		a := acc[r*prefillN : r*prefillN+cols]
		for c := range o {
			o[c] = a[c] + mm.biasAt(j0+c)
		}
	}
}
