package tensor_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// TestCPUMatMulMany checks the CPU's fused products of one row of x:
// MatMulMany over a block's q, k and v shapes and GateUpSiLU over gate and
// up give the bits of a MatMul each (and SiLUMul), in every weight dtype
// and kernel table, and hand the pool one job where separate products
// hand it one each (two threads, products large enough to be split).
func TestCPUMatMulMany(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	// q, k and v rows (grouped-query heads), each product large enough to
	// be split into several tasks in every dtype.
	const k = 2048
	shapes := []int{1024, 512, 512}
	for _, name := range tensor.KernelNames() {
		for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q4_K, tensor.Q6_K} {
			t.Run(fmt.Sprintf("%s/%v", name, dt), func(t *testing.T) {
				c := tensor.NewCPUKernels(2, name)
				defer c.Close()
				weight := func(n int) *tensor.Tensor {
					v := normals(r, n*k)
					if dt.IsQuantized() {
						return quantTensor(t, dt, tensor.Shape{n, k}, v)
					}
					if dt != tensor.F32 {
						return halves(t, dt, tensor.Shape{n, k}, v)
					}
					w, err := tensor.FromF32(tensor.Shape{n, k}, v)
					if err != nil {
						t.Fatal(err)
					}
					return w
				}
				x, _ := tensor.FromF32(tensor.Shape{1, k}, normals(r, k))
				var ws, fused, apart []*tensor.Tensor
				for _, n := range shapes {
					ws = append(ws, weight(n))
					fused = append(fused, tensor.New(tensor.F32, tensor.Shape{1, n}))
					apart = append(apart, tensor.New(tensor.F32, tensor.Shape{1, n}))
				}
				j0 := tensor.ParallelJobs(c)
				for i := range ws {
					if err := c.MatMul(apart[i], x, ws[i], nil); err != nil {
						t.Fatal(err)
					}
				}
				j1 := tensor.ParallelJobs(c)
				if err := tensor.MatMulMany(c, fused, x, ws); err != nil {
					t.Fatal(err)
				}
				j2 := tensor.ParallelJobs(c)
				for i := range ws {
					bitsEqual(t, fmt.Sprintf("product %d", i), fused[i].F32(), apart[i].F32())
				}
				if j1-j0 != int64(len(ws)) || j2-j1 != 1 {
					t.Errorf("jobs: %d for %d separate products, %d for MatMulMany; want %d and 1", j1-j0, len(ws), j2-j1, len(ws))
				}

				// GateUpSiLU: gate and up of one shape.
				const n = 1024
				wg, wu := weight(n), weight(n)
				out, up := tensor.New(tensor.F32, tensor.Shape{1, n}), tensor.New(tensor.F32, tensor.Shape{1, n})
				want, wantUp := tensor.New(tensor.F32, tensor.Shape{1, n}), tensor.New(tensor.F32, tensor.Shape{1, n})
				if err := c.MatMul(want, x, wg, nil); err != nil {
					t.Fatal(err)
				}
				if err := c.MatMul(wantUp, x, wu, nil); err != nil {
					t.Fatal(err)
				}
				if err := c.SiLUMul(want, want, wantUp); err != nil {
					t.Fatal(err)
				}
				if err := tensor.GateUpSiLU(c, out, up, x, wg, wu); err != nil {
					t.Fatal(err)
				}
				bitsEqual(t, "GateUpSiLU", out.F32(), want.F32())
			})
		}
	}
}

// TestCPUMatMulManyShapes: MatMulMany's cases around the one job: several
// rows of x (a MatMul each), a product with no rows, K of 0, small
// products run on the caller, and more products than one job takes; each
// the bits of a MatMul each.
func TestCPUMatMulManyShapes(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	c := tensor.NewCPU(2)
	defer c.Close()
	for _, tc := range []struct {
		name string
		m, k int
		ns   []int
	}{
		{"rows of x", 3, 64, []int{40, 8, 8}},
		{"a product of no rows", 1, 64, []int{40, 0, 12}},
		{"K of 0", 1, 0, []int{5, 3}},
		{"small", 1, 16, []int{4, 4, 4}},
		{"four products", 1, 128, []int{256, 64, 64, 32}},
		{"one product", 1, 256, []int{300}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, _ := tensor.FromF32(tensor.Shape{tc.m, tc.k}, normals(r, tc.m*tc.k))
			var ws, fused, apart []*tensor.Tensor
			for _, n := range tc.ns {
				hw := halves(t, tensor.F16, tensor.Shape{n, tc.k}, normals(r, n*tc.k))
				ws = append(ws, hw)
				fused = append(fused, tensor.New(tensor.F32, tensor.Shape{tc.m, n}))
				o := tensor.New(tensor.F32, tensor.Shape{tc.m, n})
				if err := c.MatMul(o, x, hw, nil); err != nil {
					t.Fatal(err)
				}
				apart = append(apart, o)
			}
			for i := range fused {
				for j := range fused[i].F32() {
					fused[i].F32()[j] = float32(math.NaN())
				}
			}
			if err := tensor.MatMulMany(c, fused, x, ws); err != nil {
				t.Fatal(err)
			}
			for i := range ws {
				bitsEqual(t, fmt.Sprintf("product %d", i), fused[i].F32(), apart[i].F32())
			}
		})
	}
}

func bitsEqual(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if i, ok := sameBits(got, want); !ok {
		t.Errorf("%s: element %d differs from a MatMul's (bit for bit): %v against %v", what, i, got[max(i, 0)], want[max(i, 0)])
	}
}

// halves converts v to F16 or BF16 as a host tensor of shape.
func halves(t *testing.T, dt tensor.DType, shape tensor.Shape, v []float32) *tensor.Tensor {
	t.Helper()
	h := make([]uint16, len(v))
	if dt == tensor.F16 {
		tensor.F32ToF16(h, v)
	} else {
		tensor.F32ToBF16(h, v)
	}
	b := make([]byte, 2*len(h))
	for i, u := range h {
		b[2*i], b[2*i+1] = byte(u), byte(u>>8)
	}
	w, err := tensor.FromBytes(dt, shape, b)
	if err != nil {
		t.Fatal(err)
	}
	return w
}
