package tensor_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// The decode product on the matrices of the 1.1B model (TinyLlama's shape:
// hidden 2048, MLP 5632), quantized and in F16, against the machine's read
// bandwidth measured in the same run. Each product streams its weights
// from memory as a decode step does: the benchmark cycles through enough
// copies of the matrix to pass streamBytes, more than the caches hold.
// GB/s counts the stored (quantized) weight bytes; bw is that over the
// read bandwidth of as many goroutines as the backend has threads.

const streamBytes = 256 << 20

// readBuf is the buffer the bandwidth measure reads: words that are not
// zero (a page of zeros could be shared).
var readBuf = sync.OnceValue(func() []uint64 {
	a := make([]uint64, streamBytes/8)
	for i := range a {
		a[i] = uint64(i)
	}
	return a
})

var sinkWords uint64

// readWith reads the whole buffer split among g goroutines, with four
// independent chains each to keep a core's loads ahead of memory, and
// returns the bytes read.
func readWith(g int) int {
	a := readBuf()
	var wg sync.WaitGroup
	sums := make([]uint64, g)
	for k := range g {
		wg.Go(func() {
			p := a[k*len(a)/g : (k+1)*len(a)/g]
			var s0, s1, s2, s3 uint64
			for i := 0; i+8 <= len(p); i += 8 {
				s0 += p[i] + p[i+4]
				s1 += p[i+1] + p[i+5]
				s2 += p[i+2] + p[i+6]
				s3 += p[i+3] + p[i+7]
			}
			sums[k] = s0 + s1 + s2 + s3
		})
	}
	wg.Wait()
	for _, s := range sums {
		sinkWords += s
	}
	return 8 * len(a)
}

// BenchmarkReadBandwidth reports the read bandwidth of one and two
// goroutines, the ceiling of a decode product.
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

// streamed returns copies of a random [n, k] weight matrix of dt, enough to
// pass streamBytes.
func streamed(b *testing.B, c *tensor.CPU, dt tensor.DType, n, k int) []*tensor.Tensor {
	r := rand.New(rand.NewPCG(uint64(n), uint64(k)))
	v := normals(r, n*k)
	var w *tensor.Tensor
	if dt.IsQuantized() {
		w = quantTensor(b, dt, tensor.Shape{n, k}, v)
	} else {
		w = tensor.New(dt, tensor.Shape{n, k})
		tensor.F32ToF16(w.U16(), v)
	}
	ws := []*tensor.Tensor{w}
	for int64(len(ws))*w.NumBytes() < streamBytes {
		u, _ := tensor.FromBytes(dt, w.Shape(), append([]byte(nil), w.Bytes()...))
		ws = append(ws, u)
	}
	return ws
}

// decodeShapes are the 1.1B model's matrices, [N, K]: the attention
// projections (q, o), gate and up, down.
var decodeShapes = []struct {
	name string
	n, k int
}{{"2048x2048", 2048, 2048}, {"5632x2048", 5632, 2048}, {"2048x5632", 2048, 5632}}

// BenchmarkMatMulDecode multiplies one row of activations with each of the
// 1.1B model's matrices in F16, Q8_0, Q4_K and Q6_K, on one and two threads.
// Other work on the machine changes the bandwidth from one moment to the
// next, so after each pass over the copies the timer stops and as many
// goroutines as the backend has threads read streamBytes: bw is the median
// over the passes of the product's rate over the read's just after it, the
// share of the bandwidth the product reached under the same conditions;
// best-GB/s is the fastest pass of the products and best-read the fastest
// read.
func BenchmarkMatMulDecode(b *testing.B) {
	for _, s := range decodeShapes {
		for _, dt := range []tensor.DType{tensor.F16, tensor.Q8_0, tensor.Q4_K, tensor.Q6_K} {
			var ws []*tensor.Tensor
			for _, threads := range []int{1, 2} {
				b.Run(fmt.Sprintf("%s/%v/threads=%d", s.name, dt, threads), func(b *testing.B) {
					c := tensor.NewCPU(threads)
					defer c.Close()
					if ws == nil {
						ws = streamed(b, c, dt, s.n, s.k)
					}
					r := rand.New(rand.NewPCG(1, 2))
					x, _ := tensor.FromF32(tensor.Shape{1, s.k}, normals(r, s.k))
					out := tensor.New(tensor.F32, tensor.Shape{1, s.n})
					pass := float64(len(ws)) * float64(ws[0].NumBytes())
					var best, bestRead float64
					var ratios []float64
					i, t0 := 0, time.Now()
					for b.Loop() {
						if err := c.MatMul(out, x, ws[i%len(ws)], nil); err != nil {
							b.Fatal(err)
						}
						if i++; i%len(ws) == 0 {
							rate := pass / time.Since(t0).Seconds() / 1e9
							b.StopTimer()
							t1 := time.Now()
							read := float64(readWith(threads)) / time.Since(t1).Seconds() / 1e9
							b.StartTimer()
							best, bestRead = max(best, rate), max(bestRead, read)
							ratios = append(ratios, rate/read)
							t0 = time.Now()
						}
					}
					b.ReportMetric(float64(ws[0].NumBytes())*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
					if len(ratios) > 0 {
						slices.Sort(ratios)
						b.ReportMetric(best, "best-GB/s")
						b.ReportMetric(bestRead, "best-read")
						b.ReportMetric(ratios[len(ratios)/2], "bw")
					}
				})
			}
		}
	}
}

// BenchmarkMatMulPrefill multiplies 16 and 128 rows of activations with
// the 1.1B model's gate projection: compute, not memory, bounds it. The
// quantized products of 16 rows run in integers, those of 128 on the gemm
// (quantGemmRows).
func BenchmarkMatMulPrefill(b *testing.B) {
	const n, k = 5632, 2048
	for _, c := range []struct {
		m  int
		dt tensor.DType
	}{{16, tensor.F16}, {16, tensor.Q8_0}, {16, tensor.Q4_K}, {128, tensor.F16}, {128, tensor.Q8_0}, {128, tensor.Q4_K}} {
		m, dt := c.m, c.dt
		for _, threads := range []int{1, 2} {
			b.Run(fmt.Sprintf("M%d_%dx%d/%v/threads=%d", m, n, k, dt, threads), func(b *testing.B) {
				c := tensor.NewCPU(threads)
				defer c.Close()
				r := rand.New(rand.NewPCG(3, 4))
				v := normals(r, n*k)
				var w *tensor.Tensor
				if dt.IsQuantized() {
					w = quantTensor(b, dt, tensor.Shape{n, k}, v)
				} else {
					w = tensor.New(dt, tensor.Shape{n, k})
					tensor.F32ToF16(w.U16(), v)
				}
				x, _ := tensor.FromF32(tensor.Shape{m, k}, normals(r, m*k))
				out := tensor.New(tensor.F32, tensor.Shape{m, n})
				for b.Loop() {
					if err := c.MatMul(out, x, w, nil); err != nil {
						b.Fatal(err)
					}
				}
				s := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(2*float64(m*n*k)/s/1e9, "GFLOP/s")
			})
		}
	}
}
