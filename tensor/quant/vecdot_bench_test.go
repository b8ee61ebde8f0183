package quant

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// The integer products on a matrix of the 1.1B model's MLP shape (2048
// rows of 5632: down_proj), single thread. The benchmark cycles through
// enough copies of the matrix to pass 256 MiB, so that every product
// streams its weights from memory, as a decode step does; GB/s counts the
// quantized weight bytes, and bw the fraction of the read bandwidth that
// BenchmarkReadBandwidth measures (measured once per run, in the same
// process, before the first product).

const (
	benchRows, benchCols = 2048, 5632
	streamBytes          = 256 << 20
)

// readBuf is the buffer the bandwidth benchmarks read: streamBytes of
// words that are not zero (a page of zeros could be shared).
var readBuf = sync.OnceValue(func() []uint64 {
	a := make([]uint64, streamBytes/8)
	for i := range a {
		a[i] = uint64(i)
	}
	return a
})

// sumWords adds the words of a with four independent chains, enough to
// keep a core's loads ahead of memory.
func sumWords(a []uint64) uint64 {
	var s0, s1, s2, s3 uint64
	for i := 0; i+8 <= len(a); i += 8 {
		s0 += a[i] + a[i+4]
		s1 += a[i+1] + a[i+5]
		s2 += a[i+2] + a[i+6]
		s3 += a[i+3] + a[i+7]
	}
	return s0 + s1 + s2 + s3
}

var sinkWords uint64

// readWith reads the whole buffer split among g goroutines and returns the
// bytes read.
func readWith(g int) int {
	a := readBuf()
	var wg sync.WaitGroup
	sums := make([]uint64, g)
	for k := range g {
		wg.Go(func() { sums[k] = sumWords(a[k*len(a)/g : (k+1)*len(a)/g]) })
	}
	wg.Wait()
	for _, s := range sums {
		sinkWords += s
	}
	return 8 * len(a)
}

// readBandwidth is the best of five single-thread passes, in GB/s.
var readBandwidth = sync.OnceValue(func() float64 {
	best := 0.0
	for range 5 {
		t := time.Now()
		n := readWith(1)
		best = max(best, float64(n)/time.Since(t).Seconds()/1e9)
	}
	return best
})

