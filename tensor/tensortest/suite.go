package tensortest

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// Option adjusts TestBackend and FuzzMatMul.
type Option func(*config)

type config struct {
	tol        float64
	quantTol   float64
	quantTypes []tensor.DType
	quantizesX bool
	cacheTypes []tensor.DType
	fusedTol   float64
}

// Tolerance sets the largest relative error ||out-ref||/||ref|| accepted
// for an operation's output (default 1e-5, right for F32 arithmetic; an FP16
// GPU backend needs about 1e-2).
func Tolerance(rel float64) Option { return func(c *config) { c.tol = rel } }

// QuantTolerance sets the largest relative error accepted for MatMul with
// quantized weights against the float64 product over the dequantized
// weights (default 1e-3: the contract's error of rounding the activations
// to 16 bits per block is at most 1e-4 on the suite's normal activations,
// its small random K-format products included; or twice Tolerance where
// that is larger, which keeps the 2e-2 that a backend with Tolerance(1e-2)
// had when activations were rounded to 8 bits).
func QuantTolerance(rel float64) Option { return func(c *config) { c.quantTol = rel } }

// QuantTypes lists the quantized weight types the backend computes with,
// when it is not all of them (QuantWeightTypes()). The suite checks MatMul
// and Embed in these, and that the others are an error rather than a
// wrong result.
func QuantTypes(dts ...tensor.DType) Option {
	return func(c *config) { c.quantTypes = append([]tensor.DType(nil), dts...) }
}

// QuantizedActivations says that the backend multiplies quantized weights
// either exactly or as quant's integer product does, with each row of x
// rounded by quant.QuantizeRow (RoundActivations). The
// suite then holds every product to Tolerance against one of the two
// float64 references: over the dequantized weights with x as given, or
// with x rounded.
func QuantizedActivations() Option { return func(c *config) { c.quantizesX = true } }

// CacheTypes lists the KV cache dtypes the backend's Attention reads and
// its CopyRows appends to, when it is not all of tensor.IsCacheDType's
// (F32, F16, BF16, Q8_0, Q8_B8).
func CacheTypes(dts ...tensor.DType) Option {
	return func(c *config) { c.cacheTypes = append([]tensor.DType(nil), dts...) }
}

// cacheTypes are the KV cache dtypes tensor.IsCacheDType allows.
var cacheTypes = []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q8_B8}

func newConfig(opts []Option) config {
	c := config{tol: 1e-5, quantTypes: QuantWeightTypes(), fusedTol: 1e-5, cacheTypes: cacheTypes}
	for _, o := range opts {
		o(&c)
	}
	if c.quantTol == 0 {
		c.quantTol = max(1e-3, 2*c.tol)
	}
	return c
}

// weightTypes are the stored types of weight operands.
var weightTypes = []tensor.DType{tensor.F32, tensor.F16, tensor.BF16}

// TestBackend checks every operation of b against the references in this
// package, and that malformed calls return errors. It uses only the Backend
// interface, and calls b's operations through tensor.Checked: the checks
// in front must pass every well-formed call, and catch the malformed ones
// before b's kernels see them.
func TestBackend(t *testing.T, b tensor.Backend, opts ...Option) {
	s := &suite{b: tensor.Checked(b), cfg: newConfig(opts)}
	t.Run("Memory", s.testMemory)
	t.Run("MatMul", s.testMatMul)
	t.Run("RMSNorm", s.testRMSNorm)
	t.Run("Rope", s.testRope)
	t.Run("RopeRows", s.testRopeRows)
	t.Run("SiLUMul", s.testSiLUMul)
	t.Run("Add", s.testAdd)
	t.Run("Embed", s.testEmbed)
	t.Run("CopyRows", s.testCopyRows)
	t.Run("Attention", s.testAttention)
	t.Run("KVAppend", s.testKVAppend)
	t.Run("AttentionBlocks", s.testAttentionBlocks)
	t.Run("Errors", s.testErrors)
	t.Run("Aliasing", s.testAliasing)
	t.Run("Quant", s.testQuant)
	t.Run("PosAt", s.testPosAt)
	t.Run("Fused", s.testFused)
}

type suite struct {
	b   tensor.Backend
	cfg config
}

// rng returns a generator seeded from the test's name, so every subtest has
// its own inputs and a failure reproduces.
func rng(t *testing.T) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(t.Name()))
	return newRand(h.Sum64())
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x5eed)) }

// uniform returns n values uniform in [lo, hi).
func uniform(r *rand.Rand, n int, lo, hi float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = lo + (hi-lo)*r.Float32()
	}
	return v
}

