//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
)

// suffix names a kernel variant by the dtype of its weight-like operand.
// A quantized dtype gets its format's name, which only the quantized
// kernels carry: an operation that has no kernel for it fails to find one
// rather than reading the blocks as floats.
func suffix(dt tensor.DType) string {
	switch dt {
	case tensor.F16:
		return "f16"
	case tensor.BF16:
		return "bf16"
	}
	if dt.IsQuantized() {
		if f, ok := quantFormatOf(dt); ok {
			return f.name
		}
		return dt.String()
	}
	return "f32"
}

// shapeErr restates a tensor.CheckShape error as this package's.
func shapeErr(err error) error {
	if err == nil {
		return nil
	}
	return errors.New("cuda: " + strings.TrimPrefix(err.Error(), "tensor: "))
}

// devices checks every named operand with Backend.device: the one check
// the operations of tensor.Kernels and tensor.GradOps make themselves, besides
// the limits of their kernels. Every other rule of their arguments (shapes,
// dtypes, ranges, aliasing, which the kernels rely on to stay inside their
// operands) is checked by tensor.Checked in front of them.
func (b *Backend) devices(op string, names []string, ts ...*tensor.Tensor) error {
	for i, t := range ts {
		if t == nil {
			continue // optional operands (bias)
		}
		if err := b.device(op, names[i], t); err != nil {
			return err
		}
	}
	return nil
}

// ops brackets a compute-stream operation: enter, take opsMu, run f.
func (b *Backend) ops(op string, f func() error) error {
	if err := b.enter(op); err != nil {
		return err
	}
	defer b.leave()
	if b.capturing() { // Capture holds opsMu for this goroutine
		return f()
	}
	b.opsMu.Lock()
	defer b.opsMu.Unlock()
	return f()
}

// Matrix-product implementations MatMul chooses from.
type mmPath int

const (
	pathAuto    mmPath = iota
	pathGEMV           // the GEMV kernels, 1, 2 or 4 rows of x per launch
	pathBLAS           // cuBLAS GemmEx, activations cast to the weight type
	pathTiled          // the built-in tiled kernel
	pathPrecise        // as pathAuto, but cuBLAS products in F32 (MatMulPrecise)
)

// MatMul computes out[M,N] = x[M,K] · w[N,K]ᵀ (+ bias). Up to gemvMaxRows
// rows (decode) go to the GEMV kernels, which read F16/BF16/F32 weights
// directly at memory speed; larger M goes to cuBLAS with F32 accumulation,
// after casting x to the weight type (cuBLAS has no F16×F32 product), or
// to the built-in tiled kernel when cuBLAS is not loaded. Quantized
// weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) go to their own
// GEMV kernels, or for larger M are dequantized to F16 block by block for
// cuBLAS (quant.go).
func (b *Backend) MatMul(out, x, w, bias *tensor.Tensor) error {
	return b.matmul(out, x, w, bias, pathAuto)
}

func (b *Backend) matmul(out, x, w, bias *tensor.Tensor, path mmPath) error {
	const op = "MatMul"
	if err := b.devices(op, []string{"out", "x", "w", "bias"}, out, x, w, bias); err != nil {
		return err
	}
	m, k, n := x.Shape()[0], x.Shape()[1], w.Shape()[0]
	if m == 0 || n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		var err error
		switch {
		case k == 0:
			err = b.memsetAsync(out.Ptr(), out.NumBytes())
		case w.DType().IsQuantized():
			err = b.matmulQuant(out, x, w, m, n, k, path)
		case path == pathGEMV || (path == pathAuto || path == pathPrecise) && m <= b.gemvMaxRows:
			err = b.gemv(out, x, w, m, n, k)
		case path == pathPrecise && b.blas != nil:
			chunk := b.preciseChunk
			if chunk <= 0 {
				chunk = gradChunkBytes
			}
			err = b.gemmPrecise(out, x, w, m, n, k, chunk)
			if err == errBLASUnsupported {
				err = b.gemmTiled(out, x, w, m, n, k)
			}
		case (path == pathBLAS || path == pathAuto) && b.blas != nil:
			err = b.gemmBLAS(out, x, w, m, n, k)
			if err == errBLASUnsupported && path == pathAuto {
				err = b.gemmTiled(out, x, w, m, n, k)
			}
		case path == pathBLAS:
			err = fmt.Errorf("%s: %s", b.name, b.BLAS())
		default:
			err = b.gemmTiled(out, x, w, m, n, k)
		}
		if err != nil || bias == nil {
			return err
		}
		a := new(args).ptr(out.Ptr()).ptr(bias.Ptr()).i64(int64(m)).i32(n)
		return b.run1D("bias_add_"+suffix(bias.DType()), int64(m)*int64(n), a)
	})
}

