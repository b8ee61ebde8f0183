//go:build cuda

package cuda

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/tensortest"
)

// openGPU opens device 0 for a test, skipping when this machine has no
// usable GPU, and closes it when the test ends, checking that Close left
// nothing behind.
func openGPU(t testing.TB) *Backend {
	t.Helper()
	b, err := Open(0)
	if errors.Is(err, ErrNoDevice) {
		t.Skipf("no CUDA device: %v", err)
	}
	if err != nil {
		t.Fatalf("Open(0): %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if s := b.Stats(); s.Reserved != 0 || s.InUse != 0 || s.Cached != 0 || s.Pinned != 0 || s.Managed != 0 {
			t.Errorf("after Close: %+v", s)
		}
	})
	return b
}

func newRand(t testing.TB) *rand.Rand {
	seed := rand.Uint64()
	t.Logf("seed %#x", seed)
	return rand.New(rand.NewPCG(seed, 1))
}

func uniform(r *rand.Rand, n int, lo, hi float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = lo + (hi-lo)*r.Float32()
	}
	return v
}

func nanSlice(n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(math.NaN())
	}
	return v
}

// put uploads v as dt and returns the tensor with the stored values.
func put(t testing.TB, b *Backend, dt tensor.DType, shape tensor.Shape, v []float32) (*tensor.Tensor, []float64) {
	t.Helper()
	x, err := tensortest.FromF32(b, dt, shape, v)
	if err != nil {
		t.Fatalf("upload %v %v: %v", dt, shape, err)
	}
	t.Cleanup(func() { b.Free(x) })
	st, err := tensortest.Stored(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	return x, st
}

func get(t testing.TB, b *Backend, x *tensor.Tensor) []float32 {
	t.Helper()
	v, err := tensortest.ToF32(b, x)
	if err != nil {
		t.Fatalf("download %v: %v", x, err)
	}
	return v
}

func check(t testing.TB, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	if e := tensortest.RelErr(got, want); !(e <= tol) {
		t.Errorf("%s: relative error %.3g > %.3g", what, e, tol)
	} else {
		t.Logf("%s: relative error %.2g", what, e)
	}
}

func TestDevices(t *testing.T) {
	b := openGPU(t)
	devs, err := Devices()
	if err != nil || len(devs) == 0 {
		t.Fatalf("Devices = %v, %v", devs, err)
	}
	for _, d := range devs {
		t.Logf("device %d: %s, compute capability %d.%d, %d SMs, %.1f GiB, driver CUDA %s, managed memory %v",
			d.Ordinal, d.Name, d.Major, d.Minor, d.SMs, float64(d.TotalMem)/(1<<30), versionString(d.DriverVersion), d.ManagedMemory)
	}
	t.Logf("%s: %s", b.Name(), b.BLAS())
	free, total, err := b.MemInfo()
	if err != nil || free <= 0 || total != devs[0].TotalMem || free > total {
		t.Errorf("MemInfo = %d, %d, %v (device has %d)", free, total, err, devs[0].TotalMem)
	}
	if _, err := Open(len(devs)); err == nil {
		t.Errorf("Open(%d) of %d devices succeeded", len(devs), len(devs))
	}
	// The registry: every device listed, opened by name, and "auto" on
	// device 0.
	want := []string{"cpu"}
	for i := range devs {
		want = append(want, fmt.Sprintf("cuda:%d", i))
	}
	if got := tensor.Devices(); !slices.Equal(got, want) {
		t.Errorf("tensor.Devices() = %v, want %v", got, want)
	}
	last := fmt.Sprintf("cuda:%d", len(devs)-1)
	for spec, name := range map[string]string{"cuda": "cuda:0", "auto": "cuda:0", last: last} {
		r, err := tensor.OpenDevice(spec, tensor.DeviceOptions{})
		if err != nil {
			t.Errorf("tensor.OpenDevice(%q): %v", spec, err)
			continue
		}
		if _, ok := r.(*Backend); !ok || r.Name() != name {
			t.Errorf("tensor.OpenDevice(%q) = %T %s, want the CUDA backend %s", spec, r, r.Name(), name)
		}
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	}
	if _, err := tensor.OpenDevice(fmt.Sprintf("cuda:%d", len(devs)), tensor.DeviceOptions{}); err == nil {
		t.Errorf("tensor.OpenDevice(cuda:%d) of %d devices succeeded", len(devs), len(devs))
	}
}

// TestBackend runs the shared backend suite.
func TestBackend(t *testing.T) {
	b := openGPU(t)
	tensortest.TestBackend(t, b, tensortest.Tolerance(1e-2))
}

func FuzzCUDAMatMul(f *testing.F) {
	b := openGPU(f)
	tensortest.FuzzMatMul(f, b, tensortest.Tolerance(1e-2))
}

// TestMatMulPaths checks every matrix-product implementation on every
// weight type, including shapes where the GEMV kernels cannot use 16-byte
// loads (K = 172) and row views that start at an odd offset.
func TestMatMulPaths(t *testing.T) {
	b := openGPU(t)
	paths := []struct {
		name string
		p    mmPath
	}{{"gemv", pathGEMV}, {"blas", pathBLAS}, {"tiled", pathTiled}}
	shapes := []struct{ m, n, k int }{{1, 4096, 4096}, {3, 300, 172}, {5, 513, 512}, {64, 256, 1024}, {7, 33, 8}}
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16} {
		for _, p := range paths {
			if p.p == pathBLAS && b.blas == nil {
				t.Logf("skipping cuBLAS: %s", b.BLAS())
				continue
			}
			for _, s := range shapes {
				t.Run(fmt.Sprintf("%v/%s/M%d_N%d_K%d", dt, p.name, s.m, s.n, s.k), func(t *testing.T) {
					r := newRand(t)
					x, xv := put(t, b, tensor.F32, tensor.Shape{s.m, s.k}, uniform(r, s.m*s.k, -1, 1))
					w, wv := put(t, b, dt, tensor.Shape{s.n, s.k}, uniform(r, s.n*s.k, -1, 1))
					bias, bv := put(t, b, dt, tensor.Shape{s.n}, uniform(r, s.n, -1, 1))
					out, _ := put(t, b, tensor.F32, tensor.Shape{s.m, s.n}, nanSlice(s.m*s.n))
					if err := b.matmul(out, x, w, bias, p.p); err != nil {
						t.Fatal(err)
					}
					tol := 1e-5
					if p.p == pathBLAS && dt == tensor.F16 {
						tol = 2e-3 // x is rounded to F16 for cuBLAS
					} else if p.p == pathBLAS && dt == tensor.BF16 {
						tol = 1e-4 // x is split into two BF16 parts for cuBLAS
					}
					check(t, "MatMul", get(t, b, out), tensortest.RefMatMul(xv, wv, bv, s.m, s.n, s.k), tol)
				})
			}
		}
	}
	t.Run("view", func(t *testing.T) {
		// Rows 1..3 of x: a view whose address is 4*K bytes past the
		// allocation, K = 6, so not 16-byte aligned.
		r := newRand(t)
		const m, n, k = 4, 40, 6
		x, xv := put(t, b, tensor.F32, tensor.Shape{m, k}, uniform(r, m*k, -1, 1))
		w, wv := put(t, b, tensor.F16, tensor.Shape{n, k}, uniform(r, n*k, -1, 1))
		view, err := x.Rows(1, 3)
		if err != nil {
			t.Fatal(err)
		}
		out, _ := put(t, b, tensor.F32, tensor.Shape{3, n}, nanSlice(3*n))
		if err := b.MatMul(out, view, w, nil); err != nil {
			t.Fatal(err)
		}
		// M = 3 goes to cuBLAS, which rounds x to F16.
		check(t, "MatMul on a view", get(t, b, out), tensortest.RefMatMul(xv[k:], wv, nil, 3, n, k), 2e-3)
	})
}

// putQuant uploads n rows of k elements of the quantized dt (hostWeights:
// quantized random values, or raw random bytes with finite scales) and
// returns the tensor with its values as quant.Dequantize reads them.
func putQuant(t testing.TB, b *Backend, r *rand.Rand, dt tensor.DType, n, k int, raw bool) (*tensor.Tensor, []float64) {
	t.Helper()
	host := hostWeights(t, r, dt, n, k, raw)
	w, err := b.Alloc(dt, tensor.Shape{n, k})
	if err != nil {
		t.Fatalf("Alloc %v [%d %d]: %v", dt, n, k, err)
	}
	t.Cleanup(func() { b.Free(w) })
	if err := b.Upload(w, 0, host); err != nil {
		t.Fatal(err)
	}
	return w, dequantized(t, dt, host, n*k)
}