// put uploads v as a dt tensor of shape, freed when the test ends, and
// returns it with the values as stored.
func (s *suite) put(t *testing.T, dt tensor.DType, shape tensor.Shape, v []float32) (*tensor.Tensor, []float64) {
	t.Helper()
	x, err := FromF32(s.b, dt, shape, v)
	if err != nil {
		t.Fatalf("upload %v %v: %v", dt, shape, err)
	}
	t.Cleanup(func() { s.b.Free(x) })
	stored, err := Stored(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	return x, stored
}

// poisoned allocates an F32 output filled with NaN.
func (s *suite) poisoned(t *testing.T, shape tensor.Shape) *tensor.Tensor {
	t.Helper()
	n := int(shape.NumElements())
	nan := make([]float32, n)
	for i := range nan {
		nan[i] = float32(math.NaN())
	}
	x, _ := s.put(t, tensor.F32, shape, nan)
	return x
}

func (s *suite) get(t *testing.T, x *tensor.Tensor) []float32 {
	t.Helper()
	v, err := ToF32(s.b, x)
	if err != nil {
		t.Fatalf("download %v: %v", x, err)
	}
	return v
}

// compare fails t unless every element of got is finite and the relative
// error against want is within the tolerance.
func (s *suite) compare(t *testing.T, what string, got []float32, want []float64) {
	t.Helper()
	compare(t, s.cfg.tol, what, got, want)
}

func compare(t *testing.T, tol float64, what string, got []float32, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d elements, want %d", what, len(got), len(want))
	}
	bad, first := 0, -1
	for i, g := range got {
		if math.IsNaN(float64(g)) || math.IsInf(float64(g), 0) {
			if first < 0 {
				first = i
			}
			bad++
		}
	}
	if bad > 0 {
		t.Fatalf("%s: %d of %d elements not written or not finite (first at %d: %v, want %v)", what, bad, len(got), first, got[first], want[first])
	}
	if e := RelErr(got, want); !(e <= tol) {
		worst, wi := 0.0, 0
		for i, g := range got {
			if d := math.Abs(float64(g) - want[i]); d > worst {
				worst, wi = d, i
			}
		}
		t.Fatalf("%s: relative error %.3g > %.3g (worst element %d: got %v, want %v)", what, e, tol, wi, got[wi], want[wi])
	}
}

func (s *suite) testMemory(t *testing.T) {
	r := rng(t)
	dts := []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.I32, tensor.I64}
	for _, dt := range append(dts, QuantWeightTypes()...) {
		t.Run(dt.String(), func(t *testing.T) {
			shape := tensor.Shape{3, 5}
			size := int64(15 * dt.Size())
			if dt.IsQuantized() { // rows of two blocks
				shape = tensor.Shape{3, 2 * dt.BlockSize()}
				size = int64(6 * dt.BlockBytes())
			}
			x, err := s.b.Alloc(dt, shape)
			if err != nil {
				t.Fatal(err)
			}
			defer s.b.Free(x)
			if x.DType() != dt || !x.Shape().Equal(shape) || x.NumBytes() != size {
				t.Fatalf("Alloc(%v, %v) = %v with %d bytes", dt, shape, x, x.NumBytes())
			}
			want := make([]byte, x.NumBytes())
			for i := range want {
				want[i] = byte(r.Uint32())
			}
			if err := s.b.Upload(x, 0, want); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(want))
			if err := s.b.Download(got, x); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("download after upload differs")
			}
			// A partial upload changes only its range.
			part := []byte{1, 2, 3, 4, 5}
			off := int64(dt.BlockBytes())
			if err := s.b.Upload(x, off, part); err != nil {
				t.Fatal(err)
			}
			copy(want[off:], part)
			if err := s.b.Download(got, x); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("partial upload at %d: got % x, want % x", off, got, want)
			}
		})
	}
}

func (s *suite) testMatMul(t *testing.T) {
	cases := []struct{ m, n, k int }{
		{1, 513, 172}, {12, 513, 172}, {1, 64, 64}, {12, 96, 256}, {3, 7, 5},
		{1, 1, 1}, {33, 130, 300}, {2, 9, 1000}, {1, 300, 2048}, {5, 4, 3},
	}
	for _, dt := range weightTypes {
		for _, c := range cases {
			for _, withBias := range []bool{false, true} {
				name := fmt.Sprintf("%v/M%d_N%d_K%d", dt, c.m, c.n, c.k)
				if withBias {
					name += "/bias"
				}
				t.Run(name, func(t *testing.T) {
					r := rng(t)
					x, xv := s.put(t, tensor.F32, tensor.Shape{c.m, c.k}, uniform(r, c.m*c.k, -1, 1))
					w, wv := s.put(t, dt, tensor.Shape{c.n, c.k}, uniform(r, c.n*c.k, -1, 1))
					var bias *tensor.Tensor
					var bv []float64
					if withBias {
						bias, bv = s.put(t, dt, tensor.Shape{c.n}, uniform(r, c.n, -1, 1))
					}
					out := s.poisoned(t, tensor.Shape{c.m, c.n})
					if err := s.b.MatMul(out, x, w, bias); err != nil {
						t.Fatal(err)
					}
					s.compare(t, "MatMul", s.get(t, out), RefMatMul(xv, wv, bv, c.m, c.n, c.k))
				})
			}
		}
	}
}