// BenchmarkReadBandwidth measures how fast one and two goroutines read a
// 256 MiB buffer: the ceiling of a product that streams its weights.
func BenchmarkReadBandwidth(b *testing.B) {
	for _, g := range []int{1, 2} {
		b.Run(fmt.Sprintf("threads=%d", g), func(b *testing.B) {
			readWith(g)
			n := 0
			for b.Loop() {
				n += readWith(g)
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// benchMatrices returns copies of one quantized benchRows x benchCols
// matrix, enough to fill streamBytes, and activations for it.
func benchMatrices(b testing.TB, typ Type) ([][]byte, []byte) {
	w := quantized(b, typ, weights(benchRows*benchCols, 41<<32))
	xq := activations(b, typ, weights(benchCols, 42<<32))
	ms := [][]byte{w}
	for len(ms)*len(w) < streamBytes {
		ms = append(ms, append([]byte(nil), w...))
	}
	return ms, xq
}

var benchVecTypes = []Type{Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K}

// BenchmarkGEMV runs each kernel table's product of the whole matrix.
func BenchmarkGEMV(b *testing.B) {
	bw := readBandwidth()
	for _, typ := range benchVecTypes {
		var ms [][]byte
		var xq []byte
		for _, k := range allKernels() {
			b.Run(typ.String()+"/"+k.name, func(b *testing.B) {
				if ms == nil {
					ms, xq = benchMatrices(b, typ)
				}
				out := make([]float32, benchRows)
				i := 0
				for b.Loop() {
					k.gemv[typ](out, ms[i%len(ms)], xq)
					i++
				}
				gbs := float64(len(ms[0])) * float64(b.N) / b.Elapsed().Seconds() / 1e9
				b.ReportMetric(gbs, "GB/s")
				b.ReportMetric(gbs/bw, "bw")
			})
		}
	}
}

// BenchmarkVecDot multiplies the matrix one row at a time through VecDot,
// with the kernels this machine chooses: GEMV's speed less the cost of a
// call per row.
func BenchmarkVecDot(b *testing.B) {
	bw := readBandwidth()
	for _, typ := range []Type{Q8_0, Q4_K, Q6_K} {
		b.Run(typ.String()+"/"+Kernels(), func(b *testing.B) {
			ms, xq := benchMatrices(b, typ)
			rb := len(ms[0]) / benchRows
			i := 0
			var sink float32
			for b.Loop() {
				w := ms[i%len(ms)]
				for r := range benchRows {
					s, err := VecDot(typ, w[r*rb:(r+1)*rb], xq, benchCols)
					if err != nil {
						b.Fatal(err)
					}
					sink += s
				}
				i++
			}
			_ = sink
			gbs := float64(len(ms[0])) * float64(b.N) / b.Elapsed().Seconds() / 1e9
			b.ReportMetric(gbs, "GB/s")
			b.ReportMetric(gbs/bw, "bw")
		})
	}
}

// BenchmarkQuantizeRow quantizes one activation vector of each of the
// 1.1B model's widths, as a decode step does before each product.
func BenchmarkQuantizeRow(b *testing.B) {
	for _, typ := range []Type{Q8_0, Q4_K} {
		for _, n := range []int{2048, 5632} {
			b.Run(fmt.Sprintf("%v/%d", typ, n), func(b *testing.B) {
				x := weights(n, 43<<32)
				nb, _ := ActivationBytes(typ, n)
				xq := make([]byte, nb)
				for b.Loop() {
					if err := QuantizeRow(typ, xq, x); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/elem")
			})
		}
	}
}

// BenchmarkGEMVCached runs the products on 64 rows of 2048 (at most 140 KB
// of weights, in the L2 cache after the first pass): the arithmetic
// ceiling of each kernel, free of memory.
func BenchmarkGEMVCached(b *testing.B) {
	for _, typ := range benchVecTypes {
		for _, k := range allKernels() {
			b.Run(typ.String()+"/"+k.name, func(b *testing.B) {
				const rows, cols = 64, 2048
				w := quantized(b, typ, weights(rows*cols, 44<<32))
				xq := activations(b, typ, weights(cols, 45<<32))
				out := make([]float32, rows)
				for b.Loop() {
					k.gemv[typ](out, w, xq)
				}
				b.ReportMetric(float64(len(w))*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
			})
		}
	}
}

// BenchmarkGEMVThreads splits the matrix's rows between two goroutines,
// as the CPU backend does with its workers; bw is the fraction of the
// two-thread read bandwidth (BenchmarkReadBandwidth/threads=2).
func BenchmarkGEMVThreads(b *testing.B) {
	bw2 := sync.OnceValue(func() float64 {
		best := 0.0
		for range 5 {
			t := time.Now()
			n := readWith(2)
			best = max(best, float64(n)/time.Since(t).Seconds()/1e9)
		}
		return best
	})()
	for _, typ := range []Type{Q8_0, Q4_K, Q6_K} {
		b.Run(typ.String()+"/"+Kernels()+"/threads=2", func(b *testing.B) {
			ms, xq := benchMatrices(b, typ)
			out := make([]float32, benchRows)
			rb := len(ms[0]) / benchRows
			const half = benchRows / 2
			i := 0
			for b.Loop() {
				w := ms[i%len(ms)]
				var wg sync.WaitGroup
				wg.Go(func() {
					if err := GEMV(typ, out[half:], w[half*rb:], half, benchCols, xq); err != nil {
						b.Error(err)
					}
				})
				if err := GEMV(typ, out[:half], w[:half*rb], half, benchCols, xq); err != nil {
					b.Error(err)
				}
				wg.Wait()
				i++
			}
			gbs := float64(len(ms[0])) * float64(b.N) / b.Elapsed().Seconds() / 1e9
			b.ReportMetric(gbs, "GB/s")
			b.ReportMetric(gbs/bw2, "bw")
		})
	}
}

// ExampleGEMV multiplies a Q4_K matrix with an activation vector through
// the integer product, and the first row again through DotF32, the
// product with the unquantized activations.
func ExampleGEMV() {
	const rows, cols = 4, 512
	w := make([]float32, rows*cols)
	x := make([]float32, cols)
	for i := range w {
		w[i] = float32((i*37)%101-50) / 100
	}
	for i := range x {
		x[i] = float32((i*53)%89-44) / 50
	}
	wq := make([]byte, rows*cols/256*144)
	if err := Q4_K.Quantize(wq, w); err != nil {
		fmt.Println(err)
		return
	}
	nb, err := ActivationBytes(Q4_K, cols)
	if err != nil {
		fmt.Println(err)
		return
	}
	xq := make([]byte, nb)
	if err := QuantizeRow(Q4_K, xq, x); err != nil {
		fmt.Println(err)
		return
	}
	out := make([]float32, rows)
	if err := GEMV(Q4_K, out, wq, rows, cols, xq); err != nil {
		fmt.Println(err)
		return
	}
	exact, err := Q4_K.DotF32(wq[:len(wq)/rows], x)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%.4f (DotF32 %.4f)\n", out, exact)
	// Output: [-1.0468 -0.0395 1.2143 2.3347] (DotF32 -1.0468)
}
