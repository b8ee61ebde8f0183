package nn

import (
	"math"
	"slices"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

func newRouting(T, E, k int) *routing {
	r := &routing{
		expert: make([]int32, T*k), weight: make([]float32, T*k), count: make([]int, E), start: make([]int, E),
		tokens: make([]int32, T*k), table: make([]float32, T*k+T), slots: make([][]int32, k),
	}
	for j := range r.slots {
		r.slots[j] = make([]int32, T)
	}
	return r
}

// TestRoute checks the routing of a few tokens against weights worked out
// by hand: the softmax over all experts, the k best with the lower index
// first among equals, the renormalisation, and the grouping by expert.
func TestRoute(t *testing.T) {
	ln := func(v float64) float32 { return float32(math.Log(v)) }
	for _, tc := range []struct {
		name    string
		scores  [][]float32 // [T][E]
		k       int
		norm    bool
		experts [][]int32   // [T][k]
		weights [][]float64 // [T][k]
	}{
		{"top-2 renormalised", [][]float32{{ln(1), ln(4), ln(2), ln(3)}}, 2, true,
			[][]int32{{1, 3}}, [][]float64{{4.0 / 7, 3.0 / 7}}},
		{"top-2 softmax weights", [][]float32{{ln(1), ln(4), ln(2), ln(3)}}, 2, false,
			[][]int32{{1, 3}}, [][]float64{{0.4, 0.3}}},
		{"ties go to the lower index", [][]float32{{2, 5, 5, 1, 5}}, 2, false,
			[][]int32{{1, 2}}, nil},
		{"top-1 renormalised is 1", [][]float32{{0.5, -3, 7}}, 1, true,
			[][]int32{{2}}, [][]float64{{1}}},
		{"three tokens", [][]float32{{0, 9, 8}, {7, 0, 6}, {5, 4, 3}}, 2, true,
			[][]int32{{1, 2}, {0, 2}, {0, 1}}, nil},
		{"a large score does not overflow", [][]float32{{1000, 999, -1000}}, 2, false,
			[][]int32{{0, 1}}, [][]float64{{1 / (1 + math.Exp(-1)), math.Exp(-1) / (1 + math.Exp(-1))}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			T, E := len(tc.scores), len(tc.scores[0])
			r := newRouting(T, E, tc.k)
			r.route(slices.Concat(tc.scores...), T, E, tc.k, tc.norm)
			for tok := range T {
				got := r.expert[tok*tc.k : (tok+1)*tc.k]
				if !slices.Equal(got, tc.experts[tok]) {
					t.Errorf("token %d chose %v, want %v", tok, got, tc.experts[tok])
				}
				for j := range tc.k {
					if tc.weights != nil && math.Abs(float64(r.weight[tok*tc.k+j])-tc.weights[tok][j]) > 1e-6 {
						t.Errorf("token %d weight %d: %v, want %v", tok, j, r.weight[tok*tc.k+j], tc.weights[tok][j])
					}
				}
			}
			// The grouping: rows by expert then token, each row's token and
			// weight, each token's slots pointing at its rows.
			row := 0
			for e := range E {
				if r.start[e] != row {
					t.Errorf("expert %d starts at row %d, want %d", e, r.start[e], row)
				}
				prev := int32(-1)
				for ; row < r.start[e]+r.count[e]; row++ {
					tok := r.tokens[row]
					if tok <= prev {
						t.Errorf("expert %d: tokens out of order at row %d", e, row)
					}
					prev = tok
					j := slices.Index(r.expert[tok*int32(tc.k):(tok+1)*int32(tc.k)], int32(e))
					if j < 0 || r.slots[j][tok] != int32(row) || r.table[row] != r.weight[int(tok)*tc.k+j] {
						t.Errorf("row %d (expert %d, token %d): slot %d, table %v", row, e, tok, j, r.table[row])
					}
				}
			}
			if row != T*tc.k {
				t.Errorf("%d rows grouped, want %d", row, T*tc.k)
			}
		})
	}
}

// TestScaleRows checks that the rotation scaleRows runs multiplies each row
// by its weight exactly, from any row of the table.
func TestScaleRows(t *testing.T) {
	b := tensor.NewCPU(1)
	defer b.Close()
	x := tensor.New(tensor.F32, tensor.Shape{3, 6})
	w := tensor.New(tensor.F32, tensor.Shape{5, 1})
	zero := tensor.New(tensor.F32, tensor.Shape{5, 1})
	xs := x.F32()
	for i := range xs {
		xs[i] = float32(math.Sin(float64(i)*1.7)) * 3
	}
	want := slices.Clone(xs)
	copy(w.F32(), []float32{9, 0.3, -1.25, 1e-3, 7})
	for r := range 3 {
		for j := range 6 {
			want[r*6+j] *= w.F32()[2+r]
		}
	}
	if err := scaleRows(tensor.Checked(b), x, w, zero, 2); err != nil {
		t.Fatal(err)
	}
	for i := range xs {
		if xs[i] != want[i] {
			t.Fatalf("element %d: %v, want %v", i, xs[i], want[i])
		}
	}
}
