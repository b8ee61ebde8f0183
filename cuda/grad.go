//go:build cuda

package cuda

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
	"gorgonia.org/cu"
)

// The backward operations of training (tensor.GradOps): kernels in
// kernels/grad.cu and kernels/attention_grad.cuh, and for the two matrix
// products cuBLAS GemmEx with F32 inputs and F32 compute (no TF32:
// gradients keep F32 precision), or tiled kernels when cuBLAS is not
// loaded. Scratch memory comes from the caching allocator and goes back to
// it in stream order.

var _ tensor.GradOps = (*Backend)(nil)

// gradChunkBytes bounds the F32 copy of an F16 or BF16 weight that
// MatMulGradX makes for cuBLAS (which has no F32×F16 product): the weight
// is widened, exactly, a chunk of rows at a time.
const gradChunkBytes = scratchBytes

// Launch geometry of the attention backward kernels; AG_WARPS and AG_TILE
// in kernels/attention_grad.cuh.
const (
	attGradWarps = 8
	attGradTile  = 32
)

// attGradInstance is the suffix of the attention backward kernels for
// headDim: the instance for the smallest of 64, 128 and 256 dimensions
// that holds it.
func attGradInstance(headDim int) string {
	switch {
	case headDim <= 64:
		return "_d64"
	case headDim <= 128:
		return "_d128"
	}
	return "_d256"
}

// attGradShared is the dynamic shared memory, in bytes, of
// attention_grad_q (kv false) or attention_grad_kv (kv true): two tiles of
// attGradTile rows padded to an odd stride, two rows per warp, and for kv
// the tile's log-sum-exp and D.
func attGradShared(headDim int, kv bool) int {
	stride := headDim | 1
	n := 2*attGradTile*stride + attGradWarps*2*headDim
	if kv {
		n += 2 * attGradTile
	}
	return 4 * n
}

// dims32 rejects dimensions that do not fit the int of cuBLAS and of the
// kernels' parameters and grids.
func dims32(op string, dims ...int) error {
	for _, d := range dims {
		if d > math.MaxInt32 {
			return fmt.Errorf("cuda: %s: dimensions %v beyond 2³¹-1", op, dims)
		}
	}
	return nil
}

// Zero sets every element of t to zero.
func (b *Backend) Zero(t *tensor.Tensor) error {
	const op = "Zero"
	if err := b.device(op, "t", t); err != nil {
		return err
	}
	if t.NumBytes() == 0 {
		return nil
	}
	return b.ops(op, func() error { return b.memsetAsync(t.Ptr(), t.NumBytes()) })
}

// gradBLAS reports whether a backward product on path goes to cuBLAS.
func (b *Backend) gradBLAS(op string, path mmPath) (bool, error) {
	switch {
	case path == pathTiled:
		return false, nil
	case b.blas != nil:
		return true, nil
	case path == pathBLAS:
		return false, fmt.Errorf("%s: %s: %s", b.name, op, b.BLAS())
	}
	return false, nil
}

// MatMulPrecise is MatMul with every product in F32: up to gemvMaxRows
// rows go to the GEMV kernels, which already read x in F32 and widen w
// exactly, larger products to cuBLAS in F32 after widening an F16 or BF16 w
// to F32 in chunks of rows (where MatMul rounds x to the weight type), or
// to the tiled kernel without cuBLAS.
func (b *Backend) MatMulPrecise(out, x, w, bias *tensor.Tensor) error {
	return b.matmul(out, x, w, bias, pathPrecise)
}

// gemmPrecise computes out = x·wᵀ through cuBLAS in F32, widening at most
// chunk bytes of w at a time. In column-major terms out is C[N,M] (ldc N),
// w is A[K,N] (lda K), used transposed, and x is B[K,M] (ldb K); rows
// n0..n1 of w give rows n0..n1 of C, the same matrix from pointer offset
// n0.
func (b *Backend) gemmPrecise(out, x, w *tensor.Tensor, m, n, k int, chunk int64) error {
	return b.widenRows("MatMulPrecise", w, chunk, func(a uintptr, n0, rows int) (bool, error) {
		b.counts.library.Add(1)
		err := cublasGemm(b.blas, true, false, rows, m, k, a, cublasR32F, k, x.Ptr(), cublasR32F, k, 0, out.Ptr()+uintptr(n0)*4, n)
		switch {
		case isBLASNotSupported(err):
			return true, errBLASUnsupported
		case err != nil:
			return true, fmt.Errorf("%s: MatMulPrecise: %w", b.name, err)
		}
		return false, nil
	})
}

