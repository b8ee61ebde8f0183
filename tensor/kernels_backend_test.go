package tensor_test

import (
	"fmt"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// TestCPUBackendKernels runs the shared backend suite on every kernel table
// this machine runs: the assembly ones and the portable Go fallback.
func TestCPUBackendKernels(t *testing.T) {
	for _, name := range tensor.KernelNames() {
		for _, threads := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/threads=%d", name, threads), func(t *testing.T) {
				c := tensor.NewCPUKernels(threads, name)
				defer c.Close()
				if c.Kernels() != name {
					t.Fatalf("backend runs %q kernels, want %q", c.Kernels(), name)
				}
				tensortest.TestBackend(t, c, tensortest.QuantizedActivations())
			})
		}
	}
}

// TestCPUGradOpsKernels runs the shared GradOps suite on every kernel table
// this machine runs.
func TestCPUGradOpsKernels(t *testing.T) {
	for _, name := range tensor.KernelNames() {
		for _, threads := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/threads=%d", name, threads), func(t *testing.T) {
				c := tensor.NewCPUKernels(threads, name)
				defer c.Close()
				if c.Kernels() != name {
					t.Fatalf("backend runs %q kernels, want %q", c.Kernels(), name)
				}
				tensortest.TestGradOps(t, c)
			})
		}
	}
}

// FuzzCPUMatMulGo fuzzes MatMul on the portable Go kernels (FuzzCPUMatMul
// covers the fastest table of the machine).
func FuzzCPUMatMulGo(f *testing.F) { fuzzKernels(f, "go") }

// FuzzCPUMatMulAVX2 fuzzes MatMul on the AVX2 kernels, where the machine
// has them (on an AVX-512 machine FuzzCPUMatMul runs the AVX-512 ones).
func FuzzCPUMatMulAVX2(f *testing.F) { fuzzKernels(f, "avx2") }

func fuzzKernels(f *testing.F, name string) {
	c := tensor.NewCPUKernels(2, name)
	f.Cleanup(func() { c.Close() })
	if c.Kernels() != name {
		f.Skipf("this machine has no %s kernels", name)
	}
	tensortest.FuzzMatMul(f, c, tensortest.QuantizedActivations())
}

// TestCPUNoAllocs checks, on every kernel table, that the operations of a
// decode step (and of a small prefill) allocate nothing once warm: the
// pool's jobs and the operations' state are recycled.
func TestCPUNoAllocs(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation counts: not run with -short")
	}
	if raceEnabled {
		t.Skip("allocation counts: sync.Pool drops items at random under -race")
	}
	for _, name := range tensor.KernelNames() {
		t.Run(name, func(t *testing.T) {
			c := tensor.NewCPUKernels(2, name)
			defer c.Close()
			testNoAllocs(t, tensor.Checked(c))
		})
	}
}

func testNoAllocs(t *testing.T, c tensor.Backend) {
	const heads, kvHeads, hd, hidden, inter = 8, 2, 16, 128, 344
	f32 := func(shape ...int) *tensor.Tensor { return tensor.New(tensor.F32, tensor.Shape(shape)) }
	x, h, q := f32(16, hidden), f32(16, hidden), f32(16, heads*hd)
	gate, up := f32(16, inter), f32(16, inter)
	kc, vc, attn := f32(64, kvHeads*hd), f32(64, kvHeads*hd), f32(16, heads*hd)
	wq := tensor.New(tensor.F16, tensor.Shape{heads * hd, hidden})
	wg := tensor.New(tensor.BF16, tensor.Shape{inter, hidden})
	// Quantized weights: an embedding table, and projections in 32-element
	// and K formats (zero blocks, whose scales are finite). Q4_1's prefill
	// runs on the gemm, the others' in integers.
	table := tensor.New(tensor.Q6_K, tensor.Shape{32, 256})
	w8 := tensor.New(tensor.Q8_0, tensor.Shape{inter, hidden})
	w41 := tensor.New(tensor.Q4_1, tensor.Shape{heads * hd, hidden})
	x4, y4 := f32(16, 256), f32(16, 96)
	w4 := tensor.New(tensor.Q4_K, tensor.Shape{96, 256})
	x41, _ := x4.Rows(0, 1)
	y41, _ := y4.Rows(0, 1)
	ids := []int32{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3}
	norm := tensor.New(tensor.F16, tensor.Shape{hidden})
	x1, _ := x.Rows(0, 1)
	h1, _ := h.Rows(0, 1)
	q1, _ := q.Rows(0, 1)
	g1, _ := gate.Rows(0, 1)
	u1, _ := up.Rows(0, 1)
	a1, _ := attn.Rows(0, 1)
	gateUp := func(h, gate, up *tensor.Tensor) ([]*tensor.Tensor, []*tensor.Tensor) {
		return []*tensor.Tensor{gate, up}, []*tensor.Tensor{wg, wg}
	}
	outs1, ws1 := gateUp(h1, g1, u1)
	outs, ws := gateUp(h, gate, up)
	step := func(x, h, q, gate, up, attn, x4, y4 *tensor.Tensor, pos int) {
		many, manyW := outs, ws
		if h.Shape()[0] == 1 {
			many, manyW = outs1, ws1
		}
		for _, err := range []error{
			tensor.MatMulMany(c, many, h, manyW),
			tensor.GateUpSiLU(c, gate, up, h, wg, wg),
			c.Embed(x4, table, ids[:x4.Shape()[0]]),
			c.RMSNorm(h, x, norm, 1e-5),
			c.MatMul(q, h, w41, nil),
			c.MatMul(q, h, wq, nil),
			c.Attention(attn, tensor.Attn{Q: q, K: kc, V: vc, Heads: heads, KVHeads: kvHeads, HeadDim: hd, Pos0: pos, Scale: 0.25}),
			c.MatMul(gate, h, wg, nil),
			c.MatMul(up, h, w8, nil),
			c.SiLUMul(gate, gate, up),
			c.MatMul(y4, x4, w4, nil),
			c.Add(x, x, h),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name string
		run  func()
	}{
		{"decode", func() { step(x1, h1, q1, g1, u1, a1, x41, y41, 40) }},
		{"prefill", func() { step(x, h, q, gate, up, attn, x4, y4, 0) }},
	} {
		tc.run()
		if n := testing.AllocsPerRun(50, tc.run); n != 0 {
			t.Errorf("%s step: %v allocations per run, want 0", tc.name, n)
		}
	}
}
