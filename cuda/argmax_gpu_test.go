//go:build cuda

package cuda

import (
	"math"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestArgmax checks Argmax (greedy decoding's, tensor.Argmaxer) against
// the host: rows of a 32,000 and a 128,256 vocabulary, ties (the lowest
// index wins), a row of equal values, one element, and rows holding a
// NaN, +Inf or -Inf (-1), one row and several at once.
func TestArgmax(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	want := func(row []float32) int32 {
		best := int32(0)
		for i, v := range row {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return -1
			}
			if v > row[best] {
				best = int32(i)
			}
		}
		return best
	}
	for _, n := range []int{1, 7, 32000, 128256} {
		var rows [][]float32
		plain := uniform(r, n, -30, 30)
		rows = append(rows, plain)
		tie := append([]float32(nil), plain...)
		if n > 1 {
			tie[n-1], tie[n/2] = 40, 40
		}
		rows = append(rows, tie, make([]float32, n))
		for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
			row := append([]float32(nil), plain...)
			row[n*2/3] = bad
			rows = append(rows, row)
		}
		var flat []float32
		for _, row := range rows {
			flat = append(flat, row...)
		}
		x, _ := put(t, b, tensor.F32, tensor.Shape{len(rows), n}, flat)
		got, err := b.Argmax(x)
		if err != nil {
			t.Fatal(err)
		}
		for i, row := range rows {
			if got[i] != want(row) {
				t.Errorf("n %d, row %d: %d, want %d", n, i, got[i], want(row))
			}
			one, _ := put(t, b, tensor.F32, tensor.Shape{n}, row)
			if g, err := b.Argmax(one); err != nil || g[0] != want(row) {
				t.Errorf("n %d, row %d alone: %v, %v; want %d", n, i, g, err, want(row))
			}
		}
	}
}
