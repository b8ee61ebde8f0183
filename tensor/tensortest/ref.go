package tensortest

import "math"

// The reference implementations below are deliberately plain: float64
// throughout, one loop per formula, no blocking. Matrices are row-major
// slices; shapes are passed explicitly.

// RefMatMul returns out[M,N] = x[M,K] · w[N,K]ᵀ, plus bias[N] on every row
// when bias is non-nil.
func RefMatMul(x, w, bias []float64, m, n, k int) []float64 {
	out := make([]float64, m*n)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s float64
			for p := 0; p < k; p++ {
				s += x[i*k+p] * w[j*k+p]
			}
			if bias != nil {
				s += bias[j]
			}
			out[i*n+j] = s
		}
	}
	return out
}

// RefRMSNorm returns out[i,:] = x[i,:] / sqrt(mean(x[i,:]²) + eps) * w for
// the m rows of d elements of x.
func RefRMSNorm(x, w []float64, m, d int, eps float64) []float64 {
	out := make([]float64, m*d)
	for i := 0; i < m; i++ {
		var ss float64
		for j := 0; j < d; j++ {
			ss += x[i*d+j] * x[i*d+j]
		}
		r := 1 / math.Sqrt(ss/float64(d)+eps)
		for j := 0; j < d; j++ {
			out[i*d+j] = x[i*d+j] * r * w[j]
		}
	}
	return out
}

// RefRope returns x[T, heads*headDim] with every head's pairs (j,
// j+headDim/2) of row t rotated by the angle whose cosine and sine are
// cos[pos0+t, j] and sin[pos0+t, j] (tables of headDim/2 columns).
func RefRope(x, cos, sin []float64, t, heads, headDim, pos0 int) []float64 {
	out := append([]float64(nil), x...)
	half := headDim / 2
	for r := 0; r < t; r++ {
		p := pos0 + r
		for h := 0; h < heads; h++ {
			base := r*heads*headDim + h*headDim
			for j := 0; j < half; j++ {
				a, b := x[base+j], x[base+j+half]
				c, s := cos[p*half+j], sin[p*half+j]
				out[base+j] = a*c - b*s
				out[base+j+half] = b*c + a*s
			}
		}
	}
	return out
}

// RopeTables returns the cos and sin tables [maxPos, headDim/2] for base
// frequency theta: the angle of position p and pair j is p·theta^(-2j/headDim).
func RopeTables(maxPos, headDim int, theta float64) (cos, sin []float64) {
	half := headDim / 2
	cos, sin = make([]float64, maxPos*half), make([]float64, maxPos*half)
	for p := 0; p < maxPos; p++ {
		for j := 0; j < half; j++ {
			a := float64(p) * math.Pow(theta, -2*float64(j)/float64(headDim))
			cos[p*half+j], sin[p*half+j] = math.Cos(a), math.Sin(a)
		}
	}
	return cos, sin
}

// RefSiLUMul returns silu(gate) * up elementwise, silu(g) = g / (1 + e^-g).
func RefSiLUMul(gate, up []float64) []float64 {
	out := make([]float64, len(gate))
	for i, g := range gate {
		out[i] = g / (1 + math.Exp(-g)) * up[i]
	}
	return out
}

// RefAdd returns a + b elementwise.
func RefAdd(a, b []float64) []float64 {
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] + b[i]
	}
	return out
}

// RefEmbed returns the rows ids of table (rows of d elements), one after
// another.
func RefEmbed(table []float64, d int, ids []int32) []float64 {
	out := make([]float64, 0, len(ids)*d)
	for _, id := range ids {
		out = append(out, table[int(id)*d:int(id+1)*d]...)
	}
	return out
}

// RefAttention returns causal grouped-query attention for the t rows of
// q [t, heads*headDim] at positions pos0..pos0+t-1, against the caches k and
// v [maxPos, kvHeads*headDim]: row r, head h attends to positions
// 0..pos0+r of KV head h/(heads/kvHeads) with softmax(scale · q·k).
func RefAttention(q, k, v []float64, t, heads, kvHeads, headDim, pos0 int, scale float64) []float64 {
	out := make([]float64, t*heads*headDim)
	group := heads / kvHeads
	qw, kw := heads*headDim, kvHeads*headDim
	for r := 0; r < t; r++ {
		n := pos0 + r + 1
		for h := 0; h < heads; h++ {
			kh := h / group
			scores := make([]float64, n)
			mx := math.Inf(-1)
			for j := 0; j < n; j++ {
				var s float64
				for d := 0; d < headDim; d++ {
					s += q[r*qw+h*headDim+d] * k[j*kw+kh*headDim+d]
				}
				scores[j] = s * scale
				mx = math.Max(mx, scores[j])
			}
			var sum float64
			for j := range scores {
				scores[j] = math.Exp(scores[j] - mx)
				sum += scores[j]
			}
			for d := 0; d < headDim; d++ {
				var o float64
				for j := 0; j < n; j++ {
					o += scores[j] / sum * v[j*kw+kh*headDim+d]
				}
				out[r*qw+h*headDim+d] = o
			}
		}
	}
	return out
}

// RelErr returns ||got - want|| / ||want|| (Euclidean norms), or +Inf when
// got holds a NaN or an infinity or the lengths differ. When want is all
// zeros it returns ||got||.
func RelErr(got []float32, want []float64) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	var num, den float64
	for i, g := range got {
		x := float64(g)
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return math.Inf(1)
		}
		num += (x - want[i]) * (x - want[i])
		den += want[i] * want[i]
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}

// abs returns |v| elementwise.
func abs(v []float64) []float64 {
	if v == nil {
		return nil
	}
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = math.Abs(x)
	}
	return out
}