// gemv runs the GEMV kernels over x in chunks of 4, 2 and 1 rows.
func (b *Backend) gemv(out, x, w *tensor.Tensor, m, n, k int) error {
	const warpsPerBlock = 8
	elems := 16 / w.DType().Size()
	vec := k%elems == 0 && w.Ptr()%16 == 0 && x.Ptr()%16 == 0
	grid := [3]uint32{uint32((n + warpsPerBlock - 1) / warpsPerBlock), 1, 1}
	block := [3]uint32{32 * warpsPerBlock, 1, 1}
	sfx := suffix(w.DType())
	for r := 0; r < m; {
		rows := min(4, m-r)
		if vec && rows == 3 {
			rows = 2
		}
		xp := x.Ptr() + uintptr(r*k*4)
		op := out.Ptr() + uintptr(r*n*4)
		var err error
		switch {
		case vec && rows == 1 && b.splitFor(sfx) != nil:
			err = b.gemvSplitRun(b.splitFor(sfx), sfx, [3]uintptr{op}, [3]uintptr{w.Ptr()}, [3]int{n}, xp, k)
		case vec && rows == 1 && b.rowsPerWarp(n) > 0:
			rpw := b.rowsPerWarp(n)
			a := new(args).ptr(op).ptr(xp).ptr(w.Ptr()).i32(n).i32(k)
			per := warpsPerBlock * rpw
			err = b.run("gemv_"+sfx+"_r"+strconv.Itoa(rpw), [3]uint32{uint32((n + per - 1) / per), 1, 1}, block, a)
		case vec:
			a := new(args).ptr(op).ptr(xp).ptr(w.Ptr()).i32(n).i32(k)
			err = b.run(gemvKernels[sfx][rows], grid, block, a)
		default:
			a := new(args).ptr(op).ptr(xp).ptr(w.Ptr()).i32(rows).i32(n).i32(k)
			err = b.run("gemv_"+sfx+"_any", grid, block, a)
		}
		if err != nil {
			return err
		}
		r += rows
	}
	return nil
}

// rowsPerWarp is the gemv_*_r kernel (1 or 2 rows per warp) an M = 1
// product of n rows runs on, or 0 for gemv_*_m1: gemvRows when set, else
// r1 for n <= 2048 (TinyLlama's o and down products, whose one short wave
// of warps gains most from having each batch's loads in flight together:
// on the H200, 7.1 against 8.6 us for 2048x2048 and 11.8 against 13.2 us
// for 2048x5632 in F16, 7.0 against 7.9 and 12.3 against 13.1 in BF16,
// launched one by one), m1 above (where r1 and r2 were no faster).
func (b *Backend) rowsPerWarp(n int) int {
	switch {
	case b.gemvRows > 0:
		return b.gemvRows
	case b.gemvRows == 0 && n <= 2048:
		return 1
	}
	return 0
}

// gemvKernels names the vector GEMV kernels by weight suffix and rows.
var gemvKernels = map[string][5]string{
	"f32":  {2: "gemv_f32_m2", 1: "gemv_f32_m1", 4: "gemv_f32_m4"},
	"f16":  {2: "gemv_f16_m2", 1: "gemv_f16_m1", 4: "gemv_f16_m4"},
	"bf16": {2: "gemv_bf16_m2", 1: "gemv_bf16_m1", 4: "gemv_bf16_m4"},
}

var errBLASUnsupported = errors.New("cuBLAS does not support this product on this device")

