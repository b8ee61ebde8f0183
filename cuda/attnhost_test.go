package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// attnHostCase is one call of a long-context attention kernel in the host
// harness.
type attnHostCase struct {
	name                               string
	dt                                 tensor.DType
	d, heads, kvHeads, t, pos0, maxPos int
	bound                              int // > 0: the split kernel reads pos0 from memory (tensor.Attn.PosAt), planned for this bound
	plan                               attnPlan
	q, k, v                            []float32 // k and v: the pos0+t rows written
	qs, ks, vs                         []float64 // as stored; qs as the kernel rounds q (roundQ16)
	exact                              []float64 // q unrounded
	scale                              float32
}

// TestAttentionKernelsOnHost runs the bodies of the split decode kernel
// (with its merge) and of the tiled tensor-core prefill kernel on the CPU
// through testdata/attnhost.cpp, built with nvcc as plain C++ where nvcc
// is installed: one host thread per GPU thread, the warps' shuffles and
// mma.sync computed from their lanes' registers as the hardware lays them
// out. Each case takes the kernel and split planAttention chooses (the
// prefill kernel for at least flashMinRows queries) over F32, F16, BF16
// Q8_0 and Q8_B8 caches whose unwritten rows are NaN, against the float64
// reference over the stored values: within 1e-5 relative for the split
// kernel (F32 arithmetic), and the rounding of the products' inputs for
// the tiled one (F16: 4e-3, BF16: 2e-2); and no read outside the rows
// written, none misaligned for its load. The shapes cut tiles and splits
// short (odd T, positions not a multiple of the tile or chunk), start
// chunks mid-cache (pos0 > 0), and group 1 to 8 query heads on a KV head
// (the prefill kernel packs a group's heads as rows of its tiles: groups of
// 3 put one query's rows in two warps). Then the caches' quantizers
// (kv_append_q8_0, kv_append_q8_b8) must write the bytes that the CPU's
// CopyRows writes (tensortest.Encode), on values with outliers, zeros, a
// block of zeros and scales too small for a normal F16; and the paged
// cache's kernels (kv_write_blocks, attention_blocks) over pools of each
// cache dtype: the rows' slots hold the bytes CopyRows writes, the output
// is the reference's over the stored values within 1e-5, and no read
// falls on a pool row left NaN.
func TestAttentionKernelsOnHost(t *testing.T) {
	ctx, bin := hostHarness(t, "attnhost.cpp")
	all := func(string) bool { return true }
	r := rand.New(rand.NewPCG(3, 4))
	var cases []*attnHostCase
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q8_B8} {
		for _, s := range []struct{ d, heads, kvHeads, t, pos0, bound int }{
			// Decode: one pass, several splits, the last one short, and
			// up to splitMaxRows queries whose lengths differ.
			{128, 4, 1, 1, 40, 0},
			{128, 2, 2, 1, 700, 0},
			{64, 8, 2, 3, 530, 0},
			{256, 2, 1, 1, 300, 0},
			{64, 2, 1, 4, 255, 0},
			// A captured decode step: the splits planned for a bound of
			// 900 positions, the kernel reading 450 from memory (the last
			// splits empty).
			{128, 4, 2, 1, 450, 900},
			{64, 2, 1, 2, 0, 600},
			// Prefill: tiles of 64 queries and 32 keys cut short.
			{64, 4, 2, 16, 0, 0},
			{64, 2, 1, 130, 0, 0},
			{128, 2, 2, 70, 33, 0},
			{128, 8, 1, 20, 5, 0},
			// A group's heads packed as rows: groups of 3 and 4 cut
			// warps and tiles mid-query.
			{64, 6, 2, 21, 0, 0},
			{128, 8, 2, 37, 10, 0},
		} {
			c := &attnHostCase{dt: dt, d: s.d, heads: s.heads, kvHeads: s.kvHeads, t: s.t, pos0: s.pos0, maxPos: max(s.pos0, s.bound) + s.t + 3, bound: s.bound}
			c.plan = planAttention(s.t, s.heads, s.d, max(s.pos0, s.bound), dt, true, false, splitChunk, all)
			c.scale = float32(1 / math.Sqrt(float64(s.d)))
			n, kw := s.pos0+s.t, s.kvHeads*s.d
			c.q = uniform32(r, s.t*s.heads*s.d, -2, 2)
			c.k, c.v = uniform32(r, n*kw, -2, 2), uniform32(r, n*kw, -1, 1)
			// A few large keys: scores far apart, as softmax must survive.
			for i := 7; i < len(c.k); i += 301 {
				c.k[i] *= 8
			}
			for _, x := range []struct {
				v   []float32
				out *[]float64
			}{{c.q, &c.qs}, {c.k, &c.ks}, {c.v, &c.vs}} {
				dt := dt
				if x.out == &c.qs {
					dt = tensor.F32
				}
				var err error
				if *x.out, err = tensortest.Stored(dt, x.v); err != nil {
					t.Fatal(err)
				}
			}
			c.exact = c.qs
			if strings.HasPrefix(c.plan.kernel, "attention_split_q8_0") && s.d%128 == 0 {
				c.qs = roundQ16(c.qs)
			}
			c.name = fmt.Sprintf("%v/%s/D%d_H%d_KV%d_T%d_pos%d", dt, c.plan.kernel, s.d, s.heads, s.kvHeads, s.t, s.pos0)
			if s.bound > 0 {
				c.name += fmt.Sprintf("_at_bound%d", s.bound)
			}
			if !strings.HasPrefix(c.plan.kernel, "flash_") && !strings.HasPrefix(c.plan.kernel, "attention_split_") {
				t.Fatalf("%s: planAttention chose %s, which the harness does not run", c.name, c.plan.kernel)
			}
			cases = append(cases, c)
		}
	}
	var req bytes.Buffer
	for _, c := range cases {
		if err := c.request(&req); err != nil {
			t.Fatal(err)
		}
	}
	var blocks []*blocksHostCase
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q8_B8} {
		for _, sh := range []struct {
			heads, kvHeads, d, bs int
			pos0, rows            []int
		}{
			{4, 2, 64, 16, []int{0, 20, 5}, []int{10, 1, 3}},
			{8, 1, 128, 8, []int{37, 0}, []int{1, 17}},
		} {
			c := newBlocksHostCase(t, r, dt, sh.heads, sh.kvHeads, sh.d, sh.bs, sh.pos0, sh.rows)
			if err := c.request(&req); err != nil {
				t.Fatal(err)
			}
			blocks = append(blocks, c)
		}
	}
	appends := appendHostCases(r)
	for _, a := range appends {
		for _, v := range []int32{3, attnHostDType[a.dt], int32(len(a.x))} {
			binary.Write(&req, binary.LittleEndian, v)
		}
		binary.Write(&req, binary.LittleEndian, a.x)
	}
	ropes := ropeQ8HostCases(r)
	for _, c := range ropes {
		c.request(&req)
	}
	req.Write(make([]byte, 4)) // op 0: end
	cmd := exec.CommandContext(ctx, bin)
	cmd.Stdin = &req
	var resp, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &resp, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("attnhost: %v\n%s", err, stderr.Bytes())
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.check(t, &resp) })
	}
	for _, c := range blocks {
		t.Run(c.name, func(t *testing.T) { c.check(t, &resp) })
	}
	for _, a := range appends {
		t.Run(fmt.Sprintf("append/%v/%s", a.dt, a.name), func(t *testing.T) {
			want, err := tensortest.Encode(a.dt, a.x)
			if err != nil {
				t.Fatal(err)
			}
			got := resp.Next(len(want))
			if !bytes.Equal(got, want) {
				bb := a.dt.BlockBytes()
				for i := 0; i < len(want); i += bb {
					if !bytes.Equal(got[i:min(i+bb, len(got))], want[i:i+bb]) {
						t.Fatalf("block %d: got % x, want % x (values %v)", i/bb, got[i:min(i+bb, len(got))], want[i:i+bb], a.x[i/bb*a.dt.BlockSize():(i/bb+1)*a.dt.BlockSize()])
					}
				}
			}
		})
	}
	for _, c := range ropes {
		t.Run(c.name, func(t *testing.T) { c.check(t, &resp) })
	}
	if resp.Len() != 0 {
		t.Errorf("%d bytes left over in the harness's output", resp.Len())
	}
}

