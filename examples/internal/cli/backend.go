package cli

import (
	"github.com/strata-llm/strata/cuda"
	"github.com/strata-llm/strata/tensor"
)

// OpenBackend opens the backend a -device flag names: "cpu" (threads
// workers, 0 for all cores), "cuda" (device 0; an error when the build lacks
// the cuda tag or there is no device) or "auto" (cuda when it opens, else
// cpu). Anything else is a usage error.
func OpenBackend(device string, threads int) (tensor.Backend, error) {
	switch device {
	case "cpu":
		return tensor.NewCPU(threads), nil
	case "cuda":
		return cuda.Open(0)
	case "auto":
		if cuda.Available() {
			if b, err := cuda.Open(0); err == nil {
				return b, nil
			}
		}
		return tensor.NewCPU(threads), nil
	}
	return nil, Usagef("-device %q: want cpu, cuda or auto", device)
}

// CloseBackend closes a backend from OpenBackend.
func CloseBackend(b tensor.Backend) { b.Close() }
