//go:build cuda

package cuda

import (
	"fmt"
	"strconv"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
)

// Matrix products and embeddings with quantized weights (kernels/quant.cuh,
// kernels/quantx.cuh).
//
// Decode (M up to quantGEMVMaxRows, and every M on the GEMV path) runs the
// integer GEMV kernels: x rounded once per product to 16-bit levels a 32
// elements (quantx16), the quantized blocks read directly and multiplied
// with dp2a, up to 8 rows of x for each read of w; one row of Q4_K or Q5_K
// weights runs the direct kernels of kernels/quantd.cuh instead (a warp a
// row of w, no staging; Backend.qgemv), with the same rounding of x, and
// MatMulMany and GateUpSiLU round x once for all their weights (fused.go).
// Against the F32 product
// over the dequantized weights its relative error is that of rounding x,
// 2e-5 to 7e-5 (quantx.cuh says how it was measured); against the product
// with the rounded x it is within 1e-6. MatMulPrecise (M up to
// gemvMaxRows), and the tiled path tests ask for, run the F32-x GEMV
// kernels instead: F32 x, F32 accumulation, within 1e-5 relative of the
// F32 product over the dequantized weights. Prefill (larger M, with cuBLAS) dequantizes the
// weight to F16 in row blocks in the scratch arena and multiplies each
// block with cuBLAS, x cast to F16 once per pass, as the F16 path does:
// its error is the F16 path's, both operands rounded to F16. MatMulPrecise
// dequantizes to F32 instead (exactly) for an F32 product. Without cuBLAS
// every M goes to the GEMV kernels.

// matmulQuant is matmul for a quantized w; the caller holds opsMu and has
// entered the context.
func (b *Backend) matmulQuant(out, x, w *tensor.Tensor, m, n, k int, path mmPath) error {
	f, ok := quantFormatOf(w.DType())
	if !ok {
		return fmt.Errorf("cuda: MatMul: no kernels for %v weights", w.DType())
	}
	switch {
	case path == pathGEMV || path == pathAuto && (m <= quantGEMVMaxRows || b.blas == nil):
		return b.gemvQuantInt(out, x, w, f, m, n, k)
	case path == pathTiled || path == pathPrecise && (m <= b.gemvMaxRows || b.blas == nil):
		return b.gemvQuant(out, x, w, f, m, n, k)
	case path == pathPrecise:
		chunk := b.preciseChunk
		if chunk <= 0 {
			chunk = gradChunkBytes
		}
		err := b.gemmPrecise(out, x, w, m, n, k, chunk)
		if err == errBLASUnsupported {
			err = b.gemvQuant(out, x, w, f, m, n, k)
		}
		return err
	case b.blas == nil:
		return fmt.Errorf("%s: %s", b.name, b.BLAS())
	}
	err := b.gemmQuant(out, x, w, f, m, n, k)
	if err == errBLASUnsupported && path == pathAuto {
		err = b.gemvQuantInt(out, x, w, f, m, n, k)
	}
	return err
}

// gemvQuantInt runs the integer GEMV kernels over x, up to 8 rows at a
// time: each chunk of rows rounded to X16 in scratch (quantx16 reads any
// F32 view), then one launch of the kernel for the fewest rows (1, 2, 4,
// 8) that holds the chunk, with as many blocks as the SMs hold at once
// (fewer for fewer row groups). A single row of a format with direct
// kernels goes to gemvDirect instead (Backend.qgemv). Q4_K and Q5_K need
// w 16-byte aligned, as for the F32-x kernels; another view goes through
// gemvWidened.
func (b *Backend) gemvQuantInt(out, x, w *tensor.Tensor, f quantFormat, m, n, k int) error {
	if f.align16 && w.Ptr()%16 != 0 {
		return b.gemvWidened(out, x, w, f, m, n, k)
	}
	rows := min(m, quantMaxRows)
	lay := x16Layout(rows, k)
	p, release, err := b.scratch("MatMul", lay.bytes)
	if err != nil {
		return err
	}
	defer release() // stream order keeps the levels for the kernels
	q, d, s := p, p+uintptr(lay.d), p+uintptr(lay.s)
	warps := f.gemvWarps(k)
	_, direct := b.directOK([]*tensor.Tensor{w})
	for r := 0; r < m; r += rows {
		c := min(rows, m-r)
		xp := x.Ptr() + uintptr(int64(r)*int64(k)*4)
		if direct && c == 1 {
			if err := b.gemvDirect([]uintptr{out.Ptr() + uintptr(int64(r)*int64(n)*4)}, xp, q, d, s, []*tensor.Tensor{w}, f, k); err != nil {
				return err
			}
			continue
		}
		blocks := int64(c) * int64(k/32)
		// A warp a block of x, 8 warps a block of the launch.
		qgrid := [3]uint32{uint32(min((blocks+7)/8, int64(b.info.SMs)*8)), 1, 1}
		if err := b.run("quantx16", qgrid, [3]uint32{256, 1, 1}, new(args).ptr(q).ptr(d).ptr(s).ptr(xp).i64(blocks)); err != nil {
			return err
		}
		mm := gemvxRows(c)
		name, per, smWarps := "gemvx_"+f.name+"_m"+strconv.Itoa(mm), f.xRows(mm), quantSMWarps
		if c == 1 && b.qgemvWide && f.xrowsWide > 0 {
			name, per, smWarps = "gemvx_"+f.name+"_m1w", f.xrowsWide, quantSMWarpsWide
		}
		groups := (n + per - 1) / per
		grid := [3]uint32{uint32(min(groups, b.info.SMs*(smWarps/warps))), 1, 1}
		a := new(args).ptr(out.Ptr() + uintptr(int64(r)*int64(n)*4)).ptr(q).ptr(d).ptr(s).ptr(w.Ptr()).i32(n).i32(k).i32(c)
		if err := b.run(name, grid, [3]uint32{uint32(32 * warps), 1, 1}, a); err != nil {
			return err
		}
	}
	return nil
}