func dequantized(t testing.TB, dt tensor.DType, b []byte, n int) []float64 {
	t.Helper()
	qt, _ := dt.Quant()
	v := make([]float32, n)
	if err := qt.Dequantize(v, b); err != nil {
		t.Fatal(err)
	}
	out := make([]float64, n)
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// TestQuantMatMul checks MatMul with quantized weights on every path
// against a float64 product over quant.Dequantize's weights: the integer
// GEMV kernels (the GEMV path, and auto for small M) within 1e-5 of the
// product with x rounded as quantx16 rounds it (quantX16) and within 2e-4
// of the one with x as given; the F32-x GEMV kernels (the tiled path, and
// precise for small M) within 1e-5; the prefill's F16 products through
// cuBLAS within the F16 path's tolerance (x and the weights rounded to
// F16); MatMulPrecise's F32 products over weights dequantized exactly
// within 1e-5. The shapes cut pieces and row groups short (N = 7, 33, 513;
// K = 3 or 43 blocks of 256) and take 1, 2 and more rows of x.
func TestQuantMatMul(t *testing.T) {
	b := openGPU(t)
	paths := []struct {
		name string
		p    mmPath
		tol  float64
	}{{"gemv", pathGEMV, 0}, {"tiled", pathTiled, 1e-5}, {"precise", pathPrecise, 1e-5}, {"blas", pathBLAS, 3e-3}, {"auto", pathAuto, 0}}
	shapes := []struct{ m, n, k int }{{2, 300, 512}, {3, 33, 768}, {64, 256, 1024}, {1, 7, 11008}}
	if !testing.Short() { // -short: the shapes compute-sanitizer gets through in time
		shapes = append(shapes, struct{ m, n, k int }{1, 4096, 4096}, struct{ m, n, k int }{5, 513, 2816})
	}
	r := newRand(t)
	for _, f := range quantFormats {
		for _, s := range shapes {
			w, wv := putQuant(t, b, r, f.dt, s.n, s.k, s.n*s.k > 1<<20)
			xh := uniform(r, s.m*s.k, -1, 1)
			x, xv := put(t, b, tensor.F32, tensor.Shape{s.m, s.k}, xh)
			bias, bv := put(t, b, tensor.F32, tensor.Shape{s.n}, uniform(r, s.n, -1, 1))
			want := tensortest.RefMatMul(xv, wv, bv, s.m, s.n, s.k)
			want16 := tensortest.RefMatMul(quantX16(xh).values(), wv, bv, s.m, s.n, s.k)
			for _, p := range paths {
				if (p.p == pathBLAS || p.p == pathPrecise) && b.blas == nil {
					continue
				}
				t.Run(fmt.Sprintf("%v/%s/M%d_N%d_K%d", f.dt, p.name, s.m, s.n, s.k), func(t *testing.T) {
					out, _ := put(t, b, tensor.F32, tensor.Shape{s.m, s.n}, nanSlice(s.m*s.n))
					if err := b.matmul(out, x, w, bias, p.p); err != nil {
						t.Fatal(err)
					}
					got := get(t, b, out)
					switch {
					case p.p == pathGEMV || p.p == pathAuto && (s.m <= quantGEMVMaxRows || b.blas == nil):
						checkX16(t, "MatMul", got, want16, want)
					case p.p == pathAuto:
						check(t, "MatMul", got, want, 3e-3)
					default:
						check(t, "MatMul", got, want, p.tol)
					}
				})
			}
		}
	}
	// Views: rows of w from row 1 (Q6_K rows of 3 blocks are 630 bytes,
	// Q8_0's of 3 blocks 102, so the view starts at an odd 16-byte
	// offset), x 4 bytes past an allocation (copied to scratch for the
	// GEMV), and Q4_K/Q5_K weights 8 bytes past one (dequantized to F32
	// for the F32 GEMV kernel).
	for _, f := range quantFormats {
		t.Run(fmt.Sprintf("%v/views", f.dt), func(t *testing.T) {
			const m, n = 3, 40
			k := 3 * f.dt.BlockSize()
			if f.dt.BlockSize() == 32 {
				k = 3 * 256
			}
			wAll, wv := putQuant(t, b, r, f.dt, n+1, k, false)
			w, err := wAll.Rows(1, n)
			if err != nil {
				t.Fatal(err)
			}
			wv = wv[k:]
			xAll, _ := put(t, b, tensor.F32, tensor.Shape{m*k + 1}, make([]float32, m*k+1))
			x, err := xAll.View(4, tensor.F32, tensor.Shape{m, k})
			if err != nil {
				t.Fatal(err)
			}
			xh := uniform(r, m*k, -1, 1)
			if err := b.Upload(x, 0, f32Bytes(xh)); err != nil {
				t.Fatal(err)
			}
			xv := make([]float64, len(xh))
			for i, v := range xh {
				xv[i] = float64(v)
			}
			want := tensortest.RefMatMul(xv, wv, nil, m, n, k)
			want16 := tensortest.RefMatMul(quantX16(xh).values(), wv, nil, m, n, k)
			for _, p := range []int{0, 1, 3} { // gemv, tiled, blas
				p := paths[p]
				if p.p == pathBLAS && b.blas == nil {
					continue
				}
				out, _ := put(t, b, tensor.F32, tensor.Shape{m, n}, nanSlice(m*n))
				if err := b.matmul(out, x, w, nil, p.p); err != nil {
					t.Fatal(err)
				}
				if p.p == pathGEMV {
					checkX16(t, "MatMul gemv (views)", get(t, b, out), want16, want)
				} else {
					check(t, "MatMul "+p.name+" (views)", get(t, b, out), want, p.tol)
				}
			}
			if !f.align16 {
				return
			}
			host := hostWeights(t, r, f.dt, n, k, true)
			big, err := b.Alloc(f.dt, tensor.Shape{n + 1, k})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Free(big)
			w8, err := big.View(8, f.dt, tensor.Shape{n, k})
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Upload(w8, 0, host); err != nil {
				t.Fatal(err)
			}
			for _, p := range []mmPath{pathGEMV, pathTiled} {
				out, _ := put(t, b, tensor.F32, tensor.Shape{m, n}, nanSlice(m*n))
				if err := b.matmul(out, x, w8, nil, p); err != nil {
					t.Fatal(err)
				}
				check(t, "MatMul (w 8 bytes past a boundary)", get(t, b, out), tensortest.RefMatMul(xv, dequantized(t, f.dt, host, n*k), nil, m, n, k), 1e-5)
			}
		})
	}
}

// TestQuantGEMVRows checks the integer GEMV for every M from 1 to 9 and
// 17 (the kernels for 1, 2, 4 and 8 rows, rows left over in the 4- and
// 8-row kernels, several launches), rows of x with different scales and a
// row with a NaN (its products NaN, the others' unchanged), that no output
// past the M rows is written (out is a view whose allocation continues
// with sentinels), and that a row batched gives what it gives alone
// (batched decode, issue 17).
func TestQuantGEMVRows(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const n = 75
	for _, f := range quantFormats {
		k := 4 * 256
		w, wv := putQuant(t, b, r, f.dt, n, k, false)
		for _, m := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9, 17} {
			t.Run(fmt.Sprintf("%v/M%d", f.dt, m), func(t *testing.T) {
				xh := uniform(r, m*k, -1, 1)
				for i := range xh {
					xh[i] *= float32(1 + i/k) // row i scaled by i+1
				}
				x, xv := put(t, b, tensor.F32, tensor.Shape{m, k}, xh)
				const sentinel = 12345
				all, _ := put(t, b, tensor.F32, tensor.Shape{(m + 1) * n}, make([]float32, (m+1)*n))
				if err := b.Upload(all, 0, f32Bytes(append(nanSlice(m*n), slices.Repeat([]float32{sentinel}, n)...))); err != nil {
					t.Fatal(err)
				}
				out, err := all.View(0, tensor.F32, tensor.Shape{m, n})
				if err != nil {
					t.Fatal(err)
				}
				if err := b.matmul(out, x, w, nil, pathGEMV); err != nil {
					t.Fatal(err)
				}
				got := get(t, b, all)
				for i, v := range got[m*n:] {
					if v != sentinel {
						t.Fatalf("out[%d], past the %d rows, was written: %g", m*n+i, m, v)
					}
				}
				checkX16(t, "MatMul", got[:m*n], tensortest.RefMatMul(quantX16(xh).values(), wv, nil, m, n, k), tensortest.RefMatMul(xv, wv, nil, m, n, k))
				// Each row alone (the 1-row kernel) against its row of the
				// batch: the same products, summed in the same order, so
				// within 1e-6 (logged: whether bit for bit).
				same := 0
				for i := range min(m, 3) {
					xi, err := x.Rows(i, 1)
					if err != nil {
						t.Fatal(err)
					}
					oi, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, nanSlice(n))
					if err := b.matmul(oi, xi, w, nil, pathGEMV); err != nil {
						t.Fatal(err)
					}
					alone := get(t, b, oi)
					want := make([]float64, n)
					for j, v := range alone {
						want[j] = float64(v)
						if math.Float32bits(v) == math.Float32bits(got[i*n+j]) {
							same++
						}
					}
					if e := tensortest.RelErr(got[i*n:(i+1)*n], want); !(e <= 1e-6) {
						t.Errorf("row %d in a batch of %d against alone: relative difference %.3g > 1e-6", i, m, e)
					}
				}
				t.Logf("rows batched against alone: %d of %d outputs bit-identical", same, min(m, 3)*n)
				if m < 3 {
					return
				}
				// A NaN in row 1 makes that row NaN and leaves the others.
				xh[k+7] = float32(math.NaN())
				if err := b.Upload(x, 0, f32Bytes(xh)); err != nil {
					t.Fatal(err)
				}
				if err := b.matmul(out, x, w, nil, pathGEMV); err != nil {
					t.Fatal(err)
				}
				got2 := get(t, b, out)
				for i, v := range got2 {
					if row := i / n; row == 1 && !math.IsNaN(float64(v)) {
						t.Fatalf("row 1 has a NaN in x; out[%d] = %g", i, v)
					} else if row != 1 && math.Float32bits(v) != math.Float32bits(got[i]) {
						t.Fatalf("row %d changed with a NaN in row 1: out[%d] = %g, was %g", row, i, v, got[i])
					}
				}
			})
		}
	}
}

