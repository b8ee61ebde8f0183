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

// TestMatMulRows: each row of MatMulRows has the bits of the one-row
// MatMul of that row, for every weight type (float and quantized), numbers
// of rows on both sides of the thresholds where MatMul changes kernels (2
// rows for the gemm, 32 and 128 for quantized weights), widths that are
// and are not multiples of the kernels' steps, with and without a bias, on
// every kernel table and thread count; through tensor.MatMulRows, which
// finds the CPU's behind the checks.
func TestMatMulRows(t *testing.T) {
	for _, name := range tensor.KernelNames() {
		for _, threads := range []int{1, 3} {
			for _, c := range []struct {
				dt   tensor.DType
				n, k int
				bias bool
			}{
				{tensor.F32, 70, 96, true},
				{tensor.F16, 130, 256, false},
				{tensor.BF16, 67, 40, true},
				{tensor.F16, 4, 2048, false},
				{tensor.Q8_0, 70, 256, false},
				{tensor.Q4_0, 33, 64, true},
				{tensor.Q4_K, 40, 512, false},
				{tensor.Q6_K, 9, 256, false},
			} {
				t.Run(fmt.Sprintf("%s/threads=%d/%v_%dx%d", name, threads, c.dt, c.n, c.k), func(t *testing.T) {
					b := tensor.NewCPUKernels(threads, name)
					defer b.Close()
					checkMatMulRows(t, b, c.dt, c.n, c.k, c.bias, []int{1, 2, 5, 33, 130})
				})
			}
		}
	}
}

func checkMatMulRows(t *testing.T, b tensor.Backend, dt tensor.DType, n, k int, withBias bool, ms []int) {
	t.Helper()
	r := rand.New(rand.NewPCG(uint64(n), uint64(k)))
	var w *tensor.Tensor
	if dt.IsQuantized() {
		blocks, err := tensortest.RandomBlocks(r, dt, n*k)
		if err != nil {
			t.Fatal(err)
		}
		if w, err = b.Alloc(dt, tensor.Shape{n, k}); err != nil {
			t.Fatal(err)
		}
		if err := b.Upload(w, 0, blocks); err != nil {
			t.Fatal(err)
		}
	} else {
		wv := make([]float32, n*k)
		for i := range wv {
			wv[i] = r.Float32()*2 - 1
		}
		var err error
		if w, err = tensortest.FromF32(b, dt, tensor.Shape{n, k}, wv); err != nil {
			t.Fatal(err)
		}
	}
	var bias *tensor.Tensor
	if withBias {
		bv := make([]float32, n)
		for i := range bv {
			bv[i] = r.Float32()
		}
		bias = rowsOf(t, b, bv, n, 0, 1)
		var err error
		if bias, err = bias.Reshape(tensor.Shape{n}); err != nil {
			t.Fatal(err)
		}
	}
	cb := tensor.Checked(b)
	for _, m := range ms {
		xv := make([]float32, m*k)
		for i := range xv {
			xv[i] = r.Float32()*4 - 2
		}
		out, err := b.Alloc(tensor.F32, tensor.Shape{m, n})
		if err != nil {
			t.Fatal(err)
		}
		if err := tensor.MatMulRows(cb, out, rowsOf(t, b, xv, k, 0, m), w, bias); err != nil {
			t.Fatal(err)
		}
		got, err := tensortest.ToF32(b, out)
		if err != nil {
			t.Fatal(err)
		}
		for i := range m {
			one, err := b.Alloc(tensor.F32, tensor.Shape{1, n})
			if err != nil {
				t.Fatal(err)
			}
			if err := cb.MatMul(one, rowsOf(t, b, xv, k, i, i+1), w, bias); err != nil {
				t.Fatal(err)
			}
			want, err := tensortest.ToF32(b, one)
			if err != nil {
				t.Fatal(err)
			}
			if j, ok := sameBits(got[i*n:(i+1)*n], want); !ok {
				t.Fatalf("%d rows: row %d column %d: %v, alone %v", m, i, j, got[i*n+j], want[j])
			}
		}
	}
}

