package tensor

import "fmt"

// Blocking of the CPU matrix product.
const (
	// decodeRows is how many output columns (weight rows) one decode task
	// computes; a multiple of 4, the width of the dot4 kernels.
	decodeRows = 16
	// prefillM and prefillN are the rows of x and of w in one prefill task:
	// each weight row is read (and converted) once per prefillM rows of x.
	prefillM = 32
	prefillN = 64
	// prefillK is the chunk of the inner dimension converted at a time; a
	// chunk of prefillM rows of x (32 KiB) stays in the L1 cache while the
	// task's weight rows pass over it.
	prefillK = 256
	// minParallel is the number of multiply-adds below which an operation
	// runs on the calling goroutine alone.
	minParallel = 1 << 15
)

// MatMul computes out[M,N] = x[M,K] · w[N,K]ᵀ (+ bias[N]). x and out are F32;
// w and bias may be F32, F16 or BF16 and are read in their stored type.
func (c *CPU) MatMul(out, x, w, bias *Tensor) error {
	const op = "MatMul"
	if err := check(op, "x", x, F32, -1, -1); err != nil {
		return err
	}
	m, k := x.shape[0], x.shape[1]
	if err := check(op, "w", w, Invalid, -1, k); err != nil {
		return err
	}
	n := w.shape[0]
	if err := check(op, "out", out, F32, m, n); err != nil {
		return err
	}
	if bias != nil {
		if err := check(op, "bias", bias, Invalid, n); err != nil {
			return err
		}
	}
	if err := noOverlap(op, out, []string{"x", "w", "bias"}, x, w, bias); err != nil {
		return err
	}
	if m == 0 || n == 0 {
		return nil
	}
	mm := &matmul{k: c.k, m: m, n: n, kd: k, x: x.F32(), out: out.F32(), wdt: w.dtype}
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
	if m == 1 {
		tasks := (n + decodeRows - 1) / decodeRows
		if n*k < minParallel {
			tasks = 1
		}
		per := (n + tasks - 1) / tasks
		per = (per + 3) &^ 3
		c.pool.run(tasks, func(t int) {
			mm.decode(t*per, min(n, (t+1)*per))
		})
		return nil
	}
	bm, bn := (m+prefillM-1)/prefillM, (n+prefillN-1)/prefillN
	if m*n*k < minParallel {
		// One task, but still blocked the same way.
		c.pool.run(1, func(int) {
			for i := range bm * bn {
				mm.prefill(i/bn, i%bn)
			}
		})
		return nil
	}
	c.pool.run(bm*bn, func(t int) { mm.prefill(t/bn, t%bn) })
	return nil
}

// matmul is one MatMul call's operands.
type matmul struct {
	k        *kernels
	m, n, kd int // M, N, K
	x, out   []float32
	wdt      DType
	w32      []float32 // F32 weights
	w16      []uint16  // F16 or BF16 weights
	bias     fvec
	hasBias  bool
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

// decode computes output columns [j0, j1) of the single row of x.
func (mm *matmul) decode(j0, j1 int) {
	k, x, out := mm.kd, mm.x, mm.out
	j := j0
	switch mm.wdt {
	case F32:
		w := mm.w32
		for ; j+4 <= j1; j += 4 {
			out[j], out[j+1], out[j+2], out[j+3] = mm.k.dot4F32(x,
				w[j*k:(j+1)*k], w[(j+1)*k:(j+2)*k], w[(j+2)*k:(j+3)*k], w[(j+3)*k:(j+4)*k])
		}
		for ; j < j1; j++ {
			out[j] = mm.k.dotF32(x, w[j*k:(j+1)*k])
		}
	case F16, BF16:
		w := mm.w16
		dot4, dot := mm.k.dot4F16, mm.k.dotF16
		if mm.wdt == BF16 {
			dot4, dot = mm.k.dot4BF16, mm.k.dotBF16
		}
		for ; j+4 <= j1; j += 4 {
			out[j], out[j+1], out[j+2], out[j+3] = dot4(x,
				w[j*k:(j+1)*k], w[(j+1)*k:(j+2)*k], w[(j+2)*k:(j+3)*k], w[(j+3)*k:(j+4)*k])
		}
		for ; j < j1; j++ {
			out[j] = dot(x, w[j*k:(j+1)*k])
		}
	default:
		panic(fmt.Sprintf("tensor: matmul with %v weights", mm.wdt)) // unreachable: checked by MatMul
	}
	if mm.hasBias {
		for j := j0; j < j1; j++ {
			out[j] += mm.bias.at(j)
		}
	}
}

// prefill computes the block (bi, bj): rows [bi*prefillM, ...) of x against
// weight rows [bj*prefillN, ...). For each chunk of K, four weight rows at a
// time are converted to F32 (F16, BF16) into a stack buffer and multiplied
// with every row of the x block by the dot4F32 kernel. (Register-blocked
// 2x4 and 3x2 kernels measured no faster in Go: the compiler spills their
// accumulators.)
func (mm *matmul) prefill(bi, bj int) {
	k, n := mm.kd, mm.n
	i0, i1 := bi*prefillM, min(mm.m, (bi+1)*prefillM)
	j0, j1 := bj*prefillN, min(n, (bj+1)*prefillN)
	rows, cols := i1-i0, j1-j0

	var acc [prefillM * prefillN]float32 // acc[r*prefillN+c] for out[i0+r, j0+c]
	var wbuf [4][prefillK]float32
	var zeros [prefillK]float32
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