// checkX16 checks a product of the integer GEMV: within 1e-5 of want16
// (the product with x rounded to X16) and 2e-4 of want (x as given),
// logging both errors.
func checkX16(t testing.TB, what string, got []float32, want16, want []float64) {
	t.Helper()
	e16, e := tensortest.RelErr(got, want16), tensortest.RelErr(got, want)
	if !(e16 <= 1e-5) || !(e <= 2e-4) {
		t.Errorf("%s: relative error %.3g against the product with x rounded to X16 (want <= 1e-5), %.3g against x (want <= 2e-4)", what, e16, e)
	} else {
		t.Logf("%s: relative error %.2g against the product with x rounded to X16, %.2g against x", what, e16, e)
	}
}

func f32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// TestQuantEmbed checks Embed of quantized tables bit for bit against
// quant.Dequantize's rows, into an aligned out and into one 4 bytes past
// an allocation (which goes through scratch).
func TestQuantEmbed(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	for _, f := range quantFormats {
		t.Run(f.dt.String(), func(t *testing.T) {
			const v, d = 37, 768
			table, tv := putQuant(t, b, r, f.dt, v, d, true)
			ids := []int32{0, v - 1, 5, 5, 17, 36, 2}
			want := tensortest.RefEmbed(tv, d, ids)
			for _, off := range []int64{0, 4} {
				all, _ := put(t, b, tensor.F32, tensor.Shape{len(ids)*d + 4}, nanSlice(len(ids)*d+4))
				out, err := all.View(off, tensor.F32, tensor.Shape{len(ids), d})
				if err != nil {
					t.Fatal(err)
				}
				if err := b.Embed(out, table, ids); err != nil {
					t.Fatal(err)
				}
				got := get(t, b, out)
				bad := 0
				for i, w := range want {
					if math.Float32bits(got[i]) != math.Float32bits(float32(w)) {
						if bad++; bad <= 3 {
							t.Errorf("out offset %d: element %d (row %d): got %g, want %g", off, i, ids[i/d], got[i], w)
						}
					}
				}
			}
		})
	}
}

// TestQuantRefusals checks that quantized operands the kernels do not
// read fail with an error, never a kernel that reads blocks as floats.
func TestQuantRefusals(t *testing.T) {
	b := openGPU(t)
	alloc := func(dt tensor.DType, shape ...int) *tensor.Tensor {
		x, err := b.Alloc(dt, shape)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Free(x) })
		return x
	}
	x, out := alloc(tensor.F32, 1, 256), alloc(tensor.F32, 1, 4)
	q8k := alloc(tensor.Q8_K, 4, 256)
	if err := b.MatMul(out, x, q8k, nil); err == nil {
		t.Error("MatMul with Q8_K weights: no error")
	}
	if err := b.Embed(alloc(tensor.F32, 1, 256), q8k, []int32{1}); err == nil {
		t.Error("Embed of a Q8_K table: no error")
	}
	if err := b.RMSNorm(x, x, alloc(tensor.Q8_0, 256), 1e-5); err == nil {
		t.Error("RMSNorm with Q8_0 weights: no error")
	}
	if err := b.matmulGradX(x, out, alloc(tensor.Q4_K, 4, 256), pathTiled, gradChunkBytes); err == nil {
		t.Error("MatMulGradX (tiled) with Q4_K weights: no error")
	}
}

// TestQuantCopyRows checks that CopyRows moves whole blocks of quantized
// rows (a Q6_K row of 3 blocks is 630 bytes), overlapping or not.
func TestQuantCopyRows(t *testing.T) {
	b := openGPU(t)
	const n, k = 9, 768
	host := hostWeights(t, newRand(t), tensor.Q6_K, n, k, true)
	rb := len(host) / n
	w, err := b.Alloc(tensor.Q6_K, tensor.Shape{n, k})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(w)
	if err := b.Upload(w, 0, host); err != nil {
		t.Fatal(err)
	}
	if err := b.CopyRows(w, 1, w, 0, 5); err != nil { // rows 0..4 to 1..5, overlapping
		t.Fatal(err)
	}
	want := slices.Clone(host)
	copy(want[rb:], host[:5*rb])
	got := make([]byte, len(host))
	if err := b.Download(got, w); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("CopyRows of Q6_K rows: bytes differ from the rows moved")
	}
}

// attnTol is the relative error TestAttentionCaches accepts of a kernel:
// F32 arithmetic throughout, the tensor-core kernel's products of inputs
// rounded to F16 (11 bits) or BF16 (8 bits), or the split kernel's q
// rounded to 16 bits where it multiplies Q8_0 keys in integers (heads of
// 128 and 256: 1.6e-5 to 2.3e-5 in the host harness, which checks the
// kernel within 1e-5 of the reference over the rounded q).
func attnTol(kernel string) float64 {
	switch {
	case strings.HasPrefix(kernel, "flash_attention_bf16"):
		return 2e-2
	case strings.HasPrefix(kernel, "flash_"):
		return 4e-3
	case kernel == "attention_split_q8_0_d128" || kernel == "attention_split_q8_0_d256":
		return 1e-4
	}
	return 1e-5
}

