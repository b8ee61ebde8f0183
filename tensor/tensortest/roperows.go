package tensortest

import (
	"fmt"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// testRopeRows checks tensor.RopeRows (rows at positions of their own, as
// a batched step's sequences have them): each row the bits of Rope at its
// position, run one row at a time, and within the reference; with the
// backend's own RopeRows and with the fallback over runs of consecutive
// positions (a backend that hides it), with more rows than the tables
// have positions too. Positions outside the tables, a count other than the
// rows' and PosAt are refused.
func (s *suite) testRopeRows(t *testing.T) {
	type hidden struct{ tensor.Backend } // no RopeRows: the fallback
	cases := []struct {
		name           string
		heads, headDim int
		pos            []int32
	}{
		{"one row", 4, 16, []int32{9}},
		{"decode rows", 8, 64, []int32{17, 3, 40, 0, 5, 22}},
		{"prompt chunk and decode rows", 4, 32, []int32{7, 0, 1, 2, 3, 30, 12, 13}},
		{"repeated positions", 2, 128, []int32{5, 5, 5, 4}},
		// A batched step of many sequences has more rows than the tables
		// have positions (64 streams' prompt chunks: 256 rows, 163
		// positions); only each row's position must be in them.
		{"more rows than the tables' positions", 2, 16, manyPositions(60, 48)},
	}
	const maxPos = 48
	for _, c := range cases {
		for _, b := range []struct {
			name string
			b    tensor.Backend
		}{{"own", s.b}, {"fallback", hidden{s.b}}} {
			t.Run(fmt.Sprintf("%s/%s", c.name, b.name), func(t *testing.T) {
				r := rng(t)
				cos64, sin64 := RopeTables(maxPos, c.headDim, 10000)
				half := tensor.Shape{maxPos, c.headDim / 2}
				cos, cv := s.put(t, tensor.F32, half, f32(cos64))
				sin, sv := s.put(t, tensor.F32, half, f32(sin64))
				w, n := c.heads*c.headDim, len(c.pos)
				xs := uniform(r, n*w, -2, 2)
				x, xv := s.put(t, tensor.F32, tensor.Shape{n, w}, xs)
				rot := tensor.Rotary{Cos: cos, Sin: sin, Heads: c.heads, HeadDim: c.headDim, Pos0: 1000}
				if err := tensor.RopeRows(b.b, x, rot, c.pos); err != nil {
					t.Fatal(err)
				}
				got := s.get(t, x)
				for i, p := range c.pos {
					one, _ := s.put(t, tensor.F32, tensor.Shape{1, w}, xs[i*w:(i+1)*w])
					rot.Pos0 = int(p)
					if err := s.b.Rope(one, rot); err != nil {
						t.Fatal(err)
					}
					s.same(t, fmt.Sprintf("row %d at %d against Rope", i, p), got[i*w:(i+1)*w], s.get(t, one))
					s.compare(t, fmt.Sprintf("row %d at %d", i, p), got[i*w:(i+1)*w], RefRope(xv[i*w:(i+1)*w], cv, sv, 1, c.heads, c.headDim, int(p)))
				}
			})
		}
	}
	t.Run("malformed", func(t *testing.T) {
		cos, _ := s.put(t, tensor.F32, tensor.Shape{8, 8}, make([]float32, 64))
		sin, _ := s.put(t, tensor.F32, tensor.Shape{8, 8}, make([]float32, 64))
		x, _ := s.put(t, tensor.F32, tensor.Shape{2, 32}, make([]float32, 64))
		at := s.position(t, 1)
		rot := tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16}
		for _, bad := range []struct {
			name string
			rot  tensor.Rotary
			pos  []int32
		}{
			{"a position past the tables", rot, []int32{1, 8}},
			{"a negative position", rot, []int32{-1, 2}},
			{"fewer positions than rows", rot, []int32{1}},
			{"more positions than rows", rot, []int32{1, 2, 3}},
			{"PosAt", tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16, PosAt: at}, []int32{1, 2}},
		} {
			if err := tensor.RopeRows(s.b, x, bad.rot, bad.pos); err == nil {
				t.Errorf("%s: no error", bad.name)
			}
		}
	})
}

// manyPositions is n rows' positions, each below maxPos, runs of
// consecutive ones and jumps between them.
func manyPositions(n, maxPos int) []int32 {
	pos := make([]int32, n)
	for i := range pos {
		pos[i] = int32((i*7 + i/5) % maxPos)
	}
	return pos
}
