package tensor_test

import (
	"fmt"
	"math"
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
			tensortest.TestBackend(t, c, tensortest.QuantizedActivations(), tensortest.FusedTolerance(0))
		})
	}
}

func TestCPUGradOps(t *testing.T) {
	for _, threads := range []int{1, 0, 3} {
		t.Run(fmt.Sprintf("threads=%d", threads), func(t *testing.T) {
			c := tensor.NewCPU(threads)
			defer c.Close()
			tensortest.TestGradOps(t, c)
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
	tensortest.FuzzMatMul(f, c, tensortest.QuantizedActivations())
}

func FuzzCPUMatMulGrad(f *testing.F) {
	c := tensor.NewCPU(0)
	defer c.Close()
	tensortest.FuzzMatMulGrad(f, c)
}

// TestCPUGradFreed checks what the CPU's backward operations check
// themselves, that their operands are host memory, and that a failed
// CrossEntropyGrad leaves the logits as they were. (The aliasing rules are
// tensortest's, through tensor.Checked.)
func TestCPUGradFreed(t *testing.T) {
	c := tensor.NewCPU(1)
	defer c.Close()
	f32 := func(shape ...int) *tensor.Tensor { return tensor.New(tensor.F32, tensor.Shape(shape)) }
	a, b := f32(4, 4), f32(4, 4)
	// A freed tensor is an error.
	freed := f32(4, 4)
	c.Free(freed)
	if err := c.MatMulGradX(freed, a, b); err == nil {
		t.Error("MatMulGradX into a freed tensor succeeded")
	}
	if err := c.Zero(freed); err == nil {
		t.Error("Zero of a freed tensor succeeded")
	}
	// A target out of range leaves the logits as they were.
	logits, _ := tensor.FromF32(tensor.Shape{2, 3}, []float32{1, 2, 3, 4, 5, 6})
	g, _ := tensor.CheckedGrad(c)
	if _, err := g.CrossEntropyGrad(logits, []int32{0, 3}, 1); err == nil {
		t.Error("CrossEntropyGrad with target 3 of 3 logits succeeded")
	}
	for i, v := range logits.F32() {
		if v != float32(i+1) {
			t.Fatalf("logits changed by a failed CrossEntropyGrad: %v", logits.F32())
		}
	}
}

// TestCPUGradThreads checks that the backward operations give the same bits
// on one thread as on several: tasks own disjoint outputs, and partial sums
// are added in a fixed order.
func TestCPUGradThreads(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 9))
	rnd := func(shape ...int) *tensor.Tensor {
		x := tensor.New(tensor.F32, tensor.Shape(shape))
		for i := range x.F32() {
			x.F32()[i] = r.Float32()*2 - 1
		}
		return x
	}
	const m, n, k, heads, kvHeads, hd = 70, 300, 260, 6, 2, 16
	dy, x, dyn, xn := rnd(m, n), rnd(m, k), rnd(m, k), rnd(m, k)
	w := tensor.New(tensor.BF16, tensor.Shape{n, k})
	tensor.F32ToBF16(w.U16(), rnd(n, k).F32())
	norm := rnd(k)
	q, kk, vv, dout := rnd(m, heads*hd), rnd(m, kvHeads*hd), rnd(m, kvHeads*hd), rnd(m, heads*hd)
	logits := rnd(m, 1000)
	targets := make([]int32, m)
	for i := range targets {
		targets[i] = int32(r.IntN(1001)) - 1
	}
	run := func(threads int) [][]float32 {
		c := tensor.NewCPU(threads)
		defer c.Close()
		dx, dw, dxn, dwn := tensor.New(tensor.F32, tensor.Shape{m, k}), tensor.New(tensor.F32, tensor.Shape{n, k}), tensor.New(tensor.F32, tensor.Shape{m, k}), tensor.New(tensor.F32, tensor.Shape{k})
		dq, dk, dv := tensor.New(tensor.F32, q.Shape()), tensor.New(tensor.F32, kk.Shape()), tensor.New(tensor.F32, vv.Shape())
		z, _ := tensor.FromF32(logits.Shape(), append([]float32(nil), logits.F32()...))
		loss, err := c.CrossEntropyGrad(z, targets, 0.01)
		for _, e := range []error{
			c.MatMulGradX(dx, dy, w),
			c.MatMulGradW(dw, dy, x),
			c.RMSNormGrad(dxn, dwn, dyn, xn, norm, 1e-5),
			c.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: dout}, tensor.Attn{Q: q, K: kk, V: vv, Heads: heads, KVHeads: kvHeads, HeadDim: hd, Scale: 0.25}),
			err,
		} {
			if e != nil {
				t.Fatal(e)
			}
		}
		return [][]float32{dx.F32(), dw.F32(), dxn.F32(), dwn.F32(), dq.F32(), dk.F32(), dv.F32(), z.F32(), {float32(loss)}}
	}
	one, many := run(1), run(3)
	for i := range one {
		for j := range one[i] {
			if math.Float32bits(one[i][j]) != math.Float32bits(many[i][j]) {
				t.Fatalf("output %d element %d: %v on one thread, %v on three", i, j, one[i][j], many[i][j])
			}
		}
	}
}
