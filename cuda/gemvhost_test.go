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

// TestGEMVSplitOnHost runs the candidate decode GEMVs (gemvVariants,
// kernels/gemv_split.cuh) on the CPU through testdata/gemvhost.cpp, built
// with nvcc as plain C++ where nvcc is installed, one host thread per GPU
// thread with the grids the backend launches: every variant's MatMul
// kernel over three matrices laid end to end (MatMulMany; the second and
// third empty for MatMul) and its gate-up kernel, and the PDL variants'
// normed MatMul and gate-up kernels (x's RMS norm first) and adding MatMul
// (out += product), on F16 and BF16 weights, against the float64 products
// of the stored weights (and normed x, and the outputs' values) within 1e-5
// (norm-wise), bit for bit equal across the variants that sum a row in
// one warp (s = 1: gemv_vec's order), no load outside the weights or x or
// misaligned, and nothing written past an output. The shapes cut row
// groups short (N odd, not a multiple of a block's rows, rows straddling
// two matrices), and K short of a batch of loads, of a split, one chunk.
func TestGEMVSplitOnHost(t *testing.T) {
	ctx, bin := hostHarness(t, "gemvhost.cpp")
	r := rand.New(rand.NewPCG(5, 6))
	type hostCase struct {
		name       string
		op         int32
		dt         tensor.DType
		v          *gemvVariant
		n          [3]int
		k          int
		want       []float64
		got        []float32
		w          []byte
		x          []float32
		g          []byte    // ops 3 and 4: the norm's weights, stored
		eps        float32   // ops 3 and 4
		init       []float32 // op 5: the outputs before the launch
		violations int64
		sameAs     *[]float32 // the s = 1 variants' outputs, which must match bit for bit
	}
	var cases []*hostCase
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		for _, s := range []struct {
			n [3]int
			k int
		}{
			{[3]int{1, 0, 0}, 8},
			{[3]int{9, 0, 0}, 24},
			{[3]int{33, 0, 0}, 2056},
			{[3]int{17, 5, 3}, 1032},
			{[3]int{16, 16, 16}, 512},
			{[3]int{7, 1, 0}, 4104},
		} {
			rows := s.n[0] + s.n[1] + s.n[2]
			wv := make([]float32, 2*rows*s.k)
			for i := range wv {
				wv[i] = 2*r.Float32() - 1
			}
			x := make([]float32, s.k)
			for i := range x {
				x[i] = 2*r.Float32() - 1
			}
			ws, raw := storedBits(t, dt, wv)
			xs := make([]float64, s.k)
			for i, v := range x {
				xs[i] = float64(v)
			}
			mm := tensortest.RefMatMul(xs, ws[:rows*s.k], nil, 1, rows, s.k)
			// The gate-up case: the first n0 rows the gate, the n0 after
			// them (rows n0.. of the same data) up.
			n0 := s.n[0]
			gu := make([]float64, n0)
			for i := range gu {
				g := tensortest.RefMatMul(xs, ws[i*s.k:(i+1)*s.k], nil, 1, 1, s.k)[0]
				u := tensortest.RefMatMul(xs, ws[(n0+i)*s.k:(n0+i+1)*s.k], nil, 1, 1, s.k)[0]
				gu[i] = g / (1 + math.Exp(-g)) * u
			}
			// The normed and adding twins of the PDL variants (their
			// bodies without the waits): x normed with stored weights g,
			// and outputs that start from init.
			gv := make([]float32, s.k)
			for i := range gv {
				gv[i] = 0.5 + r.Float32()
			}
			gs, graw := storedBits(t, dt, gv)
			const eps = 1e-5
			var ss float64
			for _, v := range xs {
				ss += v * v
			}
			inv := 1 / math.Sqrt(ss/float64(s.k)+eps)
			xn := make([]float64, s.k)
			for i := range xn {
				xn[i] = xs[i] * inv * gs[i]
			}
			mmN := tensortest.RefMatMul(xn, ws[:rows*s.k], nil, 1, rows, s.k)
			guN := make([]float64, n0)
			for i := range guN {
				g := tensortest.RefMatMul(xn, ws[i*s.k:(i+1)*s.k], nil, 1, 1, s.k)[0]
				u := tensortest.RefMatMul(xn, ws[(n0+i)*s.k:(n0+i+1)*s.k], nil, 1, 1, s.k)[0]
				guN[i] = g / (1 + math.Exp(-g)) * u
			}
			init := make([]float32, rows)
			acc := make([]float64, rows)
			for i := range init {
				init[i] = 2*r.Float32() - 1
				acc[i] = float64(init[i]) + mm[i]
			}
			for i := range gemvVariants {
				v := &gemvVariants[i]
				if !v.pdl {
					continue
				}
				base := fmt.Sprintf("%v/N%d+%d+%d_K%d/%s", dt, s.n[0], s.n[1], s.n[2], s.k, v.name)
				cases = append(cases,
					&hostCase{name: base + "/norm-many", op: 3, dt: dt, v: v, n: s.n, k: s.k, want: mmN, w: raw[:2*rows*s.k], x: x, g: graw, eps: eps},
					&hostCase{name: base + "/norm-gate-up", op: 4, dt: dt, v: v, n: [3]int{n0, 0, 0}, k: s.k, want: guN, w: raw[:2*2*n0*s.k], x: x, g: graw, eps: eps},
					&hostCase{name: base + "/add-many", op: 5, dt: dt, v: v, n: s.n, k: s.k, want: acc, w: raw[:2*rows*s.k], x: x, init: init})
			}
			var oneWarp, oneWarpGU []float32
			for i := range gemvVariants {
				v := &gemvVariants[i]
				if v.pdl {
					continue // the same bodies as the variant without PDL, which waits only on the device
				}
				base := fmt.Sprintf("%v/N%d+%d+%d_K%d/%s", dt, s.n[0], s.n[1], s.n[2], s.k, v.name)
				c := &hostCase{name: base + "/many", op: 1, dt: dt, v: v, n: s.n, k: s.k, want: mm, w: raw[:2*rows*s.k], x: x}
				if v.s == 1 {
					c.sameAs = &oneWarp
				}
				g := &hostCase{name: base + "/gate-up", op: 2, dt: dt, v: v, n: [3]int{n0, 0, 0}, k: s.k, want: gu, w: raw[:2*2*n0*s.k], x: x}
				if v.gs == 1 {
					g.sameAs = &oneWarpGU
				}
				cases = append(cases, c, g)
			}
		}
	}
	var req bytes.Buffer
	for _, c := range cases {
		u, s := c.v.u, c.v.s
		if c.op == 2 || c.op == 4 {
			u, s = c.v.gu, c.v.gs
		}
		dt := int32(1)
		if c.dt == tensor.BF16 {
			dt = 2
		}
		for _, v := range []int32{c.op, dt, int32(c.v.r), int32(u), int32(s), int32(c.n[0]), int32(c.n[1]), int32(c.n[2]), int32(c.k)} {
			binary.Write(&req, binary.LittleEndian, v)
		}
		req.Write(c.w)
		binary.Write(&req, binary.LittleEndian, c.x)
		switch c.op {
		case 3, 4:
			req.Write(c.g)
			binary.Write(&req, binary.LittleEndian, c.eps)
		case 5:
			binary.Write(&req, binary.LittleEndian, c.init)
		}
	}
	req.Write(make([]byte, 4)) // op 0: end
	cmd := exec.CommandContext(ctx, bin)
	cmd.Stdin = &req
	var resp, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &resp, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("gemvhost: %v\n%s", err, stderr.Bytes())
	}
	for _, c := range cases {
		c.got = make([]float32, len(c.want))
		if err := binary.Read(&resp, binary.LittleEndian, &c.violations); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if err := binary.Read(&resp, binary.LittleEndian, c.got); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
	}
	if resp.Len() != 0 {
		t.Errorf("%d bytes left over in the harness's output", resp.Len())
	}
	worst := 0.0
	for _, c := range cases {
		if c.violations != 0 {
			t.Errorf("%s: %d loads outside the operands or misaligned, or writes past an output", c.name, c.violations)
		}
		e := tensortest.RelErr(c.got, c.want)
		if !(e <= 1e-5) {
			t.Errorf("%s: differs from the float64 product by %.3g (%v, want %v)", c.name, e, c.got[:min(3, len(c.got))], c.want[:min(3, len(c.want))])
		}
		worst = max(worst, e)
		if c.sameAs != nil {
			if *c.sameAs == nil {
				*c.sameAs = c.got
			} else {
				for i, v := range c.got {
					if math.Float32bits(v) != math.Float32bits((*c.sameAs)[i]) {
						t.Errorf("%s: output %d is %v, another variant summing the row in one warp gives %v", c.name, i, v, (*c.sameAs)[i])
						break
					}
				}
			}
		}
	}
	t.Logf("%d cases, largest error against float64 %.2g", len(cases), worst)
}

// storedBits rounds v to dt (F16 or BF16) and returns the stored values,
// exact in float64, and their little-endian bits.
func storedBits(t *testing.T, dt tensor.DType, v []float32) ([]float64, []byte) {
	t.Helper()
	ws, err := tensortest.Stored(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	bits := make([]uint16, len(ws))
	if dt == tensor.F16 {
		f := make([]float32, len(ws))
		for i, v := range ws {
			f[i] = float32(v)
		}
		tensor.F32ToF16(bits, f)
	} else {
		for i, v := range ws {
			bits[i] = uint16(math.Float32bits(float32(v)) >> 16)
		}
	}
	raw := make([]byte, 2*len(bits))
	for i, h := range bits {
		binary.LittleEndian.PutUint16(raw[2*i:], h)
	}
	return ws, raw
}