func (b *Backend) gemmBLAS(out, x, w *tensor.Tensor, m, n, k int) error {
	blas := func(op, xp uintptr, xt, wt int, rows int, accumulate bool) error {
		b.counts.library.Add(1)
		if err := cublasMatMul(b.blas, op, xp, xt, w.Ptr(), wt, rows, n, k, accumulate); err != nil {
			if isBLASNotSupported(err) {
				return errBLASUnsupported
			}
			return fmt.Errorf("%s: MatMul: %w", b.name, err)
		}
		return nil
	}
	if w.DType() == tensor.F32 {
		return blas(out.Ptr(), x.Ptr(), cublasR32F, cublasR32F, m, false)
	}
	// x is converted into the scratch arena, as many rows at a time as fit:
	// F16 weights take x rounded to F16 (11 significant bits); BF16 keeps
	// only 8, so x is split into hi + lo, both BF16, and the two products
	// are summed in F32, which keeps about 16 bits of x at twice the
	// arithmetic (prefill is far from arithmetic-bound at these sizes).
	rowBytes := 2 * int64(k)
	if w.DType() == tensor.BF16 {
		rowBytes = 4 * int64(k)
	}
	block := int(min(int64(m), scratchBytes/rowBytes))
	if block == 0 {
		return fmt.Errorf("%s: MatMul: a row of %d needs %d bytes of scratch, the arena holds %d: %w", b.name, k, rowBytes, int64(scratchBytes), tensor.ErrOutOfMemory)
	}
	scratch, release, err := b.scratch("MatMul", int64(block)*rowBytes)
	if err != nil {
		return err
	}
	defer release() // stream order keeps the scratch for the products
	for r0 := 0; r0 < m; r0 += block {
		rows := min(block, m-r0)
		xp, op := x.Ptr()+uintptr(int64(r0)*int64(k)*4), out.Ptr()+uintptr(int64(r0)*int64(n)*4)
		rk := int64(rows) * int64(k)
		if w.DType() == tensor.F16 {
			if err := b.run1D("cast_f32_f16", rk, new(args).ptr(scratch).ptr(xp).i64(rk)); err != nil {
				return err
			}
			if err := blas(op, scratch, cublasR16F, cublasR16F, rows, false); err != nil {
				return err
			}
			continue
		}
		hi, lo := scratch, scratch+uintptr(2*rk)
		if err := b.run1D("split_f32_bf16", rk, new(args).ptr(hi).ptr(lo).ptr(xp).i64(rk)); err != nil {
			return err
		}
		if err := blas(op, hi, cublasR16BF, cublasR16BF, rows, false); err != nil {
			return err
		}
		if err := blas(op, lo, cublasR16BF, cublasR16BF, rows, true); err != nil {
			return err
		}
	}
	return nil
}

func (b *Backend) gemmTiled(out, x, w *tensor.Tensor, m, n, k int) error {
	const tile = 16
	grid := [3]uint32{uint32((n + tile - 1) / tile), uint32((m + tile - 1) / tile), 1}
	a := new(args).ptr(out.Ptr()).ptr(x.Ptr()).ptr(w.Ptr()).i32(m).i32(n).i32(k)
	return b.run("gemm_"+suffix(w.DType()), grid, [3]uint32{tile, tile, 1}, a)
}

// RMSNorm computes out[i,:] = x[i,:] / sqrt(mean(x[i,:]²) + eps) * w; out
// may be x.
func (b *Backend) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	const op = "RMSNorm"
	if err := b.devices(op, []string{"out", "x", "w"}, out, x, w); err != nil {
		return err
	}
	m, d := x.Shape()[0], x.Shape()[1]
	if m == 0 || d == 0 {
		return nil
	}
	return b.ops(op, func() error {
		a := new(args).ptr(out.Ptr()).ptr(x.Ptr()).ptr(w.Ptr()).i32(d).f32(eps)
		return b.runStep("rmsnorm_"+suffix(w.DType()), [3]uint32{uint32(m), 1, 1}, [3]uint32{normThreads(d), 1, 1}, a)
	})
}

// Rope rotates x[T, heads*headDim] in place by the angles of positions
// pos0..pos0+T-1 (Hugging Face's rotate_half pairing; the fields of r).
func (b *Backend) Rope(x *tensor.Tensor, r tensor.Rotary) error {
	const op = "Rope"
	cos, sin, heads, headDim, pos0 := r.Cos, r.Sin, r.Heads, r.HeadDim, r.Pos0
	if err := b.devices(op, []string{"x", "cos", "sin", "PosAt"}, x, cos, sin, r.PosAt); err != nil {
		return err
	}
	half, t := headDim/2, x.Shape()[0]
	if t == 0 {
		return nil
	}
	return b.ops(op, func() error {
		a := new(args).ptr(x.Ptr()).ptr(cos.Ptr()).ptr(sin.Ptr()).i32(t).i32(heads).i32(headDim).i32(pos0)
		if r.PosAt != nil { // read when the kernel runs, clamped to [0, pos0]
			return b.runStep1D("rope_f32_at", int64(t)*int64(heads)*int64(half), a.ptr(r.PosAt.Ptr()))
		}
		return b.run1D("rope_f32", int64(t)*int64(heads)*int64(half), a)
	})
}