// TestAttentionCaches runs attention over every cache dtype on shapes that
// take each kernel (planAttention: one block a query, split decode with
// one pass and with many splits, the tiled tensor-core prefill), against
// the float64 reference over the stored values. Positions past the last
// query hold NaN (a Q8_0 block: a NaN scale): a kernel that reads them
// fails. It logs each case's kernel, splits, relative and largest
// absolute error.
func TestAttentionCaches(t *testing.T) {
	b := openGPU(t)
	has := func(name string) bool { _, ok := b.kernels[name]; return ok }
	// The tensor-core kernels' PTX targets compute capability 8.0: loaded
	// (JIT-compiled by the driver) on such devices, left out on older ones.
	for _, name := range optionalKernels {
		if want := b.info.Major >= 8; has(name) != want {
			t.Errorf("compute capability %d.%d: kernel %s loaded = %v, want %v", b.info.Major, b.info.Minor, name, has(name), want)
		}
	}
	t.Logf("compute capability %d.%d: tensor-core prefill kernels loaded: %v", b.info.Major, b.info.Minor, has(optionalKernels[0]))
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q8_B8} {
		for _, c := range []struct{ heads, kvHeads, headDim, pos0, t, maxPos int }{
			{32, 8, 128, 1500, 1, 2048}, {8, 2, 64, 100, 17, 128}, {4, 4, 256, 0, 9, 16}, {2, 1, 96, 3, 2, 8},
			{32, 32, 128, 8191, 1, 8192}, {32, 8, 128, 200, 1, 256}, {8, 8, 64, 4000, 4, 4100}, {4, 1, 256, 700, 3, 710},
			{32, 8, 128, 0, 1000, 1000}, {16, 16, 64, 0, 333, 340}, {8, 1, 128, 517, 129, 700}, {8, 4, 64, 5, 16, 32},
		} {
			t.Run(fmt.Sprintf("%v/H%d_KV%d_D%d_pos%d_T%d", dt, c.heads, c.kvHeads, c.headDim, c.pos0, c.t), func(t *testing.T) {
				r := newRand(t)
				qw, kw := c.heads*c.headDim, c.kvHeads*c.headDim
				filled := (c.pos0 + c.t) * kw
				q, qv := put(t, b, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -1, 1))
				k, kv := putCache(t, b, dt, c.maxPos, kw, uniform(r, filled, -1, 1))
				v, vv := putCache(t, b, dt, c.maxPos, kw, uniform(r, filled, -1, 1))
				out, _ := put(t, b, tensor.F32, tensor.Shape{c.t, qw}, nanSlice(c.t*qw))
				scale := float32(1 / math.Sqrt(float64(c.headDim)))
				plan := planAttention(c.t, c.heads, c.headDim, c.pos0, dt, true, false, b.splitChunk, has)
				if err := b.Attention(out, tensor.Attn{Q: q, K: k, V: v, Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, Pos0: c.pos0, Scale: scale}); err != nil {
					t.Fatal(err)
				}
				want := tensortest.RefAttention(qv, kv[:filled], vv[:filled], c.t, c.heads, c.kvHeads, c.headDim, c.pos0, float64(scale))
				got := get(t, b, out)
				t.Logf("kernel %s, %d splits of %d positions; largest absolute error %.3g", plan.kernel, plan.splits, plan.chunk, maxAbs(got, want))
				check(t, "Attention", got, want, attnTol(plan.kernel))
			})
		}
	}
	if err := b.Attention(nil, tensor.Attn{Q: nil, K: nil, V: nil, Heads: 4, KVHeads: 4, HeadDim: 512, Scale: 1}); err == nil {
		t.Error("headDim 512: no error")
	}
}

// putCache uploads a [maxPos, width] cache of dtype dt whose first rows
// hold v and the rest all bits set (NaN, a NaN scale in Q8_0), and
// returns v as stored.
func putCache(t testing.TB, b *Backend, dt tensor.DType, maxPos, width int, v []float32) (*tensor.Tensor, []float64) {
	t.Helper()
	enc, err := tensortest.Encode(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	st, err := tensortest.Stored(dt, v)
	if err != nil {
		t.Fatal(err)
	}
	x, err := b.Alloc(dt, tensor.Shape{maxPos, width})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Free(x) })
	all := bytes.Repeat([]byte{0xff}, int(x.NumBytes()))
	copy(all, enc)
	if err := b.Upload(x, 0, all); err != nil {
		t.Fatal(err)
	}
	return x, st
}

// toF64 widens v.
func toF64(v []float32) []float64 {
	w := make([]float64, len(v))
	for i, x := range v {
		w[i] = float64(x)
	}
	return w
}

func maxAbs(got []float32, want []float64) float64 {
	m := 0.0
	for i, g := range got {
		m = max(m, math.Abs(float64(g)-want[i]))
	}
	return m
}

// TestAttentionAgainstCPU runs the 7B model's attention shape (32 heads
// of 128, or 8 KV heads as Llama 3's) on this backend and on the CPU
// backend over the same caches, appended by CopyRows on each (so the Q8_0
// quantization of both is compared too), and logs the largest absolute
// difference and the relative one; precise calls (training's forward)
// must agree to F32 rounding.
func TestAttentionAgainstCPU(t *testing.T) {
	b := openGPU(t)
	cpu := tensor.NewCPU(0)
	has := func(name string) bool { _, ok := b.kernels[name]; return ok }
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q8_B8} {
		for _, c := range []struct {
			kvHeads, pos0, t int
			precise          bool
		}{
			{32, 0, 512, false}, {8, 1024, 300, false}, {32, 0, 200, true}, {32, 4095, 1, false}, {8, 2047, 2, false},
		} {
			const heads, headDim = 32, 128
			t.Run(fmt.Sprintf("%v/KV%d_pos%d_T%d_precise=%v", dt, c.kvHeads, c.pos0, c.t, c.precise), func(t *testing.T) {
				r := newRand(t)
				qw, kw, n := heads*headDim, c.kvHeads*headDim, c.pos0+c.t
				qv := uniform(r, c.t*qw, -2, 2)
				kvals, vvals := uniform(r, n*kw, -2, 2), uniform(r, n*kw, -1, 1)
				attend := func(be tensor.Backend) []float32 {
					q, err := tensortest.FromF32(be, tensor.F32, tensor.Shape{c.t, qw}, qv)
					if err != nil {
						t.Fatal(err)
					}
					defer be.Free(q)
					var caches [2]*tensor.Tensor
					for j, vals := range [][]float32{kvals, vvals} {
						rows, err := tensortest.FromF32(be, tensor.F32, tensor.Shape{n, kw}, vals)
						if err != nil {
							t.Fatal(err)
						}
						defer be.Free(rows)
						if caches[j], err = be.Alloc(dt, tensor.Shape{n, kw}); err != nil {
							t.Fatal(err)
						}
						defer be.Free(caches[j])
						if err := tensor.Checked(be).CopyRows(caches[j], 0, rows, 0, n); err != nil {
							t.Fatal(err)
						}
					}
					// NaNs where the output goes: a reused block must not
					// pass for a result (the second launch below).
					out, err := tensortest.FromF32(be, tensor.F32, tensor.Shape{c.t, qw}, nanSlice(c.t*qw))
					if err != nil {
						t.Fatal(err)
					}
					defer be.Free(out)
					at := tensor.Attn{Q: q, K: caches[0], V: caches[1], Heads: heads, KVHeads: c.kvHeads, HeadDim: headDim, Pos0: c.pos0, Scale: 0.0883883, Precise: c.precise}
					if err := tensor.Checked(be).Attention(out, at); err != nil {
						t.Fatal(err)
					}
					got, err := tensortest.ToF32(be, out)
					if err != nil {
						t.Fatal(err)
					}
					return got
				}
				outs := [][]float32{attend(b), attend(cpu)}
				want := toF64(outs[1])
				plan := planAttention(c.t, heads, headDim, c.pos0, dt, true, c.precise, b.splitChunk, has)
				e := tensortest.RelErr(outs[0], want)
				t.Logf("kernel %s (%d splits): against the CPU largest absolute difference %.3g, relative %.3g", plan.kernel, plan.splits, maxAbs(outs[0], want), e)
				tol := attnTol(plan.kernel)
				if !(e <= tol) {
					t.Errorf("relative difference %.3g > %.3g", e, tol)
				}
				if plan.splits > 1 {
					// Again, the counts back at zero; and with the merge a
					// launch of its own: the same bits.
					if again := attend(b); !slices.Equal(again, outs[0]) {
						t.Errorf("a second launch differs from the first (max abs %.3g): the split counts were not reset", maxAbs(again, toF64(outs[0])))
					}
					count := b.splitCount
					b.splitCount = 0
					separate := attend(b)
					b.splitCount = count
					if !slices.Equal(separate, outs[0]) {
						t.Errorf("with attention_merge the output differs from the last split block's merge (max abs %.3g)", maxAbs(separate, toF64(outs[0])))
					}
				}
			})
		}
	}
}

// TestCast converts F32 to F16 and BF16 (round to nearest even, a NaN
// kept) and back. Argmax has TestArgmax.
func TestCast(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const rows, n = 3, 32000
	v := uniform(r, rows*n, -5, 5)
	v[n+17] = float32(math.NaN())
	x, _ := put(t, b, tensor.F32, tensor.Shape{rows, n}, v)
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		half, err := b.Alloc(dt, tensor.Shape{rows, n})
		if err != nil {
			t.Fatal(err)
		}
		back, _ := put(t, b, tensor.F32, tensor.Shape{rows, n}, nanSlice(rows*n))
		if err := b.Cast(half, x); err != nil {
			t.Fatal(err)
		}
		if err := b.Cast(back, half); err != nil {
			t.Fatal(err)
		}
		gotHalf := get(t, b, half)
		stored, _ := tensortest.Stored(dt, v)
		for i := range gotHalf {
			same := float64(gotHalf[i]) == stored[i] || math.IsNaN(stored[i]) && math.IsNaN(float64(gotHalf[i]))
			if !same {
				t.Fatalf("Cast F32->%v element %d: %v, want %v (round to nearest even)", dt, i, gotHalf[i], stored[i])
			}
		}
		gotBack := get(t, b, back)
		for i := range gotBack {
			if float64(gotBack[i]) != float64(gotHalf[i]) && !math.IsNaN(float64(gotHalf[i])) {
				t.Fatalf("Cast %v->F32 element %d: %v, want %v", dt, i, gotBack[i], gotHalf[i])
			}
		}
		b.Free(half)
	}
}

