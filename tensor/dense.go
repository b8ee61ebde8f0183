package tensor

import (
	"fmt"

	gtensor "gorgonia.org/tensor"
)

// ToDense returns a host float tensor as a gorgonia.org/tensor Dense of
// float32. For an F32 tensor the Dense shares t's storage (writes through
// either are seen by the other); F16 and BF16 tensors are converted into a
// new F32 Dense. A scalar (empty shape) becomes a one-element vector.
func ToDense(t *Tensor) (*gtensor.Dense, error) {
	if t == nil {
		return nil, fmt.Errorf("tensor: ToDense: nil tensor")
	}
	if err := onHost("ToDense", "t", t); err != nil {
		return nil, err
	}
	if !t.dtype.IsFloat() {
		return nil, fmt.Errorf("tensor: ToDense: %v is not a float tensor", t)
	}
	shape := []int(t.shape)
	if len(shape) == 0 {
		shape = []int{1}
	}
	if t.Len() == 0 {
		return nil, fmt.Errorf("tensor: ToDense: %v has no elements", t)
	}
	return gtensor.New(gtensor.WithShape(shape...), gtensor.WithBacking(t.ToF32())), nil
}

// FromDense returns a host F32 tensor holding d's values. A contiguous
// float32 Dense that is not a view is shared without copying; views and
// transposes are copied in their logical order, and float64 values are
// converted to float32. Other element types are an error.
func FromDense(d *gtensor.Dense) (*Tensor, error) {
	if d == nil {
		return nil, fmt.Errorf("tensor: FromDense: nil Dense")
	}
	shape := Shape(append([]int(nil), d.Shape()...))
	if d.IsScalar() {
		switch v := d.ScalarValue().(type) {
		case float32:
			return FromF32(shape, []float32{v})
		case float64:
			return FromF32(shape, []float32{float32(v)})
		}
		return nil, fmt.Errorf("tensor: FromDense: unsupported scalar type %v", d.Dtype())
	}
	if d.Dtype() != gtensor.Float32 && d.Dtype() != gtensor.Float64 {
		return nil, fmt.Errorf("tensor: FromDense: unsupported dtype %v (want float32 or float64)", d.Dtype())
	}
	n := int(shape.NumElements())
	if d.IsMaterializable() || d.RequiresIterator() || d.DataSize() != n {
		m, ok := d.Materialize().(*gtensor.Dense)
		if !ok {
			return nil, fmt.Errorf("tensor: FromDense: cannot materialise %v view", d.Shape())
		}
		if m == d || m.DataSize() != n {
			return nil, fmt.Errorf("tensor: FromDense: %v Dense with %d stored elements is not contiguous", d.Shape(), d.DataSize())
		}
		return fromContiguous(shape, m, true)
	}
	return fromContiguous(shape, d, false)
}

// fromContiguous wraps (or, with copied, takes over) the backing array of a
// contiguous Dense of n elements.
func fromContiguous(shape Shape, d *gtensor.Dense, copied bool) (*Tensor, error) {
	switch v := d.Data().(type) {
	case []float32:
		if !copied && len(v) > 0 {
			v = v[:len(v):len(v)]
		}
		return FromF32(shape, v)
	case []float64:
		f := make([]float32, len(v))
		for i, x := range v {
			f[i] = float32(x)
		}
		return FromF32(shape, f)
	}
	return nil, fmt.Errorf("tensor: FromDense: unsupported data %T", d.Data())
}
