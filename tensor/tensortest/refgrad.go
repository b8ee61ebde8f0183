package tensortest

import "math"

// References of the backward operations (tensor.GradOps), in the same plain
// float64 style as ref.go. Each takes dy (or dout), the gradient of a loss
// with respect to the forward's output, and returns the gradients of the
// forward's inputs, written out from the chain rule independently of any
// backend. ref_test.go checks them against central finite differences of the
// forward references.

// RefMatMulGradX returns dy[M,N] · w[N,K], the gradient of RefMatMul's x.
func RefMatMulGradX(dy, w []float64, m, n, k int) []float64 {
	dx := make([]float64, m*k)
	for i := 0; i < m; i++ {
		for p := 0; p < k; p++ {
			var s float64
			for j := 0; j < n; j++ {
				s += dy[i*n+j] * w[j*k+p]
			}
			dx[i*k+p] = s
		}
	}
	return dx
}

// RefMatMulGradW returns dy[M,N]ᵀ · x[M,K], the gradient of RefMatMul's w
// (shaped [N,K] like w).
func RefMatMulGradW(dy, x []float64, m, n, k int) []float64 {
	dw := make([]float64, n*k)
	for j := 0; j < n; j++ {
		for p := 0; p < k; p++ {
			var s float64
			for i := 0; i < m; i++ {
				s += dy[i*n+j] * x[i*k+p]
			}
			dw[j*k+p] = s
		}
	}
	return dw
}

// RefBiasGrad returns the column sums of dy[M,N], the gradient of
// RefMatMul's bias.
func RefBiasGrad(dy []float64, m, n int) []float64 {
	db := make([]float64, n)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			db[j] += dy[i*n+j]
		}
	}
	return db
}

// RefRMSNormGrad returns the gradients of RefRMSNorm's x [M,D] and w [D].
// With r = 1/sqrt(mean(x²)+eps), x̂ = x·r and g = dy·w per row, dx = r·(g -
// x̂·mean(g·x̂)) and dw = Σ over the rows of dy·x̂.
func RefRMSNormGrad(dy, x, w []float64, m, d int, eps float64) (dx, dw []float64) {
	dx, dw = make([]float64, m*d), make([]float64, d)
	for i := 0; i < m; i++ {
		row := x[i*d : (i+1)*d]
		var ss float64
		for _, v := range row {
			ss += v * v
		}
		r := 1 / math.Sqrt(ss/float64(d)+eps)
		var gx float64 // mean of g·x̂
		for j, v := range row {
			gx += dy[i*d+j] * w[j] * v * r
		}
		gx /= float64(d)
		for j, v := range row {
			dx[i*d+j] = r * (dy[i*d+j]*w[j] - v*r*gx)
			dw[j] += dy[i*d+j] * v * r
		}
	}
	return dx, dw
}

// sigmoid is 1/(1+e^-x), computed without overflow for any x.
func sigmoid(x float64) float64 {
	if x >= 0 {
		return 1 / (1 + math.Exp(-x))
	}
	e := math.Exp(x)
	return e / (1 + e)
}

// RefSiLUMulGrad returns the gradients of RefSiLUMul's gate and up for the
// upstream gradient dout: with σ the logistic function, silu'(g) = σ(g)·(1 +
// g·(1-σ(g))), so dgate = dout·up·silu'(gate) and dup = dout·silu(gate).
func RefSiLUMulGrad(dout, gate, up []float64) (dgate, dup []float64) {
	dgate, dup = make([]float64, len(gate)), make([]float64, len(gate))
	for i, g := range gate {
		s := sigmoid(g)
		dgate[i] = dout[i] * up[i] * s * (1 + g*(1-s))
		dup[i] = dout[i] * g * s
	}
	return dgate, dup
}

