package nn

import (
	"fmt"
	"math"
	"slices"
	"sync/atomic"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

// Grads are gradients by parameter name ("model.layers.0.mlp.up_proj.weight"):
// host F32 tensors shaped like their parameters. With tied embeddings one
// tensor, model.embed_tokens.weight, holds the sum of the embedding's and
// the LM head's uses. A Trainer adds into them; Zero clears them between
// steps.
type Grads map[string]*tensor.Tensor

// Names returns the parameter names, sorted.
func (g Grads) Names() []string {
	names := make([]string, 0, len(g))
	for n := range g {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Zero sets every gradient to zero, keeping the buffers.
func (g Grads) Zero() {
	for _, t := range g {
		v := t.F32()
		chunks(len(v), func(lo, hi int) { clear(v[lo:hi]) })
	}
}

// Scale multiplies every gradient by f.
func (g Grads) Scale(f float32) {
	for _, t := range g {
		v := t.F32()
		chunks(len(v), func(lo, hi int) {
			for i := lo; i < hi; i++ {
				v[i] *= f
			}
		})
	}
}

// AllFinite reports whether no gradient holds an infinity or a NaN.
func (g Grads) AllFinite() bool {
	var bad atomic.Bool
	for _, t := range g {
		v := t.F32()
		chunks(len(v), func(lo, hi int) {
			for _, x := range v[lo:hi] {
				if math.IsInf(float64(x), 0) || x != x {
					bad.Store(true)
					return
				}
			}
		})
		if bad.Load() {
			return false
		}
	}
	return true
}

// Norm is the Euclidean norm of all the gradients together. The sum runs
// in a fixed order (by name, then in fixed-size chunks), so the result does
// not depend on the number of cores.
func (g Grads) Norm() float64 {
	var ss float64
	for _, name := range g.Names() {
		v := g[name].F32()
		parts := make([]float64, (len(v)+chunkSize-1)/chunkSize)
		chunks(len(v), func(lo, hi int) {
			var s float64
			for _, x := range v[lo:hi] {
				s += float64(x) * float64(x)
			}
			parts[lo/chunkSize] = s
		})
		for _, s := range parts {
			ss += s
		}
	}
	return math.Sqrt(ss)
}

// ClipNorm scales the gradients down so that their norm is at most maxNorm,
// and returns the norm before clipping. A maxNorm <= 0 clips nothing.
func (g Grads) ClipNorm(maxNorm float64) float64 {
	n := g.Norm()
	if maxNorm > 0 && n > maxNorm {
		g.Scale(float32(maxNorm / n))
	}
	return n
}

// WriteSafetensors writes loss (F32 [1]) and grad.<name> (F32) for every
// gradient to one safetensors file: the layout of the fixtures'
// grads.safetensors.
func (g Grads) WriteSafetensors(path string, loss float64) error {
	lt, err := tensor.FromF32(tensor.Shape{1}, []float32{float32(loss)})
	if err != nil {
		return err
	}
	out := []loader.NamedTensor{{Name: "loss", T: lt}}
	for _, n := range g.Names() {
		out = append(out, loader.NamedTensor{Name: "grad." + n, T: g[n]})
	}
	if err := loader.WriteSafetensors(path, out, map[string]string{"format": "pt"}); err != nil {
		return fmt.Errorf("nn: write gradients: %w", err)
	}
	return nil
}

// buffer returns the gradient of name, allocating a zeroed one of the shape
// when there is none.
func (g Grads) buffer(name string, shape tensor.Shape) (*tensor.Tensor, error) {
	if t, ok := g[name]; ok {
		if !slices.Equal(t.Shape(), shape) || t.DType() != tensor.F32 || !t.OnHost() {
			return nil, fmt.Errorf("nn: gradient %s is %v %v, the parameter is %v", name, t.DType(), t.Shape(), shape)
		}
		return t, nil
	}
	t := tensor.New(tensor.F32, shape)
	g[name] = t
	return t, nil
}
