package quant

import (
	"fmt"
	"testing"
)

// The benchmarks work on one 4096 x 64 slab of weights (the quantized
// bytes fit in the L2 cache of most machines, so they measure the
// arithmetic, not memory). GB/s counts the quantized bytes read.

var benchTypes = []Type{F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K}

const benchN = 4096 * 64

func benchRow(b *testing.B, typ Type) ([]byte, []float32) {
	w := weights(benchN, 1)
	nb, _ := typ.Bytes(benchN)
	q := make([]byte, nb)
	if err := typ.Quantize(q, w); err != nil {
		b.Fatal(err)
	}
	return q, weights(benchN, 2)
}

func reportRate(b *testing.B, quantBytes int) {
	s := b.Elapsed().Seconds()
	b.ReportMetric(float64(quantBytes)*float64(b.N)/s/1e9, "GB/s")
	b.ReportMetric(float64(benchN)*4*float64(b.N)/s/1e9, "f32GB/s")
}

func BenchmarkDequantize(b *testing.B) {
	for _, typ := range benchTypes {
		b.Run(typ.String(), func(b *testing.B) {
			q, _ := benchRow(b, typ)
			dst := make([]float32, benchN)
			for b.Loop() {
				if err := typ.Dequantize(dst, q); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, len(q))
		})
	}
}

// BenchmarkDot is a 64-row matrix-vector product: 64 dot products of
// 4096-element rows with one F32 vector.
func BenchmarkDot(b *testing.B) {
	for _, typ := range benchTypes {
		b.Run(typ.String(), func(b *testing.B) {
			q, x := benchRow(b, typ)
			rowBytes := len(q) / (benchN / 4096)
			x = x[:4096]
			var sink float32
			for b.Loop() {
				for r := range benchN / 4096 {
					s, err := typ.DotF32(q[r*rowBytes:(r+1)*rowBytes], x)
					if err != nil {
						b.Fatal(err)
					}
					sink += s
				}
			}
			_ = sink
			reportRate(b, len(q))
		})
	}
}

func BenchmarkQuantize(b *testing.B) {
	for _, typ := range []Type{Q8_0, Q4_K, Q6_K} {
		b.Run(typ.String(), func(b *testing.B) {
			w := weights(benchN, 1)
			nb, _ := typ.Bytes(benchN)
			q := make([]byte, nb)
			for b.Loop() {
				if err := typ.Quantize(q, w); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(benchN)*float64(b.N)/b.Elapsed().Seconds()/1e6, "Melem/s")
		})
	}
}

func ExampleType_Quantize() {
	x := make([]float32, 256)
	for i := range x {
		x[i] = float32(i%16) - 7.5
	}
	q := make([]byte, 144)
	if err := Q4_K.Quantize(q, x); err != nil {
		fmt.Println(err)
		return
	}
	y := make([]float32, 256)
	if err := Q4_K.Dequantize(y, q); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d bytes for %d values; %.4f -> %.4f\n", len(q), len(x), x[3], y[3])
	// Output: 144 bytes for 256 values; -4.5000 -> -4.4989
}