func (s *suite) testRMSNorm(t *testing.T) {
	cases := []struct {
		m, d int
		eps  float32
		xMax float32 // inputs in [-xMax, xMax)
	}{
		{1, 64, 1e-5, 2}, {12, 172, 1e-6, 2}, {3, 1000, 1e-5, 2}, {2, 4096, 1e-6, 2}, {5, 7, 1e-5, 2},
		{4, 64, 1e-5, 0.01}, // mean square comparable to eps
		// Rows a GPU reads whole into registers (up to 8192), past that,
		// not in fours, and many short rows (a q norm's heads).
		{2, 8192, 1e-6, 2}, {1, 8200, 1e-6, 2}, {2, 4098, 1e-6, 2}, {64, 128, 1e-6, 2},
	}
	for _, dt := range weightTypes {
		for _, c := range cases {
			t.Run(fmt.Sprintf("%v/M%d_D%d_x%g", dt, c.m, c.d, c.xMax), func(t *testing.T) {
				r := rng(t)
				x, xv := s.put(t, tensor.F32, tensor.Shape{c.m, c.d}, uniform(r, c.m*c.d, -c.xMax, c.xMax))
				w, wv := s.put(t, dt, tensor.Shape{c.d}, uniform(r, c.d, 0.5, 1.5))
				out := s.poisoned(t, tensor.Shape{c.m, c.d})
				if err := s.b.RMSNorm(out, x, w, c.eps); err != nil {
					t.Fatal(err)
				}
				s.compare(t, "RMSNorm", s.get(t, out), RefRMSNorm(xv, wv, c.m, c.d, float64(c.eps)))
			})
		}
		// Rows that start 4 bytes into their storage (a view): a backend
		// reading four floats a load must take its other path.
		t.Run(fmt.Sprintf("%v/offset_view", dt), func(t *testing.T) {
			const m, d = 2, 4096
			r := rng(t)
			xs := uniform(r, m*d+1, -2, 2)
			whole, _ := s.put(t, tensor.F32, tensor.Shape{m*d + 1}, xs)
			x, err := whole.View(4, tensor.F32, tensor.Shape{m, d})
			if err != nil {
				t.Fatal(err)
			}
			xv, _ := Stored(tensor.F32, xs[1:])
			w, wv := s.put(t, dt, tensor.Shape{d}, uniform(r, d, 0.5, 1.5))
			out := s.poisoned(t, tensor.Shape{m, d})
			if err := s.b.RMSNorm(out, x, w, 1e-5); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "RMSNorm of an offset view", s.get(t, out), RefRMSNorm(xv, wv, m, d, 1e-5))
		})
	}
}

func (s *suite) testRope(t *testing.T) {
	cases := []struct{ t, heads, headDim, pos0 int }{
		{1, 4, 16, 37}, {12, 8, 64, 0}, {7, 6, 128, 5}, {1, 2, 2, 0}, {3, 1, 16, 100},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("T%d_H%d_D%d_pos%d", c.t, c.heads, c.headDim, c.pos0), func(t *testing.T) {
			r := rng(t)
			maxPos := c.pos0 + c.t + 3
			cos64, sin64 := RopeTables(maxPos, c.headDim, 10000)
			half := tensor.Shape{maxPos, c.headDim / 2}
			cos, cv := s.put(t, tensor.F32, half, f32(cos64))
			sin, sv := s.put(t, tensor.F32, half, f32(sin64))
			n := c.t * c.heads * c.headDim
			x, xv := s.put(t, tensor.F32, tensor.Shape{c.t, c.heads * c.headDim}, uniform(r, n, -2, 2))
			if err := s.b.Rope(x, tensor.Rotary{Cos: cos, Sin: sin, Heads: c.heads, HeadDim: c.headDim, Pos0: c.pos0}); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "Rope", s.get(t, x), RefRope(xv, cv, sv, c.t, c.heads, c.headDim, c.pos0))
		})
	}
}

func f32(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// elementwiseShapes are the shapes of the elementwise operations' tests.
var elementwiseShapes = []tensor.Shape{{1, 172}, {12, 513}, {2, 3, 5}, {1, 1}, {4, 5632}}

func (s *suite) testSiLUMul(t *testing.T) {
	for _, shape := range elementwiseShapes {
		t.Run(fmt.Sprint(shape), func(t *testing.T) {
			r := rng(t)
			n := int(shape.NumElements())
			g := uniform(r, n, -8, 8)
			for i := 0; i < n; i += 17 { // saturated tails of the sigmoid
				g[i] = []float32{-30, 30, -90, 90}[i%4]
			}
			gate, gv := s.put(t, tensor.F32, shape, g)
			up, uv := s.put(t, tensor.F32, shape, uniform(r, n, -2, 2))
			out := s.poisoned(t, shape)
			if err := s.b.SiLUMul(out, gate, up); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "SiLUMul", s.get(t, out), RefSiLUMul(gv, uv))
		})
	}
}