// RopeRows rotates each row t of x as Rope does at position pos[t]
// (tensor.RowRoper), in one launch whatever the rows' positions, read from
// the step tables (uploaded when they change).
func (b *Backend) RopeRows(x *tensor.Tensor, r tensor.Rotary, pos []int32) error {
	const op = "RopeRows"
	if err := b.devices(op, []string{"x", "cos", "sin"}, x, r.Cos, r.Sin); err != nil {
		return err
	}
	t := x.Shape()[0]
	if t == 0 {
		return nil
	}
	if len(pos) != t {
		return fmt.Errorf("cuda: %s: %d positions for %d rows", op, len(pos), t)
	}
	return b.ops(op, func() error {
		// A step's q and k, in every layer, share the positions: the
		// first call uploads them.
		pp, release, err := b.table(op, &b.tab.pos, pos)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the positions for the kernel
		a := new(args).ptr(x.Ptr()).ptr(r.Cos.Ptr()).ptr(r.Sin.Ptr()).i32(t).i32(r.Heads).i32(r.HeadDim).ptr(pp)
		return b.run1D("rope_rows_f32", int64(t)*int64(r.Heads)*int64(r.HeadDim/2), a)
	})
}

// SiLUMul computes out = silu(gate) * up elementwise; out may be gate or up.
func (b *Backend) SiLUMul(out, gate, up *tensor.Tensor) error {
	const op = "SiLUMul"
	if err := b.devices(op, []string{"out", "gate", "up"}, out, gate, up); err != nil {
		return err
	}
	n := int64(out.Len())
	if n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		return b.run1D("silu_mul_f32", n, new(args).ptr(out.Ptr()).ptr(gate.Ptr()).ptr(up.Ptr()).i64(n))
	})
}

// Add computes out = a + b elementwise; out may be a or b.
func (b *Backend) Add(out, x, y *tensor.Tensor) error {
	const op = "Add"
	if err := b.devices(op, []string{"out", "a", "b"}, out, x, y); err != nil {
		return err
	}
	n := int64(out.Len())
	if n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		return b.runStep1D("add_f32", n, new(args).ptr(out.Ptr()).ptr(x.Ptr()).ptr(y.Ptr()).i64(n))
	})
}

// Embed gathers rows of table [V, D] (F32, F16 or BF16, or quantized:
// its rows dequantized exactly) into out [len(ids), D] F32. The kernel
// reads the rows the ids name: tensor.Checked refuses an id outside
// [0, V) before anything runs.
func (b *Backend) Embed(out, table *tensor.Tensor, ids []int32) error {
	const op = "Embed"
	if err := b.devices(op, []string{"out", "table"}, out, table); err != nil {
		return err
	}
	d := table.Shape()[1]
	if len(ids) == 0 || d == 0 {
		return nil
	}
	return b.ops(op, func() error {
		if table.DType().IsQuantized() {
			return b.embedQuant(out, table, ids)
		}
		n := int64(len(ids)) * 4
		idp, release, err := b.scratch(op, n)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the ids for the kernel
		// From pageable memory the driver stages ids before returning.
		b.counts.copies.Add(1)
		if err := cu.MemcpyHtoDAsync(cu.DevicePtr(idp), unsafe.Pointer(&ids[0]), n, b.compute); err != nil {
			return fmt.Errorf("%s: %s ids: %w", b.name, op, cuError(err))
		}
		a := new(args).ptr(out.Ptr()).ptr(table.Ptr()).ptr(idp).i32(len(ids)).i32(d)
		return b.run1D("embed_"+suffix(table.DType()), int64(len(ids))*int64(d), a)
	})
}