// TestAttentionBlocksMatchesAttention: on the CPU, each row of
// AttentionBlocks has the bits Attention gives it over a contiguous cache
// of the same positions, for sequences whose blocks are spread over the
// pool, chunks longer than one task, and decode rows, on every kernel
// table and thread count.
func TestAttentionBlocksMatchesAttention(t *testing.T) {
	const heads, kvHeads, d, bs = 6, 2, 40, 8
	kw, qw := kvHeads*d, heads*d
	for _, name := range tensor.KernelNames() {
		for _, threads := range []int{1, 3} {
			for _, seqs := range [][][2]int{ // {pos0, rows}
				{{0, 1}, {13, 1}, {40, 1}},
				{{0, 75}, {8, 1}, {31, 9}},
				{{100, 1}},
			} {
				t.Run(fmt.Sprintf("%s/threads=%d/%v", name, threads, seqs), func(t *testing.T) {
					b := tensor.Checked(tensor.NewCPUKernels(threads, name))
					defer b.Close()
					r := rand.New(rand.NewPCG(uint64(len(seqs)), uint64(threads)))
					rnd := func(n int) []float32 {
						v := make([]float32, n)
						for i := range v {
							v[i] = r.Float32()*4 - 2
						}
						return v
					}
					nb := 0
					for _, s := range seqs {
						nb += (s[0] + s[1] + bs - 1) / bs
					}
					perm := r.Perm(nb)
					kp, vp := make([]float32, nb*bs*kw), make([]float32, nb*bs*kw)
					var q, kin, vin []float32
					var sb []tensor.SeqBlocks
					type want struct{ q, k, v []float32 }
					var alone []want
					for _, s := range seqs {
						n := s[0] + s[1]
						sq := tensor.SeqBlocks{Pos0: s[0], Rows: s[1]}
						for range (n + bs - 1) / bs {
							sq.Blocks = append(sq.Blocks, int32(perm[0]))
							perm = perm[1:]
						}
						k, v, qs := rnd(n*kw), rnd(n*kw), rnd(s[1]*qw)
						for j := range s[0] {
							dst := (int(sq.Blocks[j/bs])*bs + j%bs) * kw
							copy(kp[dst:dst+kw], k[j*kw:])
							copy(vp[dst:dst+kw], v[j*kw:])
						}
						q, kin, vin = append(q, qs...), append(kin, k[s[0]*kw:]...), append(vin, v[s[0]*kw:]...)
						sb, alone = append(sb, sq), append(alone, want{qs, k, v})
					}
					T := len(q) / qw
					out := rowsOf(t, b, make([]float32, T*qw), qw, 0, T)
					at := tensor.AttnBlocks{Q: rowsOf(t, b, q, qw, 0, T), K: rowsOf(t, b, kin, kw, 0, T), V: rowsOf(t, b, vin, kw, 0, T),
						KPool: rowsOf(t, b, kp, kw, 0, nb*bs), VPool: rowsOf(t, b, vp, kw, 0, nb*bs), Seqs: sb,
						Heads: heads, KVHeads: kvHeads, HeadDim: d, BlockSize: bs, Scale: 0.15}
					if err := b.AttentionBlocks(out, at); err != nil {
						t.Fatal(err)
					}
					row := 0
					for i, s := range seqs {
						w := alone[i]
						n := s[0] + s[1]
						o1 := rowsOf(t, b, make([]float32, s[1]*qw), qw, 0, s[1])
						a := tensor.Attn{Q: rowsOf(t, b, w.q, qw, 0, s[1]), K: rowsOf(t, b, w.k, kw, 0, n), V: rowsOf(t, b, w.v, kw, 0, n),
							Heads: heads, KVHeads: kvHeads, HeadDim: d, Pos0: s[0], Scale: 0.15}
						if err := b.Attention(o1, a); err != nil {
							t.Fatal(err)
						}
						if j, ok := sameBits(out.F32()[row*qw:(row+s[1])*qw], o1.F32()); !ok {
							t.Fatalf("sequence %d element %d: %v in blocks, %v contiguous", i, j, out.F32()[row*qw+j], o1.F32()[j])
						}
						row += s[1]
					}
				})
			}
		}
	}
}