// TestCopyRowsOverlap copies rows within one tensor with overlapping ranges.
func TestCopyRowsOverlap(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const rows, width = 10, 37
	v := uniform(r, rows*width, -1, 1)
	x, _ := put(t, b, tensor.F32, tensor.Shape{rows, width}, v)
	if err := b.CopyRows(x, 2, x, 0, 6); err != nil {
		t.Fatal(err)
	}
	want := append([]float32(nil), v...)
	copy(want[2*width:8*width], v[0:6*width])
	got := get(t, b, x)
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("element %d (row %d): %v, want %v", i, i/width, got[i], want[i])
		}
	}
}

// TestScratchPieces: work whose scratch exceeds the arena runs in pieces
// that fit, with the same result: a MatMul of more rows than the arena
// holds converted (F16 and BF16 weights through cuBLAS), and overlapping
// copies larger than the arena, moving up and down.
func TestScratchPieces(t *testing.T) {
	b := openGPU(t)
	if b.blas == nil {
		t.Logf("no cuBLAS (%s): only the copies are checked", b.BLAS())
	}
	const k, n = 8192, 64
	m := int(scratchBytes/(2*k)) + 37 // past one piece even for F16's 2 bytes a value
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		if b.blas == nil {
			break
		}
		r := newRand(t)
		x, xv := put(t, b, tensor.F32, tensor.Shape{m, k}, uniform(r, m*k, -1, 1))
		w, wv := put(t, b, dt, tensor.Shape{n, k}, uniform(r, n*k, -1, 1))
		out, _ := put(t, b, tensor.F32, tensor.Shape{m, n}, nanSlice(m*n))
		if err := b.matmul(out, x, w, nil, pathBLAS); err != nil {
			t.Fatal(err)
		}
		tol := 2e-3
		if dt == tensor.BF16 {
			tol = 1e-4
		}
		check(t, fmt.Sprintf("%v MatMul of %d rows in pieces", dt, m), get(t, b, out), tensortest.RefMatMul(xv, wv, nil, m, n, k), tol)
	}
	const width = 4096 // 16 KiB rows
	rows := int(scratchBytes/(4*width))*2 + 5
	r := newRand(t)
	v := uniform(r, rows*width, -1, 1)
	for _, shift := range []int{3, -3} {
		x, _ := put(t, b, tensor.F32, tensor.Shape{rows, width}, v)
		n := rows - 3
		dst, src := 3, 0
		if shift < 0 {
			dst, src = 0, 3
		}
		if err := b.CopyRows(x, dst, x, src, n); err != nil {
			t.Fatal(err)
		}
		want := append([]float32(nil), v...)
		copy(want[dst*width:(dst+n)*width], v[src*width:(src+n)*width])
		got := get(t, b, x)
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("copy by %d rows: element %d (row %d): %v, want %v", shift, i, i/width, got[i], want[i])
			}
		}
	}
}

// TestDownloadComputedLeavesCopies: DownloadComputed of a small tensor
// returns the compute's result while a large UploadAsync copy is still on
// its way (Download waits for it): the hand-over of a hidden state to the
// CPU does not wait for prefetch copies. It logs both times.
func TestDownloadComputedLeavesCopies(t *testing.T) {
	b := openGPU(t)
	const n = 128 << 20 // 512 MiB of F32: a copy of about 10 ms
	pinned, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(pinned)
	dst, err := b.Alloc(tensor.F32, tensor.Shape{n})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(dst)
	x, _ := put(t, b, tensor.F32, tensor.Shape{1, 4096}, make([]float32, 4096))
	one := make([]float32, 4096)
	for i := range one {
		one[i] = float32(i)
	}
	y, _ := put(t, b, tensor.F32, tensor.Shape{1, 4096}, one)
	host := make([]byte, 4*4096)
	for _, tc := range []struct {
		name  string
		down  func([]byte, *tensor.Tensor) error
		waits bool
	}{
		{"Download", b.Download, true},
		{"DownloadComputed", b.DownloadComputed, false},
	} {
		if err := b.Upload(x, 0, make([]byte, 4*4096)); err != nil { // x = 0 until the Add
			t.Fatal(err)
		}
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		ready, err := b.UploadAsync(context.Background(), dst, 0, pinned)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Add(x, y, y); err != nil { // x = 2y
			t.Fatal(err)
		}
		if err := tc.down(host, x); err != nil {
			t.Fatal(err)
		}
		took := time.Since(t0)
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		copyTime := time.Since(t0)
		if err := ready(); err != nil {
			t.Fatal(err)
		}
		got := unsafe.Slice((*float32)(unsafe.Pointer(&host[0])), 4096)
		for i := range got {
			if got[i] != 2*float32(i) {
				t.Fatalf("%s: element %d = %v, want %v", tc.name, i, got[i], 2*float32(i))
			}
		}
		t.Logf("%s of 16 KiB behind a 512 MiB UploadAsync: returned after %v, the copy landed after %v", tc.name, took, copyTime)
		switch {
		case tc.waits && took < copyTime/2:
			t.Errorf("%s returned after %v, before the copy (%v): it should wait for it", tc.name, took, copyTime)
		case !tc.waits && took > copyTime/2:
			t.Errorf("%s returned after %v, with the copy (%v): it waited for a copy no compute needs", tc.name, took, copyTime)
		}
	}
}

// TestDownloadAsync: DownloadAsync of what a kernel computed (a twin's keys,
// 16 MiB, as a 7B block's of a 512-token chunk) returns at once, with the
// host free to queue more compute; landed gives the kernel's result, not
// what compute queued after ready wrote into the source; and the copy
// lands while a large UploadAsync (a streamed layer) is on its way on the
// other copy engine, not after it. It logs the times.
func TestDownloadAsync(t *testing.T) {
	b := openGPU(t)
	const big = 128 << 20 // 512 MiB of F32: an upload of about 10 ms
	pinned, err := b.AllocPinned(4 * big)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(pinned)
	layer, err := b.Alloc(tensor.F32, tensor.Shape{big})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(layer)
	const n = 4 << 20 // 16 MiB of F32
	ys := make([]float32, n)
	for i := range ys {
		ys[i] = float32(i % 4099)
	}
	x, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, make([]float32, n))
	y, _ := put(t, b, tensor.F32, tensor.Shape{1, n}, ys)
	host, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(host)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	upReady, err := b.UploadAsync(context.Background(), layer, 0, pinned)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Add(x, y, y); err != nil { // x = 2y
		t.Fatal(err)
	}
	ready, landed, err := b.DownloadAsync(host, x)
	if err != nil {
		t.Fatal(err)
	}
	queued := time.Since(t0)
	if err := ready(); err != nil {
		t.Fatal(err)
	}
	if err := b.Add(x, x, y); err != nil { // x = 3y, after the copy read 2y
		t.Fatal(err)
	}
	if err := landed(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(t0)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	copyTime := time.Since(t0)
	if err := upReady(); err != nil {
		t.Fatal(err)
	}
	got := unsafe.Slice((*float32)(unsafe.Pointer(&host[0])), n)
	for i := range got {
		if got[i] != 2*ys[i] {
			t.Fatalf("element %d = %v, want %v (2y)", i, got[i], 2*ys[i])
		}
	}
	back := make([]float32, n)
	if err := b.Download(unsafe.Slice((*byte)(unsafe.Pointer(&back[0])), 4*n), x); err != nil {
		t.Fatal(err)
	}
	if back[7] != 3*ys[7] {
		t.Errorf("x after the Add queued after ready: %v, want %v (3y)", back[7], 3*ys[7])
	}
	t.Logf("DownloadAsync of 16 MiB behind a 512 MiB UploadAsync: queued after %v, landed after %v, the upload after %v", queued, took, copyTime)
	if took > copyTime*3/4 {
		t.Errorf("the download landed after %v, with the upload (%v): it waited for a copy on the other engine", took, copyTime)
	}
	if queued > took/2 {
		t.Errorf("DownloadAsync returned after %v of the %v it took to land: it waited", queued, took)
	}
}

