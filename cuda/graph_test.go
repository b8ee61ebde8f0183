//go:build cuda

package cuda

import (
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// miniStep is one decoder block's decode step on small F16 weights, with
// every fused operation: what nn captures per block.
type miniStep struct {
	b                                   tensor.Backend
	x, h, q, k, v, attn, proj, gate, up *tensor.Tensor
	kc, vc, cos, sin, pos               *tensor.Tensor
	wn1, wn2, wq, wk, wv, wo, wg, wu    *tensor.Tensor
	wd                                  *tensor.Tensor
	heads, kvHeads, headDim, maxPos     int
}

// blockDims are a decoder block's sizes.
type blockDims struct{ d, heads, kvHeads, headDim, inter, maxPos int }

// smallBlock is the block of TestGraphReplay; llama7B a Llama-2-7B block,
// tinyLlama a TinyLlama-1.1B block.
var (
	smallBlock = blockDims{d: 256, heads: 4, kvHeads: 2, headDim: 64, inter: 512, maxPos: 96}
	llama7B    = blockDims{d: 4096, heads: 32, kvHeads: 32, headDim: 128, inter: 11008, maxPos: 4096}
	tinyLlama  = blockDims{d: 2048, heads: 32, kvHeads: 4, headDim: 64, inter: 5632, maxPos: 2048}
)

// newMiniStep uploads a block of dims with the weights weights gives by
// name and size (n1, n2: the norms; q, k, v, o; g, u, d: the MLP) and the
// residual x0.
func newMiniStep(t testing.TB, b *Backend, dims blockDims, x0 []float32, weights func(name string, n int) []float32) *miniStep {
	t.Helper()
	d, heads, kvHeads, headDim, inter, maxPos := dims.d, dims.heads, dims.kvHeads, dims.headDim, dims.inter, dims.maxPos
	s := &miniStep{b: tensor.Checked(b), heads: heads, kvHeads: kvHeads, headDim: headDim, maxPos: maxPos}
	f32 := func(shape tensor.Shape, v []float32) *tensor.Tensor {
		if v == nil {
			v = nanSlice(int(shape.NumElements()))
		}
		x, _ := put(t, b, tensor.F32, shape, v)
		return x
	}
	w16 := func(name string, shape tensor.Shape) *tensor.Tensor {
		x, _ := put(t, b, tensor.F16, shape, weights(name, int(shape.NumElements())))
		return x
	}
	s.x = f32(tensor.Shape{1, d}, x0)
	s.h, s.proj = f32(tensor.Shape{1, d}, nil), f32(tensor.Shape{1, d}, nil)
	s.q, s.attn = f32(tensor.Shape{1, heads * headDim}, nil), f32(tensor.Shape{1, heads * headDim}, nil)
	s.k, s.v = f32(tensor.Shape{1, kvHeads * headDim}, nil), f32(tensor.Shape{1, kvHeads * headDim}, nil)
	s.gate, s.up = f32(tensor.Shape{1, inter}, nil), f32(tensor.Shape{1, inter}, nil)
	s.kc = f32(tensor.Shape{maxPos, kvHeads * headDim}, nil)
	s.vc = f32(tensor.Shape{maxPos, kvHeads * headDim}, nil)
	cos, sin := tensortest.RopeTables(maxPos, headDim, 10000)
	s.cos = f32(tensor.Shape{maxPos, headDim / 2}, toF32s(cos))
	s.sin = f32(tensor.Shape{maxPos, headDim / 2}, toF32s(sin))
	s.wn1, s.wn2 = w16("n1", tensor.Shape{d}), w16("n2", tensor.Shape{d})
	s.wq, s.wo = w16("q", tensor.Shape{heads * headDim, d}), w16("o", tensor.Shape{d, heads * headDim})
	s.wk, s.wv = w16("k", tensor.Shape{kvHeads * headDim, d}), w16("v", tensor.Shape{kvHeads * headDim, d})
	s.wg, s.wu, s.wd = w16("g", tensor.Shape{inter, d}), w16("u", tensor.Shape{inter, d}), w16("d", tensor.Shape{d, inter})
	var err error
	if s.pos, err = b.Alloc(tensor.I32, tensor.Shape{1}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Free(s.pos) })
	return s
}

