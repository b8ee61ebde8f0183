package cli

import (
	"github.com/strata-llm/strata/tensor"
)

// CheckDevice returns a usage error when a -device value is not a device
// name: "auto", or a driver's name with an optional ordinal ("cpu",
// "cuda", "cuda:1"). Whether the driver exists is OpenBackend's to say.
func CheckDevice(device string) error {
	if _, _, err := tensor.ParseDevice(device); err != nil {
		return Usagef("-device: %v", err)
	}
	return nil
}

// OpenBackend opens the device a -device flag names through tensor's
// registry: "cpu" (threads workers, 0 for all cores), a driver's device
// ("cuda", "cuda:1"; the cuda driver is there when the build has the cuda
// tag and the command links it in), or "auto" (device 0 of the first GPU
// driver that opens one, else the CPU). A malformed name is a usage error;
// a driver that is not registered, or a device that does not open, is an
// error saying why.
func OpenBackend(device string, threads int) (tensor.Backend, error) {
	if err := CheckDevice(device); err != nil {
		return nil, err
	}
	return tensor.OpenDevice(device, tensor.DeviceOptions{Threads: threads})
}

// CloseBackend closes a backend from OpenBackend.
func CloseBackend(b tensor.Backend) { b.Close() }
