//go:build cuda

package cuda

import "github.com/strata-llm/strata/tensor"

// The "cuda" device driver, registered for tensor.OpenDevice ("cuda",
// "cuda:1", "auto") when the package is linked in, with the cuda build tag.
func init() { tensor.RegisterDriver("cuda", driver{}) }

type driver struct{}

// Count returns the number of CUDA devices (DeviceCount).
func (driver) Count() (int, error) { return DeviceCount() }

// Open opens device ordinal (Open); the options are the CPU's.
func (driver) Open(ordinal int, _ tensor.DeviceOptions) (tensor.Backend, error) {
	b, err := Open(ordinal)
	if err != nil {
		return nil, err // not a nil *Backend in a non-nil interface
	}
	return b, nil
}
