package nn

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/strata-llm/strata/tensor"
)

// The backward of every operation the decoder uses, on host F32 slices. The
// forward runs on the backend (so that its activations are the inference
// forward's bit for bit); these functions read those activations and the
// weights in their stored dtype and add gradients into F32 buffers.
//
// Conventions: matrices are row-major; a linear layer is y[M,N] =
// x[M,K]·w[N,K]ᵀ (+ b[N]) as in tensor.Ops.MatMul. "Add" in a name or doc
// means the result is accumulated into the destination, which the caller
// zeroes when it wants the plain gradient.

// par spreads work over a number of goroutines.
type par struct{ threads int }

func newPar(threads int) par {
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	return par{threads: threads}
}

// run calls fn(i) for every i in [0, n), on up to p.threads goroutines.
func (p par) run(n int, fn func(i int)) {
	workers := min(p.threads, n)
	if workers <= 1 {
		for i := range n {
			fn(i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				fn(i)
			}
		})
	}
	wg.Wait()
}

// Blocking of the backward matrix products.
const (
	gradBlockM = 64  // rows of dx per task
	gradBlockK = 256 // columns of dx (and of dw) per task
	gradBlockN = 16  // weight rows converted to F32 at a time
)

// weightBlock converts rows n0..n1 and columns k0..k1 of w [N, K] (F32, F16
// or BF16, on the host) to F32 in dst, row-major with stride k1-k0.
func weightBlock(dst []float32, w *tensor.Tensor, n0, n1, k0, k1 int) {
	K, kb := w.Shape()[1], k1-k0
	switch w.DType() {
	case tensor.F32:
		src := w.F32()
		for n := n0; n < n1; n++ {
			copy(dst[(n-n0)*kb:(n-n0+1)*kb], src[n*K+k0:n*K+k1])
		}
	case tensor.F16:
		src := w.U16()
		for n := n0; n < n1; n++ {
			tensor.F16ToF32(dst[(n-n0)*kb:(n-n0+1)*kb], src[n*K+k0:n*K+k1])
		}
	case tensor.BF16:
		src := w.U16()
		for n := n0; n < n1; n++ {
			tensor.BF16ToF32(dst[(n-n0)*kb:(n-n0+1)*kb], src[n*K+k0:n*K+k1])
		}
	default:
		panic("nn: weight of dtype " + w.DType().String()) // checked by the caller
	}
}

// axpy adds a*x into y.
func axpy(y []float32, a float32, x []float32) {
	x = x[:len(y)]
	i := 0
	for ; i+4 <= len(y); i += 4 {
		y[i] += a * x[i]
		y[i+1] += a * x[i+1]
		y[i+2] += a * x[i+2]
		y[i+3] += a * x[i+3]
	}
	for ; i < len(y); i++ {
		y[i] += a * x[i]
	}
}

// linearBackX adds dy[M,N]·w[N,K] into dx[M,K]: the gradient of a linear
// layer's input.
func linearBackX(p par, dx, dy []float32, w *tensor.Tensor, M int) {
	N, K := w.Shape()[0], w.Shape()[1]
	if M == 0 || N == 0 || K == 0 {
		return
	}
	mb, kb := (M+gradBlockM-1)/gradBlockM, (K+gradBlockK-1)/gradBlockK
	p.run(mb*kb, func(task int) {
		m0, k0 := task/kb*gradBlockM, task%kb*gradBlockK
		m1, k1 := min(M, m0+gradBlockM), min(K, k0+gradBlockK)
		width := k1 - k0
		buf := make([]float32, gradBlockN*width)
		for n0 := 0; n0 < N; n0 += gradBlockN {
			n1 := min(N, n0+gradBlockN)
			weightBlock(buf, w, n0, n1, k0, k1)
			for m := m0; m < m1; m++ {
				row := dx[m*K+k0 : m*K+k1]
				g := dy[m*N+n0 : m*N+n1]
				for j, a := range g {
					if a != 0 {
						axpy(row, a, buf[j*width:(j+1)*width])
					}
				}
			}
		}
	})
}

