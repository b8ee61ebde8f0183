package nn

import (
	"math"
	"slices"

	"github.com/strata-llm/strata/arch"
)

// refModel is an independent, slow float64 Llama forward pass used to check
// the backend path on shapes the Hugging Face fixtures do not cover. It
// recomputes the whole sequence without a cache.
type refModel struct {
	cfg *arch.Config
	w   map[string][]float64 // every weight, row-major, converted from storage
}

// forward returns the logits [len(ids)][vocab] and the hidden states after
// the embedding, each block and the final norm.
func (r *refModel) forward(ids []int32) (logits [][]float64, hidden [][][]float64) {
	c := r.cfg
	H, T := c.HiddenSize, len(ids)
	x := make([][]float64, T)
	for t, id := range ids {
		x[t] = append([]float64(nil), r.w[arch.EmbedName][int(id)*H:(int(id)+1)*H]...)
	}
	snap := func(m [][]float64) [][]float64 {
		out := make([][]float64, len(m))
		for i := range m {
			out[i] = append([]float64(nil), m[i]...)
		}
		return out
	}
	hidden = append(hidden, snap(x))
	for l := 0; l < c.NumLayers; l++ {
		n := c.LayerNames(c.BlockLayer(l))
		h := r.norm(x, r.w[n[arch.AttnNorm]])
		q := r.linear(h, n[arch.Q], n[arch.QBias], c.QDim())
		k := r.linear(h, n[arch.K], n[arch.KBias], c.KVDim())
		v := r.linear(h, n[arch.V], n[arch.VBias], c.KVDim())
		if c.QKNorm {
			r.headNorm(q, r.w[n[arch.QNorm]])
			r.headNorm(k, r.w[n[arch.KNorm]])
		}
		r.rope(q, c.NumHeads)
		r.rope(k, c.NumKVHeads)
		attn := make([][]float64, T)
		group := c.NumHeads / c.NumKVHeads
		for t := 0; t < T; t++ {
			attn[t] = make([]float64, c.QDim())
			for hd := 0; hd < c.NumHeads; hd++ {
				kvh := hd / group
				qh := q[t][hd*c.HeadDim : (hd+1)*c.HeadDim]
				scores := make([]float64, t+1)
				maxS := math.Inf(-1)
				for s := 0; s <= t; s++ {
					kh := k[s][kvh*c.HeadDim : (kvh+1)*c.HeadDim]
					dot := 0.0
					for d := range qh {
						dot += qh[d] * kh[d]
					}
					scores[s] = dot / math.Sqrt(float64(c.HeadDim))
					maxS = math.Max(maxS, scores[s])
				}
				sum := 0.0
				for s := range scores {
					scores[s] = math.Exp(scores[s] - maxS)
					sum += scores[s]
				}
				for s := range scores {
					vh := v[s][kvh*c.HeadDim : (kvh+1)*c.HeadDim]
					for d := range vh {
						attn[t][hd*c.HeadDim+d] += scores[s] / sum * vh[d]
					}
				}
			}
		}
		o := r.linear(attn, n[arch.O], n[arch.OBias], H)
		for t := range x {
			for i := range x[t] {
				x[t][i] += o[t][i]
			}
		}
		h = r.norm(x, r.w[n[arch.MLPNorm]])
		var d [][]float64
		if c.Sparse(l) {
			d = r.moe(h, c.BlockLayer(l))
		} else {
			d = r.mlp(h, n[arch.Gate], n[arch.Up], n[arch.Down], c.IntermediateSize)
		}
		for t := range x {
			for i := range x[t] {
				x[t][i] += d[t][i]
			}
		}
		hidden = append(hidden, snap(x))
	}
	h := r.norm(x, r.w[arch.NormName])
	hidden = append(hidden, snap(h))
	head := arch.LMHeadName
	if c.TieEmbeddings {
		head = arch.EmbedName
	}
	return r.linear(h, head, "", c.VocabSize), hidden
}

// mlp is the SwiGLU MLP down(silu(gate·x) * up·x) of width size.
func (r *refModel) mlp(x [][]float64, gate, up, down string, size int) [][]float64 {
	g := r.linear(x, gate, "", size)
	u := r.linear(x, up, "", size)
	for t := range g {
		for i := range g[t] {
			g[t][i] = g[t][i] / (1 + math.Exp(-g[t][i])) * u[t][i]
		}
	}
	return r.linear(g, down, "", r.cfg.HiddenSize)
}

