//go:build !cuda

package cuda

import (
	"errors"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

func TestStubSaysWhy(t *testing.T) {
	b, err := Open(0)
	if b != nil || !errors.Is(err, ErrNotCompiled) {
		t.Fatalf("Open = %v, %v; want ErrNotCompiled", b, err)
	}
	const want = "strata was built without CUDA support; rebuild with -tags cuda"
	if err.Error() != want {
		t.Errorf("message %q, want %q", err, want)
	}
	if Available() {
		t.Error("Available() in a build without CUDA")
	}
	if _, err := DeviceCount(); !errors.Is(err, ErrNotCompiled) {
		t.Errorf("DeviceCount: %v", err)
	}
	var s *Backend
	if _, err := s.Alloc(tensor.F32, tensor.Shape{1}); !errors.Is(err, ErrNotCompiled) {
		t.Errorf("Alloc: %v", err)
	}
	if err := s.MatMul(nil, nil, nil, nil); !errors.Is(err, ErrNotCompiled) {
		t.Errorf("MatMul: %v", err)
	}
	if _, err := s.CrossEntropyGrad(nil, nil, 1); !errors.Is(err, ErrNotCompiled) {
		t.Errorf("CrossEntropyGrad: %v", err)
	}
}
