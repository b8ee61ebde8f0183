//go:build cuda

package cuda

import (
	"context"
	"fmt"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// weightSet allocates count random [n, k] weight matrices of dt, enough of
// them that together they exceed the GPU's L2 cache, so that a benchmark
// cycling through them reads HBM.
func weightSet(b *testing.B, be *Backend, dt tensor.DType, count, n, k int) []*tensor.Tensor {
	r := newRand(b)
	ws := make([]*tensor.Tensor, count)
	v := uniform(r, n*k, -1, 1)
	for i := range ws {
		ws[i], _ = put(b, be, dt, tensor.Shape{n, k}, v)
	}
	return ws
}

// BenchmarkGEMVDecode times the decode matrix-vector product (M = 1,
// K = N = 4096) and reports the weight bytes read per second. Eight
// products are queued per iteration, each on a different matrix, and the
// iteration waits for them, so launch cost is included as in decode.
func BenchmarkGEMVDecode(b *testing.B) {
	be := openGPU(b)
	const n, k, perIter = 4096, 4096, 8
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16, tensor.F32} {
		b.Run(dt.String(), func(b *testing.B) {
			ws := weightSet(b, be, dt, 16, n, k) // 512 MiB of F16
			x, _ := put(b, be, tensor.F32, tensor.Shape{1, k}, uniform(newRand(b), k, -1, 1))
			out, _ := put(b, be, tensor.F32, tensor.Shape{1, n}, make([]float32, n))
			i := 0
			for b.Loop() {
				for range perIter {
					if err := be.MatMul(out, x, ws[i%len(ws)], nil); err != nil {
						b.Fatal(err)
					}
					i++
				}
				if err := be.Sync(); err != nil {
					b.Fatal(err)
				}
			}
			bytes := float64(perIter) * float64(ws[0].NumBytes())
			b.ReportMetric(bytes*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
			b.ReportMetric(b.Elapsed().Seconds()/float64(b.N*perIter)*1e6, "us/product")
		})
	}
}

// BenchmarkMatMulPaths compares the GEMV kernels and cuBLAS (with the cast
// of x to F16) on F16 weights for growing M, to place gemvMaxRows.
func BenchmarkMatMulPaths(b *testing.B) {
	be := openGPU(b)
	const n, k, perIter = 4096, 4096, 8
	ws := weightSet(b, be, tensor.F16, 16, n, k)
	for _, m := range []int{1, 2, 4, 8, 16, 64, 512} {
		x, _ := put(b, be, tensor.F32, tensor.Shape{m, k}, uniform(newRand(b), m*k, -1, 1))
		out, _ := put(b, be, tensor.F32, tensor.Shape{m, n}, make([]float32, m*n))
		for _, p := range []struct {
			name string
			p    mmPath
		}{{"gemv", pathGEMV}, {"blas", pathBLAS}} {
			if p.p == pathBLAS && be.blas == nil {
				continue
			}
			if p.p == pathGEMV && m > 64 {
				continue
			}
			b.Run(fmt.Sprintf("M%d/%s", m, p.name), func(b *testing.B) {
				i := 0
				for b.Loop() {
					for range perIter {
						if err := be.matmul(out, x, ws[i%len(ws)], nil, p.p); err != nil {
							b.Fatal(err)
						}
						i++
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N*perIter)
				b.ReportMetric(sec*1e6, "us/product")
				b.ReportMetric(float64(ws[0].NumBytes())/sec/1e9, "GB/s")
				b.ReportMetric(2*float64(m)*n*k/sec/1e12, "TFLOP/s")
			})
		}
	}
}

// BenchmarkH2D measures host-to-device copies from pinned memory
// (UploadAsync, then Sync) and from pageable Go memory (Upload).
func BenchmarkH2D(b *testing.B) {
	be := openGPU(b)
	for _, size := range []int64{64 << 20, 256 << 20} {
		dst, err := be.Alloc(tensor.F16, tensor.Shape{int(size / 2)})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { be.Free(dst) })
		b.Run(fmt.Sprintf("pinned/%dMiB", size>>20), func(b *testing.B) {
			src, err := be.AllocPinned(size)
			if err != nil {
				b.Fatal(err)
			}
			defer be.FreePinned(src)
			for i := range src {
				src[i] = byte(i)
			}
			b.SetBytes(size)
			for b.Loop() {
				ready, err := be.UploadAsync(context.Background(), dst, 0, src)
				if err != nil {
					b.Fatal(err)
				}
				if err := ready(); err != nil {
					b.Fatal(err)
				}
				if err := be.Sync(); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("pageable/%dMiB", size>>20), func(b *testing.B) {
			src := make([]byte, size)
			for i := range src {
				src[i] = byte(i)
			}
			b.SetBytes(size)
			for b.Loop() {
				if err := be.Upload(dst, 0, src); err != nil {
					b.Fatal(err)
				}
				if err := be.Sync(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDecodeStepAlloc measures Alloc+Free of a decode step's buffers
// once the cache is warm (no driver calls).
func BenchmarkDecodeStepAlloc(b *testing.B) {
	be := openGPU(b)
	shapes := []tensor.Shape{{1, 4096}, {1, 11008}, {1, 11008}, {1, 32000}}
	ts := make([]*tensor.Tensor, len(shapes))
	for b.Loop() {
		for i, s := range shapes {
			var err error
			if ts[i], err = be.Alloc(tensor.F32, s); err != nil {
				b.Fatal(err)
			}
		}
		for _, x := range ts {
			be.Free(x)
		}
	}
}

// BenchmarkLaunchFloor times a MatMul too small to matter on the GPU
// (M = 1, N = K = 64): what one operation costs to issue and run.
func BenchmarkLaunchFloor(b *testing.B) {
	be := openGPU(b)
	const perIter = 64
	r := newRand(b)
	w, _ := put(b, be, tensor.F16, tensor.Shape{64, 64}, uniform(r, 64*64, -1, 1))
	x, _ := put(b, be, tensor.F32, tensor.Shape{1, 64}, uniform(r, 64, -1, 1))
	out, _ := put(b, be, tensor.F32, tensor.Shape{1, 64}, make([]float32, 64))
	for b.Loop() {
		for range perIter {
			if err := be.MatMul(out, x, w, nil); err != nil {
				b.Fatal(err)
			}
		}
		if err := be.Sync(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(b.Elapsed().Seconds()/float64(b.N*perIter)*1e6, "us/op")
}

// BenchmarkAttentionGrad times the attention backward (both kernels) on a
// training-sized sequence: T = 512, 32 query heads on 4 KV heads,
// headDim 64. TFLOP/s counts the usual 2.5 times the causal forward's
// 4·T²/2·headDim·heads.
func BenchmarkAttentionGrad(b *testing.B) {
	be := openGPU(b)
	const t, heads, kvHeads, headDim = 512, 32, 4, 64
	r := newRand(b)
	qw, kw := heads*headDim, kvHeads*headDim
	q, _ := put(b, be, tensor.F32, tensor.Shape{t, qw}, uniform(r, t*qw, -1, 1))
	k, _ := put(b, be, tensor.F32, tensor.Shape{t, kw}, uniform(r, t*kw, -1, 1))
	v, _ := put(b, be, tensor.F32, tensor.Shape{t, kw}, uniform(r, t*kw, -1, 1))
	dout, _ := put(b, be, tensor.F32, tensor.Shape{t, qw}, uniform(r, t*qw, -1, 1))
	out, _ := put(b, be, tensor.F32, tensor.Shape{t, qw}, make([]float32, t*qw))
	dq, _ := put(b, be, tensor.F32, tensor.Shape{t, qw}, make([]float32, t*qw))
	dk, _ := put(b, be, tensor.F32, tensor.Shape{t, kw}, make([]float32, t*kw))
	dv, _ := put(b, be, tensor.F32, tensor.Shape{t, kw}, make([]float32, t*kw))
	const scale = 0.125
	if err := be.Attention(out, tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Scale: scale}); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := be.AttentionGrad(tensor.AttnGrad{DQ: dq, DK: dk, DV: dv, DOut: dout, Out: out}, tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Scale: scale}); err != nil {
			b.Fatal(err)
		}
		if err := be.Sync(); err != nil {
			b.Fatal(err)
		}
	}
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(sec*1e6, "us/op")
	b.ReportMetric(2.5*4*float64(t)*float64(t+1)/2*headDim*heads/sec/1e12, "TFLOP/s")
}

// BenchmarkMatMulGrad times the two backward products of a linear layer
// with F16 weights, M = 512 rows, N = K = 2048, on cuBLAS (the weight
// widened to F32 for MatMulGradX) and on the tiled kernels.
func BenchmarkMatMulGrad(b *testing.B) {
	be := openGPU(b)
	const m, n, k = 512, 2048, 2048
	r := newRand(b)
	w, _ := put(b, be, tensor.F16, tensor.Shape{n, k}, uniform(r, n*k, -1, 1))
	dy, _ := put(b, be, tensor.F32, tensor.Shape{m, n}, uniform(r, m*n, -1, 1))
	x, _ := put(b, be, tensor.F32, tensor.Shape{m, k}, uniform(r, m*k, -1, 1))
	dx, _ := put(b, be, tensor.F32, tensor.Shape{m, k}, make([]float32, m*k))
	dw, _ := put(b, be, tensor.F32, tensor.Shape{n, k}, make([]float32, n*k))
	for _, p := range []struct {
		name string
		p    mmPath
	}{{"blas", pathBLAS}, {"tiled", pathTiled}} {
		if p.p == pathBLAS && be.blas == nil {
			continue
		}
		for _, op := range []struct {
			name string
			f    func() error
		}{
			{"GradX", func() error { return be.matmulGradX(dx, dy, w, p.p, gradChunkBytes) }},
			{"GradW", func() error { return be.matmulGradW(dw, dy, x, p.p) }},
		} {
			b.Run(op.name+"/"+p.name, func(b *testing.B) {
				for b.Loop() {
					if err := op.f(); err != nil {
						b.Fatal(err)
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(sec*1e6, "us/op")
				b.ReportMetric(2*float64(m)*n*k/sec/1e12, "TFLOP/s")
			})
		}
	}
}

// BenchmarkManagedStreaming measures how fast a layer-sized managed weight
// (256 MiB of F16, preferring host memory) reaches a GEMV that reads it,
// one layer at a time as streaming decode does, against the explicit path
// (pinned host memory, UploadAsync into device memory):
//
//	explicit  UploadAsync, GEMV
//	migrate   PrefetchToDevice, GEMV, PrefetchToHost: the pages move both ways
//	mapped    AdviseDeviceAccess once, no prefetch: the GEMV reads the host
//	          pages in place over the link (what paging.Unified does with
//	          streamed weights)
//
// GB/s is weight bytes per second of wall time, sync included. (Read-mostly
// advice is no way out for migrate: prefetching a read-mostly page back to
// the host keeps the device's copy, so the device would end up holding
// every layer.)
func BenchmarkManagedStreaming(b *testing.B) {
	be := openGPU(b)
	const n, k = 16384, 8192 // 256 MiB of F16
	x, _ := put(b, be, tensor.F32, tensor.Shape{1, k}, uniform(newRand(b), k, -1, 1))
	out, _ := put(b, be, tensor.F32, tensor.Shape{1, n}, make([]float32, n))
	host := make([]byte, 2*n*k)
	for i := range host {
		host[i] = byte(i*7) & 0x3b // finite F16 values
	}
	report := func(b *testing.B, bytes int64) {
		b.ReportMetric(float64(bytes)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
	}
	b.Run("explicit", func(b *testing.B) {
		pinned, err := be.AllocPinned(int64(len(host)))
		if err != nil {
			b.Fatal(err)
		}
		defer be.FreePinned(pinned)
		copy(pinned, host)
		w, err := be.Alloc(tensor.F16, tensor.Shape{n, k})
		if err != nil {
			b.Fatal(err)
		}
		defer be.Free(w)
		for b.Loop() {
			ready, err := be.UploadAsync(context.Background(), w, 0, pinned)
			if err == nil {
				err = ready()
			}
			if err == nil {
				err = be.MatMul(out, x, w, nil)
			}
			if err == nil {
				err = be.Sync()
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		report(b, w.NumBytes())
	})
	for _, mode := range []string{"migrate", "mapped"} {
		b.Run(mode, func(b *testing.B) {
			w, err := be.AllocManaged(tensor.F16, tensor.Shape{n, k})
			if err != nil {
				b.Skipf("managed memory: %v", err)
			}
			defer be.Free(w)
			if err := be.Upload(w, 0, host); err != nil {
				b.Fatal(err)
			}
			if err := be.AdviseHost(w); err != nil {
				b.Fatal(err)
			}
			if mode == "mapped" {
				err = be.AdviseDeviceAccess(w)
			}
			if err == nil {
				err = be.PrefetchToHost(w)
			}
			if err == nil {
				err = be.Sync()
			}
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if mode == "migrate" {
					err = be.PrefetchToDevice(w)
				}
				if err == nil {
					err = be.MatMul(out, x, w, nil)
				}
				if err == nil && mode == "migrate" {
					err = be.PrefetchToHost(w)
				}
				if err == nil {
					err = be.Sync()
				}
				if err != nil {
					b.Fatal(err)
				}
			}
			report(b, w.NumBytes())
		})
	}
}

// quantWeightSet allocates [n, k] weights of the quantized dt, raw random
// bytes with finite scales (what the bytes hold does not change the
// time), enough matrices that together they exceed 512 MiB and so the L2
// cache.
func quantWeightSet(b *testing.B, be *Backend, dt tensor.DType, n, k int) []*tensor.Tensor {
	host := hostWeights(b, newRand(b), dt, n, k, true)
	ws := make([]*tensor.Tensor, max(4, (512<<20+len(host)-1)/len(host)))
	for i := range ws {
		w, err := be.Alloc(dt, tensor.Shape{n, k})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { be.Free(w) })
		if err := be.Upload(w, 0, host); err != nil {
			b.Fatal(err)
		}
		ws[i] = w
	}
	return ws
}

// BenchmarkQuantGEMV times the decode product (M = 1) with quantized
// weights on a 7B model's MLP shapes, N×K = 11008×4096 (gate, up) and
// 4096×11008 (down), next to F16, and reports the stored bytes read per
// second (GB/s) and the time per product; 8 products on rotating
// matrices per iteration, synced, so launch cost is included as in
// decode. Quantized weights run MatMul's integer GEMV (the rounding of x
// and the GEMV, both timed: the staged kernel gemvx_*_m1; for Q4_K and
// Q5_K, as <dtype>-direct-r<R>u<U>, the direct kernel's variants on X16
// and as <dtype>-direct8 the direct one on X8; Backend.qgemv and
// qgemvD; as <dtype>-wide, for
// Q8_0, Q6_K and Q4_0, the staged gemvx_*_m1w with twice the warps an SM,
// Backend.qgemvWide) and, as <dtype>-f32x,
// the F32-x GEMV kernels that MatMulPrecise runs. The copy sub-benchmark measures the device in the same run: a
// device-to-device copy of 1 GiB, GB/s counting the bytes read and
// written, the rate the GEMVs' GB/s are to be compared with.
func BenchmarkQuantGEMV(b *testing.B) {
	be := openGPU(b)
	b.Run("copy", func(b *testing.B) {
		const size = 1 << 30
		src, err := be.Alloc(tensor.F32, tensor.Shape{size / 4})
		if err != nil {
			b.Fatal(err)
		}
		defer be.Free(src)
		dst, err := be.Alloc(tensor.F32, tensor.Shape{size / 4})
		if err != nil {
			b.Fatal(err)
		}
		defer be.Free(dst)
		for b.Loop() {
			if err := be.CopyRows(dst, 0, src, 0, size/4); err != nil {
				b.Fatal(err)
			}
			if err := be.Sync(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(2*size*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
	})
	const perIter = 8
	defer func(k qgemvKind, v gemvdVariant) { be.qgemv, be.qgemvD, be.qgemvWide = k, v, false }(be.qgemv, be.qgemvD)
	// qgemvWideBench marks the entries of gemvx_<f>_m1w (Backend.qgemvWide).
	const qgemvWideBench qgemvKind = -1
	r1u2, r2u1, r2u2, r4u1 := gemvdVariant{1, 2}, gemvdVariant{2, 1}, gemvdVariant{2, 2}, gemvdVariant{4, 1}
	for _, s := range []struct{ n, k int }{{11008, 4096}, {4096, 11008}, {4096, 4096}} {
		for _, c := range []struct {
			dt    tensor.DType
			f32x  bool
			qgemv qgemvKind
			v     gemvdVariant
		}{{tensor.F16, false, 0, r2u2}, {tensor.Q8_0, false, 0, r2u2}, {tensor.Q6_K, false, 0, r2u2}, {tensor.Q5_K, false, 0, r2u2}, {tensor.Q4_K, false, 0, r2u2}, {tensor.Q4_0, false, 0, r2u2},
			{tensor.Q5_K, false, qgemvDirect8, gemvd8Variant}, {tensor.Q4_K, false, qgemvDirect8, gemvd8Variant},
			{tensor.Q5_K, false, qgemvDirect, r2u1}, {tensor.Q5_K, false, qgemvDirect, r2u2},
			{tensor.Q4_K, false, qgemvDirect, r1u2}, {tensor.Q4_K, false, qgemvDirect, r2u1}, {tensor.Q4_K, false, qgemvDirect, r2u2}, {tensor.Q4_K, false, qgemvDirect, r4u1},
			{tensor.Q8_0, false, qgemvWideBench, r2u2}, {tensor.Q6_K, false, qgemvWideBench, r2u2}, {tensor.Q4_0, false, qgemvWideBench, r2u2},
			{tensor.Q8_0, true, 0, r2u2}, {tensor.Q6_K, true, 0, r2u2}, {tensor.Q5_K, true, 0, r2u2}, {tensor.Q4_K, true, 0, r2u2}, {tensor.Q4_0, true, 0, r2u2}} {
			dt, path, name, kind := c.dt, pathAuto, c.dt.String(), c.qgemv
			switch {
			case c.f32x:
				path, name = pathTiled, name+"-f32x"
			case kind == qgemvWideBench:
				// gemvx_<f>_m1w (Backend.qgemvWide) for a format
				// without direct kernels.
				name += "-wide"
			case kind == qgemvDirect:
				name += "-direct-" + c.v.String()
			case kind != qgemvStaged:
				// The entries without a suffix run the staged kernel on
				// X16; these name the other integer GEMVs (Backend.qgemv).
				name += "-" + kind.String()
			}
			b.Run(fmt.Sprintf("%s/N%d_K%d", name, s.n, s.k), func(b *testing.B) {
				be.qgemv, be.qgemvD, be.qgemvWide = kind, c.v, kind == qgemvWideBench
				if kind == qgemvWideBench {
					be.qgemv = qgemvStaged
				}
				var ws []*tensor.Tensor
				if dt.IsQuantized() {
					ws = quantWeightSet(b, be, dt, s.n, s.k)
				} else {
					ws = weightSet(b, be, dt, (512<<20)/(2*s.n*s.k)+1, s.n, s.k)
				}
				x, _ := put(b, be, tensor.F32, tensor.Shape{1, s.k}, uniform(newRand(b), s.k, -1, 1))
				out, _ := put(b, be, tensor.F32, tensor.Shape{1, s.n}, make([]float32, s.n))
				i := 0
				for b.Loop() {
					for range perIter {
						if err := be.matmul(out, x, ws[i%len(ws)], nil, path); err != nil {
							b.Fatal(err)
						}
						i++
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N*perIter)
				b.ReportMetric(float64(ws[0].NumBytes())/sec/1e9, "GB/s")
				b.ReportMetric(sec*1e6, "us/product")
			})
		}
	}
}

// BenchmarkQuantX16 times quantx16 alone, the rounding of x that every
// integer GEMV launch is preceded by, for 1 and 8 rows of the 7B MLP's
// row lengths (8 launches per iteration, synced, as BenchmarkQuantGEMV).
func BenchmarkQuantX16(b *testing.B) {
	be := openGPU(b)
	const perIter = 8
	for _, k := range []int{4096, 11008} {
		for _, m := range []int{1, 8} {
			b.Run(fmt.Sprintf("M%d_K%d", m, k), func(b *testing.B) {
				x, _ := put(b, be, tensor.F32, tensor.Shape{m, k}, uniform(newRand(b), m*k, -1, 1))
				lay := x16Layout(m, k)
				q, err := be.Alloc(tensor.F32, tensor.Shape{int(lay.bytes / 4)})
				if err != nil {
					b.Fatal(err)
				}
				defer be.Free(q)
				blocks := int64(m * k / 32)
				grid := [3]uint32{uint32(min((blocks+7)/8, int64(be.info.SMs)*8)), 1, 1}
				for b.Loop() {
					for range perIter {
						a := new(args).ptr(q.Ptr()).ptr(q.Ptr() + uintptr(lay.d)).ptr(q.Ptr() + uintptr(lay.s)).ptr(x.Ptr()).i64(blocks)
						if err := be.ops("quantx16", func() error { return be.run("quantx16", grid, [3]uint32{256, 1, 1}, a) }); err != nil {
							b.Fatal(err)
						}
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(b.Elapsed().Seconds()/float64(b.N*perIter)*1e6, "us/op")
			})
		}
	}
}

// BenchmarkQuantMatMulPaths compares, for Q4_K and Q8_0 weights (N = K =
// 4096) and growing M, the integer GEMV (gemv: each launch reads w once
// for up to 8 rows of x), the F32-x GEMV (gemv-f32x: two rows a launch,
// up to M = 8) and the prefill path (weights dequantized to F16 for
// cuBLAS, x cast to F16), to place the M from which MatMul sends quantized
// weights to cuBLAS (quantGEMVMaxRows).
func BenchmarkQuantMatMulPaths(b *testing.B) {
	be := openGPU(b)
	const n, k, perIter = 4096, 4096, 8
	for _, dt := range []tensor.DType{tensor.Q4_K, tensor.Q8_0} {
		ws := quantWeightSet(b, be, dt, n, k)
		for _, m := range []int{1, 2, 3, 4, 5, 8, 16, 64, 512} {
			x, _ := put(b, be, tensor.F32, tensor.Shape{m, k}, uniform(newRand(b), m*k, -1, 1))
			out, _ := put(b, be, tensor.F32, tensor.Shape{m, n}, make([]float32, m*n))
			for _, p := range []struct {
				name string
				p    mmPath
			}{{"gemv", pathGEMV}, {"gemv-f32x", pathTiled}, {"blas", pathBLAS}} {
				if p.p == pathBLAS && be.blas == nil || p.p == pathGEMV && m > 64 || p.p == pathTiled && m > 8 {
					continue
				}
				b.Run(fmt.Sprintf("%v/M%d/%s", dt, m, p.name), func(b *testing.B) {
					i := 0
					for b.Loop() {
						for range perIter {
							if err := be.matmul(out, x, ws[i%len(ws)], nil, p.p); err != nil {
								b.Fatal(err)
							}
							i++
						}
						if err := be.Sync(); err != nil {
							b.Fatal(err)
						}
					}
					sec := b.Elapsed().Seconds() / float64(b.N*perIter)
					b.ReportMetric(sec*1e6, "us/product")
					b.ReportMetric(float64(ws[0].NumBytes())/sec/1e9, "GB/s")
					b.ReportMetric(2*float64(m)*n*k/sec/1e12, "TFLOP/s")
				})
			}
		}
	}
}

// BenchmarkAttention times one layer's attention of the 7B shape (32
// heads of 128, 32 KV heads), resident: prefill of T = 512, 2048 and 8192
// queries from position 0 (the tiled tensor-core kernel; TFLOP/s counts
// the causal 4·T²/2·headDim·heads), and decode of one query at 128, 1024
// and 8192 positions (the split kernel; GB/s counts the K and V bytes of
// the positions read). The caches are F32, F16 and Q8_0; each result names
// the kernel planAttention chose. The decode target: at 8,192 positions in
// F16 the 32 layers read 1.07 GB a token, 0.27 ms at 4 TB/s, so a layer
// should take about 8.4 us plus the launch.
func BenchmarkAttention(b *testing.B) {
	be := openGPU(b)
	const heads, kvHeads, headDim = 32, 32, 128
	qw, kw := heads*headDim, kvHeads*headDim
	r := newRand(b)
	has := func(name string) bool { _, ok := be.kernels[name]; return ok }
	for _, c := range []struct {
		name   string
		t, pos int
	}{
		{"prefill/T=512", 512, 0}, {"prefill/T=2048", 2048, 0}, {"prefill/T=8192", 8192, 0},
		{"decode/pos=128", 1, 127}, {"decode/pos=1024", 1, 1023}, {"decode/pos=8192", 1, 8191},
	} {
		for _, dt := range []tensor.DType{tensor.F32, tensor.F16, tensor.Q8_0, tensor.Q8_B8} {
			n := c.pos + c.t
			plan := planAttention(c.t, heads, headDim, c.pos, dt, true, false, be.splitChunk, has)
			b.Run(fmt.Sprintf("%s/%v/%s", c.name, dt, plan.kernel), func(b *testing.B) {
				q, _ := put(b, be, tensor.F32, tensor.Shape{c.t, qw}, uniform(r, c.t*qw, -1, 1))
				k, _ := put(b, be, dt, tensor.Shape{n, kw}, uniform(r, n*kw, -1, 1))
				v, _ := put(b, be, dt, tensor.Shape{n, kw}, uniform(r, n*kw, -1, 1))
				out, _ := put(b, be, tensor.F32, tensor.Shape{c.t, qw}, make([]float32, c.t*qw))
				at := tensor.Attn{Q: q, K: k, V: v, Heads: heads, KVHeads: kvHeads, HeadDim: headDim, Pos0: c.pos, Scale: 0.0883883}
				const perIter = 8
				for b.Loop() {
					for range perIter {
						if err := be.Attention(out, at); err != nil {
							b.Fatal(err)
						}
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N*perIter)
				b.ReportMetric(sec*1e6, "us/layer")
				if c.t > 1 {
					b.ReportMetric(4*float64(c.t)*float64(c.t)/2*headDim*heads/sec/1e12, "TFLOP/s")
				} else {
					b.ReportMetric(float64(k.NumBytes()+v.NumBytes())/sec/1e9, "GB/s")
				}
				b.ReportMetric(float64(plan.splits), "splits")
			})
		}
	}
}