// ropeQ8HostCase is one call of rope_kv_q8 (RopeKV into a Q8_0 or Q8_B8
// cache) in the host harness.
type ropeQ8HostCase struct {
	name                     string
	dt                       tensor.DType
	t, heads, kvHeads, d, p0 int
	q, k, v, cos, sin        []float32
}

// ropeQ8HostCases: heads of 32 to 128, one to three rows, groups of query
// heads on a KV head, keys with outliers (as rotated keys have), and for
// Q8_B8 a row of 40 values, whose keys and values (80) end mid-warp: q's
// pairs then start at the next warp.
func ropeQ8HostCases(r *rand.Rand) []*ropeQ8HostCase {
	var out []*ropeQ8HostCase
	for _, dt := range []tensor.DType{tensor.Q8_0, tensor.Q8_B8} {
		shapes := []struct{ t, heads, kvHeads, d, p0 int }{
			{1, 8, 2, 64, 17}, {3, 4, 4, 128, 5}, {2, 6, 3, 32, 0}, {1, 32, 32, 128, 40},
		}
		if dt == tensor.Q8_B8 {
			shapes = append(shapes, struct{ t, heads, kvHeads, d, p0 int }{1, 2, 1, 40, 3})
		}
		for _, s := range shapes {
			c := &ropeQ8HostCase{dt: dt, t: s.t, heads: s.heads, kvHeads: s.kvHeads, d: s.d, p0: s.p0}
			c.name = fmt.Sprintf("rope_kv/%v/T%d_H%d_KV%d_D%d_p%d", dt, s.t, s.heads, s.kvHeads, s.d, s.p0)
			kw := s.kvHeads * s.d
			c.q = uniform32(r, s.t*s.heads*s.d, -2, 2)
			c.k, c.v = uniform32(r, s.t*kw, -2, 2), uniform32(r, s.t*kw, -1, 1)
			for i := 5; i < len(c.k); i += 53 {
				c.k[i] *= 30
			}
			cos, sin := tensortest.RopeTables(s.p0+s.t, s.d, 10000)
			for i := range cos {
				c.cos, c.sin = append(c.cos, float32(cos[i])), append(c.sin, float32(sin[i]))
			}
			out = append(out, c)
		}
	}
	return out
}

