// Package gorgonia exchanges host tensors with gorgonia.org/tensor: ToDense
// wraps an F32 tensor as a *tensor.Dense without copying (F16 and BF16 are
// converted), and FromDense wraps a contiguous float32 Dense as an F32
// tensor (views, transposes and float64 values are copied).
//
// It lives apart from package tensor so that the core, which every other
// package imports, does not pull gorgonia.org/tensor and its dependencies
// (arrow, protobuf, flatbuffers, gonum) into programs that never exchange
// data with it. It knows only the exported Tensor API: nothing of backends
// or device memory (a device tensor is an error).
//
// Example:
//
//	x, _ := tensor.FromF32(tensor.Shape{2, 3}, []float32{1, 2, 3, 4, 5, 6})
//	d, err := gorgonia.ToDense(x) // shares x's storage
//	if err != nil {
//		return err
//	}
//	y, err := gorgonia.FromDense(d) // shares it again: &y.F32()[0] == &x.F32()[0]
package gorgonia