// CombineRows computes out[t] = Σ_j w[r]·src[r], r = idx[t*k+j]
// (tensor.CombineRows) in one launch, the indices copied up with it.
func (b *Backend) CombineRows(out, src, w *tensor.Tensor, idx []int32, k int) error {
	const op = "CombineRows"
	if err := b.devices(op, []string{"out", "src", "w"}, out, src, w); err != nil {
		return err
	}
	t, d := out.Shape()[0], src.Shape()[1]
	if t == 0 || d == 0 {
		return nil
	}
	return b.ops(op, func() error {
		n := int64(len(idx)) * 4
		idp, release, err := b.scratch(op, n)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the indices for the kernel
		b.counts.copies.Add(1)
		if err := cu.MemcpyHtoDAsync(cu.DevicePtr(idp), unsafe.Pointer(&idx[0]), n, b.compute); err != nil {
			return fmt.Errorf("%s: %s indices: %w", b.name, op, cuError(err))
		}
		a := new(args).ptr(out.Ptr()).ptr(src.Ptr()).ptr(w.Ptr()).ptr(idp).i32(t).i32(d).i32(k)
		return b.run1D("combine_rows_f32", int64(t)*int64(d), a)
	})
}

// CopyRows copies n rows of src from row srcRow into dst from row dstRow;
// same dtype and row length; dst and src may be the same tensor. F32 rows
// into an F16, BF16, Q8_0 or Q8_B8 cache are converted (kvAppend).
func (b *Backend) CopyRows(dst *tensor.Tensor, dstRow int, src *tensor.Tensor, srcRow, n int) error {
	const op = "CopyRows"
	if err := b.devices(op, []string{"dst", "src"}, dst, src); err != nil {
		return err
	}
	if dst.DType() != src.DType() {
		return b.kvAppend(dst, dstRow, src, srcRow, n)
	}
	rb := dst.Shape()[1:].NumElements() * int64(dst.DType().Size())
	if dst.DType().BlockSize() > 1 { // Size is 0: a row is whole blocks
		var err error
		if rb, err = dst.DType().ShapeBytes(dst.Shape()[1:]); err != nil {
			return fmt.Errorf("cuda: %s: %w", op, err)
		}
	}
	bytes := int64(n) * rb
	if bytes == 0 {
		return nil
	}
	d0 := dst.Ptr() + uintptr(int64(dstRow)*rb)
	s0 := src.Ptr() + uintptr(int64(srcRow)*rb)
	return b.ops(op, func() error {
		if d0 == s0 {
			return nil
		}
		if d0 < s0+uintptr(bytes) && s0 < d0+uintptr(bytes) {
			return b.copyOverlapping(op, d0, s0, bytes, rb)
		}
		b.counts.copies.Add(1)
		if err := cu.MemcpyDtoDAsync(cu.DevicePtr(d0), cu.DevicePtr(s0), bytes, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		return nil
	})
}

// kvAppend writes n F32 rows of src from row srcRow into the cache dst
// from row dstRow, rounded to F16 or BF16 (the cast kernels) or quantized
// to Q8_0 or Q8_B8 blocks as quant.QuantizeQ8_0 and quant.QuantizeQ8B8 do
// (kv_append_q8_0, kv_append_q8_b8).
func (b *Backend) kvAppend(dst *tensor.Tensor, dstRow int, src *tensor.Tensor, srcRow, n int) error {
	const op = "CopyRows"
	width := dst.Shape()[1:].NumElements()
	elems := int64(n) * width
	if elems == 0 {
		return nil
	}
	sp := src.Ptr() + uintptr(int64(srcRow)*width*4)
	return b.ops(op, func() error {
		switch dst.DType() {
		case tensor.F16, tensor.BF16:
			dp := dst.Ptr() + uintptr(int64(dstRow)*width*2)
			return b.run1D("cast_f32_"+suffix(dst.DType()), elems, new(args).ptr(dp).ptr(sp).i64(elems))
		case tensor.Q8_0:
			dp := dst.Ptr() + uintptr(int64(dstRow)*width/32*34)
			return b.run1D("kv_append_q8_0", elems/32, new(args).ptr(dp).ptr(sp).i64(elems/32))
		case tensor.Q8_B8:
			dp := dst.Ptr() + uintptr(int64(dstRow)*width/8*10)
			return b.run1D("kv_append_q8_b8", elems/8, new(args).ptr(dp).ptr(sp).i64(elems/8))
		}
		return fmt.Errorf("cuda: %s: no conversion from %v to %v", op, src.DType(), dst.DType())
	})
}

// copyOverlapping copies bytes from s0 to d0, ranges that overlap, through
// the scratch arena in pieces of whole rows of rb bytes: from the last
// piece back when the copy moves up, from the first on when it moves down,
// so that no piece overwrites source bytes not yet copied.
func (b *Backend) copyOverlapping(op string, d0, s0 uintptr, bytes, rb int64) error {
	piece := min(bytes, scratchBytes/rb*rb)
	if piece == 0 {
		return fmt.Errorf("%s: %s: a row of %d bytes exceeds the scratch arena of %d: %w", b.name, op, rb, int64(scratchBytes), tensor.ErrOutOfMemory)
	}
	tmp, release, err := b.scratch(op, piece)
	if err != nil {
		return err
	}
	defer release()
	copyPiece := func(off, n int64) error {
		b.counts.copies.Add(1)
		if err := cu.MemcpyDtoDAsync(cu.DevicePtr(tmp), cu.DevicePtr(s0+uintptr(off)), n, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		b.counts.copies.Add(1)
		if err := cu.MemcpyDtoDAsync(cu.DevicePtr(d0+uintptr(off)), cu.DevicePtr(tmp), n, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		return nil
	}
	if d0 > s0 {
		for end := bytes; end > 0; end -= piece {
			off := max(0, end-piece)
			if err := copyPiece(off, end-off); err != nil {
				return err
			}
		}
		return nil
	}
	for off := int64(0); off < bytes; off += piece {
		if err := copyPiece(off, min(piece, bytes-off)); err != nil {
			return err
		}
	}
	return nil
}

// maxHeadDim is the largest head dimension the attention kernel holds in
// registers (32 lanes x ATT_PER in kernels/attention.cu).
const maxHeadDim = 256

// Attention computes causal grouped-query attention for the T rows of q at
// positions pos0..pos0+T-1 against the caches k and v. The caches may be
// F32, F16, BF16, Q8_0 or Q8_B8 (both the same); softmax is F32. planAttention
// chooses the kernel: tiled with tensor cores for prefill, split across
// the sequence for decode over long caches, one block a query otherwise
// (which holds a head of at most maxHeadDim dimensions and takes at most
// 65535 queries a call).
func (b *Backend) Attention(out *tensor.Tensor, at tensor.Attn) error {
	const op = "Attention"
	q, k, v, headDim, pos0 := at.Q, at.K, at.V, at.HeadDim, at.Pos0
	if headDim > maxHeadDim {
		return fmt.Errorf("cuda: %s: headDim %d above the kernel's limit of %d", op, headDim, maxHeadDim)
	}
	if err := b.devices(op, []string{"out", "q", "k", "v", "PosAt"}, out, q, k, v, at.PosAt); err != nil {
		return err
	}
	t := q.Shape()[0]
	if t == 0 {
		return nil
	}
	aligned := q.Ptr()%16 == 0 && k.Ptr()%16 == 0 && v.Ptr()%16 == 0 && out.Ptr()%16 == 0
	has := func(name string) bool { _, ok := b.kernels[name]; return ok }
	if at.PosAt != nil {
		// A captured decode step (tensor.Attn.PosAt): the position is read
		// when the kernels run; pos0 bounds it, and plans the splits.
		has = func(name string) bool { _, ok := b.kernels[name]; return ok && !strings.HasPrefix(name, "flash_") }
	}
	plan := planAttention(t, at.Heads, headDim, pos0, k.DType(), aligned, at.Precise, b.splitChunk, has)
	if plan.kernel == "attention_"+cacheSuffix(k.DType()) && t > 65535 {
		return fmt.Errorf("cuda: %s: %d queries in one call; the kernel takes at most 65535", op, t)
	}
	return b.ops(op, func() error { return b.attention(out, at, plan) })
}

// attention launches plan's kernels; the caller holds opsMu.
func (b *Backend) attention(out *tensor.Tensor, at tensor.Attn, plan attnPlan) error {
	q, k, v, heads, kvHeads, headDim, pos0, scale := at.Q, at.K, at.V, at.Heads, at.KVHeads, at.HeadDim, at.Pos0, at.Scale
	t := q.Shape()[0]
	switch {
	case strings.HasPrefix(plan.kernel, "flash_"):
		const rows = 64 // FA_BR
		a := new(args).ptr(out.Ptr()).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).i32(t).i32(heads).i32(kvHeads).i32(pos0).f32(scale)
		packed := t * (heads / kvHeads) // the rows of a KV head's group: each query of each of its heads
		return b.run(plan.kernel, [3]uint32{uint32((packed + rows - 1) / rows), uint32(kvHeads), 1}, [3]uint32{128, 1, 1}, a)
	case strings.HasPrefix(plan.kernel, "attention_split_"):
		grid := [3]uint32{uint32(heads), uint32(t), uint32(plan.splits)}
		block := [3]uint32{splitWarps * 32, 1, 1}
		if plan.splits == 1 {
			a := new(args).ptr(out.Ptr()).ptr(0).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).i32(heads).i32(kvHeads).i32(pos0).f32(scale).i32(plan.chunk).ptr(posPtr(at.PosAt)).ptr(0)
			return b.runStep(plan.kernel, grid, block, a)
		}
		n := int64(heads) * int64(t) * int64(plan.splits) * int64(headDim+2) * 4
		part, release, err := b.scratch("Attention", n)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the partials for the merge
		// The splits count themselves where the counts have room: the
		// last block of each head merges (a launch less a layer).
		count := uintptr(0)
		if b.splitCount != 0 && heads*t <= splitCounts {
			count = b.splitCount
		}
		a := new(args).ptr(out.Ptr()).ptr(part).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).i32(heads).i32(kvHeads).i32(pos0).f32(scale).i32(plan.chunk).ptr(posPtr(at.PosAt)).ptr(count)
		if err := b.runStep(plan.kernel, grid, block, a); err != nil {
			return err
		}
		if count != 0 {
			return nil // merged by the last block
		}
		m := new(args).ptr(out.Ptr()).ptr(part).i32(heads).i32(plan.splits)
		// The merge runs with the split blocks' warps, as the last block's does.
		return b.runStep(fmt.Sprintf("attention_merge_d%d", headDim), [3]uint32{uint32(heads), uint32(t), 1}, block, m)
	}
	a := new(args).ptr(out.Ptr()).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).i32(heads).i32(kvHeads).i32(headDim).i32(pos0).f32(scale)
	// Graph capture: the _at kernels read pos0 from at.PosAt when they
	// run, clamped to [0, pos0] (tensor.Attn.PosAt).
	if at.PosAt != nil {
		return b.run(plan.kernel+"_at", [3]uint32{uint32(heads), uint32(t), 1}, [3]uint32{256, 1, 1}, a.ptr(at.PosAt.Ptr()))
	}
	return b.run(plan.kernel, [3]uint32{uint32(heads), uint32(t), 1}, [3]uint32{256, 1, 1}, a)
}