func (c *ropeQ8HostCase) request(w *bytes.Buffer) {
	for _, v := range []int32{5, attnHostDType[c.dt], int32(c.t), int32(c.heads), int32(c.kvHeads), int32(c.d), int32(c.p0)} {
		binary.Write(w, binary.LittleEndian, v)
	}
	for _, x := range [][]float32{c.q, c.k, c.v, c.cos, c.sin} {
		binary.Write(w, binary.LittleEndian, x)
	}
}

// rotate is Rope's rotation of rows of heads of d values at positions
// p0.., each product rounded to float32 before the sum, as the harness's
// C++ (no fused multiply-add) computes it.
func (c *ropeQ8HostCase) rotate(x []float32, heads int) []float32 {
	y := slices.Clone(x)
	half := c.d / 2
	for t := range c.t {
		for h := range heads {
			row := y[(t*heads+h)*c.d:]
			for j := range half {
				co, si := c.cos[(c.p0+t)*half+j], c.sin[(c.p0+t)*half+j]
				x1, x2 := row[j], row[j+half]
				row[j] = float32(x1*co) - float32(x2*si)
				row[j+half] = float32(x2*co) + float32(x1*si)
			}
		}
	}
	return y
}

// check: q rotated to the bit, and every row of each cache the bytes
// CopyRows writes of the rotated keys and the values (tensortest.Encode);
// the rows before p0 untouched.
func (c *ropeQ8HostCase) check(t *testing.T, resp *bytes.Buffer) {
	q := make([]float32, len(c.q))
	if err := binary.Read(resp, binary.LittleEndian, q); err != nil {
		t.Fatal(err)
	}
	kw := c.kvHeads * c.d
	rowBytes := kw / c.dt.BlockSize() * c.dt.BlockBytes()
	kc, vc := resp.Next(rowBytes*(c.p0+c.t)), resp.Next(rowBytes*(c.p0+c.t))
	for i, want := range c.rotate(c.q, c.heads) {
		if math.Float32bits(q[i]) != math.Float32bits(want) {
			t.Fatalf("q[%d] = %v, want %v", i, q[i], want)
		}
	}
	rk := c.rotate(c.k, c.kvHeads)
	for _, x := range []struct {
		name  string
		cache []byte
		rows  []float32
	}{{"key", kc, rk}, {"value", vc, c.v}} {
		if i := slices.IndexFunc(x.cache[:rowBytes*c.p0], func(b byte) bool { return b != 0xa5 }); i >= 0 {
			t.Fatalf("%s cache byte %d, before row %d, was written", x.name, i, c.p0)
		}
		for r := range c.t {
			want, err := tensortest.Encode(c.dt, x.rows[r*kw:(r+1)*kw])
			if err != nil {
				t.Fatal(err)
			}
			got := x.cache[(c.p0+r)*rowBytes : (c.p0+r+1)*rowBytes]
			if !bytes.Equal(got, want) {
				bb := c.dt.BlockBytes()
				for i := 0; i < len(want); i += bb {
					if !bytes.Equal(got[i:i+bb], want[i:i+bb]) {
						t.Fatalf("%s row %d block %d: got % x, want % x", x.name, r, i/bb, got[i:i+bb], want[i:i+bb])
					}
				}
			}
		}
	}
}