func (s *suite) testAdd(t *testing.T) {
	for _, shape := range elementwiseShapes {
		t.Run(fmt.Sprint(shape), func(t *testing.T) {
			r := rng(t)
			n := int(shape.NumElements())
			a, av := s.put(t, tensor.F32, shape, uniform(r, n, -4, 4))
			b, bv := s.put(t, tensor.F32, shape, uniform(r, n, -4, 4))
			want := RefAdd(av, bv)
			out := s.poisoned(t, shape)
			if err := s.b.Add(out, a, b); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "Add", s.get(t, out), want)
			// out may alias a or b: the residual update x += y.
			if err := s.b.Add(a, a, b); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "Add into a", s.get(t, a), want)
			a0, _ := s.put(t, tensor.F32, shape, f32(av)) // a's original values
			if err := s.b.Add(b, a0, b); err != nil {
				t.Fatal(err)
			}
			s.compare(t, "Add into b", s.get(t, b), want)
		})
	}
}

func (s *suite) testEmbed(t *testing.T) {
	cases := []struct {
		v, d int
		ids  []int32
	}{
		{50, 16, []int32{0, 49, 7, 7, 3}},
		{37, 172, []int32{36, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}},
		{1, 3, []int32{0}},
	}
	for _, dt := range weightTypes {
		for _, c := range cases {
			t.Run(fmt.Sprintf("%v/V%d_D%d_T%d", dt, c.v, c.d, len(c.ids)), func(t *testing.T) {
				r := rng(t)
				table, tv := s.put(t, dt, tensor.Shape{c.v, c.d}, uniform(r, c.v*c.d, -1, 1))
				out := s.poisoned(t, tensor.Shape{len(c.ids), c.d})
				if err := s.b.Embed(out, table, c.ids); err != nil {
					t.Fatal(err)
				}
				got := s.get(t, out)
				want := RefEmbed(tv, c.d, c.ids)
				for i := range got { // a gather is exact
					if float64(got[i]) != want[i] {
						t.Fatalf("element %d (row %d): got %v, want %v", i, i/c.d, got[i], want[i])
					}
				}
			})
		}
	}
}

func (s *suite) testCopyRows(t *testing.T) {
	cases := []struct {
		dt                tensor.DType
		dst, src          tensor.Shape
		dstRow, srcRow, n int
	}{
		{tensor.F32, tensor.Shape{9, 12}, tensor.Shape{5, 3, 4}, 4, 1, 3},
		{tensor.F16, tensor.Shape{10, 8}, tensor.Shape{6, 8}, 4, 0, 6},
		{tensor.BF16, tensor.Shape{4, 2, 2}, tensor.Shape{1, 4}, 3, 0, 1},
		{tensor.I32, tensor.Shape{3, 5}, tensor.Shape{3, 5}, 0, 0, 3},
		{tensor.F32, tensor.Shape{3, 5}, tensor.Shape{2, 5}, 1, 0, 0},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%v/%v<-%v", c.dt, c.dst, c.src), func(t *testing.T) {
			r := rng(t)
			randBytes := func(n int64) []byte {
				b := make([]byte, n)
				for i := range b {
					b[i] = byte(r.Uint32())
				}
				return b
			}
			dst, err := s.b.Alloc(c.dt, c.dst)
			if err != nil {
				t.Fatal(err)
			}
			defer s.b.Free(dst)
			src, err := s.b.Alloc(c.dt, c.src)
			if err != nil {
				t.Fatal(err)
			}
			defer s.b.Free(src)
			db, sb := randBytes(dst.NumBytes()), randBytes(src.NumBytes())
			if err := s.b.Upload(dst, 0, db); err != nil {
				t.Fatal(err)
			}
			if err := s.b.Upload(src, 0, sb); err != nil {
				t.Fatal(err)
			}
			if err := s.b.CopyRows(dst, c.dstRow, src, c.srcRow, c.n); err != nil {
				t.Fatal(err)
			}
			rb := int(dst.NumBytes()) / c.dst[0]
			want := append([]byte(nil), db...)
			copy(want[c.dstRow*rb:(c.dstRow+c.n)*rb], sb[c.srcRow*rb:(c.srcRow+c.n)*rb])
			got := make([]byte, len(want))
			if err := s.b.Download(got, dst); err != nil {
				t.Fatal(err)
			}
			for row := 0; row < c.dst[0]; row++ {
				if !bytes.Equal(got[row*rb:(row+1)*rb], want[row*rb:(row+1)*rb]) {
					t.Fatalf("dst row %d: got % x, want % x", row, got[row*rb:(row+1)*rb], want[row*rb:(row+1)*rb])
				}
			}
		})
	}
}

