package paging

import (
	"context"
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// TensorSpec describes one stored tensor of a layer.
type TensorSpec struct {
	Name  string       `json:"name"`
	DType tensor.DType `json:"dtype"`
	Shape tensor.Shape `json:"shape"`
	Bytes int64        `json:"bytes"` // stored size: elements x dtype size
}

// Source is what paging needs from a model on disk. Layers are numbered as
// nn numbers them: 0 is the embedding, 1..L the decoder blocks, L+1 the final
// norm and head. The loader's model is adapted to it.
//
// A Source must be safe for concurrent use: layers load in parallel.
type Source interface {
	// NumLayers is the number of layers (L+2 for a Llama model).
	NumLayers() int
	// LayerTensors lists the tensors of a layer.
	LayerTensors(layer int) []TensorSpec
	// ReadTensor reads exactly the stored bytes of the named tensor of the
	// layer into dst (len(dst) == its Bytes), honouring ctx.
	ReadTensor(ctx context.Context, layer int, name string, dst []byte) error
}

// RangeSource is a Source that also reads part of a tensor. The pager's
// staging ring (Options.StagingSlots) uses it to read a large tensor in
// pieces on several goroutines, and to queue each piece's copy as soon as
// it is read: a read from the page cache runs at a few GB/s on one thread,
// a copy over the link several times faster.
type RangeSource interface {
	Source
	// ReadTensorRange reads len(dst) bytes of the named tensor of the
	// layer, from off bytes into its stored bytes, honouring ctx. The
	// pager asks for whole rows (of the tensor's first dimension).
	ReadTensorRange(ctx context.Context, layer int, name string, off int64, dst []byte) error
}

// MappedSource is a Source some of whose tensors' stored bytes lie in
// place in host memory (a read-only mapping of the weight files) that a
// backend can page-lock (tensor.HostRegistrar). The pager's staging ring
// then copies those tensors to the device straight from there: no read
// into a staging buffer, so the CPU moves nothing and the copy engine
// reads the page cache at the pinned rate.
type MappedSource interface {
	Source
	// MappedRegions is the memory to page-lock; MappedTensor's bytes lie
	// in it. It stays valid until the source is closed.
	MappedRegions() [][]byte
	// MappedTensor returns the named tensor's stored bytes in place, as
	// ReadTensor would write them, or ok false when it has none (its
	// bytes are read). The bytes must not be written.
	MappedTensor(layer int, name string) (b []byte, ok bool, err error)
}

func checkSpecs(layer int, specs []TensorSpec) error {
	seen := map[string]bool{}
	for _, s := range specs {
		if s.Name == "" {
			return fmt.Errorf("paging: layer %d: tensor with no name", layer)
		}
		if seen[s.Name] {
			return fmt.Errorf("paging: layer %d: tensor %s listed twice", layer, s.Name)
		}
		seen[s.Name] = true
		n, err := tensorBytes(s.DType, s.Shape)
		if err != nil {
			return fmt.Errorf("paging: layer %d: tensor %s: %v", layer, s.Name, err)
		}
		if n != s.Bytes {
			return fmt.Errorf("paging: layer %d: tensor %s: %v %v is %d bytes, spec says %d", layer, s.Name, s.DType, s.Shape, n, s.Bytes)
		}
	}
	return nil
}

// ExpertSource is a Source whose layers hold experts: groups of tensors of
// which a step uses a few, chosen as it runs (the routed experts of a
// mixture of experts). Planned WithExpertCache, each expert is a unit of
// its own: the Pager keeps the experts out of its layers and loads them
// one by one into an expert cache (AcquireExperts), and the tensors that
// choose a layer's experts stay resident, so that a user can guess the
// experts of a layer before it runs (AcquireResident).
type ExpertSource interface {
	Source
	// LayerExperts names the tensors of each expert of the layer, indexed
	// by expert, among LayerTensors(layer); nil for a layer without
	// experts.
	LayerExperts(layer int) [][]string
	// LayerRouting names the tensors of the layer that choose its experts
	// (its router), among LayerTensors(layer).
	LayerRouting(layer int) []string
}

// checkExperts checks a layer's experts and routing tensors against its
// specs: every name is one of its tensors, no tensor belongs to two
// experts or to an expert and the routing, and no expert is empty.
func checkExperts(layer int, specs []TensorSpec, experts [][]string, routing []string) error {
	have := map[string]bool{}
	for _, s := range specs {
		have[s.Name] = true
	}
	owner := map[string]string{}
	claim := func(name, who string) error {
		if !have[name] {
			return fmt.Errorf("paging: layer %d: %s names tensor %s, which the layer does not have", layer, who, name)
		}
		if prev, ok := owner[name]; ok {
			return fmt.Errorf("paging: layer %d: tensor %s is listed by %s and by %s", layer, name, prev, who)
		}
		owner[name] = who
		return nil
	}
	for e, names := range experts {
		who := fmt.Sprintf("expert %d", e)
		if len(names) == 0 {
			return fmt.Errorf("paging: layer %d: %s has no tensors", layer, who)
		}
		for _, n := range names {
			if err := claim(n, who); err != nil {
				return err
			}
		}
	}
	for _, n := range routing {
		if err := claim(n, "the routing"); err != nil {
			return err
		}
	}
	return nil
}