var _ tensor.Argmaxer = (*Backend)(nil)

// Argmax returns, for each row of x (F32 [rows, n], or [n] as one row),
// the index of its largest element, the lowest on ties, or -1 when the
// row holds a NaN or an infinity (tensor.Argmaxer). It waits for the
// result (greedy decoding reads it at once).
func (b *Backend) Argmax(x *tensor.Tensor) ([]int32, error) {
	const op = "Argmax"
	if x == nil {
		return nil, fmt.Errorf("cuda: %s: x is nil", op)
	}
	var rows, n int
	switch len(x.Shape()) {
	case 1:
		rows, n = 1, x.Shape()[0]
	case 2:
		rows, n = x.Shape()[0], x.Shape()[1]
	default:
		return nil, fmt.Errorf("cuda: %s: x has shape %v, want 1 or 2 dimensions", op, x.Shape())
	}
	if err := tensor.CheckShape(op, "x", x, tensor.F32, x.Shape()...); err != nil {
		return nil, shapeErr(err)
	}
	if n == 0 {
		return nil, fmt.Errorf("cuda: %s: rows of x are empty", op)
	}
	if err := b.device(op, "x", x); err != nil {
		return nil, err
	}
	out := make([]int32, rows)
	if rows == 0 {
		return out, nil
	}
	err := b.ops(op, func() error {
		bytes := int64(rows) * 4
		p, release, err := b.scratch(op, bytes)
		if err != nil {
			return err
		}
		defer release()
		if err := b.run("argmax_f32", [3]uint32{uint32(rows), 1, 1}, [3]uint32{1024, 1, 1}, new(args).ptr(p).ptr(x.Ptr()).i32(n)); err != nil {
			return err
		}
		b.counts.copies.Add(1)
		if err := cu.MemcpyDtoHAsync(unsafe.Pointer(&out[0]), cu.DevicePtr(p), bytes, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		if err := b.compute.Synchronize(); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		return nil
	})
	return out, err
}

// Cast converts src into dst, element for element: F32 to F16 or BF16
// (rounding to nearest even) and back, or a copy when the types match.
func (b *Backend) Cast(dst, src *tensor.Tensor) error {
	const op = "Cast"
	if dst == nil || src == nil {
		return fmt.Errorf("cuda: %s: nil tensor", op)
	}
	if dst.Len() != src.Len() {
		return fmt.Errorf("cuda: %s: dst %v and src %v differ in element count", op, dst.Shape(), src.Shape())
	}
	var kernel string
	switch {
	case dst.DType() == src.DType():
	case src.DType() == tensor.F32 && (dst.DType() == tensor.F16 || dst.DType() == tensor.BF16):
		kernel = "cast_f32_" + suffix(dst.DType())
	case dst.DType() == tensor.F32 && (src.DType() == tensor.F16 || src.DType() == tensor.BF16):
		kernel = "cast_" + suffix(src.DType()) + "_f32"
	default:
		return fmt.Errorf("cuda: %s: no conversion from %v to %v", op, src.DType(), dst.DType())
	}
	if err := b.devices(op, []string{"dst", "src"}, dst, src); err != nil {
		return err
	}
	if tensor.Overlap(dst, src) {
		return fmt.Errorf("cuda: %s: dst overlaps src", op)
	}
	n := int64(src.Len())
	if n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		if kernel == "" {
			b.counts.copies.Add(1)
			if err := cu.MemcpyDtoDAsync(cu.DevicePtr(dst.Ptr()), cu.DevicePtr(src.Ptr()), src.NumBytes(), b.compute); err != nil {
				return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
			}
			return nil
		}
		return b.run1D(kernel, n, new(args).ptr(dst.Ptr()).ptr(src.Ptr()).i64(n))
	})
}