// widenRows calls fn with w in F32 (its own storage when it is F32, else
// widened exactly into scratch, at most chunk bytes and at least one row at
// a time; a quantized w is dequantized) as the address of rows
// n0..n0+rows, in order, until fn says stop. The scratch is returned to
// the allocator in stream order after the last use.
func (b *Backend) widenRows(op string, w *tensor.Tensor, chunk int64, fn func(a uintptr, n0, rows int) (stop bool, err error)) error {
	n, k := w.Shape()[0], w.Shape()[1]
	if w.DType() == tensor.F32 {
		_, err := fn(w.Ptr(), 0, n)
		return err
	}
	rowBytes := 4 * int64(k)
	rows := int(max(1, min(int64(n), min(chunk, scratchBytes)/rowBytes)))
	scratch, release, err := b.scratch(op, int64(rows)*rowBytes)
	if err != nil {
		return fmt.Errorf("%s: %s: widening w: %w", b.name, op, err)
	}
	defer release() // stream order keeps the scratch for the products
	cast := "cast_" + suffix(w.DType()) + "_f32"
	qf, quantized := quantFormatOf(w.DType())
	if w.DType().IsQuantized() && !quantized {
		return fmt.Errorf("cuda: %s: no kernels for %v weights", op, w.DType())
	}
	for n0 := 0; n0 < n; n0 += rows {
		r := min(rows, n-n0)
		cnt := int64(r) * int64(k)
		if quantized {
			if err := b.dequantRows(qf, scratch, w, 0, n0, r, false); err != nil {
				return err
			}
		} else {
			src := w.Ptr() + uintptr(int64(n0)*int64(k)*int64(w.DType().Size()))
			if err := b.run1D(cast, cnt, new(args).ptr(scratch).ptr(src).i64(cnt)); err != nil {
				return err
			}
		}
		if stop, err := fn(scratch, n0, r); stop || err != nil {
			return err
		}
	}
	return nil
}

// MatMulGradX adds dy[M,N]·w[N,K] into dx[M,K]: the gradient of MatMul's
// x. w may be F32, F16 or BF16; with cuBLAS an F16 or BF16 w is widened to
// F32 (exactly) in chunks of rows, so the product is an F32 one.
func (b *Backend) MatMulGradX(dx, dy, w *tensor.Tensor) error {
	return b.matmulGradX(dx, dy, w, b.gradPath, gradChunkBytes)
}

// matmulGradX is MatMulGradX on path, widening at most chunk bytes of w at
// a time (at least one row).
func (b *Backend) matmulGradX(dx, dy, w *tensor.Tensor, path mmPath, chunk int64) error {
	const op = "MatMulGradX"
	if err := b.devices(op, []string{"dx", "dy", "w"}, dx, dy, w); err != nil {
		return err
	}
	m, n, k := dy.Shape()[0], dy.Shape()[1], w.Shape()[1]
	if err := dims32(op, m, n, k); err != nil {
		return err
	}
	if m == 0 || n == 0 || k == 0 {
		return nil
	}
	return b.ops(op, func() error {
		blas, err := b.gradBLAS(op, path)
		if err != nil {
			return err
		}
		if !blas {
			return b.gradXTiled(dx, dy, w, m, n, k, 0)
		}
		return b.gradXBLAS(dx, dy, w, m, n, k, chunk, path == pathAuto)
	})
}