// gemvDirect is the product of one row of x (at xp) with up to three
// weights ws of format f (outputs at outs) by the direct kernels of
// kernels/quantd.cuh: x rounded once into the scratch at q, d, s (the
// interleaved X16, or X8 for qgemvDirect8), then one launch over all the
// weights' rows, a warp a group of Backend.qgemvD's rows (gemvdAuto's
// where it is unset). The weights must be 16-byte aligned (directOK).
func (b *Backend) gemvDirect(outs []uintptr, xp, q, d, s uintptr, ws []*tensor.Tensor, f quantFormat, k int) error {
	round, v, prefix := "quantx16i", b.qgemvD, "gemvd_"
	if b.qgemv == qgemvDirect8 {
		round, v, prefix = "quantx8i", gemvd8Variant, "gemvd8_"
	}
	var o, w [3]uintptr
	var n [3]int
	rows := 0
	for i := range ws {
		o[i], w[i], n[i] = outs[i], ws[i].Ptr(), ws[i].Shape()[0]
		rows += n[i]
	}
	if v.r == 0 {
		v = gemvdAuto(rows)
	}
	groups := 0
	for i := range n {
		groups += (n[i] + v.r - 1) / v.r
	}
	if groups == 0 {
		return nil
	}
	blocks := int64(k / 32)
	qgrid := [3]uint32{uint32(min((blocks+7)/8, int64(b.info.SMs)*8)), 1, 1}
	if err := b.run(round, qgrid, [3]uint32{256, 1, 1}, new(args).ptr(q).ptr(d).ptr(s).ptr(xp).i64(blocks)); err != nil {
		return err
	}
	grid := [3]uint32{uint32((groups + gemvdWarps - 1) / gemvdWarps), 1, 1}
	a := new(args).ptr(o[0]).ptr(o[1]).ptr(o[2]).ptr(q).ptr(d).ptr(s).ptr(w[0]).ptr(w[1]).ptr(w[2]).i32(n[0]).i32(n[1]).i32(n[2]).i32(k)
	return b.run(prefix+f.name+"_"+v.String(), grid, [3]uint32{32 * gemvdWarps, 1, 1}, a)
}

// directOK reports whether one row of x times the weights ws (1 to 3, of
// one quantized dtype and row length) runs on the direct kernels: the
// format has them, Backend.qgemv picks them, and every weight is 16-byte
// aligned.
func (b *Backend) directOK(ws []*tensor.Tensor) (quantFormat, bool) {
	if len(ws) == 0 || len(ws) > 3 || b.qgemv == qgemvStaged {
		return quantFormat{}, false
	}
	f, ok := quantFormatOf(ws[0].DType())
	if !ok || !f.direct {
		return quantFormat{}, false
	}
	for _, w := range ws {
		if w.DType() != f.dt || w.Ptr()%16 != 0 || len(w.Shape()) != 2 || w.Shape()[1] != ws[0].Shape()[1] {
			return quantFormat{}, false
		}
	}
	return f, true
}

