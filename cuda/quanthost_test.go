package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os/exec"
	"testing"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// TestQuantKernelsOnHost runs the bodies of the quantized-weight kernels
// (kernels/quant.cuh) on the CPU through testdata/quanthost.cu, built with
// nvcc where it is installed (make cuda-deps CUDA_DEPS_PKGS="nvidia-cuda-dev
// nvidia-cuda-toolkit"), one host thread per GPU thread: the GEMV against
// a float64 product over quant.Dequantize's weights within 1e-5, the
// dequantization bit-exact with it (F32) or its rounding to F16, no read
// outside the weights, no misaligned vector access. The shapes cover
// pieces and row groups cut short, more warps than pieces, fewer blocks
// than row groups, and weights at odd byte offsets; the weights are
// quantized values and raw random bytes (every bit pattern of the
// scales, levels and high bits) with finite F16 scales; x is centred or
// offset (the GEMV's sums of x cancel most there).
func TestQuantKernelsOnHost(t *testing.T) {
	ctx, bin := hostHarness(t, "quanthost.cu")
	r := rand.New(rand.NewPCG(1, 2))
	var cases []*hostCase
	for id, f := range quantFormats {
		qk := f.dt.BlockSize()
		small, big := qk, qk*(f.pieceBlocks+5) // one block; a piece and a part
		offs := []int{0, 2, 6, 9}
		if f.align16 {
			offs = []int{0, 16, 48, 0}
		}
		for i, g := range []struct{ m, n, k, nblocks, nwarps int }{
			{1, 13, big, 2, 4},
			{2, 7, big, 1, 3},
			{2, 5, small, 3, 1},
			{1, 1, small, 1, 2},
			{1, 9, big, 4, 2},
			{2, 6, 3 * big, 2, 4},
		} {
			c := &hostCase{op: 1, f: f, id: id, nblocks: g.nblocks, nwarps: g.nwarps, woff: offs[i%len(offs)], n: g.n, k: g.k, m: g.m, nanRow: -1}
			c.w = hostWeights(t, r, f.dt, g.n, g.k, i%2 == 1)
			c.x = make([]float32, g.m*g.k)
			for j := range c.x {
				c.x[j] = 2*r.Float32() - 1
				if i%3 == 2 {
					c.x[j] += 0.75
				}
			}
			c.name = fmt.Sprintf("%v/gemv/M%d_N%d_K%d_off%d_%dx%d", f.dt, g.m, g.n, g.k, c.woff, g.nblocks, g.nwarps)
			cases = append(cases, c)
			// The integer GEMV on the same weights, with 1 to 8 rows of x
			// (3, 5 and 7 run on the kernels for 4 and 8, rows left over).
			ci := *c
			ci.op, ci.m = 4, []int{1, 2, 3, 5, 8, 7}[i]
			ci.x = make([]float32, ci.m*g.k)
			for j := range ci.x {
				ci.x[j] = 2*r.Float32() - 1
				if i%3 == 2 {
					ci.x[j] += 0.75
				}
				if j%32 == 5 && i%2 == 0 {
					ci.x[j] *= 16 // an outlier a block
				}
			}
			if i == 4 {
				ci.x[3*32] = 0 // a block of zeros
				for j := range 32 {
					ci.x[2*32+j] = 0
				}
			}
			if i == 3 || i == 5 {
				// A NaN (M = 5) or an infinity (M = 7) in row 1: its products
				// are NaN, the other rows' as without.
				ci.x[g.k+3] = float32(math.NaN())
				if i == 5 {
					ci.x[g.k+3] = float32(math.Inf(-1))
				}
				ci.nanRow = 1
			}
			ci.name = fmt.Sprintf("%v/gemvx/M%d_N%d_K%d_off%d_%dx%d", f.dt, ci.m, g.n, g.k, c.woff, g.nblocks, g.nwarps)
			cases = append(cases, &ci)
		}
		if f.xrowsWide > 0 {
			// The staged GEMV of one row with gemvx_<f>_m1w's rows of w a
			// block (op 7): row groups cut short, fewer blocks than groups.
			for i, g := range []struct{ n, k, nblocks, nwarps int }{{13, big, 2, 4}, {5, small, 1, 2}, {9, 3 * big, 4, 3}} {
				c := &hostCase{op: 7, f: f, id: id, nblocks: g.nblocks, nwarps: g.nwarps, woff: offs[i], n: g.n, k: g.k, m: 1, nanRow: -1}
				c.w = hostWeights(t, r, f.dt, g.n, g.k, i == 1)
				c.x = make([]float32, g.k)
				for j := range c.x {
					c.x[j] = 2*r.Float32() - 1
					if i == 2 {
						c.x[j] += 0.75
					}
				}
				c.name = fmt.Sprintf("%v/gemvx_m1w/N%d_K%d_off%d_%dx%d", f.dt, g.n, g.k, c.woff, g.nblocks, g.nwarps)
				cases = append(cases, c)
			}
		}
		if f.direct {
			// The direct GEMV (one row of x) on X16 (op 5) and X8 (op 6):
			// units cut short at a row's end (13 blocks: 104 units, 4 a
			// lane in flight), rows left over for the grid's warps, one
			// block, weights 16 or 48 bytes past a 256-byte boundary.
			for i, g := range []struct{ n, k, nblocks, nwarps, woff int }{
				{13, 13 * qk, 2, 4, 16},
				{7, 2 * qk, 1, 3, 48},
				{5, qk, 3, 1, 0},
				{33, 43 * qk, 2, 4, 0},
			} {
				variants := append([]gemvdVariant{}, gemvdVariants...)
				variants = append(variants, gemvd8Variant)
				for vi, v := range variants {
					op := int32(5)
					if vi == len(variants)-1 {
						op = 6
					}
					c := &hostCase{op: op, f: f, id: id, nblocks: g.nblocks, nwarps: g.nwarps, woff: g.woff, n: g.n, k: g.k, m: 1, nanRow: -1, dv: v}
					c.w = hostWeights(t, r, f.dt, g.n, g.k, i%2 == 1)
					c.x = make([]float32, g.k)
					for j := range c.x {
						c.x[j] = 2*r.Float32() - 1
						if i == 2 {
							c.x[j] += 0.75
						}
						if j%32 == 5 && i%2 == 0 {
							c.x[j] *= 16 // an outlier a block
						}
					}
					if i == 1 {
						c.x[3] = float32(math.NaN())
						c.nanRow = 0
					}
					c.name = fmt.Sprintf("%v/gemvd_op%d_%v/N%d_K%d_off%d_%dx%d", f.dt, op, v, g.n, g.k, g.woff, g.nblocks, g.nwarps)
					cases = append(cases, c)
				}
			}
		}
		const n = 9
		c := &hostCase{op: 2, f: f, id: id, nblocks: 2, nwarps: 3, woff: offs[1], n: n, k: big, ids: []int32{n - 1, 0, 3, 3, -1, n, 5}}
		c.rows = len(c.ids)
		c.w = hostWeights(t, r, f.dt, n, big, true)
		c.name = fmt.Sprintf("%v/dequant_f32/ids", f.dt)
		cases = append(cases, c)
		c = &hostCase{op: 3, f: f, id: id, nblocks: 5, nwarps: 4, woff: offs[2], n: n, k: big, r0: 2, rows: n - 2}
		c.w = hostWeights(t, r, f.dt, n, big, false)
		c.name = fmt.Sprintf("%v/dequant_f16/rows", f.dt)
		cases = append(cases, c)
		c = &hostCase{op: 2, f: f, id: id, nblocks: 1, nwarps: 1, woff: offs[3], n: 3, k: small, r0: 0, rows: 3}
		c.w = hostWeights(t, r, f.dt, 3, small, true)
		c.name = fmt.Sprintf("%v/dequant_f32/small", f.dt)
		cases = append(cases, c)
	}

	var req bytes.Buffer
	for _, c := range cases {
		c.request(&req)
	}
	req.Write(make([]byte, 4)) // op 0: end
	cmd := exec.CommandContext(ctx, bin)
	cmd.Stdin = &req
	var resp, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &resp, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("quanthost: %v\n%s", err, stderr.Bytes())
	}
	for _, c := range cases {
		if !t.Run(c.name, func(t *testing.T) { c.check(t, &resp) }) {
			t.Logf("failing case %s", c.name)
		}
	}
	if resp.Len() != 0 {
		t.Errorf("%d bytes left over in the harness's output", resp.Len())
	}
}