// moe is the mixture of experts of a sparse block's layer, token by token:
// the softmax of the router's scores over all the experts, the k largest
// (renormalised when NormTopK) weighting their experts' outputs, plus the
// shared expert's output weighted by the sigmoid of its gate.
func (r *refModel) moe(x [][]float64, layer int) [][]float64 {
	c, m := r.cfg, r.cfg.MoE
	n, experts := c.LayerNames(layer), c.LayerExperts(layer)
	scores := r.linear(x, n[arch.Router], "", m.Experts)
	out := make([][]float64, len(x))
	for t := range x {
		out[t] = make([]float64, c.HiddenSize)
		mx := slices.Max(scores[t])
		p := make([]float64, m.Experts)
		sum := 0.0
		for e, s := range scores[t] {
			p[e] = math.Exp(s - mx)
			sum += p[e]
		}
		order := make([]int, m.Experts)
		for e := range order {
			order[e] = e
			p[e] /= sum
		}
		slices.SortStableFunc(order, func(a, b int) int { return -cmpFloat(p[a], p[b]) })
		chosen := order[:m.ExpertsPerToken]
		norm := 1.0
		if m.NormTopK {
			norm = 0
			for _, e := range chosen {
				norm += p[e]
			}
		}
		row := [][]float64{x[t]}
		for _, e := range chosen {
			y := r.mlp(row, experts[e][arch.ExpertGate], experts[e][arch.ExpertUp], experts[e][arch.ExpertDown], m.ExpertSize)[0]
			for i := range y {
				out[t][i] += p[e] / norm * y[i]
			}
		}
		if m.SharedExperts > 0 {
			y := r.mlp(row, n[arch.SharedGate], n[arch.SharedUp], n[arch.SharedDown], m.SharedSize)[0]
			g := r.linear(row, n[arch.SharedScale], "", 1)[0][0]
			for i := range y {
				out[t][i] += y[i] / (1 + math.Exp(-g))
			}
		}
	}
	return out
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// headNorm applies the RMS norm with weight w to each head of each row of
// x, heads of w's length.
func (r *refModel) headNorm(x [][]float64, w []float64) {
	d := len(w)
	for t := range x {
		for h := 0; h+d <= len(x[t]); h += d {
			copy(x[t][h:h+d], r.norm([][]float64{x[t][h : h+d]}, w)[0])
		}
	}
}

func (r *refModel) norm(x [][]float64, w []float64) [][]float64 {
	out := make([][]float64, len(x))
	for t, row := range x {
		ss := 0.0
		for _, v := range row {
			ss += v * v
		}
		inv := 1 / math.Sqrt(ss/float64(len(row))+float64(r.cfg.NormEps()))
		out[t] = make([]float64, len(row))
		for i, v := range row {
			out[t][i] = v * inv * w[i]
		}
	}
	return out
}

func (r *refModel) linear(x [][]float64, name, bias string, n int) [][]float64 {
	w, b := r.w[name], r.w[bias]
	out := make([][]float64, len(x))
	for t, row := range x {
		out[t] = make([]float64, n)
		for j := 0; j < n; j++ {
			s := 0.0
			if b != nil {
				s = b[j]
			}
			wr := w[j*len(row) : (j+1)*len(row)]
			for i, v := range row {
				s += v * wr[i]
			}
			out[t][j] = s
		}
	}
	return out
}

// rope applies the rotary embedding in float64 from the configuration's
// inverse frequencies, independently of the float32 tables.
func (r *refModel) rope(x [][]float64, heads int) {
	c := r.cfg
	half := c.HeadDim / 2
	inv := make([]float64, half)
	for i := range inv {
		inv[i] = math.Pow(c.RopeTheta, -float64(2*i)/float64(c.HeadDim))
		if s := c.RopeScaling; s != nil {
			// llama3: long wavelengths slowed by Factor, short ones kept,
			// a linear blend in between.
			wavelen := 2 * math.Pi / inv[i]
			ratio := float64(s.OriginalMaxPositions) / wavelen
			switch {
			case ratio < s.LowFreqFactor:
				inv[i] /= s.Factor
			case ratio <= s.HighFreqFactor:
				smooth := (ratio - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
				inv[i] = (1-smooth)*inv[i]/s.Factor + smooth*inv[i]
			}
		}
	}
	for t := range x {
		for h := 0; h < heads; h++ {
			v := x[t][h*c.HeadDim : (h+1)*c.HeadDim]
			for i := 0; i < half; i++ {
				a := float64(t) * inv[i]
				cos, sin := math.Cos(a), math.Sin(a)
				x0, x1 := v[i], v[i+half]
				v[i] = x0*cos - x1*sin
				v[i+half] = x1*cos + x0*sin
			}
		}
	}
}
