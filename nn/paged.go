package nn

import (
	"context"
	"fmt"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Source adapts an opened model directory to paging.Source, in the layer
// numbering Weights uses. It is a paging.ExpertSource: the routed experts
// of a mixture of experts and their routers are named, for plans that page
// experts one by one.
func Source(m *loader.Model) paging.Source { return modelSource{m} }

var (
	_ paging.ExpertSource = modelSource{}
	_ paging.RangeSource  = modelSource{}
	_ paging.MappedSource = modelSource{}
)

type modelSource struct{ m *loader.Model }

func (s modelSource) NumLayers() int { return len(s.m.Layers()) }

func (s modelSource) LayerTensors(layer int) []paging.TensorSpec {
	ls := s.m.Layers()
	if layer < 0 || layer >= len(ls) {
		return nil
	}
	specs := make([]paging.TensorSpec, 0, len(ls[layer].Tensors))
	for _, t := range ls[layer].Tensors {
		specs = append(specs, paging.TensorSpec{Name: t.Name, DType: t.DType, Shape: t.Shape, Bytes: t.Size})
	}
	return specs
}

// LayerExperts names the tensors of each routed expert of a sparse block
// (arch.Config.LayerExperts): gate, up and down projections.
func (s modelSource) LayerExperts(layer int) [][]string {
	xs := s.m.Config.LayerExperts(layer)
	if xs == nil {
		return nil
	}
	out := make([][]string, len(xs))
	for e, n := range xs {
		out[e] = []string{n[arch.ExpertGate], n[arch.ExpertUp], n[arch.ExpertDown]}
	}
	return out
}

// LayerRouting names a sparse block's router.
func (s modelSource) LayerRouting(layer int) []string {
	if s.m.Config.LayerExperts(layer) == nil {
		return nil
	}
	return []string{s.m.Config.LayerNames(layer)[arch.Router]}
}

func (s modelSource) ReadTensor(ctx context.Context, layer int, name string, dst []byte) error {
	t, ok := s.m.Tensor(name)
	if !ok {
		return fmt.Errorf("nn: layer %d has no tensor %s", layer, name)
	}
	return s.m.ReadInto(ctx, t, dst)
}

// ReadTensorRange reads part of a tensor (the pager's staging ring reads
// large tensors in pieces on several goroutines). A range's values are
// checked as ReadTensor's are, once (loader.Model.ReadRange).
func (s modelSource) ReadTensorRange(ctx context.Context, layer int, name string, off int64, dst []byte) error {
	t, ok := s.m.Tensor(name)
	if !ok {
		return fmt.Errorf("nn: layer %d has no tensor %s", layer, name)
	}
	return s.m.ReadRange(ctx, t, off, dst)
}

// MappedRegions are the mappings of the weight files (none when they are
// read with pread), which the pager's staging ring page-locks to copy
// tensors to the device in place.
func (s modelSource) MappedRegions() [][]byte { return s.m.MappedRegions() }

// MappedTensor gives a tensor's stored bytes in place in its file's
// mapping (loader.Model.Mapped).
func (s modelSource) MappedTensor(layer int, name string) ([]byte, bool, error) {
	t, ok := s.m.Tensor(name)
	if !ok {
		return nil, false, fmt.Errorf("nn: layer %d has no tensor %s", layer, name)
	}
	return s.m.Mapped(t)
}

// ModelInfo describes the model to the planner: its layers, and the
// memory a Session allocates beside them (Reserve). For training, replace
// the reserve with TrainReserve.
func ModelInfo(m *loader.Model, cfg *arch.Config) (paging.ModelInfo, error) {
	return ModelInfoKV(m, cfg, tensor.F32)
}

// ModelInfoKV is ModelInfo for sessions that store their KV cache in kv
// (SessionOptions.KVDType).
func ModelInfoKV(m *loader.Model, cfg *arch.Config, kv tensor.DType) (paging.ModelInfo, error) {
	if err := CheckKVDType(cfg, kv); err != nil {
		return paging.ModelInfo{}, err
	}
	layers, err := paging.DescribeSource(Source(m))
	if err != nil {
		return paging.ModelInfo{}, err
	}
	return paging.ModelInfo{Layers: layers, NumLayers: cfg.NumLayers, Reserve: ReserveKV(cfg, kv)}, nil
}