func toF32s(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// run queues the step at position pos, or, when bound >= 0, at the
// position s.pos holds (at most bound).
func (s *miniStep) run(pos, bound int) error {
	b := s.b
	var at *tensor.Tensor
	if bound >= 0 {
		pos, at = bound, s.pos
	}
	if err := b.RMSNorm(s.h, s.x, s.wn1, 1e-5); err != nil {
		return err
	}
	if err := tensor.MatMulMany(b, []*tensor.Tensor{s.q, s.k, s.v}, s.h, []*tensor.Tensor{s.wq, s.wk, s.wv}); err != nil {
		return err
	}
	rot := tensor.Rotary{Cos: s.cos, Sin: s.sin, Heads: s.heads, HeadDim: s.headDim, Pos0: pos, PosAt: at}
	if err := tensor.RopeKV(b, s.q, s.k, s.v, s.kc, s.vc, rot); err != nil {
		return err
	}
	a := tensor.Attn{Q: s.q, K: s.kc, V: s.vc, Heads: s.heads, KVHeads: s.kvHeads, HeadDim: s.headDim, Pos0: pos, Scale: 0.125, PosAt: at}
	if err := b.Attention(s.attn, a); err != nil {
		return err
	}
	if err := b.MatMul(s.proj, s.attn, s.wo, nil); err != nil {
		return err
	}
	if err := tensor.AddRMSNorm(b, s.h, s.x, s.proj, s.wn2, 1e-5); err != nil {
		return err
	}
	if err := tensor.GateUpSiLU(b, s.gate, s.up, s.h, s.wg, s.wu); err != nil {
		return err
	}
	if err := b.MatMul(s.proj, s.gate, s.wd, nil); err != nil {
		return err
	}
	return b.Add(s.x, s.x, s.proj)
}

func (s *miniStep) setPos(t testing.TB, p int) {
	t.Helper()
	var buf [4]byte
	binary.LittleEndian.PutUint32(buf[:], uint32(p))
	if err := s.b.Upload(s.pos, 0, buf[:]); err != nil {
		t.Fatal(err)
	}
}

// TestGraphReplay runs a decoder block's decode step (norm, q/k/v
// products, RopeKV, attention, o product, AddRMSNorm, GateUpSiLU, down
// product, residual add) for 80 positions eagerly on one set of buffers
// and as a captured graph replayed with the position in device memory on
// another, and checks that the residual streams agree within 1e-5 after
// every step (the graph's kernels read the position, the eager ones take
// it as an argument; the arithmetic is the same). Two graphs are
// captured: one bounded to positions below 32, and one after the
// sequence crosses that bound. It logs the launches and the time per
// step of each path.
func TestGraphReplay(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	weights := randomWeights(r)
	x0 := uniform(r, 256, -1, 1)
	eager, graphed := newMiniStep(t, b, smallBlock, x0, weights), newMiniStep(t, b, smallBlock, x0, weights)
	const steps, bucket = 80, 32
	var g tensor.Graph
	var bound int
	var eagerTime, graphTime time.Duration
	var eagerL, graphL tensor.Launches
	captures := 0
	for p := range steps {
		l0, t0 := b.Launches(), time.Now()
		if err := eager.run(p, -1); err != nil {
			t.Fatalf("eager step %d: %v", p, err)
		}
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		eagerTime += time.Since(t0)
		eagerL = addLaunches(eagerL, b.Launches().Sub(l0))

		if g == nil || p > bound {
			if g != nil {
				g.Close()
			}
			bound = min((p/bucket+1)*bucket, eager.maxPos) - 1
			var err error
			if g, err = b.Capture(func() error { return graphed.run(0, bound) }); err != nil {
				t.Fatalf("capture at position %d: %v", p, err)
			}
			captures++
			t.Logf("captured a graph of %d nodes for positions up to %d", g.(*graph).Nodes(), bound)
		}
		l0, t0 = b.Launches(), time.Now()
		graphed.setPos(t, p)
		if err := g.Replay(); err != nil {
			t.Fatalf("replay at position %d: %v", p, err)
		}
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		graphTime += time.Since(t0)
		graphL = addLaunches(graphL, b.Launches().Sub(l0))

		want, got := get(t, b, eager.x), get(t, b, graphed.x)
		w := make([]float64, len(want))
		for i, v := range want {
			w[i] = float64(v)
		}
		if e := tensortest.RelErr(got, w); !(e <= 1e-5) {
			t.Fatalf("position %d: the graph's residual differs from the eager one by %.3g (relative)", p, e)
		}
	}
	g.Close()
	if captures != 3 {
		t.Errorf("%d captures for %d positions in buckets of %d, want 3", captures, steps, bucket)
	}
	t.Logf("eager: %.1f launches per step (%+v over %d steps), %.1f us per step (synchronised)", float64(eagerL.Total())/steps, eagerL, steps, us(eagerTime)/steps)
	t.Logf("graph: %.1f launches per step (%+v over %d steps, the position upload included), %.1f us per step", float64(graphL.Total())/steps, graphL, steps, us(graphTime)/steps)
	if graphL.Graphs != steps || graphL.Kernels != 0 {
		t.Errorf("graph path: %+v, want one graph launch and no kernel launch per step", graphL)
	}
}

// randomWeights gives each weight of a block its values, the same on
// every call for a name: norms near 1, products' weights within ±0.1.
func randomWeights(r *rand.Rand) func(name string, n int) []float32 {
	seen := map[string][]float32{}
	return func(name string, n int) []float32 {
		if v, ok := seen[name]; ok && len(v) == n {
			return v
		}
		lo, hi := float32(-0.1), float32(0.1)
		if name == "n1" || name == "n2" {
			lo, hi = 0.8, 1.2
		}
		seen[name] = uniform(r, n, lo, hi)
		return seen[name]
	}
}

func addLaunches(a, b tensor.Launches) tensor.Launches {
	return tensor.Launches{Kernels: a.Kernels + b.Kernels, Copies: a.Copies + b.Copies, Library: a.Library + b.Library, Graphs: a.Graphs + b.Graphs}
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// TestCaptureErrors checks what a capture refuses (a Download, an error or
// a panic from f, a nested capture, a replay of a closed graph) and that
// the backend computes normally afterwards.
func TestCaptureErrors(t *testing.T) {
	b := openGPU(t)
	x, _ := put(t, b, tensor.F32, tensor.Shape{1, 64}, make([]float32, 64))
	y, _ := put(t, b, tensor.F32, tensor.Shape{1, 64}, make([]float32, 64))
	boom := errors.New("boom")
	cases := []struct {
		name string
		f    func() error
	}{
		{"download", func() error { return b.Download(make([]byte, 256), x) }},
		{"sync", func() error { return b.Sync() }},
		{"error", func() error { return boom }},
		{"nested", func() error {
			_, err := b.Capture(func() error { return nil })
			return err
		}},
		{"upload-async", func() error {
			_, err := b.UploadAsync(t.Context(), x, 0, make([]byte, 16))
			return err
		}},
	}
	for _, c := range cases {
		g, err := b.Capture(func() error {
			if err := b.Add(y, x, x); err != nil {
				return err
			}
			return c.f()
		})
		if err == nil {
			g.Close()
			t.Errorf("%s in a capture: no error", c.name)
			continue
		}
		t.Logf("%s in a capture: %v", c.name, err)
		if c.name == "error" && !errors.Is(err, boom) {
			t.Errorf("f's error is not wrapped: %v", err)
		}
		if err := b.Add(y, x, x); err != nil {
			t.Fatalf("Add after a failed capture (%s): %v", c.name, err)
		}
		if err := b.Sync(); err != nil {
			t.Fatalf("Sync after a failed capture (%s): %v", c.name, err)
		}
	}
	func() {
		defer func() {
			if p := recover(); p == nil {
				t.Error("a panic in f was swallowed")
			}
		}()
		b.Capture(func() error { panic("in f") })
	}()
	if err := b.Add(y, x, x); err != nil {
		t.Fatalf("Add after a panic in a capture: %v", err)
	}
	g, err := b.Capture(func() error { return b.Add(y, x, x) })
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Replay(); err != nil {
		t.Fatal(err)
	}
	g.Close()
	if err := g.Replay(); err == nil {
		t.Error("Replay of a closed graph: no error")
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if v := get(t, b, y); math.IsNaN(float64(v[0])) {
		t.Error("y not written")
	}
}

// TestRopeKVCaches checks RopeKV into F16, BF16, Q8_0 and Q8_B8 caches
// against the F32 cache rounded or quantized, at a position from PosAt.
func TestRopeKVCaches(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const heads, kvHeads, headDim, maxPos, pos = 8, 2, 64, 40, 17
	cos, sin := tensortest.RopeTables(maxPos, headDim, 10000)
	ct, _ := put(t, b, tensor.F32, tensor.Shape{maxPos, headDim / 2}, toF32s(cos))
	st, _ := put(t, b, tensor.F32, tensor.Shape{maxPos, headDim / 2}, toF32s(sin))
	qv, kv, vv := uniform(r, heads*headDim, -1, 1), uniform(r, kvHeads*headDim, -1, 1), uniform(r, kvHeads*headDim, -1, 1)
	at, err := b.Alloc(tensor.I32, tensor.Shape{1})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(at)
	var buf [4]byte
	binary.LittleEndian.PutUint32(buf[:], pos)
	if err := b.Upload(at, 0, buf[:]); err != nil {
		t.Fatal(err)
	}
	rows := func(dt tensor.DType) (kc, vc []float32) {
		q, _ := put(t, b, tensor.F32, tensor.Shape{1, heads * headDim}, qv)
		k, _ := put(t, b, tensor.F32, tensor.Shape{1, kvHeads * headDim}, kv)
		v, _ := put(t, b, tensor.F32, tensor.Shape{1, kvHeads * headDim}, vv)
		kct, _ := put(t, b, dt, tensor.Shape{maxPos, kvHeads * headDim}, make([]float32, maxPos*kvHeads*headDim))
		vct, _ := put(t, b, dt, tensor.Shape{maxPos, kvHeads * headDim}, make([]float32, maxPos*kvHeads*headDim))
		rot := tensor.Rotary{Cos: ct, Sin: st, Heads: heads, HeadDim: headDim, Pos0: maxPos - 1, PosAt: at}
		if err := tensor.RopeKV(tensor.Checked(b), q, k, v, kct, vct, rot); err != nil {
			t.Fatal(err)
		}
		w := kvHeads * headDim
		return get(t, b, kct)[pos*w : (pos+1)*w], get(t, b, vct)[pos*w : (pos+1)*w]
	}
	k32, v32 := rows(tensor.F32)
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		ulp := math.Ldexp(1, -10) // F16's relative spacing; BF16's is 2^-7
		if dt == tensor.BF16 {
			ulp = math.Ldexp(1, -7)
		}
		kc, vc := rows(dt)
		for i := range k32 {
			w, _ := tensortest.Stored(dt, []float32{k32[i], v32[i]})
			// The values are the F32 cache's rounded to dt; the key, rotated
			// by another instantiation of the kernel, within one step of it.
			if float64(vc[i]) != w[1] || math.Abs(float64(kc[i])-w[0]) > ulp*math.Abs(w[0]) {
				t.Fatalf("%v cache element %d: key %v value %v, want the F32 cache's rounded: %v %v", dt, i, kc[i], vc[i], w[0], w[1])
			}
		}
	}
	// The quantized caches (rope_kv_q8_0, _q8_b8): the values are the F32
	// cache's quantized as CopyRows quantizes them; a key rotated a step
	// off the F32 cache's may round to the next code, a 127th of its
	// block's largest magnitude.
	for _, dt := range []tensor.DType{tensor.Q8_0, tensor.Q8_B8} {
		kc, vc := rows(dt)
		wk, err := tensortest.Stored(dt, k32)
		if err != nil {
			t.Fatal(err)
		}
		wv, err := tensortest.Stored(dt, v32)
		if err != nil {
			t.Fatal(err)
		}
		bs := dt.BlockSize()
		for i := range k32 {
			var amax float64
			for _, x := range k32[i/bs*bs : i/bs*bs+bs] {
				amax = max(amax, math.Abs(float64(x)))
			}
			if float64(vc[i]) != wv[i] || math.Abs(float64(kc[i])-wk[i]) > amax/127*1.01 {
				t.Fatalf("%v cache element %d: key %v value %v, want the F32 cache's quantized: %v %v", dt, i, kc[i], vc[i], wk[i], wv[i])
			}
		}
	}
}

// TestGEMVRowsPerWarp checks the candidate M = 1 GEMV kernels (gemv_*_r1
// and _r2, Backend.gemvRows) against the default one on shapes whose N is
// odd (the r2 kernel's last warp has one row) or not a multiple of the
// block's rows, and K with a tail of chunks: within 1e-6 relative, as they
// add each row's products in the same order.
func TestGEMVRowsPerWarp(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16, tensor.F32} {
		for _, s := range []struct{ n, k int }{{4096, 4096}, {4097, 512}, {33, 2056}, {1, 8}, {11008, 4096}} {
			x, _ := put(t, b, tensor.F32, tensor.Shape{1, s.k}, uniform(r, s.k, -1, 1))
			w, _ := put(t, b, dt, tensor.Shape{s.n, s.k}, uniform(r, s.n*s.k, -1, 1))
			var outs [3][]float32
			for rows := range 3 {
				b.gemvRows = []int{-1, 1, 2}[rows] // m1, r1, r2
				out, _ := put(t, b, tensor.F32, tensor.Shape{1, s.n}, nanSlice(s.n))
				if err := b.MatMul(out, x, w, nil); err != nil {
					t.Fatal(err)
				}
				outs[rows] = get(t, b, out)
			}
			b.gemvRows = 0
			want := make([]float64, s.n)
			for i, v := range outs[0] {
				want[i] = float64(v)
			}
			for rows := 1; rows < 3; rows++ {
				if e := tensortest.RelErr(outs[rows], want); !(e <= 1e-6) {
					t.Errorf("%v N=%d K=%d: %d rows per warp differ from one by %.3g", dt, s.n, s.k, rows, e)
				}
			}
		}
	}
}

// TestCaptureConcurrent captures and replays graphs on one goroutine while
// others run eager operations and asynchronous uploads on the same
// backend: the other goroutines' work must stay out of the graphs (it
// waits while a capture runs) and every result must be right.
func TestCaptureConcurrent(t *testing.T) {
	b := openGPU(t)
	const n, rounds = 4096, 200
	ones := make([]float32, n)
	for i := range ones {
		ones[i] = 1
	}
	x, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, ones)
	captured, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, make([]float32, n))
	eager, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, make([]float32, n))
	dst, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, make([]float32, n))
	src := make([]byte, 4*n)
	errs := make(chan error, 3)
	done := make(chan struct{})
	go func() { // captures of captured = x + x, replayed
		defer func() { done <- struct{}{} }()
		for range rounds {
			g, err := b.Capture(func() error { return b.Add(captured, x, x) })
			if err != nil {
				errs <- err
				return
			}
			if err := g.Replay(); err != nil {
				errs <- err
				return
			}
			g.Close()
		}
	}()
	go func() { // eager: eager = x + eager, rounds times
		defer func() { done <- struct{}{} }()
		for range rounds {
			if err := b.Add(eager, x, eager); err != nil {
				errs <- err
				return
			}
		}
	}()
	go func() { // uploads on the copy stream
		defer func() { done <- struct{}{} }()
		for range rounds {
			ready, err := b.UploadAsync(t.Context(), dst, 0, src)
			if err == nil {
				err = ready()
			}
			if err != nil {
				errs <- err
				return
			}
		}
	}()
	for range 3 {
		<-done
	}
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if v := get(t, b, captured); v[0] != 2 || v[n-1] != 2 {
		t.Errorf("captured x + x: %v ... %v, want 2", v[0], v[n-1])
	}
	if v := get(t, b, eager); v[0] != rounds || v[n-1] != rounds {
		t.Errorf("eager sum of %d ones: %v ... %v (an eager Add went into a graph?)", rounds, v[0], v[n-1])
	}
}