// gradXBLAS is MatMulGradX through cuBLAS. In column-major terms dx is
// C[K,M] (ldc K), w is A[K,N] (lda K) and dy is B[N,M] (ldb N), so
// C += A·B needs no transposes; a chunk of rows n0..n1 of w pairs with
// columns n0..n1 of dy, the same matrix from pointer offset n0. With
// fallback, a product cuBLAS does not support goes to the tiled kernel
// from the chunk where it failed.
func (b *Backend) gradXBLAS(dx, dy, w *tensor.Tensor, m, n, k int, chunk int64, fallback bool) error {
	const op = "MatMulGradX"
	// gemm adds the product of rows n0..n0+rows of w, at a, and reports
	// done when the tiled kernel has taken over all rows from n0 on.
	gemm := func(a uintptr, n0, rows int) (done bool, err error) {
		b.counts.library.Add(1)
		err = cublasGemm(b.blas, false, false, k, m, rows, a, cublasR32F, k, dy.Ptr()+uintptr(n0)*4, cublasR32F, n, 1, dx.Ptr(), k)
		switch {
		case err == nil:
			return false, nil
		case isBLASNotSupported(err) && fallback:
			return true, b.gradXTiled(dx, dy, w, m, n, k, n0)
		case isBLASNotSupported(err):
			return true, fmt.Errorf("%s: %s: %w", b.name, op, errBLASUnsupported)
		}
		return true, fmt.Errorf("%s: %s: %w", b.name, op, err)
	}
	return b.widenRows(op, w, chunk, gemm)
}

// gradXTiled adds dy[:, n0:N]·w[n0:N, :] into dx with the tiled kernel.
func (b *Backend) gradXTiled(dx, dy, w *tensor.Tensor, m, n, k, n0 int) error {
	const tile = 16
	gy := (m + tile - 1) / tile
	if gy > 65535 {
		return fmt.Errorf("%s: MatMulGradX: %d rows exceed the tiled kernel's grid (%d)", b.name, m, 65535*tile)
	}
	dyp := dy.Ptr() + uintptr(n0)*4
	wp := w.Ptr() + uintptr(int64(n0)*int64(k)*int64(w.DType().Size()))
	a := new(args).ptr(dx.Ptr()).ptr(dyp).ptr(wp).i32(m).i32(n - n0).i32(k).i32(n)
	return b.run("gemm_grad_x_"+suffix(w.DType()), [3]uint32{uint32((k + tile - 1) / tile), uint32(gy), 1}, [3]uint32{tile, tile, 1}, a)
}

// MatMulGradW adds dy[M,N]ᵀ·x[M,K] into dw[N,K]: the gradient of MatMul's
// w. All three are F32.
func (b *Backend) MatMulGradW(dw, dy, x *tensor.Tensor) error {
	return b.matmulGradW(dw, dy, x, b.gradPath)
}

func (b *Backend) matmulGradW(dw, dy, x *tensor.Tensor, path mmPath) error {
	const op = "MatMulGradW"
	if err := b.devices(op, []string{"dw", "dy", "x"}, dw, dy, x); err != nil {
		return err
	}
	m, n, k := dy.Shape()[0], dy.Shape()[1], x.Shape()[1]
	if err := dims32(op, m, n, k); err != nil {
		return err
	}
	if m == 0 || n == 0 || k == 0 {
		return nil
	}
	return b.ops(op, func() error {
		blas, err := b.gradBLAS(op, path)
		if err != nil {
			return err
		}
		if blas {
			// Column-major: dw is C[K,N] (ldc K) = X[K,M] (x, lda K) ·
			// DYᵀ, DY[N,M] being dy (ldb N).
			b.counts.library.Add(1)
			err := cublasGemm(b.blas, false, true, k, n, m, x.Ptr(), cublasR32F, k, dy.Ptr(), cublasR32F, n, 1, dw.Ptr(), k)
			switch {
			case err == nil:
				return nil
			case isBLASNotSupported(err) && path == pathAuto:
				// the tiled kernel below
			case isBLASNotSupported(err):
				return fmt.Errorf("%s: %s: %w", b.name, op, errBLASUnsupported)
			default:
				return fmt.Errorf("%s: %s: %w", b.name, op, err)
			}
		}
		const tile = 16
		gy := (n + tile - 1) / tile
		if gy > 65535 {
			return fmt.Errorf("%s: %s: %d rows of dw exceed the tiled kernel's grid (%d)", b.name, op, n, 65535*tile)
		}
		a := new(args).ptr(dw.Ptr()).ptr(dy.Ptr()).ptr(x.Ptr()).i32(m).i32(n).i32(k)
		return b.run("gemm_grad_w_f32", [3]uint32{uint32((k + tile - 1) / tile), uint32(gy), 1}, [3]uint32{tile, tile, 1}, a)
	})
}

// colBlocks is the launch geometry of the column-reduction kernels
// (bias_grad, rmsnorm_grad_w): 32 columns per block of 8 warps.
func colBlocks(n int) (grid, block [3]uint32) {
	return [3]uint32{uint32((n + 31) / 32), 1, 1}, [3]uint32{256, 1, 1}
}