// testKVAppend checks CopyRows from F32 rows into each narrow cache dtype:
// the rows it writes are the values encoded as Encode does (F16 and BF16
// rounded to nearest even, Q8_0 and Q8_B8 quantized as quant.QuantizeQ8_0
// and quant.QuantizeQ8B8), byte for byte, and the rows around them are
// untouched.
func (s *suite) testKVAppend(t *testing.T) {
	cases := []struct {
		width, rows, dstRow, srcRow, n int
	}{
		{width: 64, rows: 9, dstRow: 3, srcRow: 1, n: 4},
		{width: 256, rows: 5, dstRow: 4, srcRow: 0, n: 1},    // decode: one row
		{width: 1024, rows: 40, dstRow: 0, srcRow: 0, n: 33}, // prefill of an odd length
		{width: 32, rows: 3, dstRow: 1, srcRow: 2, n: 0},
		{width: 24, rows: 6, dstRow: 2, srcRow: 1, n: 3}, // blocks of 8 only
	}
	for _, dt := range s.cfg.cacheTypes {
		if dt == tensor.F32 {
			continue // the plain copy of testCopyRows
		}
		for _, c := range cases {
			if c.width%dt.BlockSize() != 0 {
				continue
			}
			t.Run(fmt.Sprintf("%v/w%d_rows%d_at%d_n%d", dt, c.width, c.rows, c.dstRow, c.n), func(t *testing.T) {
				r := rng(t)
				// Large values in a few channels, as real keys have.
				vals := uniform(r, (c.srcRow+c.n+1)*c.width, -2, 2)
				for i := 5; i < len(vals); i += 97 {
					vals[i] *= 30
				}
				src, _ := s.put(t, tensor.F32, tensor.Shape{c.srcRow + c.n + 1, c.width}, vals)
				before := uniform(r, c.rows*c.width, -1, 1)
				dst, _ := s.put(t, dt, tensor.Shape{c.rows, c.width}, before)
				if err := s.b.CopyRows(dst, c.dstRow, src, c.srcRow, c.n); err != nil {
					t.Fatal(err)
				}
				want, err := Encode(dt, before)
				if err != nil {
					t.Fatal(err)
				}
				rb := len(want) / c.rows
				rows, err := Encode(dt, vals[c.srcRow*c.width:(c.srcRow+c.n)*c.width])
				if err != nil {
					t.Fatal(err)
				}
				copy(want[c.dstRow*rb:], rows)
				got := make([]byte, len(want))
				if err := s.b.Download(got, dst); err != nil {
					t.Fatal(err)
				}
				for row := range c.rows {
					if g, w := got[row*rb:(row+1)*rb], want[row*rb:(row+1)*rb]; !bytes.Equal(g, w) {
						for i := range g {
							if g[i] != w[i] {
								t.Fatalf("row %d differs from byte %d: got % x, want % x", row, i, g[i:min(i+8, len(g))], w[i:min(i+8, len(w))])
							}
						}
					}
				}
			})
		}
	}
}

// attentionCase is one shape of the attention tests.
type attentionCase struct {
	name                             string
	heads, kvHeads, headDim, pos0, t int
	maxPos                           int
	qScale                           float32 // range of q and k values; default 1
	scale                            float64 // softmax scale; default 1/sqrt(headDim)
	cache                            tensor.DType
}

func (s *suite) testAttention(t *testing.T) {
	cases := []attentionCase{
		{name: "prefill", heads: 4, kvHeads: 2, headDim: 16, pos0: 0, t: 12, maxPos: 16},
		{name: "decode", heads: 8, kvHeads: 8, headDim: 64, pos0: 37, t: 1, maxPos: 64},
		{name: "prefill", heads: 6, kvHeads: 1, headDim: 128, pos0: 0, t: 12, maxPos: 16},
		{name: "decode", heads: 6, kvHeads: 1, headDim: 128, pos0: 37, t: 1, maxPos: 40},
		{name: "decode", heads: 4, kvHeads: 2, headDim: 16, pos0: 200, t: 1, maxPos: 256},
		{name: "chunk", heads: 4, kvHeads: 2, headDim: 16, pos0: 5, t: 7, maxPos: 16},
		{name: "first", heads: 8, kvHeads: 8, headDim: 64, pos0: 0, t: 1, maxPos: 8},
		{name: "one-position", heads: 4, kvHeads: 2, headDim: 16, pos0: 0, t: 1, maxPos: 1},
		// Scores of up to about ±150: softmax overflows float32 without
		// subtracting the maximum.
		{name: "large-scores", heads: 4, kvHeads: 2, headDim: 64, pos0: 20, t: 3, maxPos: 24, qScale: 4, scale: 1},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/H%d_KV%d_D%d_pos%d_T%d", c.name, c.heads, c.kvHeads, c.headDim, c.pos0, c.t), func(t *testing.T) {
			s.attention(t, c)
		})
	}
	// Every cache dtype on the shapes that a tiled prefill kernel and a
	// decode kernel split across the sequence meet: tiles cut at odd
	// lengths, chunks starting mid-cache, GQA groups of 1 to 8, head
	// dimensions 64, 128 and 256, and decode over thousands of positions.
	long := []attentionCase{
		{name: "tiles", heads: 8, kvHeads: 2, headDim: 64, pos0: 0, t: 130, maxPos: 136},
		{name: "tiles", heads: 4, kvHeads: 4, headDim: 128, pos0: 0, t: 97, maxPos: 97},
		{name: "tiles-chunk", heads: 8, kvHeads: 1, headDim: 128, pos0: 77, t: 67, maxPos: 160},
		{name: "tiles", heads: 2, kvHeads: 1, headDim: 256, pos0: 3, t: 45, maxPos: 64},
		{name: "tiles-d32", heads: 4, kvHeads: 2, headDim: 32, pos0: 0, t: 70, maxPos: 80},
		{name: "decode-long", heads: 8, kvHeads: 2, headDim: 128, pos0: 3001, t: 1, maxPos: 3010},
		{name: "decode-long", heads: 4, kvHeads: 4, headDim: 64, pos0: 1023, t: 1, maxPos: 1024},
		{name: "decode-rows", heads: 8, kvHeads: 8, headDim: 64, pos0: 2049, t: 3, maxPos: 2060},
		{name: "decode-short", heads: 8, kvHeads: 2, headDim: 64, pos0: 5, t: 1, maxPos: 8},
		{name: "large-scores", heads: 4, kvHeads: 1, headDim: 64, pos0: 600, t: 2, maxPos: 610, qScale: 4, scale: 1},
		// Heads of 12 and 40: the second KV head starts inside a block of
		// 8 (blocks of 8 only).
		{name: "odd-heads", heads: 4, kvHeads: 2, headDim: 12, pos0: 9, t: 5, maxPos: 16},
		{name: "odd-heads", heads: 6, kvHeads: 3, headDim: 40, pos0: 70, t: 1, maxPos: 80},
	}
	for _, dt := range s.cfg.cacheTypes {
		for _, c := range long {
			if c.kvHeads*c.headDim%dt.BlockSize() != 0 {
				continue
			}
			c.cache = dt
			t.Run(fmt.Sprintf("%v/%s/H%d_KV%d_D%d_pos%d_T%d", dt, c.name, c.heads, c.kvHeads, c.headDim, c.pos0, c.t), func(t *testing.T) {
				s.attention(t, c)
			})
		}
	}
}

