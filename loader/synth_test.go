package loader

import (
	"bytes"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// fill must give the same bytes however the tensor is cut, even inside an
// element (a file mixing dtypes puts chunk boundaries anywhere).
func TestFillAnyCut(t *testing.T) {
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16} {
		g := &uniformGen{tab: newLevelTable(dt, 0.5, 0.25), key: 99}
		const size = 1000 * 4
		whole := make([]byte, size)
		if err := g.fill(whole, 0); err != nil {
			t.Fatal(err)
		}
		for _, cut := range []int{1, 2, 3, 5, 7, 8, 13, 64, 333, 999} {
			pieced := make([]byte, size)
			for off := 0; off < size; off += cut {
				end := min(off+cut, size)
				if err := g.fill(pieced[off:end], int64(off)); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(whole, pieced) {
				t.Errorf("%v: pieces of %d bytes differ from the whole", dt, cut)
			}
		}
		// Values lie in [center-halfWidth, center+halfWidth] and use many levels.
		x, _ := tensor.FromBytes(dt, tensor.Shape{size / dt.Size()}, whole)
		seen := map[float32]bool{}
		for _, v := range x.ToF32() {
			if v < 0.25 || v > 0.75 {
				t.Fatalf("%v: value %v outside [0.25, 0.75]", dt, v)
			}
			seen[v] = true
		}
		if len(seen) < 150 { // BF16 has 193 values in [0.25, 0.75]
			t.Errorf("%v: only %d distinct values", dt, len(seen))
		}
	}
}
