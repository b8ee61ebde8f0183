package gorgonia_test

import (
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/gorgonia"
	gtensor "gorgonia.org/tensor"
)

func TestToDenseSharesF32(t *testing.T) {
	x, err := tensor.FromF32(tensor.Shape{2, 3}, []float32{1, 2, 3, 4, 5, 6})
	if err != nil {
		t.Fatal(err)
	}
	d, err := gorgonia.ToDense(x)
	if err != nil {
		t.Fatal(err)
	}
	if got := []int(d.Shape()); len(got) != 2 || got[0] != 2 || got[1] != 3 {
		t.Fatalf("shape %v, want (2, 3)", d.Shape())
	}
	v, err := d.At(1, 2)
	if err != nil || v.(float32) != 6 {
		t.Fatalf("At(1, 2) = %v, %v; want 6", v, err)
	}
	// Zero-copy both ways: a write through the Dense shows in the tensor,
	// and a write to the tensor shows in the Dense.
	if err := d.SetAt(float32(-7), 0, 1); err != nil {
		t.Fatal(err)
	}
	if got := x.F32()[1]; got != -7 {
		t.Fatalf("tensor element 1 = %v after Dense.SetAt, want -7", got)
	}
	x.F32()[5] = 42
	if v, _ := d.At(1, 2); v.(float32) != 42 {
		t.Fatalf("Dense (1, 2) = %v after writing the tensor, want 42", v)
	}
}

func TestToDenseConverts(t *testing.T) {
	vals := []float32{0.5, -1.25, 3, 65504, -0.0009765625, 2}
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		x := tensor.New(dt, tensor.Shape{3, 2})
		if dt == tensor.F16 {
			tensor.F32ToF16(x.U16(), vals)
		} else {
			tensor.F32ToBF16(x.U16(), vals)
		}
		d, err := gorgonia.ToDense(x)
		if err != nil {
			t.Fatal(err)
		}
		got := d.Data().([]float32)
		want := x.ToF32()
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%v: element %d = %v, want %v", dt, i, got[i], want[i])
			}
		}
		// A converted Dense is a copy: writing it leaves the tensor alone.
		got[0] = 99
		if x.ToF32()[0] == 99 {
			t.Fatalf("%v: Dense shares the F16/BF16 tensor's storage", dt)
		}
	}
	if _, err := gorgonia.ToDense(tensor.New(tensor.I32, tensor.Shape{2})); err == nil {
		t.Error("ToDense of an I32 tensor succeeded")
	}
	if _, err := gorgonia.ToDense(nil); err == nil {
		t.Error("ToDense(nil) succeeded")
	}
}

func TestFromDenseShares(t *testing.T) {
	backing := []float32{1, 2, 3, 4, 5, 6}
	d := gtensor.New(gtensor.WithShape(3, 2), gtensor.WithBacking(backing))
	x, err := gorgonia.FromDense(d)
	if err != nil {
		t.Fatal(err)
	}
	if x.DType() != tensor.F32 || !x.Shape().Equal(tensor.Shape{3, 2}) {
		t.Fatalf("FromDense = %v", x)
	}
	x.F32()[4] = -5
	if v, _ := d.At(2, 0); v.(float32) != -5 {
		t.Fatalf("Dense (2, 0) = %v after writing the tensor, want -5", v)
	}
	if err := d.SetAt(float32(11), 0, 0); err != nil {
		t.Fatal(err)
	}
	if x.F32()[0] != 11 {
		t.Fatalf("tensor element 0 = %v after Dense.SetAt, want 11", x.F32()[0])
	}
}

func TestFromDenseCopies(t *testing.T) {
	// float64 converts.
	d64 := gtensor.New(gtensor.WithShape(2, 2), gtensor.WithBacking([]float64{1.5, -2, 3, 4.25}))
	x, err := gorgonia.FromDense(d64)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := x.F32(), []float32{1.5, -2, 3, 4.25}; !equalF32(got, want) {
		t.Fatalf("from float64: %v, want %v", got, want)
	}

	// A transposed view is copied in logical order.
	d := gtensor.New(gtensor.WithShape(2, 3), gtensor.WithBacking([]float32{1, 2, 3, 4, 5, 6}))
	if err := d.T(); err != nil {
		t.Fatal(err)
	}
	x, err = gorgonia.FromDense(d)
	if err != nil {
		t.Fatal(err)
	}
	if !x.Shape().Equal(tensor.Shape{3, 2}) {
		t.Fatalf("transposed shape %v, want [3, 2]", x.Shape())
	}
	if got, want := x.F32(), []float32{1, 4, 2, 5, 3, 6}; !equalF32(got, want) {
		t.Fatalf("transposed: %v, want %v", got, want)
	}
	x.F32()[0] = 100
	if v, _ := d.At(0, 0); v.(float32) == 100 {
		t.Fatal("the copy of a transposed view shares storage")
	}

	// A strided slice (the second column) is copied.
	d = gtensor.New(gtensor.WithShape(3, 2), gtensor.WithBacking([]float32{1, 2, 3, 4, 5, 6}))
	col, err := d.Slice(nil, gtensor.S(1))
	if err != nil {
		t.Fatal(err)
	}
	x, err = gorgonia.FromDense(col.(*gtensor.Dense))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := x.F32(), []float32{2, 4, 6}; !equalF32(got, want) {
		t.Fatalf("column slice: %v (shape %v), want %v", got, x.Shape(), want)
	}

	// A scalar becomes a one-element tensor of empty shape.
	x, err = gorgonia.FromDense(gtensor.New(gtensor.FromScalar(float32(2.5))))
	if err != nil {
		t.Fatal(err)
	}
	if len(x.Shape()) != 0 || x.Len() != 1 || x.F32()[0] != 2.5 {
		t.Fatalf("scalar: %v = %v, want 2.5", x, x.F32())
	}

	// Other element types are errors.
	if _, err := gorgonia.FromDense(gtensor.New(gtensor.WithShape(2), gtensor.WithBacking([]int{1, 2}))); err == nil {
		t.Error("FromDense of an int Dense succeeded")
	}
	if _, err := gorgonia.FromDense(nil); err == nil {
		t.Error("FromDense(nil) succeeded")
	}
}

func TestDenseRoundTrip(t *testing.T) {
	x, _ := tensor.FromF32(tensor.Shape{4}, []float32{1, 2, 3, 4})
	d, err := gorgonia.ToDense(x)
	if err != nil {
		t.Fatal(err)
	}
	y, err := gorgonia.FromDense(d)
	if err != nil {
		t.Fatal(err)
	}
	if &y.F32()[0] != &x.F32()[0] {
		t.Fatal("F32 round trip through Dense copied the data")
	}
}

func equalF32(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