// gemvQuant runs the GEMV kernels over x, two rows at a time (then one).
// They need x 16-byte aligned, as an allocation and its row views are (K
// is whole blocks of 32): another view is copied into scratch first. Q4_K and Q5_K
// need w 16-byte aligned too, as every tensor Alloc, a row view or the
// pager's ring gives is; another view of one goes through gemvWidened.
func (b *Backend) gemvQuant(out, x, w *tensor.Tensor, f quantFormat, m, n, k int) error {
	if f.align16 && w.Ptr()%16 != 0 {
		return b.gemvWidened(out, x, w, f, m, n, k)
	}
	var xs uintptr // scratch for x, when x is not aligned
	if x.Ptr()%16 != 0 {
		p, release, err := b.scratch("MatMul", 2*int64(k)*4)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the copies for the kernels
		xs = p
	}
	warps := f.gemvWarps(k)
	for r := 0; r < m; {
		rows := min(2, m-r)
		xp := x.Ptr() + uintptr(int64(r)*int64(k)*4)
		if xs != 0 {
			b.counts.copies.Add(1)
			if err := cu.MemcpyDtoDAsync(cu.DevicePtr(xs), cu.DevicePtr(xp), int64(rows)*int64(k)*4, b.compute); err != nil {
				return fmt.Errorf("%s: MatMul: copying x: %w", b.name, cuError(err))
			}
			xp = xs
		}
		perBlock := quantRows / rows // rows of w a block takes at a time (QROWS)
		grid := [3]uint32{uint32((n + perBlock - 1) / perBlock), 1, 1}
		a := new(args).ptr(out.Ptr() + uintptr(int64(r)*int64(n)*4)).ptr(xp).ptr(w.Ptr()).i32(n).i32(k)
		if err := b.run("gemv_"+f.name+"_m"+strconv.Itoa(rows), grid, [3]uint32{uint32(32 * warps), 1, 1}, a); err != nil {
			return err
		}
		r += rows
	}
	return nil
}

// gemvWidened is the GEMV for a w the quantized kernels cannot read in
// place: rows of w dequantized to F32 in scratch, each block multiplied by
// the F32 GEMV kernel, one row of x at a time.
func (b *Backend) gemvWidened(out, x, w *tensor.Tensor, f quantFormat, m, n, k int) error {
	rowBytes := 4 * int64(k)
	rows := int(min(int64(n), scratchBytes/rowBytes))
	if rows == 0 {
		return fmt.Errorf("%s: MatMul: a row of %d needs %d bytes of scratch, the arena holds %d: %w", b.name, k, rowBytes, int64(scratchBytes), tensor.ErrOutOfMemory)
	}
	scratch, release, err := b.scratch("MatMul", int64(rows)*rowBytes)
	if err != nil {
		return err
	}
	defer release()
	const warpsPerBlock = 8
	for n0 := 0; n0 < n; n0 += rows {
		r := min(rows, n-n0)
		if err := b.dequantRows(f, scratch, w, 0, n0, r, false); err != nil {
			return err
		}
		grid := [3]uint32{uint32((r + warpsPerBlock - 1) / warpsPerBlock), 1, 1}
		for i := range m {
			op := out.Ptr() + uintptr((int64(i)*int64(n)+int64(n0))*4)
			xp := x.Ptr() + uintptr(int64(i)*int64(k)*4)
			a := new(args).ptr(op).ptr(xp).ptr(scratch).i32(1).i32(r).i32(k)
			if err := b.run("gemv_f32_any", grid, [3]uint32{32 * warpsPerBlock, 1, 1}, a); err != nil {
				return err
			}
		}
	}
	return nil
}

