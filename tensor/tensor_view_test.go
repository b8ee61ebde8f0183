package tensor

import "testing"

func TestView(t *testing.T) {
	base := New(F32, Shape{16})
	v, err := base.View(8, F16, Shape{2, 3})
	if err != nil {
		t.Fatal(err)
	}
	if v.NumBytes() != 12 || !v.Shape().Equal(Shape{2, 3}) || v.DType() != F16 {
		t.Fatalf("view %v of %d bytes", v, v.NumBytes())
	}
	v.U16()[0] = 0xffff
	if base.Bytes()[8] != 0xff || base.Bytes()[9] != 0xff {
		t.Fatal("the view does not share the base's storage")
	}
	dev := NewDevice(F32, Shape{64}, 0x1000)
	dv, err := dev.View(256-192, F32, Shape{4})
	if err != nil || dv.Ptr() != 0x1000+64 {
		t.Fatalf("device view at %#x, %v", dv.Ptr(), err)
	}
	for _, tc := range []struct {
		off   int64
		shape Shape
	}{{-1, Shape{1}}, {60, Shape{2}}, {65, Shape{0}}, {0, Shape{17}}, {0, Shape{-1}}} {
		if _, err := base.View(tc.off, F32, tc.shape); err == nil {
			t.Errorf("View(%d, %v) of 64 bytes succeeded", tc.off, tc.shape)
		}
	}
}

// TestReshapeQuantized checks that a quantized tensor reshapes only to rows
// of whole blocks: a row that splits a block has no storage of its own.
func TestReshapeQuantized(t *testing.T) {
	x := New(Q8_0, Shape{2, 64})
	for _, tc := range []struct {
		shape Shape
		ok    bool
	}{
		{Shape{4, 32}, true}, {Shape{128}, true}, {Shape{1, 2, 64}, true},
		{Shape{8, 16}, false}, {Shape{64, 2}, false}, {Shape{}, false}, {Shape{2, 2, 32}, true},
	} {
		r, err := x.Reshape(tc.shape)
		if (err == nil) != tc.ok {
			t.Errorf("Reshape(%v) of Q8_0 [2, 64]: %v, %v", tc.shape, r, err)
			continue
		}
		if err == nil && (r.NumBytes() != x.NumBytes() || !r.Shape().Equal(tc.shape)) {
			t.Errorf("Reshape(%v): %v of %d bytes", tc.shape, r, r.NumBytes())
		}
	}
	if _, err := New(F16, Shape{2, 64}).Reshape(Shape{8, 16}); err != nil {
		t.Errorf("a float tensor refuses a reshape: %v", err)
	}
}