func uniform32(r *rand.Rand, n int, lo, hi float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = lo + (hi-lo)*r.Float32()
	}
	return v
}

var attnHostDType = map[tensor.DType]int32{tensor.F32: 0, tensor.F16: 1, tensor.BF16: 2, tensor.Q8_0: 3, tensor.Q8_B8: 4}

// appendHostCase is a run of values the harness quantizes as a cache
// append does.
type appendHostCase struct {
	name string
	dt   tensor.DType
	x    []float32
}

func appendHostCases(r *rand.Rand) []appendHostCase {
	var out []appendHostCase
	for _, dt := range []tensor.DType{tensor.Q8_0, tensor.Q8_B8} {
		wide := uniform32(r, 4096, -3, 3)
		for i := 11; i < len(wide); i += 37 {
			wide[i] *= 40 // outliers, as keys have
		}
		for i := 64; i < 96; i++ {
			wide[i] = 0 // a block of zeros
		}
		wide[200] = 0
		tiny := uniform32(r, 256, -1e-5, 1e-5) // scales below the normal F16s
		// A grid of halves: many values that round the same way in each
		// block.
		halves := make([]float32, 256)
		for i := range halves {
			halves[i] = float32(i%32-16) + 0.5
		}
		out = append(out, appendHostCase{"uniform-outliers", dt, wide}, appendHostCase{"tiny", dt, tiny}, appendHostCase{"halves", dt, halves})
	}
	return out
}

func (c *attnHostCase) request(w *bytes.Buffer) error {
	op := int32(1)
	if strings.HasPrefix(c.plan.kernel, "flash_") {
		op = 2
	}
	chunk, splits := c.plan.chunk, c.plan.splits
	if op == 2 {
		chunk, splits = 0, 1
	}
	pos0, posAt := c.pos0, -1
	if c.bound > 0 {
		pos0, posAt = c.bound, c.pos0
	}
	for _, v := range []int32{op, attnHostDType[c.dt], int32(c.d), int32(c.heads), int32(c.kvHeads), int32(c.t), int32(pos0), int32(c.maxPos), int32(chunk), int32(splits), int32(posAt)} {
		binary.Write(w, binary.LittleEndian, v)
	}
	binary.Write(w, binary.LittleEndian, c.scale)
	binary.Write(w, binary.LittleEndian, c.q)
	kw := c.kvHeads * c.d
	for _, vals := range [][]float32{c.k, c.v} {
		enc, err := tensortest.Encode(c.dt, vals)
		if err != nil {
			return err
		}
		rows, err := c.dt.Bytes(int64(c.maxPos * kw))
		if err != nil {
			return err
		}
		all := bytes.Repeat([]byte{0xff}, int(rows)) // unwritten rows: NaN
		copy(all, enc)
		w.Write(all)
	}
	return nil
}