// BiasGrad adds the column sums of dy[M,N] into db[N], both F32.
func (b *Backend) BiasGrad(db, dy *tensor.Tensor) error {
	const op = "BiasGrad"
	if err := b.devices(op, []string{"db", "dy"}, db, dy); err != nil {
		return err
	}
	m, n := dy.Shape()[0], dy.Shape()[1]
	if err := dims32(op, n); err != nil {
		return err
	}
	if m == 0 || n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		grid, block := colBlocks(n)
		return b.run("bias_grad_f32", grid, block, new(args).ptr(db.Ptr()).ptr(dy.Ptr()).i64(int64(m)).i32(n))
	})
}

// RMSNormGrad is the backward of RMSNorm(out, x, w, eps): given dy [M,H],
// it adds the gradient of x into dx [M,H] and, when dw is not nil, that of
// w into dw [H] (F32). w may be F32, F16 or BF16. dx must not overlap dy,
// x or w, and dw no other operand.
func (b *Backend) RMSNormGrad(dx, dw, dy, x, w *tensor.Tensor, eps float32) error {
	const op = "RMSNormGrad"
	if err := b.devices(op, []string{"dx", "dw", "dy", "x", "w"}, dx, dw, dy, x, w); err != nil {
		return err
	}
	m, h := x.Shape()[0], x.Shape()[1]
	if err := dims32(op, m, h); err != nil {
		return err
	}
	if m == 0 || h == 0 {
		return nil
	}
	return b.ops(op, func() error {
		rs, release, err := b.scratch(op, 4*int64(m))
		if err != nil {
			return err
		}
		defer release() // stream order keeps the scratch for the kernels
		a := new(args).ptr(dx.Ptr()).ptr(rs).ptr(dy.Ptr()).ptr(x.Ptr()).ptr(w.Ptr()).i32(h).f32(eps)
		if err := b.run("rmsnorm_grad_"+suffix(w.DType()), [3]uint32{uint32(m), 1, 1}, [3]uint32{256, 1, 1}, a); err != nil {
			return err
		}
		if dw == nil {
			return nil
		}
		grid, block := colBlocks(h)
		return b.run("rmsnorm_grad_w_f32", grid, block, new(args).ptr(dw.Ptr()).ptr(dy.Ptr()).ptr(x.Ptr()).ptr(rs).i64(int64(m)).i32(h))
	})
}

// SiLUMulGrad is the backward of SiLUMul(out, gate, up): given dout, it
// sets dgate and dup. All are F32 of one shape; dgate may be dout (in
// place); no output may overlap another operand otherwise.
func (b *Backend) SiLUMulGrad(dgate, dup, dout, gate, up *tensor.Tensor) error {
	const op = "SiLUMulGrad"
	if err := b.devices(op, []string{"dgate", "dup", "dout", "gate", "up"}, dgate, dup, dout, gate, up); err != nil {
		return err
	}
	n := int64(dout.Len())
	if n == 0 {
		return nil
	}
	return b.ops(op, func() error {
		return b.run1D("silu_mul_grad_f32", n, new(args).ptr(dgate.Ptr()).ptr(dup.Ptr()).ptr(dout.Ptr()).ptr(gate.Ptr()).ptr(up.Ptr()).i64(n))
	})
}