// TestUploadBesideAsyncCopy times what a hybrid decode does at each hand-over
// from the CPU: a small Upload from pinned memory (the hidden state, 16 KiB)
// on the compute stream while a large UploadAsync copy (a prefetched layer)
// runs on the copy stream. The small one should not wait for the large one
// to finish: a pager that keeps the copy engine busy would otherwise delay
// every hand-over by up to a layer's copy. It logs both times; it fails when
// the small upload took more than half the large copy's time.
func TestUploadBesideAsyncCopy(t *testing.T) {
	b := openGPU(t)
	const n = 128 << 20 // 512 MiB of F32: a copy of about 10 ms
	big, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(big)
	small, err := b.AllocPinned(4 * 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(small)
	dst, err := b.Alloc(tensor.F32, tensor.Shape{n})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(dst)
	h, _ := put(t, b, tensor.F32, tensor.Shape{1, 4096}, make([]float32, 4096))
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	ready, err := b.UploadAsync(context.Background(), dst, 0, big)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Millisecond) // the copy is under way
	t1 := time.Now()
	if err := b.Upload(h, 0, small); err != nil {
		t.Fatal(err)
	}
	took := time.Since(t1)
	if err := ready(); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	copyTime := time.Since(t0)
	t.Logf("a 16 KiB Upload from pinned memory 1 ms into a 512 MiB UploadAsync took %v; the large copy %v (%.1f GB/s)",
		took, copyTime, float64(4*n)/copyTime.Seconds()/1e9)
	if took > copyTime/2 {
		t.Errorf("the small upload waited for the large copy (%v of %v): hand-overs from the CPU wait for prefetch copies; split large UploadAsync copies", took, copyTime)
	}
}

