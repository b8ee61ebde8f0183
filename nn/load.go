package nn

import (
	"context"
	"fmt"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/tensor"
)

// HostWeights holds every layer of a model on a backend for the model's
// lifetime: the simplest Weights, for models that fit.
type HostWeights struct {
	backend tensor.Memory
	layers  []LayerWeights
}

// Progress is told how many weight bytes are loaded so far, of total.
type Progress func(done, total int64)

// LoadWeights reads every tensor of m onto b in its stored dtype.
func LoadWeights(ctx context.Context, m *loader.Model, b tensor.Memory, progress Progress) (*HostWeights, error) {
	hw := &HostWeights{backend: b}
	total, done := m.WeightBytes(), int64(0)
	loaded := map[string]*tensor.Tensor{} // tied embeddings appear in two layers
	for _, l := range m.Layers() {
		lw := LayerWeights{}
		for _, ti := range l.Tensors {
			if t, ok := loaded[ti.Name]; ok {
				lw[ti.Name] = t
				continue
			}
			host, err := m.ReadTensor(ctx, ti.Name)
			if err != nil {
				hw.Close()
				return nil, err
			}
			t, err := b.Alloc(ti.DType, ti.Shape)
			if err == nil {
				err = b.Upload(t, 0, host.Bytes())
			}
			if err != nil {
				b.Free(t)
				hw.Close()
				return nil, fmt.Errorf("nn: load %s: %w", ti.Name, err)
			}
			lw[ti.Name], loaded[ti.Name] = t, t
			done += ti.Size
			if progress != nil {
				progress(done, total)
			}
		}
		hw.layers = append(hw.layers, lw)
	}
	return hw, nil
}

// Acquire returns the layer's tensors.
func (hw *HostWeights) Acquire(ctx context.Context, layer int) (LayerWeights, error) {
	if layer < 0 || layer >= len(hw.layers) {
		return nil, fmt.Errorf("nn: no layer %d (model has %d)", layer, len(hw.layers))
	}
	return hw.layers[layer], ctx.Err()
}

// Release does nothing: the weights stay loaded.
func (hw *HostWeights) Release(int) {}

// Resident reports that every layer stays loaded (ResidentWeights).
func (hw *HostWeights) Resident(layer int) bool { return layer >= 0 && layer < len(hw.layers) }

// Close frees the weights. It is safe to call more than once.
func (hw *HostWeights) Close() {
	freed := map[*tensor.Tensor]bool{}
	for _, lw := range hw.layers {
		for _, t := range lw {
			if !freed[t] {
				freed[t] = true
				hw.backend.Free(t)
			}
		}
	}
	hw.layers = nil
}
