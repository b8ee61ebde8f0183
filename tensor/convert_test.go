package tensor

import (
	"math"
	"math/rand/v2"
	"testing"
)

// f16Cases are float32 values around every rounding and range boundary of
// half precision: zeros, subnormals, the smallest normal, ties to even,
// the largest finite value and just past it, infinities and NaN.
var f16Cases = []float32{
	0, float32(math.Copysign(0, -1)), 1, -1, 0.1, 65504, -65504, 65519.99, 65520, 1e9, -1e9,
	6.1035156e-05, 5.9604645e-08, 2.9802322e-08, 2.98023259e-08, 1e-10,
	1 + 1.0/2048, 1 + 3.0/2048, 1 + 1.0/4096, 2049, 2051, 4097,
	float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()),
}

// checkF32ToF16 compares F32ToF16 with the portable conversion on v, at
// every length up to len(v) so that the assembly's 8- and 32-element steps
// and the Go tail all run. NaN must stay NaN; other values must match bit
// for bit.
func checkF32ToF16(t *testing.T, v []float32) {
	t.Helper()
	want := make([]uint16, len(v))
	f32ToF16Go(want, v)
	for n := range len(v) + 1 {
		got := make([]uint16, n)
		F32ToF16(got, v[:n])
		for i, h := range got {
			isNaN := func(h uint16) bool { return h&0x7c00 == 0x7c00 && h&0x3ff != 0 }
			if v[i] != v[i] {
				if !isNaN(h) {
					t.Fatalf("n=%d: NaN at %d became %#04x", n, i, h)
				}
				continue
			}
			if h != want[i] {
				t.Fatalf("n=%d: %g at %d: %#04x, the portable conversion gives %#04x", n, v[i], i, h, want[i])
			}
		}
	}
}

// TestF32ToF16 checks the conversion (F16C where the machine has it)
// against the portable one on the boundary cases and on random values of
// every magnitude.
func TestF32ToF16(t *testing.T) {
	if !hasAVX2 {
		t.Logf("no F16C here: F32ToF16 is the portable conversion")
	}
	checkF32ToF16(t, f16Cases)
	r := rand.New(rand.NewPCG(7, 7))
	v := make([]float32, 1000)
	for i := range v {
		v[i] = math.Float32frombits(r.Uint32())
	}
	checkF32ToF16(t, v)
}

func FuzzF32ToF16(f *testing.F) {
	f.Add(uint32(0x3f800001), uint32(0x477fefff), uint32(0x33800000))
	f.Fuzz(func(t *testing.T, a, b, c uint32) {
		v := make([]float32, 40)
		for i := range v {
			v[i] = math.Float32frombits([]uint32{a, b, c}[i%3] + uint32(i))
		}
		checkF32ToF16(t, v)
	})
}

func BenchmarkF32ToF16(b *testing.B) {
	src := make([]float32, 1<<20)
	for i := range src {
		src[i] = float32(i) * 1e-3
	}
	dst := make([]uint16, len(src))
	for b.Loop() {
		F32ToF16(dst, src)
	}
	b.ReportMetric(float64(len(src))*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
}