func (c *attnHostCase) check(t *testing.T, resp *bytes.Buffer) {
	var violations int64
	if err := binary.Read(resp, binary.LittleEndian, &violations); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, c.t*c.heads*c.d)
	if err := binary.Read(resp, binary.LittleEndian, got); err != nil {
		t.Fatal(err)
	}
	if violations != 0 {
		t.Errorf("%d cache reads outside the rows written or misaligned", violations)
	}
	want := tensortest.RefAttention(c.qs, c.ks, c.vs, c.t, c.heads, c.kvHeads, c.d, c.pos0, float64(c.scale))
	for i, g := range got {
		if math.IsNaN(float64(g)) || math.IsInf(float64(g), 0) {
			t.Fatalf("out[%d] = %v: not written, or a NaN read (want %v)", i, g, want[i])
		}
	}
	tol := 1e-5
	switch {
	case strings.HasPrefix(c.plan.kernel, "flash_attention_bf16"):
		tol = 2e-2
	case strings.HasPrefix(c.plan.kernel, "flash_"):
		tol = 4e-3
	}
	e := tensortest.RelErr(got, want)
	worst := 0.0
	for i, g := range got {
		worst = max(worst, math.Abs(float64(g)-want[i]))
	}
	t.Logf("%d splits of %d: relative error %.3g, largest absolute %.3g", c.plan.splits, c.plan.chunk, e, worst)
	if &c.exact[0] != &c.qs[0] {
		exact := tensortest.RefAttention(c.exact, c.ks, c.vs, c.t, c.heads, c.kvHeads, c.d, c.pos0, float64(c.scale))
		t.Logf("q rounded to 16 bits: relative error %.3g against q unrounded", tensortest.RelErr(got, exact))
	}
	if !(e <= tol) {
		t.Errorf("relative error %.3g > %.3g", e, tol)
	}
}

// blocksHostCase is one AttentionBlocks call in the host harness: the
// pools' blocks shuffled, the positions cached before the call stored,
// the rest of the pools all bits set.
type blocksHostCase struct {
	name         string
	dt           tensor.DType
	at           tensor.AttnBlocks
	poolRows, t  int
	q, k, v      []float32 // the call's rows
	kpool, vpool []byte
	kAll, vAll   [][]float32 // each sequence's positions
	qs           []float64
}

func newBlocksHostCase(t *testing.T, r *rand.Rand, dt tensor.DType, heads, kvHeads, d, bs int, pos0, rows []int) *blocksHostCase {
	kw := kvHeads * d
	nb := 2 // spare blocks
	for i := range rows {
		nb += (pos0[i] + rows[i] + bs - 1) / bs
	}
	c := &blocksHostCase{dt: dt, poolRows: nb * bs,
		name: fmt.Sprintf("blocks/%v/H%d_KV%d_D%d_B%d_seqs%d", dt, heads, kvHeads, d, bs, len(rows))}
	rb, err := dt.Bytes(int64(kw))
	if err != nil {
		t.Fatal(err)
	}
	c.kpool, c.vpool = bytes.Repeat([]byte{0xff}, nb*bs*int(rb)), bytes.Repeat([]byte{0xff}, nb*bs*int(rb))
	perm, next := r.Perm(nb), 0
	for i := range rows {
		n := pos0[i] + rows[i]
		sq := tensor.SeqBlocks{Rows: rows[i], Pos0: pos0[i]}
		for range (n + bs - 1) / bs {
			sq.Blocks = append(sq.Blocks, int32(perm[next]))
			next++
		}
		k, v := uniform32(r, n*kw, -2, 2), uniform32(r, n*kw, -1, 1)
		for j := range pos0[i] {
			slot := int(sq.Blocks[j/bs])*bs + j%bs
			for _, x := range []struct {
				pool []byte
				vals []float32
			}{{c.kpool, k}, {c.vpool, v}} {
				enc, err := tensortest.Encode(dt, x.vals[j*kw:(j+1)*kw])
				if err != nil {
					t.Fatal(err)
				}
				copy(x.pool[slot*int(rb):], enc)
			}
		}
		c.k, c.v = append(c.k, k[pos0[i]*kw:]...), append(c.v, v[pos0[i]*kw:]...)
		c.kAll, c.vAll = append(c.kAll, k), append(c.vAll, v)
		c.at.Seqs = append(c.at.Seqs, sq)
		c.t += rows[i]
	}
	c.q = uniform32(r, c.t*heads*d, -2, 2)
	c.qs = make([]float64, len(c.q))
	for i, x := range c.q {
		c.qs[i] = float64(x)
	}
	c.at.Heads, c.at.KVHeads, c.at.HeadDim, c.at.BlockSize = heads, kvHeads, d, bs
	c.at.Scale = float32(1 / math.Sqrt(float64(d)))
	return c
}

