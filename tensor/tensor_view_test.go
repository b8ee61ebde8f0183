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