// TestUploadAsyncOrdering checks both orders UploadAsync promises: compute
// queued after ready() sees the new bytes, and compute queued before the
// call still sees the old ones.
func TestUploadAsyncOrdering(t *testing.T) {
	b := openGPU(t)
	const n = 16 << 20 // 64 MiB of F32: a copy of about a millisecond
	shape := tensor.Shape{n}
	pinned, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	src := unsafe.Slice((*float32)(unsafe.Pointer(&pinned[0])), n)
	for i := range src {
		src[i] = float32(i%1000) + 0.5
	}
	dst, _ := put(t, b, tensor.F32, shape, nanSlice(n))
	zero, _ := put(t, b, tensor.F32, shape, make([]float32, n))
	out, _ := put(t, b, tensor.F32, shape, nanSlice(n))

	// Read after write: the Add must see the copied values.
	ready, err := b.UploadAsync(context.Background(), dst, 0, pinned)
	if err != nil {
		t.Fatal(err)
	}
	if err := ready(); err != nil {
		t.Fatal(err)
	}
	if err := b.Add(out, dst, zero); err != nil {
		t.Fatal(err)
	}
	got := get(t, b, out)
	for i := range got {
		if got[i] != src[i] {
			t.Fatalf("after ready: element %d = %v, want %v (the Add ran before the copy landed)", i, got[i], src[i])
		}
	}

	// Write after read: Adds queued before UploadAsync read the old dst.
	old := append([]float32(nil), src...)
	for i := range src {
		src[i] = -1
	}
	for range 4 {
		if err := b.Add(out, dst, zero); err != nil {
			t.Fatal(err)
		}
	}
	ready, err = b.UploadAsync(context.Background(), dst, 0, pinned)
	if err != nil {
		t.Fatal(err)
	}
	got = get(t, b, out)
	for i := range got {
		if got[i] != old[i] {
			t.Fatalf("before the copy: element %d = %v, want %v (the copy overwrote dst while it was read)", i, got[i], old[i])
		}
	}
	if err := ready(); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	got = get(t, b, dst)
	if got[0] != -1 || got[n-1] != -1 {
		t.Fatalf("after Sync: dst = %v ... %v, want -1", got[0], got[n-1])
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b.UploadAsync(ctx, dst, 0, pinned); !errors.Is(err, context.Canceled) {
		t.Errorf("UploadAsync with a cancelled context: %v", err)
	}
	if err := b.FreePinned(pinned); err != nil {
		t.Fatal(err)
	}
	if err := b.FreePinned(pinned); err == nil {
		t.Error("second FreePinned: no error")
	}
	if s := b.Stats(); s.Pinned != 0 {
		t.Errorf("pinned bytes after FreePinned: %d", s.Pinned)
	}
}

// TestUploadStagedLanded reuses one pinned staging buffer for a copy into
// each of several tensors, refilling it as soon as landed returns: every
// tensor must hold the values its round staged (a landed that returned
// before the copy read the buffer lets the next round's values in), with
// ready run before landed in some rounds and after it in others.
func TestUploadStagedLanded(t *testing.T) {
	b := openGPU(t)
	const n, rounds = 16 << 20, 6 // 64 MiB of F32 a round
	pinned, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(pinned)
	src := unsafe.Slice((*float32)(unsafe.Pointer(&pinned[0])), n)
	var dsts []*tensor.Tensor
	for r := range rounds {
		dst, _ := put(t, b, tensor.F32, tensor.Shape{n}, nanSlice(n))
		dsts = append(dsts, dst)
		for i := range src {
			src[i] = float32(r*1000 + i%1000)
		}
		ready, landed, err := b.UploadStaged(context.Background(), dst, 0, pinned)
		if err != nil {
			t.Fatal(err)
		}
		if r%2 == 0 {
			err = errors.Join(ready(), landed())
		} else {
			err = errors.Join(landed(), ready())
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	for r, dst := range dsts {
		got := get(t, b, dst)
		for _, i := range []int{0, n / 2, n - 1} {
			if want := float32(r*1000 + i%1000); got[i] != want {
				t.Fatalf("round %d: element %d = %v, want %v (landed returned before the copy read the buffer)", r, i, got[i], want)
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := b.UploadStaged(ctx, dsts[0], 0, pinned); !errors.Is(err, context.Canceled) {
		t.Errorf("UploadStaged with a cancelled context: %v", err)
	}
}

// TestCachingAllocator checks that a repeated decode step stops calling
// the driver, and that Trim gives the cache back.
func TestCachingAllocator(t *testing.T) {
	b := openGPU(t)
	shapes := []tensor.Shape{{1, 4096}, {1, 11008}, {1, 11008}, {1, 32000}, {1, 4096}}
	var afterFirst Stats
	for step := range 20 {
		var ts []*tensor.Tensor
		for _, s := range shapes {
			x, err := b.Alloc(tensor.F32, s)
			if err != nil {
				t.Fatal(err)
			}
			ts = append(ts, x)
		}
		for _, x := range ts {
			b.Free(x)
		}
		if step == 0 {
			afterFirst = b.Stats()
		}
	}
	s := b.Stats()
	if s.DriverAllocs != afterFirst.DriverAllocs || s.CacheHits < int64(19*len(shapes)) {
		t.Errorf("driver allocations went from %d to %d over 19 more steps (cache hits %d)", afterFirst.DriverAllocs, s.DriverAllocs, s.CacheHits)
	}
	if s.InUse != 0 || s.Cached == 0 || s.Reserved != s.Cached+s.Workspace {
		t.Errorf("after the steps: %+v", s)
	}
	// The same accounts through tensor.CachingAllocator, as a budget sees
	// them.
	c, ok := tensor.Caching(b)
	if !ok {
		t.Fatal("the backend is not a tensor.CachingAllocator")
	}
	if c.Cached() != s.Cached || c.Fixed() != s.Workspace {
		t.Errorf("Cached %d, Fixed %d; stats %+v", c.Cached(), c.Fixed(), s)
	}
	for _, shape := range []tensor.Shape{{3}, {1, 4096}, {1, 11008}, {4099, 7}} {
		before := b.Stats().InUse
		x, err := b.Alloc(tensor.F32, shape)
		if err != nil {
			t.Fatal(err)
		}
		if n := x.NumBytes(); b.Stats().InUse-before != c.AllocSize(n) || c.AllocSize(n) < n {
			t.Errorf("Alloc of %d bytes took %d; AllocSize says %d", n, b.Stats().InUse-before, c.AllocSize(n))
		}
		b.Free(x)
	}
	free0, _, _ := b.MemInfo()
	big, err := b.Alloc(tensor.F16, tensor.Shape{16384, 16384}) // 512 MiB
	if err != nil {
		t.Fatal(err)
	}
	b.Free(big)
	free1, _, _ := b.MemInfo()
	released, err := b.Trim()
	if err != nil {
		t.Fatal(err)
	}
	free2, _, _ := b.MemInfo()
	if released < 512<<20 || free2-free1 < 512<<20 {
		t.Errorf("Trim released %d bytes; driver free memory %d -> %d -> %d", released, free0, free1, free2)
	}
	if s := b.Stats(); s.Cached != 0 || s.Reserved != s.Workspace || c.Cached() != 0 {
		t.Errorf("after Trim: %+v, Cached %d", s, c.Cached())
	}
}

func TestManagedMemory(t *testing.T) {
	b := openGPU(t)
	if !b.Info().ManagedMemory {
		t.Skip("device without concurrent managed access")
	}
	free, _, err := b.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	// Refused before any allocation: more than the device has free.
	if _, err := b.AllocManaged(tensor.F32, tensor.Shape{int(free/4) + 1<<20}); !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Fatalf("AllocManaged beyond free memory: %v, want ErrOutOfMemory", err)
	}
	const n = 16 << 20
	m, err := b.AllocManaged(tensor.F32, tensor.Shape{n})
	if err != nil {
		t.Fatal(err)
	}
	if s := b.Stats(); s.Managed != 4*n {
		t.Errorf("managed bytes %d, want %d", s.Managed, 4*n)
	}
	r := newRand(t)
	v := uniform(r, n, -1, 1)
	bytes, _ := tensortest.Encode(tensor.F32, v)
	if err := b.AdviseHost(m); err != nil {
		t.Fatal(err)
	}
	if err := b.Upload(m, 0, bytes); err != nil {
		t.Fatal(err)
	}
	if err := b.PrefetchToDevice(m); err != nil {
		t.Fatal(err)
	}
	if err := b.Add(m, m, m); err != nil {
		t.Fatal(err)
	}
	if err := b.PrefetchToHost(m); err != nil {
		t.Fatal(err)
	}
	got := get(t, b, m)
	for i := range got {
		if got[i] != 2*v[i] {
			t.Fatalf("element %d: %v, want %v", i, got[i], 2*v[i])
		}
	}
	plain, _ := put(t, b, tensor.F32, tensor.Shape{4}, nil4())
	if err := b.PrefetchToDevice(plain); err == nil {
		t.Error("PrefetchToDevice of a non-managed tensor: no error")
	}
	b.Free(m)
	if s := b.Stats(); s.Managed != 0 {
		t.Errorf("managed bytes after Free: %d", s.Managed)
	}
}

func nil4() []float32 { return []float32{1, 2, 3, 4} }

// TestCloseFreesEverything opens a second backend on the device, leaves
// tensors, cached blocks, pinned and managed memory behind, closes it, and
// checks its accounts and the driver's free memory.
func TestCloseFreesEverything(t *testing.T) {
	keep := openGPU(t) // keeps the primary context alive to measure with
	free0, _, err := keep.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	var live []*tensor.Tensor
	for i := range 8 {
		x, err := b.Alloc(tensor.F16, tensor.Shape{4096, 4096}) // 32 MiB
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			b.Free(x) // cached
		} else {
			live = append(live, x) // never freed
		}
	}
	if _, err := b.AllocPinned(64 << 20); err != nil {
		t.Fatal(err)
	}
	if b.Info().ManagedMemory {
		if _, err := b.AllocManaged(tensor.F32, tensor.Shape{16 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	during, _, _ := keep.MemInfo()
	before := b.Stats()
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	after := b.Stats()
	free1, _, _ := keep.MemInfo()
	t.Logf("before Close: %+v; driver free %d MiB -> %d MiB -> %d MiB", before, free0>>20, during>>20, free1>>20)
	if after.Reserved != 0 || after.InUse != 0 || after.Cached != 0 || after.Pinned != 0 || after.Managed != 0 {
		t.Errorf("after Close: %+v", after)
	}
	if d := free0 - free1; d > 32<<20 {
		t.Errorf("driver free memory %d MiB lower after Close than before Open", d>>20)
	}
	if _, err := b.Alloc(tensor.F32, tensor.Shape{4}); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close: %v", err)
	}
	if err := b.MatMul(live[0], live[0], live[0], nil); err == nil {
		t.Error("MatMul after Close: no error")
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestErrors(t *testing.T) {
	b := openGPU(t)
	_, total, _ := b.MemInfo()
	if _, err := b.Alloc(tensor.F32, tensor.Shape{int(total / 2)}); !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Errorf("Alloc of twice the device: %v, want ErrOutOfMemory", err)
	} else {
		t.Logf("Alloc of twice the device: %v", err)
	}
	host := tensor.New(tensor.F32, tensor.Shape{2, 2})
	dev, _ := put(t, b, tensor.F32, tensor.Shape{2, 2}, nil4())
	if err := b.Add(dev, host, dev); err == nil {
		t.Error("Add with a host tensor: no error")
	} else {
		t.Logf("host tensor: %v", err)
	}
	freed, _ := b.Alloc(tensor.F32, tensor.Shape{2, 2})
	b.Free(freed)
	b.Free(freed) // a second Free is a no-op
	if err := b.FreePinned(make([]byte, 16)); err == nil {
		t.Error("FreePinned of Go memory: no error")
	}
	if _, err := b.AllocPinned(0); err == nil {
		t.Error("AllocPinned(0): no error")
	}
}

// TestCopyStats checks the copy and stall timing: a copy of 256 MiB from
// pinned memory is counted with a plausible rate, and a compute stream that
// waits at once for it stalls for about the copy's time.
func TestCopyStats(t *testing.T) {
	b := openGPU(t)
	const n = 64 << 20 // 256 MiB of F32
	pinned, err := b.AllocPinned(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(pinned)
	dst, _ := put(t, b, tensor.F32, tensor.Shape{n}, make([]float32, n))
	bytes0, busy0, stall0 := b.CopyStats()
	ready, err := b.UploadAsync(context.Background(), dst, 0, pinned)
	if err != nil {
		t.Fatal(err)
	}
	if err := ready(); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	bytes, busy, stall := b.CopyStats()
	bytes, busy, stall = bytes-bytes0, busy-busy0, stall-stall0
	gbps := float64(bytes) / busy.Seconds() / 1e9
	t.Logf("copied %d bytes in %v (%.1f GB/s), compute stalled %v", bytes, busy, gbps, stall)
	if bytes != 4*n {
		t.Errorf("CopyStats counted %d bytes, want %d", bytes, 4*n)
	}
	if !(gbps > 1 && gbps < 1000) {
		t.Errorf("implausible copy rate %.1f GB/s", gbps)
	}
	if stall <= 0 || stall > 2*busy+time.Millisecond {
		t.Errorf("stall %v for a copy of %v waited on at once", stall, busy)
	}
}

// TestGradOps runs the shared suite of the backward operations, with the
// matrix products on cuBLAS (when it is loaded) and again on the tiled
// kernels.
func TestGradOps(t *testing.T) {
	b := openGPU(t)
	t.Run("auto", func(t *testing.T) {
		t.Logf("%s", b.BLAS())
		tensortest.TestGradOps(t, b)
	})
	t.Run("tiled", func(t *testing.T) {
		b.gradPath = pathTiled
		defer func() { b.gradPath = pathAuto }()
		tensortest.TestGradOps(t, b)
	})
}

// TestMatMulGradPaths checks both backward products on cuBLAS and on the
// tiled kernels, for every weight type, adding into destinations that are
// not zero, and MatMulGradX's widening of F16 and BF16 weights in chunks
// of a few rows (the last one shorter).
func TestMatMulGradPaths(t *testing.T) {
	b := openGPU(t)
	shapes := []struct{ m, n, k int }{{1, 1, 1}, {3, 300, 172}, {64, 256, 1024}, {7, 33, 8}, {17, 100, 70}}
	type variant struct {
		name  string
		p     mmPath
		chunk int64 // rows of w widened at a time (0: gradChunkBytes)
	}
	variants := []variant{{"tiled", pathTiled, 0}}
	if b.blas != nil {
		variants = append(variants, variant{"blas", pathBLAS, 0}, variant{"blas-chunk3", pathBLAS, 3})
	} else {
		t.Logf("skipping cuBLAS: %s", b.BLAS())
	}
	for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16} {
		for _, vr := range variants {
			for _, s := range shapes {
				t.Run(fmt.Sprintf("%v/%s/M%d_N%d_K%d", dt, vr.name, s.m, s.n, s.k), func(t *testing.T) {
					r := newRand(t)
					dy, dyv := put(t, b, tensor.F32, tensor.Shape{s.m, s.n}, uniform(r, s.m*s.n, -1, 1))
					w, wv := put(t, b, dt, tensor.Shape{s.n, s.k}, uniform(r, s.n*s.k, -1, 1))
					dx, dx0 := put(t, b, tensor.F32, tensor.Shape{s.m, s.k}, uniform(r, s.m*s.k, -1, 1))
					chunk := int64(gradChunkBytes)
					if vr.chunk > 0 {
						chunk = vr.chunk * 4 * int64(s.k)
					}
					if err := b.matmulGradX(dx, dy, w, vr.p, chunk); err != nil {
						t.Fatal(err)
					}
					want := tensortest.RefMatMulGradX(dyv, wv, s.m, s.n, s.k)
					for i := range want {
						want[i] += dx0[i]
					}
					check(t, "MatMulGradX", get(t, b, dx), want, 1e-5)
					if dt != tensor.F32 || vr.chunk > 0 {
						return
					}
					x, xv := put(t, b, tensor.F32, tensor.Shape{s.m, s.k}, uniform(r, s.m*s.k, -1, 1))
					dw, dw0 := put(t, b, tensor.F32, tensor.Shape{s.n, s.k}, uniform(r, s.n*s.k, -1, 1))
					if err := b.matmulGradW(dw, dy, x, vr.p); err != nil {
						t.Fatal(err)
					}
					want = tensortest.RefMatMulGradW(dyv, xv, s.m, s.n, s.k)
					for i := range want {
						want[i] += dw0[i]
					}
					check(t, "MatMulGradW", get(t, b, dw), want, 1e-5)
				})
			}
		}
	}
}

// TestMatMulPreciseChunks checks MatMulPrecise against the float64
// reference at 1e-5 (MatMul's F16 cast of x would miss it) with F16 and
// BF16 weights widened three rows at a time, the last chunk shorter, with
// and without a bias.
func TestMatMulPreciseChunks(t *testing.T) {
	b := openGPU(t)
	if b.blas == nil {
		t.Skipf("MatMulPrecise widens weights only for cuBLAS: %s", b.BLAS())
	}
	b.preciseChunk = 3 * 4 * 70
	defer func() { b.preciseChunk = 0 }()
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		for _, withBias := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/bias=%v", dt, withBias), func(t *testing.T) {
				const m, n, k = 40, 100, 70
				r := newRand(t)
				x, xv := put(t, b, tensor.F32, tensor.Shape{m, k}, uniform(r, m*k, -1, 1))
				w, wv := put(t, b, dt, tensor.Shape{n, k}, uniform(r, n*k, -1, 1))
				var bias *tensor.Tensor
				var bv []float64
				if withBias {
					bias, bv = put(t, b, dt, tensor.Shape{n}, uniform(r, n, -1, 1))
				}
				out, _ := put(t, b, tensor.F32, tensor.Shape{m, n}, make([]float32, m*n))
				if err := b.MatMulPrecise(out, x, w, bias); err != nil {
					t.Fatal(err)
				}
				check(t, "MatMulPrecise", get(t, b, out), tensortest.RefMatMul(xv, wv, bv, m, n, k), 1e-5)
			})
		}
	}
}

// TestAttentionGradShapes runs the attention backward on shapes beyond the
// shared suite's: several tiles of 32 positions, a partial last block, an
// odd head dimension, and headDim 256, whose kernels need more than 48 KiB
// of shared memory. out comes from the precise forward kernel, as in
// training (the tensor-core prefill rounds Q, K and V to F16).
func TestAttentionGradShapes(t *testing.T) {
	b := openGPU(t)
	for _, c := range []struct{ t, heads, kvHeads, headDim int }{
		{1, 2, 1, 64}, {100, 8, 2, 64}, {45, 4, 4, 33}, {70, 4, 1, 256}, {300, 32, 4, 128},
	} {
		t.Run(fmt.Sprintf("T%d_H%d_KV%d_D%d", c.t, c.heads, c.kvHeads, c.headDim), func(t *testing.T) {
			if testing.Short() && c.t*c.heads > 1000 {
				t.Skip("large case; skipped in -short runs (the sanitizers)")
			}
			r := newRand(t)
			qw, kw := c.heads*c.headDim, c.kvHeads*c.headDim
			q, qv := put(t, b, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -1, 1))
			k, kv := put(t, b, tensor.F32, tensor.Shape{c.t, kw}, uniform(r, c.t*kw, -1, 1))
			v, vv := put(t, b, tensor.F32, tensor.Shape{c.t, kw}, uniform(r, c.t*kw, -1, 1))
			dout, dov := put(t, b, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -1, 1))
			out, _ := put(t, b, tensor.F32, tensor.Shape{c.t, qw}, nanSlice(c.t*qw))
			dq, _ := put(t, b, tensor.F32, tensor.Shape{c.t, qw}, nanSlice(c.t*qw))
			dk, _ := put(t, b, tensor.F32, tensor.Shape{c.t, kw}, nanSlice(c.t*kw))
			dv, _ := put(t, b, tensor.F32, tensor.Shape{c.t, kw}, nanSlice(c.t*kw))
			scale := float32(1 / math.Sqrt(float64(c.headDim)))
			if err := b.Attention(out, tensor.Attn{Q: q, K: k, V: v, Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, Scale: scale, Precise: true}); err != nil {
				t.Fatal(err)
			}
			if err := b.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: out}, tensor.Attn{Q: q, K: k, V: v, Heads: c.heads, KVHeads: c.kvHeads, HeadDim: c.headDim, Scale: scale}); err != nil {
				t.Fatal(err)
			}
			wq, wk, wv := tensortest.RefAttentionGrad(dov, qv, kv, vv, c.t, c.heads, c.kvHeads, c.headDim, float64(scale))
			// With T = 1, dq and dk are zero and RelErr is the norm of
			// what came out: rounding only.
			check(t, "dq", get(t, b, dq), wq, 1e-5)
			check(t, "dk", get(t, b, dk), wk, 1e-5)
			check(t, "dv", get(t, b, dv), wv, 1e-5)
		})
	}
}