// linearBackW adds dy[M,N]ᵀ·x[M,K] into dw[N,K]: the gradient of a linear
// layer's weight.
func linearBackW(p par, dw, dy, x []float32, M, N, K int) {
	if M == 0 || N == 0 || K == 0 {
		return
	}
	nb, kb := (N+gradBlockN-1)/gradBlockN, (K+gradBlockK-1)/gradBlockK
	p.run(nb*kb, func(task int) {
		n0, k0 := task/kb*gradBlockN, task%kb*gradBlockK
		n1, k1 := min(N, n0+gradBlockN), min(K, k0+gradBlockK)
		for m := range M {
			xr := x[m*K+k0 : m*K+k1]
			g := dy[m*N : (m+1)*N]
			for n := n0; n < n1; n++ {
				if a := g[n]; a != 0 {
					axpy(dw[n*K+k0:n*K+k1], a, xr)
				}
			}
		}
	})
}

// biasBack adds the column sums of dy[M,N] into db[N].
func biasBack(db, dy []float32, M int) {
	N := len(db)
	for m := range M {
		for n, v := range dy[m*N : (m+1)*N] {
			db[n] += v
		}
	}
}

// rmsNormBack is the backward of y = x / sqrt(mean(x²) + eps) * w over rows
// of width H: it adds the input gradient into dx and the weight gradient into
// dw (nil to skip it). w is the norm weight in F32.
func rmsNormBack(p par, dx, dy, x, w, dw []float32, H int, eps float32) {
	M := len(x) / H
	if M == 0 {
		return
	}
	tasks := min(p.threads, M)
	per := (M + tasks - 1) / tasks
	var partial [][]float64
	if dw != nil {
		partial = make([][]float64, tasks)
	}
	p.run(tasks, func(task int) {
		lo, hi := task*per, min(M, (task+1)*per)
		var pdw []float64
		if dw != nil {
			pdw = make([]float64, H)
			partial[task] = pdw
		}
		for m := lo; m < hi; m++ {
			xr, gr, dr := x[m*H:(m+1)*H], dy[m*H:(m+1)*H], dx[m*H:(m+1)*H]
			var ss, dot float64
			for i, v := range xr {
				ss += float64(v) * float64(v)
				dot += float64(gr[i]) * float64(w[i]) * float64(v)
			}
			r := 1 / math.Sqrt(ss/float64(H)+float64(eps))
			c := r * r * r * dot / float64(H)
			for i, v := range xr {
				dr[i] += float32(r*float64(gr[i])*float64(w[i]) - c*float64(v))
				if pdw != nil {
					pdw[i] += float64(gr[i]) * float64(v) * r
				}
			}
		}
	})
	for _, pdw := range partial {
		for i, v := range pdw {
			dw[i] += float32(v)
		}
	}
}

// ropeBack undoes the rotary embedding on the gradient dx[T, heads*headDim]
// in place: row t was rotated by the angles of position pos0+t, so its
// gradient is rotated back by them. cos and sin are the [maxPos, headDim/2]
// tables the forward used.
func ropeBack(dx, cos, sin []float32, heads, headDim, pos0 int) {
	half, w := headDim/2, heads*headDim
	T := len(dx) / w
	for t := range T {
		c, s := cos[(pos0+t)*half:(pos0+t+1)*half], sin[(pos0+t)*half:(pos0+t+1)*half]
		for h := range heads {
			v := dx[t*w+h*headDim : t*w+(h+1)*headDim]
			for i := range half {
				d0, d1 := v[i], v[i+half]
				v[i] = d0*c[i] + d1*s[i]
				v[i+half] = d1*c[i] - d0*s[i]
			}
		}
	}
}

// siluMulBack is the backward of out = silu(gate) * up. On entry dgate holds
// the gradient of out and dup anything; on return they hold the gradients of
// gate and up.
func siluMulBack(dgate, dup, gate, up []float32) {
	for i, g := range gate {
		d := dgate[i]
		sig := float32(1 / (1 + math.Exp(-float64(g))))
		silu := g * sig
		dup[i] = d * silu
		dgate[i] = d * up[i] * sig * (1 + g*(1-sig))
	}
}

