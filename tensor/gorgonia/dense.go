package gorgonia

import (
	"fmt"

	"github.com/strata-llm/strata/tensor"
	gtensor "gorgonia.org/tensor"
)

// ToDense returns a host float tensor as a gorgonia.org/tensor Dense of
// float32. For an F32 tensor the Dense shares t's storage (writes through
// either are seen by the other); F16 and BF16 tensors are converted into a
// new F32 Dense. A scalar (empty shape) becomes a one-element vector.
func ToDense(t *tensor.Tensor) (*gtensor.Dense, error) {
	if t == nil {
		return nil, fmt.Errorf("gorgonia: ToDense: nil tensor")
	}
	if !t.OnHost() {
		return nil, fmt.Errorf("gorgonia: ToDense: t (%v) is not in host memory (a device tensor, or freed)", t)
	}
	if !t.DType().IsFloat() {
		return nil, fmt.Errorf("gorgonia: ToDense: %v is not a float tensor", t)
	}
	shape := []int(t.Shape())
	if len(shape) == 0 {
		shape = []int{1}
	}
	if t.Len() == 0 {
		return nil, fmt.Errorf("gorgonia: ToDense: %v has no elements", t)
	}
	return gtensor.New(gtensor.WithShape(shape...), gtensor.WithBacking(t.ToF32())), nil
}

// FromDense returns a host F32 tensor holding d's values. A contiguous
// float32 Dense that is not a view is shared without copying; views and
// transposes are copied in their logical order, and float64 values are
// converted to float32. Other element types are an error.
func FromDense(d *gtensor.Dense) (*tensor.Tensor, error) {
	if d == nil {
		return nil, fmt.Errorf("gorgonia: FromDense: nil Dense")
	}
	shape := tensor.Shape(append([]int(nil), d.Shape()...))
	if d.IsScalar() {
		switch v := d.ScalarValue().(type) {
		case float32:
			return tensor.FromF32(shape, []float32{v})
		case float64:
			return tensor.FromF32(shape, []float32{float32(v)})
		}
		return nil, fmt.Errorf("gorgonia: FromDense: unsupported scalar type %v", d.Dtype())
	}
	if d.Dtype() != gtensor.Float32 && d.Dtype() != gtensor.Float64 {
		return nil, fmt.Errorf("gorgonia: FromDense: unsupported dtype %v (want float32 or float64)", d.Dtype())
	}
	n := int(shape.NumElements())
	if d.IsMaterializable() || d.RequiresIterator() || d.DataSize() != n {
		m, ok := d.Materialize().(*gtensor.Dense)
		if !ok {
			return nil, fmt.Errorf("gorgonia: FromDense: cannot materialise %v view", d.Shape())
		}
		if m == d || m.DataSize() != n {
			return nil, fmt.Errorf("gorgonia: FromDense: %v Dense with %d stored elements is not contiguous", d.Shape(), d.DataSize())
		}
		return fromContiguous(shape, m, true)
	}
	return fromContiguous(shape, d, false)
}

// fromContiguous wraps (or, with copied, takes over) the backing array of a
// contiguous Dense of n elements.
func fromContiguous(shape tensor.Shape, d *gtensor.Dense, copied bool) (*tensor.Tensor, error) {
	switch v := d.Data().(type) {
	case []float32:
		if !copied && len(v) > 0 {
			v = v[:len(v):len(v)]
		}
		return tensor.FromF32(shape, v)
	case []float64:
		f := make([]float32, len(v))
		for i, x := range v {
			f[i] = float32(x)
		}
		return tensor.FromF32(shape, f)
	}
	return nil, fmt.Errorf("gorgonia: FromDense: unsupported data %T", d.Data())
}
