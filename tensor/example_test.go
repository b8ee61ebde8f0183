package tensor_test

import (
	"fmt"

	"github.com/strata-llm/strata/tensor"
)

// A matrix product on the CPU backend with F16 weights in Hugging Face's
// [out_features, in_features] layout.
func ExampleCPU_MatMul() {
	cpu := tensor.NewCPU(0)
	defer cpu.Close()

	x, _ := tensor.FromF32(tensor.Shape{1, 3}, []float32{1, 2, 3})
	w := tensor.New(tensor.F16, tensor.Shape{2, 3})
	tensor.F32ToF16(w.U16(), []float32{
		1, 0, 0, // out[0] = x[0]
		0.5, 0.5, 0.5, // out[1] = (x[0]+x[1]+x[2])/2
	})
	out, _ := cpu.Alloc(tensor.F32, tensor.Shape{1, 2})
	if err := cpu.MatMul(out, x, w, nil); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(out.F32())
	// Output: [1 3]
}

// The checks in front of a backend return malformed calls as errors naming
// the operation and the operand; the backend's kernel never sees them.
func ExampleChecked() {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	b := tensor.Checked(cpu)
	x := tensor.New(tensor.F32, tensor.Shape{1, 3})
	w := tensor.New(tensor.F16, tensor.Shape{2, 4})
	out := tensor.New(tensor.F32, tensor.Shape{1, 2})
	fmt.Println(b.MatMul(out, x, w, nil))
	// Output: tensor: MatMul: w has shape [2, 4], want dimension 1 = 3
}
