package cuda

// The norm kernels' launch, in a file of its own (no build tag) so that
// it is tested without a GPU.

// normVec is NORM_VEC of kernels/norm.cuh: the float4 of a row each
// thread of the norm kernels holds (TestKernelConstants).
const normVec = 2

// normThreads is the block of the norm kernels for rows of n: enough
// threads that each holds at most normVec float4 of the row (a whole
// warp at least, 1024 at most), so that a row is one round of loads.
func normThreads(n int) uint32 {
	t := (n + 4*normVec - 1) / (4 * normVec)
	return uint32(min(max((t+31)&^31, 32), 1024))
}