// putCache uploads the first filled values of a [maxPos, width] cache in
// dtype dt, the rows past them all bits set (NaN in every float type, and
// a NaN scale in Q8_0 and Q8_B8), and returns the values as stored.
func (s *suite) putCache(t *testing.T, dt tensor.DType, maxPos, width int, v []float32) (*tensor.Tensor, []float64) {
	t.Helper()
	enc, err := Encode(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	stored, err := Stored(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	x, err := s.b.Alloc(dt, tensor.Shape{maxPos, width})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.b.Free(x) })
	all := bytes.Repeat([]byte{0xff}, int(x.NumBytes()))
	copy(all, enc)
	if err := s.b.Upload(x, 0, all); err != nil {
		t.Fatal(err)
	}
	return x, stored
}

func (s *suite) attention(t *testing.T, c attentionCase) {
	r := rng(t)
	qs := c.qScale
	if qs == 0 {
		qs = 1
	}
	scale := c.scale
	if scale == 0 {
		scale = 1 / math.Sqrt(float64(c.headDim))
	}
	qw, kw := c.heads*c.headDim, c.kvHeads*c.headDim
	q, qv := s.put(t, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -qs, qs))
	// Positions past pos0+t-1 hold NaN: a backend that reads them fails.
	filled := (c.pos0 + c.t) * kw
	cache := c.cache
	if cache == tensor.Invalid {
		cache = tensor.F32
	}
	k, kv := s.putCache(t, cache, c.maxPos, kw, uniform(r, filled, -qs, qs))
	v, vv := s.putCache(t, cache, c.maxPos, kw, uniform(r, filled, -1, 1))
	out := s.poisoned(t, tensor.Shape{c.t, qw})
	if err := s.b.Attention(out, tensor.Attn{Q: q, K: k, V: v, Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, Pos0: c.pos0, Scale: float32(scale)}); err != nil {
		t.Fatal(err)
	}
	want := RefAttention(qv, kv[:filled], vv[:filled], c.t, c.heads, c.kvHeads, c.headDim, c.pos0, float64(float32(scale)))
	s.compare(t, "Attention", s.get(t, out), want)
}

func nans(n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(math.NaN())
	}
	return v
}