// AttentionBlocks writes the rows' keys and values into the pools and
// computes each sequence's attention over its blocks (see
// tensor.AttnBlocks), the pools in any cache dtype. The host flattens the
// rows' slots, positions and the block tables into one int32 table that
// the kernels read (kernels/attention_blocks.cu).
func (b *Backend) AttentionBlocks(out *tensor.Tensor, at tensor.AttnBlocks) error {
	const op = "AttentionBlocks"
	if at.HeadDim > maxHeadDim {
		return fmt.Errorf("cuda: %s: headDim %d above the kernel's limit of %d", op, at.HeadDim, maxHeadDim)
	}
	if dt := at.KPool.DType(); !tensor.IsCacheDType(dt) || at.VPool.DType() != dt {
		return fmt.Errorf("cuda: %s: the pools are %v and %v, not one cache dtype", op, dt, at.VPool.DType())
	}
	t := at.Q.Shape()[0]
	if t > 65535 {
		return fmt.Errorf("cuda: %s: %d queries in one call; the kernel takes at most 65535", op, t)
	}
	if err := b.devices(op, []string{"out", "q", "k", "v", "kPool", "vPool"}, out, at.Q, at.K, at.V, at.KPool, at.VPool); err != nil {
		return err
	}
	if t == 0 {
		return nil
	}
	meta := blocksMeta(at, t)
	return b.ops(op, func() error {
		// The layers of a step share the table: the first uploads it.
		mp, release, err := b.table(op, &b.tab.attn, meta)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the table for the kernels
		kw := at.KVHeads * at.HeadDim
		sfx := cacheSuffix(at.KPool.DType())
		// One thread an element, or a block of the 8-bit caches.
		threads := int64(t) * int64(kw) / int64(at.KPool.DType().BlockSize())
		w := new(args).ptr(at.KPool.Ptr()).ptr(at.VPool.Ptr()).ptr(at.K.Ptr()).ptr(at.V.Ptr()).ptr(mp).i32(t).i32(kw)
		if err := b.run1D("kv_write_blocks_"+sfx, threads, w); err != nil {
			return err
		}
		a := new(args).ptr(out.Ptr()).ptr(at.Q.Ptr()).ptr(at.KPool.Ptr()).ptr(at.VPool.Ptr()).ptr(mp).i32(t).
			i32(at.Heads).i32(at.KVHeads).i32(at.HeadDim).i32(at.BlockSize).f32(at.Scale)
		return b.run("attention_blocks_"+sfx, [3]uint32{uint32(at.Heads), uint32(t), 1}, [3]uint32{256, 1, 1}, a)
	})
}
