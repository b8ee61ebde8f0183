package tensor

// Hooks for the external tests: a backend on a chosen kernel table, so that
// the shared suite runs on the assembly kernels and on the Go fallback.

// NewCPUKernels returns NewCPU(threads) running the kernel table called
// name ("go", "avx2", "avx512"; see kernelsNamed).
func NewCPUKernels(threads int, name string) *CPU {
	c := NewCPU(threads)
	c.k = kernelsNamed(name)
	return c
}

// KernelNames lists the kernel tables this machine runs, fastest first.
func KernelNames() []string {
	var names []string
	for _, k := range allKernels() {
		names = append(names, k.name)
	}
	return names
}

// QuantGemmRows is the number of rows of x from which the CPU's MatMul
// multiplies quantized weights of dt on the gemm, dequantized, rather than
// in integers.
func QuantGemmRows(dt DType) int { return quantGemmRows(dt) }

// ParallelJobs counts the jobs c's pool has handed to its threads.
func ParallelJobs(c *CPU) int64 { return c.pool.parallel.Load() }