// testErrors checks that malformed calls return errors (and do not panic).
func (s *suite) testErrors(t *testing.T) {
	f32s := func(shape ...int) *tensor.Tensor {
		x, _ := s.put(t, tensor.F32, shape, make([]float32, tensor.Shape(shape).NumElements()))
		return x
	}
	f16s := func(shape ...int) *tensor.Tensor {
		x, _ := s.put(t, tensor.F16, shape, make([]float32, tensor.Shape(shape).NumElements()))
		return x
	}
	x24, w34, w35, out23, out24 := f32s(2, 4), f32s(3, 4), f32s(3, 5), f32s(2, 3), f32s(2, 4)
	table := f16s(10, 4)
	cos, sin := f32s(8, 8), f32s(8, 8)
	q, kc := f32s(2, 64), f32s(8, 32)
	b := s.b
	cases := []struct {
		name string
		call func() error
	}{
		{"MatMul/K mismatch", func() error { return b.MatMul(out23, x24, w35, nil) }},
		{"MatMul/out shape", func() error { return b.MatMul(out24, x24, w34, nil) }},
		{"MatMul/bias length", func() error { return b.MatMul(out23, x24, w34, f32s(4)) }},
		{"MatMul/nil weight", func() error { return b.MatMul(out23, x24, nil, nil) }},
		{"MatMul/F16 activations", func() error { return b.MatMul(out23, f16s(2, 4), w34, nil) }},
		{"MatMul/F16 output", func() error { return b.MatMul(f16s(2, 3), x24, w34, nil) }},
		{"MatMul/1-D x", func() error { return b.MatMul(out23, f32s(4), w34, nil) }},
		{"RMSNorm/weight length", func() error { return b.RMSNorm(out24, x24, f32s(5), 1e-5) }},
		{"RMSNorm/out shape", func() error { return b.RMSNorm(out23, x24, f32s(4), 1e-5) }},
		{"Rope/odd headDim", func() error { return b.Rope(f32s(1, 6), tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 3}) }},
		{"Rope/past the tables", func() error {
			return b.Rope(f32s(2, 32), tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16, Pos0: 7})
		}},
		{"Rope/width", func() error { return b.Rope(f32s(1, 30), tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 16}) }},
		{"Rope/table width", func() error { return b.Rope(f32s(1, 64), tensor.Rotary{Cos: cos, Sin: sin, Heads: 2, HeadDim: 32}) }},
		{"SiLUMul/shapes", func() error { return b.SiLUMul(out24, x24, f32s(2, 5)) }},
		{"SiLUMul/out shape", func() error { return b.SiLUMul(out23, x24, x24) }},
		{"Add/shapes", func() error { return b.Add(out24, x24, f32s(4, 2)) }},
		{"Embed/id too large", func() error { return b.Embed(out24, table, []int32{1, 10}) }},
		{"Embed/negative id", func() error { return b.Embed(out24, table, []int32{-1, 0}) }},
		{"Embed/out rows", func() error { return b.Embed(out24, table, []int32{1, 2, 3}) }},
		{"Embed/out width", func() error { return b.Embed(out23, table, []int32{1, 2}) }},
		{"CopyRows/past dst", func() error { return b.CopyRows(w34, 2, x24, 0, 2) }},
		{"CopyRows/past src", func() error { return b.CopyRows(w34, 0, x24, 1, 2) }},
		{"CopyRows/negative n", func() error { return b.CopyRows(w34, 0, x24, 0, -1) }},
		{"CopyRows/negative row", func() error { return b.CopyRows(w34, -1, x24, 0, 1) }},
		{"CopyRows/row length", func() error { return b.CopyRows(w35, 0, x24, 0, 1) }},
		{"CopyRows/dtype", func() error { return b.CopyRows(x24, 0, table, 0, 1) }},
		{"Attention/kvHeads", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 3, HeadDim: 16, Scale: 1})
		}},
		{"Attention/past the cache", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 16, Pos0: 7, Scale: 1})
		}},
		{"Attention/q width", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 8, Scale: 1})
		}},
		{"Attention/out shape", func() error {
			return b.Attention(f32s(1, 64), tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 16, Scale: 1})
		}},
		{"Attention/v shape", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q, K: kc, V: f32s(8, 16), Heads: 4, KVHeads: 2, HeadDim: 16, Scale: 1})
		}},
		{"Attention/v dtype", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q, K: kc, V: f16s(8, 32), Heads: 4, KVHeads: 2, HeadDim: 16, Scale: 1})
		}},
		{"Attention/NaN scale", func() error {
			return b.Attention(f32s(2, 64), tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 16, Scale: float32(math.NaN())})
		}},
		{"Upload/past the end", func() error { return b.Upload(x24, 30, make([]byte, 4)) }},
		{"Upload/negative offset", func() error { return b.Upload(x24, -4, make([]byte, 4)) }},
		{"AttentionBlocks/rows do not add up", func() error {
			return b.AttentionBlocks(f32s(2, 64), blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 1, Blocks: []int32{0}}}))
		}},
		{"AttentionBlocks/table too short", func() error {
			return b.AttentionBlocks(f32s(2, 64), blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Pos0: 3, Blocks: []int32{0}}}))
		}},
		{"AttentionBlocks/block outside the pool", func() error {
			return b.AttentionBlocks(f32s(2, 64), blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Blocks: []int32{2}}}))
		}},
		{"AttentionBlocks/negative block", func() error {
			return b.AttentionBlocks(f32s(2, 64), blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Blocks: []int32{-1}}}))
		}},
		{"AttentionBlocks/block listed twice", func() error {
			return b.AttentionBlocks(f32s(2, 64), blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Pos0: 4, Blocks: []int32{1, 1}}}))
		}},
		{"AttentionBlocks/written block read by another", func() error {
			return b.AttentionBlocks(f32s(2, 64), blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 1, Blocks: []int32{0}}, {Rows: 1, Pos0: 4, Blocks: []int32{0, 1}}}))
		}},
		{"AttentionBlocks/pool not whole blocks", func() error {
			a := blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Blocks: []int32{0}}})
			a.KPool, a.VPool = f32s(6, 32), f32s(6, 32)
			return b.AttentionBlocks(f32s(2, 64), a)
		}},
		{"AttentionBlocks/block size 0", func() error {
			a := blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Blocks: []int32{0}}})
			a.BlockSize = 0
			return b.AttentionBlocks(f32s(2, 64), a)
		}},
		{"AttentionBlocks/out aliases q", func() error {
			a := blocksArgs(f32s, []tensor.SeqBlocks{{Rows: 2, Blocks: []int32{0}}})
			return b.AttentionBlocks(a.Q, a)
		}},
		{"Download/short buffer", func() error { return b.Download(make([]byte, 31), x24) }},
		{"Download/long buffer", func() error { return b.Download(make([]byte, 33), x24) }},
		{"Alloc/negative dimension", func() error { x, err := b.Alloc(tensor.F32, tensor.Shape{2, -1}); b.Free(x); return err }},
		{"Alloc/invalid dtype", func() error { x, err := b.Alloc(tensor.Invalid, tensor.Shape{2}); b.Free(x); return err }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("panicked instead of returning an error: %v", p)
				}
			}()
			if err := c.call(); err == nil {
				t.Fatalf("no error")
			} else {
				t.Logf("error: %v", err)
			}
		})
	}
}

