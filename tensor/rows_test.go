package tensor_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// rowsOf uploads rows [i0, i1) of v (rows of width d) as an F32 tensor.
func rowsOf(t *testing.T, b tensor.Backend, v []float32, d, i0, i1 int) *tensor.Tensor {
	t.Helper()
	x, err := tensortest.FromF32(b, tensor.F32, tensor.Shape{i1 - i0, d}, v[i0*d:i1*d])
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// sameBits reports the first element where a and b differ in their bits.
func sameBits(a, b []float32) (int, bool) {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i, false
		}
	}
	return -1, len(a) == len(b)
}

// TestSiLUMulRowsIndependent: a row's SiLU product has the same bits
// however many rows share the call, on every kernel table and thread
// count, for rows whose width is not a multiple of the kernels' 8 lanes
// and calls large enough to be split over the pool.
func TestSiLUMulRowsIndependent(t *testing.T) {
	for _, name := range tensor.KernelNames() {
		for _, threads := range []int{1, 3} {
			for _, c := range []struct{ rows, d int }{{70, 1001}, {9, 8191}, {40, 13}, {300, 250}} {
				t.Run(fmt.Sprintf("%s/threads=%d/%dx%d", name, threads, c.rows, c.d), func(t *testing.T) {
					b := tensor.NewCPUKernels(threads, name)
					defer b.Close()
					r := rand.New(rand.NewPCG(uint64(c.rows), uint64(c.d)))
					g, u := make([]float32, c.rows*c.d), make([]float32, c.rows*c.d)
					for i := range g {
						g[i], u[i] = r.Float32()*16-8, r.Float32()*2-1
					}
					run := func(i0, i1 int) []float32 {
						gt, ut := rowsOf(t, b, g, c.d, i0, i1), rowsOf(t, b, u, c.d, i0, i1)
						out, err := b.Alloc(tensor.F32, tensor.Shape{i1 - i0, c.d})
						if err != nil {
							t.Fatal(err)
						}
						if err := tensor.Checked(b).SiLUMul(out, gt, ut); err != nil {
							t.Fatal(err)
						}
						return out.F32()
					}
					all := run(0, c.rows)
					for _, i := range []int{0, 1, c.rows / 2, c.rows - 1} {
						one := run(i, i+1)
						if j, ok := sameBits(all[i*c.d:(i+1)*c.d], one); !ok {
							t.Fatalf("row %d element %d: %v among %d rows, %v alone", i, j, all[i*c.d+j], c.rows, one[j])
						}
					}
				})
			}
		}
	}
}