// gemmQuant is the prefill product through cuBLAS: x cast to F16 (mb rows
// at a time) and w dequantized to F16 (nb rows at a time) in the scratch
// arena, each pair of blocks multiplied into its block of out. In
// column-major terms out is C[N,M] (ldc N), a w block is A[K,rows] (lda K)
// used transposed, an x block is B[K,rows] (ldb K).
func (b *Backend) gemmQuant(out, x, w *tensor.Tensor, f quantFormat, m, n, k int) error {
	rowBytes := 2 * int64(k)
	fit := scratchBytes / rowBytes // rows of K halves the arena holds
	if fit < 2 {
		return fmt.Errorf("%s: MatMul: two rows of %d need %d bytes of scratch, the arena holds %d: %w", b.name, k, 2*rowBytes, int64(scratchBytes), tensor.ErrOutOfMemory)
	}
	mb := int(min(int64(m), fit/2))
	nb := int(min(int64(n), fit-int64(mb)))
	scratch, release, err := b.scratch("MatMul", int64(mb+nb)*rowBytes)
	if err != nil {
		return err
	}
	defer release() // stream order keeps the scratch for the products
	x16, w16 := scratch, scratch+uintptr(int64(mb)*rowBytes)
	for r0 := 0; r0 < m; r0 += mb {
		rows := min(mb, m-r0)
		rk := int64(rows) * int64(k)
		xp := x.Ptr() + uintptr(int64(r0)*int64(k)*4)
		if err := b.run1D("cast_f32_f16", rk, new(args).ptr(x16).ptr(xp).i64(rk)); err != nil {
			return err
		}
		for n0 := 0; n0 < n; n0 += nb {
			cols := min(nb, n-n0)
			if err := b.dequantRows(f, w16, w, 0, n0, cols, true); err != nil {
				return err
			}
			op := out.Ptr() + uintptr((int64(r0)*int64(n)+int64(n0))*4)
			b.counts.library.Add(1)
			err := cublasGemm(b.blas, true, false, cols, rows, k, w16, cublasR16F, k, x16, cublasR16F, k, 0, op, n)
			switch {
			case isBLASNotSupported(err):
				return errBLASUnsupported
			case err != nil:
				return fmt.Errorf("%s: MatMul: %w", b.name, err)
			}
		}
	}
	return nil
}

// dequantRows decodes rows of the quantized w into dst (row-major, K
// elements a row, 16-byte aligned): rows r0..r0+rows-1, or those the ids
// at device address ids name (ids != 0), as F32 (exact) or F16.
func (b *Backend) dequantRows(f quantFormat, dst uintptr, w *tensor.Tensor, ids uintptr, r0, rows int, f16 bool) error {
	n, k := w.Shape()[0], w.Shape()[1]
	pieces := (k/w.DType().BlockSize() + f.pieceBlocks - 1) / f.pieceBlocks
	items := int64(rows) * int64(pieces) // one warp each
	blocks := min((items+quantWarps-1)/quantWarps, int64(b.info.SMs)*32)
	name := "dequant_" + f.name + "_f32"
	if f16 {
		name = "dequant_" + f.name + "_f16"
	}
	a := new(args).ptr(dst).ptr(w.Ptr()).ptr(ids).i32(r0).i32(rows).i32(k).i32(n)
	return b.run(name, [3]uint32{uint32(max(blocks, 1)), 1, 1}, [3]uint32{32 * quantWarps, 1, 1}, a)
}

// embedQuant is Embed for a quantized table: the rows the ids name,
// dequantized exactly to F32 straight into out, or through scratch in
// pieces when out is not 16-byte aligned. The caller holds opsMu and has
// entered the context.
func (b *Backend) embedQuant(out, table *tensor.Tensor, ids []int32) error {
	const op = "Embed"
	f, ok := quantFormatOf(table.DType())
	if !ok {
		return fmt.Errorf("cuda: %s: no kernels for %v tables", op, table.DType())
	}
	d := int64(table.Shape()[1])
	idBytes := (int64(len(ids))*4 + 255) &^ 255
	chunk := len(ids)
	need := idBytes
	direct := out.Ptr()%16 == 0
	if !direct {
		chunk = int(min(int64(len(ids)), (scratchBytes-idBytes)/(4*d)))
		if chunk <= 0 {
			return fmt.Errorf("%s: %s: %d ids and a row of %d floats exceed the scratch arena of %d bytes: %w", b.name, op, len(ids), d, int64(scratchBytes), tensor.ErrOutOfMemory)
		}
		need += int64(chunk) * 4 * d
	}
	p, release, err := b.scratch(op, need)
	if err != nil {
		return err
	}
	defer release() // stream order keeps the ids for the kernels
	// From pageable memory the driver stages ids before returning.
	b.counts.copies.Add(1)
	if err := cu.MemcpyHtoDAsync(cu.DevicePtr(p), unsafe.Pointer(&ids[0]), int64(len(ids))*4, b.compute); err != nil {
		return fmt.Errorf("%s: %s ids: %w", b.name, op, cuError(err))
	}
	for i0 := 0; i0 < len(ids); i0 += chunk {
		c := min(chunk, len(ids)-i0)
		dst := out.Ptr() + uintptr(int64(i0)*4*d)
		if !direct {
			dst = p + uintptr(idBytes)
		}
		if err := b.dequantRows(f, dst, table, p+uintptr(4*i0), 0, c, false); err != nil {
			return err
		}
		if direct {
			continue
		}
		b.counts.copies.Add(1)
		if err := cu.MemcpyDtoDAsync(cu.DevicePtr(out.Ptr()+uintptr(int64(i0)*4*d)), cu.DevicePtr(dst), int64(c)*4*d, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
	}
	return nil
}
