package tensortest

import (
	"fmt"
	"math"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// blocksCase is one shape of the AttentionBlocks tests: sequences given by
// their positions already cached (pos0) and the rows of the call.
type blocksCase struct {
	name                               string
	heads, kvHeads, headDim, blockSize int
	pos0, rows                         []int
	spare                              int // pool blocks no sequence uses
}

func (s *suite) testAttentionBlocks(t *testing.T) {
	cases := []blocksCase{
		{name: "decode", heads: 4, kvHeads: 2, headDim: 16, blockSize: 4, pos0: []int{0, 5, 11, 3}, rows: []int{1, 1, 1, 1}, spare: 3},
		{name: "prefill+decode", heads: 4, kvHeads: 2, headDim: 16, blockSize: 4, pos0: []int{0, 9, 4}, rows: []int{10, 1, 3}, spare: 1},
		{name: "one", heads: 8, kvHeads: 8, headDim: 64, blockSize: 16, pos0: []int{37}, rows: []int{1}},
		{name: "long-prefill", heads: 6, kvHeads: 1, headDim: 128, blockSize: 16, pos0: []int{0, 20}, rows: []int{70, 1}, spare: 2},
		{name: "block-edges", heads: 4, kvHeads: 1, headDim: 32, blockSize: 8, pos0: []int{7, 8, 15, 16}, rows: []int{1, 1, 2, 8}},
		{name: "empty-seq", heads: 4, kvHeads: 2, headDim: 16, blockSize: 4, pos0: []int{3, 6}, rows: []int{0, 2}},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/H%d_KV%d_D%d_B%d_seqs%d", c.name, c.heads, c.kvHeads, c.headDim, c.blockSize, len(c.rows)), func(t *testing.T) {
			s.attentionBlocks(t, c, tensor.F32)
		})
	}
	// Pools of each narrow cache dtype: the rows converted on the way in,
	// the positions read back widened.
	for _, dt := range s.cfg.cacheTypes {
		if dt == tensor.F32 {
			continue
		}
		for _, c := range cases[:4] {
			t.Run(fmt.Sprintf("%v/%s/H%d_KV%d_D%d_B%d_seqs%d", dt, c.name, c.heads, c.kvHeads, c.headDim, c.blockSize, len(c.rows)), func(t *testing.T) {
				s.attentionBlocks(t, c, dt)
			})
		}
	}
}

// attentionBlocks fills the pools (of dtype dt) with each sequence's
// cached positions in blocks spread over the pool in a shuffled order (the
// rest NaN: a backend that reads a position it should not fails), runs
// the rows, and checks each sequence's output against the contiguous
// reference over the values as stored and that the rows' keys and values
// landed in their slots, converted to dt.
func (s *suite) attentionBlocks(t *testing.T, c blocksCase, dt tensor.DType) {
	r := rng(t)
	bs, kw, qw := c.blockSize, c.kvHeads*c.headDim, c.heads*c.headDim
	nb := c.spare
	for i := range c.rows {
		nb += (c.pos0[i] + c.rows[i] + bs - 1) / bs
	}
	perm := r.Perm(nb)
	kpool, vpool := nans(nb*bs*kw), nans(nb*bs*kw)
	seqs := make([]tensor.SeqBlocks, len(c.rows))
	T, next := 0, 0
	kAll, vAll := make([][]float32, len(c.rows)), make([][]float32, len(c.rows)) // each sequence's positions, contiguous
	for i := range c.rows {
		n := c.pos0[i] + c.rows[i]
		sq := tensor.SeqBlocks{Rows: c.rows[i], Pos0: c.pos0[i]}
		for range (n + bs - 1) / bs {
			sq.Blocks = append(sq.Blocks, int32(perm[next]))
			next++
		}
		kAll[i], vAll[i] = uniform(r, n*kw, -1, 1), uniform(r, n*kw, -1, 1)
		for j := range c.pos0[i] {
			dst := (int(sq.Blocks[j/bs])*bs + j%bs) * kw
			copy(kpool[dst:dst+kw], kAll[i][j*kw:(j+1)*kw])
			copy(vpool[dst:dst+kw], vAll[i][j*kw:(j+1)*kw])
		}
		seqs[i] = sq
		T += c.rows[i]
	}
	var kin, vin []float32
	for i := range c.rows {
		kin = append(kin, kAll[i][c.pos0[i]*kw:]...)
		vin = append(vin, vAll[i][c.pos0[i]*kw:]...)
	}
	qv := uniform(r, T*qw, -1, 1)
	q, qs := s.put(t, tensor.F32, tensor.Shape{T, qw}, qv)
	k, _ := s.put(t, tensor.F32, tensor.Shape{T, kw}, kin)
	v, _ := s.put(t, tensor.F32, tensor.Shape{T, kw}, vin)
	kp := s.putPool(t, dt, nb*bs, kw, kpool)
	vp := s.putPool(t, dt, nb*bs, kw, vpool)
	out := s.poisoned(t, tensor.Shape{T, qw})
	scale := float32(1 / math.Sqrt(float64(c.headDim)))
	if err := s.b.AttentionBlocks(out, tensor.AttnBlocks{Q: q, K: k, V: v, KPool: kp, VPool: vp, Seqs: seqs,
		Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, BlockSize: bs, Scale: scale}); err != nil {
		t.Fatal(err)
	}
	got, gk, gv := s.get(t, out), s.get(t, kp), s.get(t, vp)
	row := 0
	for i, sq := range seqs {
		n := sq.Pos0 + sq.Rows
		if sq.Rows == 0 {
			continue
		}
		k64, err := Stored(dt, kAll[i])
		if err != nil {
			t.Fatal(err)
		}
		v64, err := Stored(dt, vAll[i])
		if err != nil {
			t.Fatal(err)
		}
		want := RefAttention(qs[row*qw:(row+sq.Rows)*qw], k64, v64, sq.Rows, c.heads, c.kvHeads, c.headDim, sq.Pos0, float64(scale))
		s.compare(t, fmt.Sprintf("sequence %d", i), got[row*qw:(row+sq.Rows)*qw], want)
		for j := sq.Pos0; j < n; j++ {
			src := (int(sq.Blocks[j/bs])*bs + j%bs) * kw
			for e := range kw {
				if float64(gk[src+e]) != k64[j*kw+e] || float64(gv[src+e]) != v64[j*kw+e] {
					t.Fatalf("sequence %d position %d: pool slot %d holds key %v value %v, want %v %v", i, j, src/kw, gk[src+e], gv[src+e], k64[j*kw+e], v64[j*kw+e])
				}
			}
		}
		row += sq.Rows
	}
}

// putPool uploads a pool of rows of width values in dtype dt: the rows of
// v that hold a NaN are uploaded with all bits set (NaN in every float
// type, a NaN scale in the 8-bit ones, which Encode refuses to write).
func (s *suite) putPool(t *testing.T, dt tensor.DType, rows, width int, v []float32) *tensor.Tensor {
	t.Helper()
	finite := append([]float32(nil), v...)
	unset := make([]bool, rows)
	for i, x := range finite {
		if x != x {
			finite[i], unset[i/width] = 0, true
		}
	}
	enc, err := Encode(dt, finite)
	if err != nil {
		t.Fatal(err)
	}
	rb := len(enc) / rows
	for r, u := range unset {
		if u {
			for i := r * rb; i < (r+1)*rb; i++ {
				enc[i] = 0xff
			}
		}
	}
	x, err := s.b.Alloc(dt, tensor.Shape{rows, width})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.b.Free(x) })
	if err := s.b.Upload(x, 0, enc); err != nil {
		t.Fatal(err)
	}
	return x
}
