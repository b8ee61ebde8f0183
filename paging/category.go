package paging

import (
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// Category says what a budgeted byte holds.
type Category int

// The categories every device byte is charged to.
const (
	ResidentWeights Category = iota // weights that stay on the device
	StreamedWeights                 // the ring that streamed weights pass through
	KVCache                         // keys and values of past positions
	Activations                     // per-step buffers of the forward pass
	Workspace                       // scratch for kernels and libraries
	Gradients                       // training: one layer's gradients on their way to the host
	Cached                          // freed blocks the backend's allocator keeps for reuse
	numCategories
)

var categoryNames = [...]string{"resident weights", "streamed weights", "kv cache", "activations", "workspace", "gradients", "cached"}

func (c Category) String() string {
	if c >= 0 && c < numCategories {
		return categoryNames[c]
	}
	return fmt.Sprintf("Category(%d)", int(c))
}

// ParseCategory returns the category whose String is name.
func ParseCategory(name string) (Category, error) {
	if c, ok := categoryNamed(name); ok {
		return c, nil
	}
	return 0, fmt.Errorf("paging: unknown category %q", name)
}

func categoryNamed(name string) (Category, bool) {
	for c, n := range categoryNames {
		if n == name {
			return Category(c), true
		}
	}
	return 0, false
}

// Allocator hands out backend memory charged to a category. nn takes its KV
// cache and activation buffers from one; paging's budgeted allocator is the
// implementation that enforces a byte budget.
type Allocator interface {
	Alloc(cat Category, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error)
	Free(t *tensor.Tensor)
}

// Unbudgeted returns an Allocator that passes every request to b and keeps
// no accounts.
func Unbudgeted(b tensor.Memory) Allocator { return unbudgeted{b} }

type unbudgeted struct{ b tensor.Memory }

func (u unbudgeted) Alloc(_ Category, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	return u.b.Alloc(dt, shape)
}
func (u unbudgeted) Free(t *tensor.Tensor) { u.b.Free(t) }