func (c *blocksHostCase) request(w *bytes.Buffer) error {
	meta := blocksMeta(c.at, c.t)
	for _, v := range []int32{4, attnHostDType[c.dt], int32(c.at.Heads), int32(c.at.KVHeads), int32(c.at.HeadDim), int32(c.at.BlockSize), int32(c.t), int32(c.poolRows), int32(len(meta))} {
		binary.Write(w, binary.LittleEndian, v)
	}
	binary.Write(w, binary.LittleEndian, c.at.Scale)
	binary.Write(w, binary.LittleEndian, meta)
	for _, x := range [][]float32{c.q, c.k, c.v} {
		binary.Write(w, binary.LittleEndian, x)
	}
	w.Write(c.kpool)
	w.Write(c.vpool)
	return nil
}

func (c *blocksHostCase) check(t *testing.T, resp *bytes.Buffer) {
	var violations int64
	if err := binary.Read(resp, binary.LittleEndian, &violations); err != nil {
		t.Fatal(err)
	}
	qw, kw := c.at.Heads*c.at.HeadDim, c.at.KVHeads*c.at.HeadDim
	got := make([]float32, c.t*qw)
	if err := binary.Read(resp, binary.LittleEndian, got); err != nil {
		t.Fatal(err)
	}
	kp, vp := resp.Next(len(c.kpool)), resp.Next(len(c.vpool))
	if violations != 0 {
		t.Errorf("%d pool reads outside the pools or misaligned", violations)
	}
	rb := len(c.kpool) / c.poolRows
	row := 0
	for i, sq := range c.at.Seqs {
		ks, err := tensortest.Stored(c.dt, c.kAll[i])
		if err != nil {
			t.Fatal(err)
		}
		vs, err := tensortest.Stored(c.dt, c.vAll[i])
		if err != nil {
			t.Fatal(err)
		}
		want := tensortest.RefAttention(c.qs[row*qw:(row+sq.Rows)*qw], ks, vs, sq.Rows, c.at.Heads, c.at.KVHeads, c.at.HeadDim, sq.Pos0, float64(c.at.Scale))
		g := got[row*qw : (row+sq.Rows)*qw]
		if e := tensortest.RelErr(g, want); !(e <= 1e-5) {
			t.Errorf("sequence %d: relative error %.3g > 1e-5", i, e)
		}
		for j := sq.Pos0; j < sq.Pos0+sq.Rows; j++ {
			slot := int(sq.Blocks[j/c.at.BlockSize])*c.at.BlockSize + j%c.at.BlockSize
			for _, x := range []struct {
				pool []byte
				vals []float32
			}{{kp, c.kAll[i]}, {vp, c.vAll[i]}} {
				want, err := tensortest.Encode(c.dt, x.vals[j*kw:(j+1)*kw])
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(x.pool[slot*rb:(slot+1)*rb], want) {
					t.Fatalf("sequence %d position %d: slot %d holds % x, want % x", i, j, slot, x.pool[slot*rb:slot*rb+min(rb, 16)], want[:min(rb, 16)])
				}
			}
		}
		row += sq.Rows
	}
}

// roundQ16 rounds q as the split decode kernel does for a Q8_0 cache read
// by kv_cache_q8w (kvcache.cuh's set_query): each 8 values (a lane's) to
// int16 levels of their largest magnitude, ties to even.
func roundQ16(q []float64) []float64 {
	r := make([]float64, len(q))
	for i := 0; i < len(q); i += 8 {
		a := 0.0
		for _, v := range q[i : i+8] {
			a = max(a, math.Abs(v))
		}
		if a == 0 {
			continue
		}
		for j, v := range q[i : i+8] {
			r[i+j] = math.RoundToEven(v*32767/a) * a / 32767
		}
	}
	return r
}