// AttentionGrad is the backward of Attention(g.Out, at) over T positions
// from 0: q, out and dout are F32 [T, heads*headDim], k and v F32 [T,
// kvHeads*headDim]; it sets dq, dk and dv (shaped as q, k and v), which
// must not overlap each other or the inputs. The attention probabilities are recomputed; the scratch is two
// floats per (position, head). The kernels hold a head of at most
// maxHeadDim dimensions, and at most 65535 heads.
func (b *Backend) AttentionGrad(g tensor.AttnGrad, at tensor.Attn) error {
	const op = "AttentionGrad"
	dq, dk, dv, dout, out := g.DQ, g.DK, g.DV, g.DOut, g.Out
	q, k, v, heads, kvHeads, headDim, scale := at.Q, at.K, at.V, at.Heads, at.KVHeads, at.HeadDim, at.Scale
	if headDim > maxHeadDim {
		return fmt.Errorf("cuda: %s: headDim %d above the kernel's limit of %d", op, headDim, maxHeadDim)
	}
	if heads > 65535 {
		return fmt.Errorf("cuda: %s: %d heads; the kernel takes at most 65535", op, heads)
	}
	if err := b.devices(op, []string{"dq", "dk", "dv", "dout", "q", "k", "v", "out"}, dq, dk, dv, dout, q, k, v, out); err != nil {
		return err
	}
	t := q.Shape()[0]
	if err := dims32(op, t); err != nil {
		return err
	}
	if t == 0 {
		return nil
	}
	return b.ops(op, func() error {
		rows := int64(t) * int64(heads)
		scratch, release, err := b.scratch(op, 8*rows)
		if err != nil {
			return err
		}
		defer release() // stream order keeps the scratch for the kernels
		lse, dd := scratch, scratch+uintptr(4*rows)
		blocks := uint32((t + attGradWarps - 1) / attGradWarps)
		block := [3]uint32{32 * attGradWarps, 1, 1}
		a := new(args).ptr(dq.Ptr()).ptr(lse).ptr(dd).ptr(dout.Ptr()).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).ptr(out.Ptr()).
			i32(t).i32(heads).i32(kvHeads).i32(headDim).f32(scale)
		inst := attGradInstance(headDim)
		if err := b.runShared("attention_grad_q_f32"+inst, [3]uint32{blocks, uint32(heads), 1}, block, attGradShared(headDim, false), a); err != nil {
			return err
		}
		a = new(args).ptr(dk.Ptr()).ptr(dv.Ptr()).ptr(lse).ptr(dd).ptr(dout.Ptr()).ptr(q.Ptr()).ptr(k.Ptr()).ptr(v.Ptr()).
			i32(t).i32(heads).i32(kvHeads).i32(headDim).f32(scale)
		return b.runShared("attention_grad_kv_f32"+inst, [3]uint32{blocks, uint32(kvHeads), 1}, block, attGradShared(headDim, true), a)
	})
}

// CrossEntropyGrad takes logits [rows, V] (F32) and targets (one per row,
// on the host) and returns the sum over the rows of -log
// softmax(logits[i])[targets[i]], overwriting logits with the gradient of
// scale times that sum: (softmax - onehot)·scale. A negative target leaves
// its row out (no loss, zero gradient); tensor.Checked refuses a target >=
// V, which the kernel would read past its row, before anything is written.
// The per-row losses are F32 on the device and summed in float64 here; the
// call waits for them.
func (b *Backend) CrossEntropyGrad(logits *tensor.Tensor, targets []int32, scale float32) (float64, error) {
	const op = "CrossEntropyGrad"
	if err := b.device(op, "logits", logits); err != nil {
		return 0, err
	}
	rows, vocab := logits.Shape()[0], logits.Shape()[1]
	if err := dims32(op, rows, vocab); err != nil {
		return 0, err
	}
	if rows == 0 || vocab == 0 { // with vocab 0 every target is negative
		return 0, nil
	}
	loss := make([]float32, rows)
	err := b.ops(op, func() error {
		n := int64(rows) * 4
		scratch, release, err := b.scratch(op, 2*n)
		if err != nil {
			return err
		}
		defer release()
		ids, lp := scratch, scratch+uintptr(n)
		// From pageable memory the driver stages targets before returning.
		b.counts.copies.Add(1)
		if err := cu.MemcpyHtoDAsync(cu.DevicePtr(ids), unsafe.Pointer(&targets[0]), n, b.compute); err != nil {
			return fmt.Errorf("%s: %s targets: %w", b.name, op, cuError(err))
		}
		a := new(args).ptr(logits.Ptr()).ptr(lp).ptr(ids).i32(vocab).f32(scale)
		if err := b.run("cross_entropy_grad_f32", [3]uint32{uint32(rows), 1, 1}, [3]uint32{512, 1, 1}, a); err != nil {
			return err
		}
		b.counts.copies.Add(1)
		if err := cu.MemcpyDtoHAsync(unsafe.Pointer(&loss[0]), cu.DevicePtr(lp), n, b.compute); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		if err := b.compute.Synchronize(); err != nil {
			return fmt.Errorf("%s: %s: %w", b.name, op, cuError(err))
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, l := range loss {
		sum += float64(l)
	}
	return sum, nil
}