// RefRopeGrad returns the gradient of RefRope's x for the upstream gradient
// dy: every pair is turned back by its angle (the transpose of a rotation is
// its inverse).
func RefRopeGrad(dy, cos, sin []float64, t, heads, headDim, pos0 int) []float64 {
	dx := make([]float64, len(dy))
	half := headDim / 2
	for r := 0; r < t; r++ {
		p := pos0 + r
		for h := 0; h < heads; h++ {
			base := r*heads*headDim + h*headDim
			for j := 0; j < half; j++ {
				a, b := dy[base+j], dy[base+j+half]
				c, s := cos[p*half+j], sin[p*half+j]
				dx[base+j] = a*c + b*s
				dx[base+j+half] = b*c - a*s
			}
		}
	}
	return dx
}

// RefAttentionGrad returns the gradients of RefAttention's q [t,
// heads*headDim], k and v [t, kvHeads*headDim] for t positions from 0 and
// the upstream gradient dout. For query row r and head h, with P the
// softmax of S_j = scale·q·k_j over j <= r: dv_j += P_j·dout, dP_j =
// dout·v_j, dS_j = P_j·(dP_j - Σ_i P_i·dP_i), dq += scale·Σ_j dS_j·k_j and
// dk_j += scale·dS_j·q.
func RefAttentionGrad(dout, q, k, v []float64, t, heads, kvHeads, headDim int, scale float64) (dq, dk, dv []float64) {
	qw, kw := heads*headDim, kvHeads*headDim
	dq, dk, dv = make([]float64, t*qw), make([]float64, t*kw), make([]float64, t*kw)
	group := heads / kvHeads
	for r := 0; r < t; r++ {
		for h := 0; h < heads; h++ {
			qo, ko := r*qw+h*headDim, (h/group)*headDim
			n := r + 1
			p := make([]float64, n)
			mx := math.Inf(-1)
			for j := 0; j < n; j++ {
				var s float64
				for d := 0; d < headDim; d++ {
					s += q[qo+d] * k[j*kw+ko+d]
				}
				p[j] = s * scale
				mx = math.Max(mx, p[j])
			}
			var sum float64
			for j := range p {
				p[j] = math.Exp(p[j] - mx)
				sum += p[j]
			}
			dp := make([]float64, n)
			var pdp float64
			for j := range p {
				p[j] /= sum
				for d := 0; d < headDim; d++ {
					dp[j] += dout[qo+d] * v[j*kw+ko+d]
				}
				pdp += p[j] * dp[j]
			}
			for j := range p {
				ds := p[j] * (dp[j] - pdp)
				for d := 0; d < headDim; d++ {
					dv[j*kw+ko+d] += p[j] * dout[qo+d]
					dq[qo+d] += scale * ds * k[j*kw+ko+d]
					dk[j*kw+ko+d] += scale * ds * q[qo+d]
				}
			}
		}
	}
	return dq, dk, dv
}

// RefCrossEntropy returns the sum over the rows of logits [rows, v] of
// -log softmax(logits[i])[targets[i]], leaving out rows with a negative
// target.
func RefCrossEntropy(logits []float64, targets []int32, v int) float64 {
	var loss float64
	for i, y := range targets {
		if y < 0 {
			continue
		}
		z := logits[i*v : (i+1)*v]
		mx := math.Inf(-1)
		for _, x := range z {
			mx = math.Max(mx, x)
		}
		var sum float64
		for _, x := range z {
			sum += math.Exp(x - mx)
		}
		loss += mx + math.Log(sum) - z[y]
	}
	return loss
}

// RefCrossEntropyGrad returns the gradient of scale·RefCrossEntropy with
// respect to the logits, (softmax - onehot)·scale on rows with a target and
// zero on the others, and the unscaled loss.
func RefCrossEntropyGrad(logits []float64, targets []int32, v int, scale float64) (grad []float64, loss float64) {
	grad = make([]float64, len(logits))
	for i, y := range targets {
		if y < 0 {
			continue
		}
		z, g := logits[i*v:(i+1)*v], grad[i*v:(i+1)*v]
		mx := math.Inf(-1)
		for _, x := range z {
			mx = math.Max(mx, x)
		}
		var sum float64
		for j, x := range z {
			g[j] = math.Exp(x - mx)
			sum += g[j]
		}
		for j := range g {
			g[j] = g[j] / sum * scale
		}
		g[y] -= scale
		loss += math.Log(sum) + mx - z[y]
	}
	return grad, loss
}