// TestLaunchCounts checks what Launches counts for a few operations: a
// decode product is one kernel (two with a bias), a prefill product with
// F16 weights a cast kernel and a cuBLAS call, a Download one copy, a
// graph's replay one graph launch and nothing else.
func TestLaunchCounts(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	x1, _ := put(t, b, tensor.F32, tensor.Shape{1, 256}, uniform(r, 256, -1, 1))
	x64, _ := put(t, b, tensor.F32, tensor.Shape{64, 256}, uniform(r, 64*256, -1, 1))
	w, _ := put(t, b, tensor.F16, tensor.Shape{128, 256}, uniform(r, 128*256, -1, 1))
	bias, _ := put(t, b, tensor.F16, tensor.Shape{128}, uniform(r, 128, -1, 1))
	o1, _ := put(t, b, tensor.F32, tensor.Shape{1, 128}, make([]float32, 128))
	o64, _ := put(t, b, tensor.F32, tensor.Shape{64, 128}, make([]float32, 64*128))
	g, err := b.Capture(func() error { return b.MatMul(o1, x1, w, nil) })
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	cases := []struct {
		name string
		op   func() error
		want tensor.Launches
	}{
		{"decode product", func() error { return b.MatMul(o1, x1, w, nil) }, tensor.Launches{Kernels: 1}},
		{"decode product with a bias", func() error { return b.MatMul(o1, x1, w, bias) }, tensor.Launches{Kernels: 2}},
		{"download", func() error { return b.Download(make([]byte, 512), o1) }, tensor.Launches{Copies: 1}},
		{"graph replay", g.Replay, tensor.Launches{Graphs: 1}},
	}
	if b.blas != nil {
		cases = append(cases, struct {
			name string
			op   func() error
			want tensor.Launches
		}{"prefill product", func() error { return b.MatMul(o64, x64, w, nil) }, tensor.Launches{Kernels: 1, Library: 1}})
	}
	for _, c := range cases {
		l0 := b.Launches()
		if err := c.op(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := b.Launches().Sub(l0); got != c.want {
			t.Errorf("%s: launches %+v, want %+v", c.name, got, c.want)
		} else {
			t.Logf("%s: %+v", c.name, got)
		}
	}
}

// TestSetPosition checks that SetPosition writes the position a replayed
// graph reads: a captured Rope at the position in device memory, replayed
// after SetPosition at several positions, against Rope at each position
// given on the host; the value read back; and the refusals of a tensor
// not I32 and of a position outside [0, MaxInt32].
func TestSetPosition(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const heads, headDim, maxPos = 4, 64, 300
	cos, sin := tensortest.RopeTables(maxPos, headDim, 10000)
	ct, _ := put(t, b, tensor.F32, tensor.Shape{maxPos, headDim / 2}, toF32s(cos))
	st, _ := put(t, b, tensor.F32, tensor.Shape{maxPos, headDim / 2}, toF32s(sin))
	xv := uniform(r, heads*headDim, -1, 1)
	at, err := b.Alloc(tensor.I32, tensor.Shape{1})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(at)
	x, _ := put(t, b, tensor.F32, tensor.Shape{1, heads * headDim}, xv)
	rot := tensor.Rotary{Cos: ct, Sin: st, Heads: heads, HeadDim: headDim, Pos0: maxPos - 1, PosAt: at}
	g, err := b.Capture(func() error { return b.Rope(x, rot) })
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for _, p := range []int{0, 1, 17, 130, maxPos - 1} {
		if err := b.SetPosition(at, p); err != nil {
			t.Fatal(err)
		}
		var buf [4]byte
		if err := b.Download(buf[:], at); err != nil {
			t.Fatal(err)
		}
		if v := int32(binary.LittleEndian.Uint32(buf[:])); v != int32(p) {
			t.Fatalf("SetPosition(%d) left %d", p, v)
		}
		if err := b.Upload(x, 0, f32Bytes(xv)); err != nil {
			t.Fatal(err)
		}
		if err := g.Replay(); err != nil {
			t.Fatal(err)
		}
		want, _ := put(t, b, tensor.F32, tensor.Shape{1, heads * headDim}, xv)
		eager := rot
		eager.PosAt, eager.Pos0 = nil, p
		if err := b.Rope(want, eager); err != nil {
			t.Fatal(err)
		}
		got, w := get(t, b, x), get(t, b, want)
		for i := range w {
			if got[i] != w[i] {
				t.Fatalf("position %d: replayed rope element %d = %v, eager %v", p, i, got[i], w[i])
			}
		}
	}
	f, _ := put(t, b, tensor.F32, tensor.Shape{1}, []float32{0})
	for _, c := range []struct {
		at  *tensor.Tensor
		pos int
	}{{f, 1}, {at, -1}, {at, math.MaxInt32 + 1}} {
		if err := b.SetPosition(c.at, c.pos); err == nil {
			t.Errorf("SetPosition(%v, %d) succeeded", c.at.DType(), c.pos)
		}
	}
}
