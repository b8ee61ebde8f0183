package tensor_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// quantDTypes are the quantized weight types, those with an integer
// product.
var quantDTypes = []tensor.DType{tensor.Q8_0, tensor.Q4_0, tensor.Q4_1, tensor.Q5_0, tensor.Q5_1, tensor.Q4_K, tensor.Q5_K, tensor.Q6_K}

func normals(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

// quantTensor returns values quantized to dt as a host tensor.
func quantTensor(t testing.TB, dt tensor.DType, shape tensor.Shape, v []float32) *tensor.Tensor {
	t.Helper()
	typ, _ := dt.Quant()
	n, err := dt.ShapeBytes(shape)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, n)
	if err := typ.Quantize(b, v); err != nil {
		t.Fatal(err)
	}
	w, err := tensor.FromBytes(dt, shape, b)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// blocksTensor returns random blocks of dt (tensortest.RandomBlocks) as a
// host tensor.
func blocksTensor(t testing.TB, r *rand.Rand, dt tensor.DType, shape tensor.Shape) *tensor.Tensor {
	t.Helper()
	b, err := tensortest.RandomBlocks(r, dt, int(shape.NumElements()))
	if err != nil {
		t.Fatal(err)
	}
	w, err := tensor.FromBytes(dt, shape, b)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestCPUMatMulQuant checks the quantized product. Below
// QuantGemmRows rows of x the CPU quantizes each row of x with
// quant.QuantizeRow and multiplies with quant.GEMV over ranges of weight
// rows, so every element must be VecDot's, bit for bit, plus the bias in
// F32, whatever the threads and the split. From QuantGemmRows rows it
// dequantizes the weights for the gemm, so every element must be that of
// the product with F32 weights holding the dequantized values.
func TestCPUMatMulQuant(t *testing.T) {
	shapes := []struct{ m, n, blocks int }{
		{1, 2048, 8}, {1, 7, 1}, {3, 130, 3}, {37, 300, 2}, {1, 1, 1}, {64, 5, 4},
		{31, 10, 80},  // x quantized on the pool
		{300, 20, 16}, // the gemm for every format
		{128, 130, 2}, // the gemm from its first row count for the K formats
	}
	for _, dt := range quantDTypes {
		typ, _ := dt.Quant()
		for _, s := range shapes {
			for _, threads := range []int{1, 3} {
				gemm := s.m >= tensor.QuantGemmRows(dt)
				name := fmt.Sprintf("%v/M%d_N%d_K%d/threads=%d", dt, s.m, s.n, s.blocks*dt.BlockSize(), threads)
				if gemm {
					name += "/gemm"
				}
				t.Run(name, func(t *testing.T) {
					r := rand.New(rand.NewPCG(uint64(s.m*s.n), uint64(dt)))
					k := s.blocks * dt.BlockSize()
					c := tensor.NewCPU(threads)
					defer c.Close()
					x, _ := tensor.FromF32(tensor.Shape{s.m, k}, normals(r, s.m*k))
					w := blocksTensor(t, r, dt, tensor.Shape{s.n, k})
					bias, _ := tensor.FromF32(tensor.Shape{s.n}, normals(r, s.n))
					out := tensor.New(tensor.F32, tensor.Shape{s.m, s.n})
					for i := range out.F32() {
						out.F32()[i] = float32(math.NaN())
					}
					if err := c.MatMul(out, x, w, bias); err != nil {
						t.Fatal(err)
					}
					if gemm {
						wf := tensor.New(tensor.F32, w.Shape())
						if err := typ.Dequantize(wf.F32(), w.Bytes()); err != nil {
							t.Fatal(err)
						}
						want := tensor.New(tensor.F32, out.Shape())
						if err := c.MatMul(want, x, wf, bias); err != nil {
							t.Fatal(err)
						}
						for i, v := range want.F32() {
							if got := out.F32()[i]; math.Float32bits(got) != math.Float32bits(v) {
								t.Fatalf("out[%d,%d] = %v, want %v (F32 weights)", i/s.n, i%s.n, got, v)
							}
						}
						return
					}
					xb, err := quant.ActivationBytes(typ, k)
					if err != nil {
						t.Fatal(err)
					}
					xq := make([]byte, xb)
					rb := int(w.NumBytes()) / s.n
					for i := range s.m {
						if err := quant.QuantizeRow(typ, xq, x.F32()[i*k:(i+1)*k]); err != nil {
							t.Fatal(err)
						}
						for j := range s.n {
							d, err := quant.VecDot(typ, w.Bytes()[j*rb:(j+1)*rb], xq, k)
							if err != nil {
								t.Fatal(err)
							}
							want := d + bias.F32()[j]
							if got := out.F32()[i*s.n+j]; math.Float32bits(got) != math.Float32bits(want) {
								t.Fatalf("out[%d,%d] = %v, want %v (VecDot %v + bias %v)", i, j, got, want, d, bias.F32()[j])
							}
						}
					}
				})
			}
		}
	}
}

// TestCPUMatMulQuantF16Bias checks a bias in a narrow float type, read in
// its stored type, and no bias at all.
func TestCPUMatMulQuantF16Bias(t *testing.T) {
	c := tensor.NewCPU(2)
	defer c.Close()
	r := rand.New(rand.NewPCG(3, 3))
	const m, n, k = 2, 40, 64
	x, _ := tensor.FromF32(tensor.Shape{m, k}, normals(r, m*k))
	w := quantTensor(t, tensor.Q8_0, tensor.Shape{n, k}, normals(r, n*k))
	bias := tensor.New(tensor.F16, tensor.Shape{n})
	tensor.F32ToF16(bias.U16(), normals(r, n))
	plain, biased := tensor.New(tensor.F32, tensor.Shape{m, n}), tensor.New(tensor.F32, tensor.Shape{m, n})
	if err := c.MatMul(plain, x, w, nil); err != nil {
		t.Fatal(err)
	}
	if err := c.MatMul(biased, x, w, bias); err != nil {
		t.Fatal(err)
	}
	for i := range plain.F32() {
		want := plain.F32()[i] + tensor.F16ToF32One(bias.U16()[i%n])
		if biased.F32()[i] != want {
			t.Fatalf("element %d: %v with the bias, %v without", i, biased.F32()[i], plain.F32()[i])
		}
	}
}

// TestCPUMatMulQuantActivations checks activations quant cannot quantize,
// where the CPU quantizes them (fewer rows than
// QuantGemmRows): an error wrapping quant.ErrNotFinite that names the row.
func TestCPUMatMulQuantActivations(t *testing.T) {
	c := tensor.NewCPU(2)
	defer c.Close()
	for _, tc := range []struct {
		dt      tensor.DType
		v       float32
		rows, k int
		at      int // the row that holds v
	}{
		{tensor.Q8_0, float32(math.NaN()), 3, 256, 2},
		{tensor.Q4_K, float32(math.Inf(-1)), 3, 256, 2},
		{tensor.Q4_0, float32(math.Inf(1)), 3, 256, 2},
		{tensor.Q6_K, float32(math.NaN()), 120, 1024, 100}, // x quantized on the pool
	} {
		t.Run(fmt.Sprintf("%v/%v/M%d", tc.dt, tc.v, tc.rows), func(t *testing.T) {
			x := tensor.New(tensor.F32, tensor.Shape{tc.rows, tc.k})
			x.F32()[tc.at*tc.k+5] = tc.v
			w := quantTensor(t, tc.dt, tensor.Shape{4, tc.k}, make([]float32, 4*tc.k))
			out := tensor.New(tensor.F32, tensor.Shape{tc.rows, 4})
			err := c.MatMul(out, x, w, nil)
			if !errors.Is(err, quant.ErrNotFinite) || !strings.Contains(err.Error(), fmt.Sprintf("row %d of x", tc.at)) {
				t.Fatalf("error %v, want one naming row %d and wrapping quant.ErrNotFinite", err, tc.at)
			}
			t.Log(err)
		})
	}
}

// TestCPUMatMulQuantZeroK checks the empty inner dimension: out is the
// bias.
func TestCPUMatMulQuantZeroK(t *testing.T) {
	c := tensor.NewCPU(1)
	defer c.Close()
	x := tensor.New(tensor.F32, tensor.Shape{2, 0})
	w := tensor.New(tensor.Q4_K, tensor.Shape{3, 0})
	bias, _ := tensor.FromF32(tensor.Shape{3}, []float32{1, 2, 3})
	out, _ := tensor.FromF32(tensor.Shape{2, 3}, []float32{9, 9, 9, 9, 9, 9})
	if err := c.MatMul(out, x, w, bias); err != nil {
		t.Fatal(err)
	}
	want := []float32{1, 2, 3, 1, 2, 3}
	for i, v := range out.F32() {
		if v != want[i] {
			t.Fatalf("out = %v, want %v", out.F32(), want)
		}
	}
}

// TestCPUEmbedQuant checks that the rows of a quantized table come out as
// quant.Dequantize decodes them, bit for bit.
func TestCPUEmbedQuant(t *testing.T) {
	c := tensor.NewCPU(1)
	defer c.Close()
	r := rand.New(rand.NewPCG(5, 5))
	ids := []int32{9, 0, 3, 3, 9}
	for _, dt := range append(quantDTypes, tensor.Q8_K) {
		t.Run(dt.String(), func(t *testing.T) {
			const v = 10
			d := 2 * dt.BlockSize()
			table := quantTensor(t, dt, tensor.Shape{v, d}, normals(r, v*d))
			out := tensor.New(tensor.F32, tensor.Shape{len(ids), d})
			if err := c.Embed(out, table, ids); err != nil {
				t.Fatal(err)
			}
			typ, _ := dt.Quant()
			all := make([]float32, v*d)
			if err := typ.Dequantize(all, table.Bytes()); err != nil {
				t.Fatal(err)
			}
			for i, id := range ids {
				for j := range d {
					got, want := out.F32()[i*d+j], all[int(id)*d+j]
					if math.Float32bits(got) != math.Float32bits(want) {
						t.Fatalf("row %d (id %d) element %d: %v, want %v", i, id, j, got, want)
					}
				}
			}
		})
	}
}

// TestCPUMatMulQuantConcurrent runs quantized products of every method
// from several goroutines on one backend, whose calls share pooled
// buffers, and checks each against the same product on a backend of its
// own; run it under -race.
func TestCPUMatMulQuantConcurrent(t *testing.T) {
	c := tensor.NewCPU(2)
	defer c.Close()
	type job struct{ out, x, w, want *tensor.Tensor }
	var jobs []job
	r := rand.New(rand.NewPCG(7, 7))
	for _, dt := range []tensor.DType{tensor.Q8_0, tensor.Q4_K} {
		for _, m := range []int{1, 7, 40, 130} {
			const n, k = 96, 512
			x, _ := tensor.FromF32(tensor.Shape{m, k}, normals(r, m*k))
			w := blocksTensor(t, r, dt, tensor.Shape{n, k})
			want := tensor.New(tensor.F32, tensor.Shape{m, n})
			own := tensor.NewCPU(1)
			if err := own.MatMul(want, x, w, nil); err != nil {
				t.Fatal(err)
			}
			own.Close()
			jobs = append(jobs, job{tensor.New(tensor.F32, tensor.Shape{m, n}), x, w, want})
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(jobs))
	for g := range 4 {
		wg.Go(func() {
			for i := range 20 {
				j := jobs[(g+i)%len(jobs)]
				out := tensor.New(tensor.F32, j.out.Shape())
				if err := c.MatMul(out, j.x, j.w, nil); err != nil {
					errs <- err
					return
				}
				for e, v := range j.want.F32() {
					if out.F32()[e] != v {
						errs <- fmt.Errorf("goroutine %d, %v %v: element %d is %v, want %v", g, j.w.DType(), j.x.Shape(), e, out.F32()[e], v)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