// attentionBack is the backward of causal grouped-query attention over T
// positions starting at 0: out[t,h] = Σ_{s<=t} softmax_s(scale q[t,h]·k[s,g])
// v[s,g], g = h/(heads/kvHeads). Given dout, it sets (not adds) dq, dk and
// dv. The probabilities are recomputed from q and k, so nothing of size T²
// is kept between the forward and the backward.
func attentionBack(p par, dq, dk, dv, dout, q, k, v []float32, T, heads, kvHeads, headDim int, scale float32) {
	clear(dq)
	clear(dk)
	clear(dv)
	group, qw, kw := heads/kvHeads, heads*headDim, kvHeads*headDim
	// One task per KV head: it owns the dk and dv columns of that head and
	// the dq columns of the query heads that read it.
	p.run(kvHeads, func(g int) {
		prob := make([]float32, T)
		dp := make([]float32, T)
		ko := g * headDim
		for h := g * group; h < (g+1)*group; h++ {
			qo := h * headDim
			for t := range T {
				qt := q[t*qw+qo : t*qw+qo+headDim]
				dot := dout[t*qw+qo : t*qw+qo+headDim]
				maxS := float32(math.Inf(-1))
				for s := 0; s <= t; s++ {
					ks := k[s*kw+ko : s*kw+ko+headDim]
					var a float32
					for d, x := range qt {
						a += x * ks[d]
					}
					prob[s] = a * scale
					maxS = max(maxS, prob[s])
				}
				var sum float64
				for s := 0; s <= t; s++ {
					e := float32(math.Exp(float64(prob[s] - maxS)))
					prob[s] = e
					sum += float64(e)
				}
				inv := float32(1 / sum)
				var D float64
				for s := 0; s <= t; s++ {
					prob[s] *= inv
					vs := v[s*kw+ko : s*kw+ko+headDim]
					var a float32
					for d, x := range dot {
						a += x * vs[d]
					}
					dp[s] = a
					D += float64(prob[s]) * float64(a)
				}
				dqt := dq[t*qw+qo : t*qw+qo+headDim]
				for s := 0; s <= t; s++ {
					ds := prob[s] * (dp[s] - float32(D)) * scale
					axpy(dqt, ds, k[s*kw+ko:s*kw+ko+headDim])
					axpy(dk[s*kw+ko:s*kw+ko+headDim], ds, qt)
					axpy(dv[s*kw+ko:s*kw+ko+headDim], prob[s], dot)
				}
			}
		}
	})
}

// crossEntropy turns logits [rows, V] into the gradient of the mean
// cross-entropy, in place, and returns the sum of the rows' losses. Row i's
// target is targets[i]; a negative target leaves the row out (its gradient is
// zero). The gradient is scaled by scale/count: count is the number of
// targets in the whole loss, of which these rows may be a part.
func crossEntropy(logits []float32, targets []int32, V int, scale float64, count int) float64 {
	var total float64
	g := scale / float64(count)
	for i, y := range targets {
		z := logits[i*V : (i+1)*V]
		if y < 0 {
			clear(z)
			continue
		}
		maxZ := z[0]
		for _, v := range z {
			maxZ = max(maxZ, v)
		}
		var sum float64
		for _, v := range z {
			sum += math.Exp(float64(v - maxZ))
		}
		lse := float64(maxZ) + math.Log(sum)
		total += lse - float64(z[y])
		for j, v := range z {
			z[j] = float32(math.Exp(float64(v)-lse) * g)
		}
		z[y] -= float32(g)
	}
	return total
}

// embedBack adds each row of dx [T, H] into row ids[t] of dtable.
func embedBack(dtable, dx []float32, ids []int32, H int) {
	for t, id := range ids {
		row := dtable[int(id)*H : (int(id)+1)*H]
		for i, v := range dx[t*H : (t+1)*H] {
			row[i] += v
		}
	}
}