type hostCase struct {
	name                  string
	op                    int32 // 1 gemv, 2 dequant to F32, 3 dequant to F16, 4 gemvx, 5 gemvd, 6 gemvd8, 7 gemvx_m1w
	f                     quantFormat
	id                    int
	nblocks, nwarps, woff int
	n, k, m               int
	rows, r0              int
	ids                   []int32
	w                     []byte
	x                     []float32
	nanRow                int          // the row of x with a NaN or an infinity (op 4), or -1
	dv                    gemvdVariant // the direct gemv's variant (ops 5, 6)
}

func (c *hostCase) request(b *bytes.Buffer) {
	put := func(vs ...int) {
		for _, v := range vs {
			binary.Write(b, binary.LittleEndian, int32(v))
		}
	}
	put(int(c.op), c.id, c.nblocks, c.nwarps, c.woff, c.n, c.k)
	if c.op == 1 || c.op >= 4 {
		put(c.m)
		if c.op == 5 || c.op == 6 {
			put(c.dv.r, c.dv.u)
		}
		b.Write(c.w)
		binary.Write(b, binary.LittleEndian, c.x)
		return
	}
	put(c.rows, c.r0, len(c.ids))
	binary.Write(b, binary.LittleEndian, c.ids)
	b.Write(c.w)
}

