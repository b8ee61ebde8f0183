package tensor_test

import (
	"fmt"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// TestCPUBackendKernels runs the shared backend suite on every kernel table
// this machine runs: the assembly ones and the portable Go fallback.
func TestCPUBackendKernels(t *testing.T) {
	for _, name := range tensor.KernelNames() {
		for _, threads := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/threads=%d", name, threads), func(t *testing.T) {
				c := tensor.NewCPUKernels(threads, name)
				defer c.Close()
				if c.Kernels() != name {
					t.Fatalf("backend runs %q kernels, want %q", c.Kernels(), name)
				}
				tensortest.TestBackend(t, c)
			})
		}
	}
}

// FuzzCPUMatMulGo fuzzes MatMul on the portable Go kernels (FuzzCPUMatMul
// covers the fastest table of the machine).
func FuzzCPUMatMulGo(f *testing.F) { fuzzKernels(f, "go") }

// FuzzCPUMatMulAVX2 fuzzes MatMul on the AVX2 kernels, where the machine
// has them (on an AVX-512 machine FuzzCPUMatMul runs the AVX-512 ones).
func FuzzCPUMatMulAVX2(f *testing.F) { fuzzKernels(f, "avx2") }

func fuzzKernels(f *testing.F, name string) {
	c := tensor.NewCPUKernels(2, name)
	f.Cleanup(c.Close)
	if c.Kernels() != name {
		f.Skipf("this machine has no %s kernels", name)
	}
	tensortest.FuzzMatMul(f, c)
}