// testAliasing checks the storage-sharing rules: an output that overlaps
// an input where the result would be wrong is an error saying so, and the
// in-place forms the contract allows work.
func (s *suite) testAliasing(t *testing.T) {
	f32s := func(shape ...int) *tensor.Tensor {
		x, _ := s.put(t, tensor.F32, shape, make([]float32, tensor.Shape(shape).NumElements()))
		return x
	}
	b := s.b
	x, w, norm := f32s(4, 4), f32s(4, 4), f32s(4)
	top, _ := x.Rows(0, 2)
	low, _ := x.Rows(1, 2)
	wide := f32s(3, 16)
	q, _ := wide.Rows(0, 2)
	cos, sin := f32s(8, 4), f32s(8, 4)
	kc := f32s(8, 8)
	for _, c := range []struct {
		name string
		call func() error
	}{
		{"MatMul/out is x", func() error { return b.MatMul(x, x, w, nil) }},
		{"MatMul/out is w", func() error { return b.MatMul(w, x, w, nil) }},
		{"MatMul/out is bias", func() error {
			r, _ := x.Rows(0, 1)
			bias, _ := r.Reshape(tensor.Shape{4})
			return b.MatMul(x, w, w, bias)
		}},
		{"RMSNorm/out is w", func() error {
			r, _ := x.Rows(0, 1)
			wv, _ := r.Reshape(tensor.Shape{4})
			return b.RMSNorm(x, w, wv, 1e-5)
		}},
		{"RMSNorm/out partly x", func() error { return b.RMSNorm(low, top, norm, 1e-5) }},
		{"Rope/x is cos", func() error {
			xc, _ := cos.Reshape(tensor.Shape{4, 8})
			return b.Rope(xc, tensor.Rotary{Cos: cos, Sin: sin, Heads: 1, HeadDim: 8})
		}},
		{"Add/out partly a", func() error { return b.Add(low, top, top) }},
		{"SiLUMul/out partly up", func() error { return b.SiLUMul(low, f32s(2, 4), top) }},
		{"Attention/out is q", func() error {
			return b.Attention(q, tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 4, Scale: 1})
		}},
		{"Attention/out is k", func() error {
			kr, _ := kc.Rows(0, 4)
			o, _ := kr.Reshape(tensor.Shape{2, 16})
			return b.Attention(o, tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 4, Scale: 1})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			if err == nil || !strings.Contains(err.Error(), "overlaps") {
				t.Fatalf("error %v, want one about overlapping operands", err)
			}
		})
	}
	for _, c := range []struct {
		name string
		call func() error
	}{
		{"Add in place", func() error { return b.Add(x, x, x) }},
		{"SiLUMul in place", func() error { return b.SiLUMul(x, x, w) }},
		{"RMSNorm in place", func() error { return b.RMSNorm(x, x, norm, 1e-5) }},
	} {
		if err := c.call(); err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}

// blocksArgs is a well-formed AttentionBlocks call of two rows (4 heads
// over 2 KV heads of 16) on a pool of two blocks of 4 positions, but for
// seqs.
func blocksArgs(f32s func(...int) *tensor.Tensor, seqs []tensor.SeqBlocks) tensor.AttnBlocks {
	return tensor.AttnBlocks{Q: f32s(2, 64), K: f32s(2, 32), V: f32s(2, 32), KPool: f32s(8, 32), VPool: f32s(8, 32),
		Seqs: seqs, Heads: 4, KVHeads: 2, HeadDim: 16, BlockSize: 4, Scale: 0.25}
}