func (c *hostCase) check(t *testing.T, resp *bytes.Buffer) {
	var violations int64
	binary.Read(resp, binary.LittleEndian, &violations)
	if violations != 0 {
		t.Errorf("%d reads outside the weights or misaligned accesses", violations)
	}
	qt, _ := c.f.dt.Quant()
	rowBytes := c.k / qt.BlockSize() * qt.BlockBytes()
	row := func(i int) []float32 {
		src := make([]byte, rowBytes) // a row outside w decodes as zero bytes
		if i >= 0 && i < c.n {
			src = c.w[i*rowBytes : (i+1)*rowBytes]
		}
		out := make([]float32, c.k)
		if err := qt.Dequantize(out, src); err != nil {
			t.Fatal(err)
		}
		return out
	}
	switch c.op {
	case 1:
		got := make([]float32, c.m*c.n)
		binary.Read(resp, binary.LittleEndian, got)
		want := make([]float64, c.m*c.n)
		for i := range c.n {
			w := row(i)
			for m := range c.m {
				var s float64
				for k, v := range w {
					s += float64(v) * float64(c.x[m*c.k+k])
				}
				want[m*c.n+i] = s
			}
		}
		if e := tensortest.RelErr(got, want); !(e <= 1e-5) {
			t.Errorf("GEMV: relative error %.3g > 1e-5\ngot  %v\nwant %v", e, got[:min(8, len(got))], want[:min(8, len(want))])
		} else {
			t.Logf("GEMV: relative error %.2g", e)
		}
	case 4, 5, 6, 7:
		c.checkX16(t, resp, row)
	case 2, 3:
		n := c.rows * c.k
		var got []float32
		if c.op == 2 {
			got = make([]float32, n)
			binary.Read(resp, binary.LittleEndian, got)
		} else {
			h := make([]uint16, n)
			binary.Read(resp, binary.LittleEndian, h)
			got = make([]float32, n)
			tensor.F16ToF32(got, h)
		}
		bad := 0
		for i := range c.rows {
			src := c.r0 + i
			if c.ids != nil {
				src = int(c.ids[i])
			}
			want := row(src)
			if c.op == 3 {
				h := make([]uint16, len(want))
				tensor.F32ToF16(h, want)
				tensor.F16ToF32(want, h)
			}
			for k, v := range want {
				if g := got[i*c.k+k]; math.Float32bits(g) != math.Float32bits(v) {
					if bad++; bad <= 5 {
						t.Errorf("row %d (source %d) element %d: got %g, want %g", i, src, k, g, v)
					}
				}
			}
		}
		if bad > 5 {
			t.Errorf("%d values differ", bad)
		}
	}
}