// TestCrossEntropyGradRows checks a vocabulary of 32000 and ignored rows,
// and that a target out of range is an error (of the checks in front) that
// leaves logits alone.
func TestCrossEntropyGradRows(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const rows, vocab = 6, 32000
	logits, lv := put(t, b, tensor.F32, tensor.Shape{rows, vocab}, uniform(r, rows*vocab, -8, 8))
	targets := []int32{5, -1, vocab - 1, 0, -100, 1234}
	g, _ := tensor.CheckedGrad(b)
	if _, err := g.CrossEntropyGrad(logits, []int32{0, 0, 0, vocab, 0, 0}, 1); err == nil {
		t.Fatal("target == V: no error")
	}
	check(t, "logits after a refused call", get(t, b, logits), lv, 0)
	const scale = 0.25
	loss, err := b.CrossEntropyGrad(logits, targets, scale)
	if err != nil {
		t.Fatal(err)
	}
	grad, want := tensortest.RefCrossEntropyGrad(lv, targets, vocab, scale)
	if math.Abs(loss-want) > 1e-5*math.Abs(want) {
		t.Errorf("loss %v, want %v", loss, want)
	}
	check(t, "gradient", get(t, b, logits), grad, 1e-5)
}

// TestGradErrors checks the argument errors particular to this backend,
// which its operations check themselves: the limits of its kernels and the
// residency of operands. (The contract's rules are tensortest's, through
// tensor.Checked.)
func TestGradErrors(t *testing.T) {
	b := openGPU(t)
	x, _ := put(t, b, tensor.F32, tensor.Shape{2, 4}, make([]float32, 8))
	if err := b.AttentionGrad(tensor.AttnGrad{DQ: x, DK: x, DV: x, DOut: x, Out: x}, tensor.Attn{Q: x, K: x, V: x, Heads: 1, KVHeads: 1, HeadDim: 512, Scale: 1}); err == nil {
		t.Error("AttentionGrad with headDim 512: no error")
	}
	host := tensor.New(tensor.F32, tensor.Shape{4})
	if err := b.BiasGrad(host, x); err == nil {
		t.Error("BiasGrad into a host tensor: no error")
	}
	if err := b.Zero(host); err == nil {
		t.Error("Zero of a host tensor: no error")
	}
}

// TestEmbeddedKernels checks, without a GPU, that the embedded PTX defines
// every kernel Open requires.
func TestEmbeddedKernels(t *testing.T) {
	files, err := ptxFS.ReadDir("kernels")
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, e := range files {
		data, err := ptxFS.ReadFile("kernels/" + e.Name())
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range ptxEntries(string(data)) {
			have[name] = true
		}
	}
	for _, name := range append(append(append([]string(nil), requiredKernels...), optionalKernels...), pdlKernels...) {
		if !have[name] {
			t.Errorf("kernel %s is not in the embedded PTX; run make cuda-ptx", name)
		}
	}
}
