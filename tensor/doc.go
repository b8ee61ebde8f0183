// Package tensor holds strata's tensor type, element types and the Backend
// contract that the decoder runs on, with the pure-Go CPU backend.
//
// A Tensor is a dense row-major array of one DType (F32, F16, BF16, I32,
// I64) in host memory or in memory a backend owns. A Backend allocates
// tensors, copies bytes in and out, and runs the handful of operations a
// Llama-family decoder needs (MatMul, RMSNorm, Rope, SiLUMul, Add, Embed,
// CopyRows, Attention). Activations are F32; weights are read in their
// stored type, never copied to F32.
//
// The CPU backend (NewCPU, registered as "cpu") works everywhere. It spreads
// each operation over a persistent pool of goroutines; decoding one token
// is bound by the bytes of weights read per second. Package tensor/gorgonia
// exchanges F32 data with gorgonia.org/tensor without copying.
//
// Example:
//
//	cpu := tensor.NewCPU(0) // all cores
//	defer cpu.Close()
//	x, _ := tensor.FromF32(tensor.Shape{1, 4096}, hidden)
//	out, _ := cpu.Alloc(tensor.F32, tensor.Shape{1, 4096})
//	if err := cpu.MatMul(out, x, qProj, nil); err != nil { // qProj: F16 [4096, 4096]
//		return err
//	}
//
// Package tensortest checks any Backend against float64 references.
package tensor
