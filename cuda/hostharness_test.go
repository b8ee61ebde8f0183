package cuda

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// hostHarness builds testdata/src, a harness that runs kernel bodies on
// the CPU, with nvcc for the host (as C++ for a .cpp file), and returns
// its path and a context of ten minutes for building and running it. It
// skips the test where nvcc is not installed, and with -short.
func hostHarness(t *testing.T, src string) (context.Context, string) {
	t.Helper()
	nvcc, err := exec.LookPath("nvcc")
	if err != nil {
		t.Skipf("nvcc not found (make cuda-deps CUDA_DEPS_PKGS=\"nvidia-cuda-dev nvidia-cuda-toolkit\"): %v", err)
	}
	if testing.Short() {
		t.Skip("builds the kernels' host harness with nvcc")
	}
	bin := filepath.Join(t.TempDir(), strings.TrimSuffix(src, filepath.Ext(src)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)
	args := []string{"-O2", "-std=c++17", "-Xcompiler", "-pthread", "-o", bin, filepath.Join("testdata", src)}
	if filepath.Ext(src) == ".cpp" {
		args = append([]string{"-x", "c++"}, args...)
	}
	if out, err := exec.CommandContext(ctx, nvcc, args...).CombinedOutput(); err != nil {
		t.Fatalf("nvcc: %v\n%s", err, out)
	}
	return ctx, bin
}
