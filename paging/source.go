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