// checkX16 checks the integer GEMV's response (staged or direct on X16,
// direct on X8): x's levels bit for bit against quantX16 (quantX8), the
// product within 1e-5 of the float64 product of the dequantized weights
// and the rounded x (d*q), and within 2e-4 (X8: 6e-2) of the one with x as
// given (the rounding's own error, logged).
func (c *hostCase) checkX16(t *testing.T, resp *bytes.Buffer, row func(int) []float32) {
	got := make([]float32, c.m*c.n)
	binary.Read(resp, binary.LittleEndian, got)
	var gx x16
	gx.q = make([]int16, c.m*c.k)
	gx.d = make([]float32, c.m*c.k/32)
	gx.s = make([]int32, c.m*c.k/16)
	wx, tolX, what := quantX16(c.x), 2e-4, "X16"
	if c.op == 6 {
		// 8-bit levels: the error of rounding x is ~256 times X16's.
		q8 := make([]int8, len(gx.q))
		binary.Read(resp, binary.LittleEndian, q8)
		for i, v := range q8 {
			gx.q[i] = int16(v)
		}
		wx, tolX, what = quantX8(c.x), 6e-2, "X8" // 3.8e-2 measured: 256 elements offset by 0.75
	} else {
		binary.Read(resp, binary.LittleEndian, gx.q)
	}
	if c.op == 5 || c.op == 6 {
		// The direct kernels' levels are interleaved.
		l := 8
		if c.op == 6 {
			l = 16
		}
		gx.q = deinterleave(gx.q, l)
	}
	binary.Read(resp, binary.LittleEndian, gx.d)
	binary.Read(resp, binary.LittleEndian, gx.s)
	bad := 0
	for i := range wx.q {
		if gx.q[i] != wx.q[i] {
			if bad++; bad <= 5 {
				t.Errorf("%s level %d: got %d, want %d (x %g)", what, i, gx.q[i], wx.q[i], c.x[i])
			}
		}
	}
	for i := range wx.d {
		if math.Float32bits(gx.d[i]) != math.Float32bits(wx.d[i]) || gx.s[2*i] != wx.s[2*i] || gx.s[2*i+1] != wx.s[2*i+1] {
			if bad++; bad <= 5 {
				t.Errorf("%s block %d: got d %g, sums %d %d; want %g, %d %d", what, i, gx.d[i], gx.s[2*i], gx.s[2*i+1], wx.d[i], wx.s[2*i], wx.s[2*i+1])
			}
		}
	}
	w := make([]float64, c.n*c.k)
	for i := range c.n {
		for k, v := range row(i) {
			w[i*c.k+k] = float64(v)
		}
	}
	exact := make([]float64, len(c.x))
	for i, f := range c.x {
		exact[i] = float64(f)
	}
	want16, want := productRef(w, wx.values(), c.m, c.n, c.k), productRef(w, exact, c.m, c.n, c.k)
	if r := c.nanRow; r >= 0 {
		for i, v := range got[r*c.n : (r+1)*c.n] {
			if !math.IsNaN(float64(v)) {
				t.Errorf("row %d of x has a NaN or an infinity; out[%d] = %g, want NaN", r, r*c.n+i, v)
			}
		}
		// The other rows against their references.
		got = append(got[:r*c.n:r*c.n], got[(r+1)*c.n:]...)
		want16 = append(want16[:r*c.n:r*c.n], want16[(r+1)*c.n:]...)
		want = append(want[:r*c.n:r*c.n], want[(r+1)*c.n:]...)
	}
	er := tensortest.RelErr(got, want16)
	ex := tensortest.RelErr(got, want)
	if !(er <= 1e-5) || !(ex <= tolX) {
		t.Errorf("GEMV on %s: relative error %.3g against the rounded x (want <= 1e-5), %.3g against x (want <= %g)\ngot %v", what, er, ex, tolX, got[:min(8, len(got))])
	} else {
		t.Logf("GEMV on %s: relative error %.2g against the rounded x, %.2g against x", what, er, ex)
	}
}

// deinterleave puts the levels of the direct GEMV's interleaved X16 or X8
// (kernels/quantx.cuh, ilpos: l levels a 16-byte load) back in element
// order: in each 256 elements, lane m = 2g+h of a block takes the elements
// 64g+16h+i and 64g+32+16h+i (i < 16), 32 levels, and piece j of them
// (l levels) of lanes 0..7 lies at 8*l*j, lane after lane.
func deinterleave(q []int16, l int) []int16 {
	out := make([]int16, len(q))
	for base := 0; base+256 <= len(q); base += 256 {
		for m := range 8 {
			g, h := m/2, m%2
			for t := range 32 {
				e := 64*g + 16*h + 32*(t/16) + t%16
				out[base+e] = q[base+8*l*(t/l)+m*l+t%l]
			}
		}
	}
	return out
}

// halfFields are the byte offsets of the F16 scales in a block.
var halfFields = map[tensor.DType][]int{
	tensor.Q8_0: {0}, tensor.Q4_0: {0}, tensor.Q5_0: {0}, tensor.Q4_1: {0, 2}, tensor.Q5_1: {0, 2},
	tensor.Q4_K: {0, 2}, tensor.Q5_K: {0, 2}, tensor.Q6_K: {208},
}

// hostWeights returns n rows of k elements of dt: random values quantized,
// or raw random bytes with random finite F16 scales.
func hostWeights(t testing.TB, r *rand.Rand, dt tensor.DType, n, k int, raw bool) []byte {
	t.Helper()
	qt, _ := dt.Quant()
	size, err := qt.Bytes(int64(n * k))
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, size)
	if !raw {
		v := make([]float32, n*k)
		for i := range v {
			v[i] = float32(r.NormFloat64())
		}
		if err := qt.Quantize(b, v); err != nil {
			t.Fatal(err)
		}
		return b
	}
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	bb := qt.BlockBytes()
	for blk := 0; blk < len(b); blk += bb {
		for _, off := range halfFields[dt] {
			// sign, exponent 2^-9..2^0, any mantissa
			h := uint16(r.IntN(2))<<15 | uint16(6+r.IntN(10))<<10 | uint16(r.IntN(1024))
			binary.LittleEndian.PutUint16(b[blk+off:], h)
		}
	}
	return b
}
