// Package tensortest checks that a tensor.Backend computes what the
// contract in package tensor says, so that every backend (the pure-Go CPU
// backend, the CUDA backend) passes one suite.
//
// TestBackend runs every operation on fresh random inputs of several shapes
// (odd sizes, one and many rows, grouped-query attention layouts) in every
// weight type, and compares the results with plain float64 reference
// implementations (RefMatMul, RefAttention, ...), which other tests may use
// too. Outputs are filled with NaN before each operation, so an element the
// backend forgot to write fails the check. It calls the operations through
// tensor.Checked, and checks that malformed calls (bad shapes and dtypes,
// operands that share storage where the contract forbids it) return errors
// before the backend's kernels see them. The suite uses only the Backend
// interface: tensors are made with Alloc and Upload and read back with
// Download.
//
// Its Quant section covers quantized weights: MatMul in every quantized
// weight type (QuantWeightTypes) against the float64 product over the
// dequantized weights, within QuantTolerance (default 1e-3, or twice
// Tolerance where larger; rounding the activations to 16 bits per block,
// as the CPU does, costs at most 1e-4 of the suite's products); Embed of
// quantized tables, exactly against the dequantized rows; and the refusal of a
// quantized operand anywhere else, with an error wrapping
// tensor.ErrQuantized. The weights are random blocks (RandomBlocks), so that
// every bit pattern of a format occurs.
//
// A backend's test calls it with options suited to its arithmetic:
//
//	func TestCPU(t *testing.T) {
//		// Default tolerance 1e-5; each quantized product also matches,
//		// within it, the exact product or the one over the activations
//		// rounded by quant.QuantizeRow.
//		tensortest.TestBackend(t, tensor.NewCPU(0), tensortest.QuantizedActivations())
//	}
//
//	func TestCUDA(t *testing.T) {
//		b := openCUDA(t) // t.Skip, with the reason, when "cuda" does not open
//		tensortest.TestBackend(t, b, tensortest.Tolerance(1e-2),
//			tensortest.QuantTypes(tensor.Q8_0, tensor.Q4_0, tensor.Q4_K, tensor.Q5_K, tensor.Q6_K))
//	}
//
// TestGradOps does the same for the backward operations of a backend that
// implements tensor.GradOps, against float64 references (RefMatMulGradX,
// RefAttentionGrad, ...) that this package's own tests check against finite
// differences of the forward references. It holds every backend to the
// default tolerance, since training compares gradients with an F32
// reference.
//
// FuzzMatMul and FuzzMatMulGrad do the same for random matrix-product
// shapes under go test -fuzz.
package tensortest
