package tensor_test

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

func TestCPUBackend(t *testing.T) {
	for _, threads := range []int{1, 0, 3} {
		t.Run(fmt.Sprintf("threads=%d", threads), func(t *testing.T) {
			c := tensor.NewCPU(threads)
			defer c.Close()
			tensortest.TestBackend(t, c)
		})
	}
}

func TestCPUThreads(t *testing.T) {
	c := tensor.NewCPU(0)
	defer c.Close()
	if c.Threads() < 1 {
		t.Fatalf("NewCPU(0).Threads() = %d", c.Threads())
	}
	c3 := tensor.NewCPU(3)
	defer c3.Close()
	if c3.Threads() != 3 {
		t.Fatalf("NewCPU(3).Threads() = %d", c3.Threads())
	}
}

func TestCPURegistered(t *testing.T) {
	b, err := tensor.Open("cpu")
	if err != nil {
		t.Fatal(err)
	}
	if b.Name() != "cpu" {
		t.Fatalf("Open(\"cpu\").Name() = %q", b.Name())
	}
	c, ok := b.(*tensor.CPU)
	if !ok {
		t.Fatalf("Open(\"cpu\") is %T", b)
	}
	c.Close()
}

// randMatMul builds a random MatMul problem on c and returns its reference.
func randMatMul(t *testing.T, c *tensor.CPU, r *rand.Rand, m, n, k int, dt tensor.DType) (out, x, w *tensor.Tensor, want []float64) {
	t.Helper()
	rnd := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = r.Float32()*2 - 1
		}
		return v
	}
	xs, ws := rnd(m*k), rnd(n*k)
	var err error
	if x, err = tensortest.FromF32(c, tensor.F32, tensor.Shape{m, k}, xs); err != nil {
		t.Fatal(err)
	}
	if w, err = tensortest.FromF32(c, dt, tensor.Shape{n, k}, ws); err != nil {
		t.Fatal(err)
	}
	if out, err = c.Alloc(tensor.F32, tensor.Shape{m, n}); err != nil {
		t.Fatal(err)
	}
	xv, _ := tensortest.Stored(tensor.F32, xs)
	wv, _ := tensortest.Stored(dt, ws)
	return out, x, w, tensortest.RefMatMul(xv, wv, nil, m, n, k)
}

// TestCPUConcurrent runs operations from several goroutines on one backend
// (one shared worker pool); run it under -race.
func TestCPUConcurrent(t *testing.T) {
	c := tensor.NewCPU(2)
	defer c.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for i := range 3 {
				m := []int{1, 7, 40}[i]
				out, x, w, want := randMatMul(t, c, r, m, 300, 200, tensor.F16)
				if err := c.MatMul(out, x, w, nil); err != nil {
					errs <- err
					return
				}
				if e := tensortest.RelErr(out.F32(), want); e > 1e-5 {
					errs <- fmt.Errorf("goroutine %d, M=%d: relative error %g", g, m, e)
					return
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

// TestCPUAfterClose checks that operations still run, on the caller, after
// Close, and that Close may be repeated.
func TestCPUAfterClose(t *testing.T) {
	c := tensor.NewCPU(2)
	c.Close()
	c.Close()
	out, x, w, want := randMatMul(t, c, rand.New(rand.NewPCG(1, 2)), 20, 200, 300, tensor.BF16)
	if err := c.MatMul(out, x, w, nil); err != nil {
		t.Fatal(err)
	}
	if e := tensortest.RelErr(out.F32(), want); e > 1e-5 {
		t.Fatalf("relative error %g after Close", e)
	}
}

// TestCPUFree checks that a freed tensor cannot be used.
func TestCPUFree(t *testing.T) {
	c := tensor.NewCPU(1)
	defer c.Close()
	x, err := c.Alloc(tensor.F32, tensor.Shape{2, 2})
	if err != nil {
		t.Fatal(err)
	}
	c.Free(x)
	c.Free(x)
	c.Free(nil)
	if err := c.Download(make([]byte, 16), x); err == nil {
		t.Fatal("Download of a freed tensor succeeded")
	}
	y, _ := c.Alloc(tensor.F32, tensor.Shape{2, 2})
	if err := c.Add(y, x, y); err == nil {
		t.Fatal("Add with a freed operand succeeded")
	}
}

// TestCPUOverlap checks that outputs overlapping inputs are rejected where
// the result would be wrong, and accepted where the contract allows it.
func TestCPUOverlap(t *testing.T) {
	c := tensor.NewCPU(1)
	defer c.Close()
	x := tensor.New(tensor.F32, tensor.Shape{4, 4})
	w := tensor.New(tensor.F32, tensor.Shape{4, 4})
	if err := c.MatMul(x, x, w, nil); err == nil {
		t.Error("MatMul with out == x succeeded")
	}
	half, err := x.Rows(1, 2)
	if err != nil {
		t.Fatal(err)
	}
	rest, _ := x.Rows(0, 2)
	if err := c.Add(half, rest, rest); err == nil {
		t.Error("Add with out partially overlapping a succeeded")
	}
	if err := c.Add(x, x, x); err != nil {
		t.Errorf("Add in place: %v", err)
	}
	norm := tensor.New(tensor.F32, tensor.Shape{4})
	if err := c.RMSNorm(x, x, norm, 1e-5); err != nil {
		t.Errorf("RMSNorm in place: %v", err)
	}
}

// TestCPUZeroK checks the empty inner dimension: out is the bias.
func TestCPUZeroK(t *testing.T) {
	c := tensor.NewCPU(1)
	defer c.Close()
	x := tensor.New(tensor.F32, tensor.Shape{2, 0})
	w := tensor.New(tensor.F16, tensor.Shape{3, 0})
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

func FuzzCPUMatMul(f *testing.F) {
	c := tensor.NewCPU(0)
	defer c.Close()
	tensortest.FuzzMatMul(f, c)
}
