//go:build amd64 && !purego

package quant

import (
	"bytes"
	"math"
	"math/rand/v2"
	"testing"
)

// TestActAVX2MatchesGo: the AVX2 kernels of the activations'
// quantization give the Go loops' bits: the largest magnitude's bits
// (with NaNs and infinities among the values), the rounded quants and
// their sums by groups of 32,
// over random blocks at many scales, exact halves (ties to even), signed
// zeros, subnormals and the extremes ±ActMax.
func TestActAVX2MatchesGo(t *testing.T) {
	if !hasAVX2 {
		t.Skip("no AVX2 on this processor: the Go loops run")
	}
	rng := rand.New(rand.NewPCG(5, 6))
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-45, -1e-45, 1.1754942e-38, 0.5, -0.5, 1.5, -2.5, 3.5}
	for trial := range 2000 {
		n := 16 * (1 + rng.IntN(16))
		x := make([]float32, n)
		scale := math.Pow(10, float64(rng.IntN(40)-20))
		for j := range x {
			switch rng.IntN(8) {
			case 0:
				x[j] = special[rng.IntN(len(special))]
			case 1:
				x[j] = float32(rng.IntN(64)) + 0.5 // a half: ties go to even
			default:
				x[j] = float32(rng.NormFloat64() * scale)
			}
		}
		if trial%50 == 0 {
			x[rng.IntN(n)] = [...]float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))}[trial/50%3]
		}
		if got, want := maxAbsBits(x), maxAbsBitsGo(x); got != want {
			t.Fatalf("trial %d: largest magnitude's bits %#x, want %#x", trial, got, want)
		}
		mbits := maxAbsBitsGo(x)
		if mbits >= 0x7f800000 || mbits == 0 {
			continue
		}
		amax := math.Float32frombits(mbits)
		if amax < tinyAmax {
			continue
		}
		for _, id := range []float32{ActMax / amax, 1, 0.5} { // the quantizer's scale, and plain rounding
			if id != ActMax/amax && amax*id > ActMax {
				continue
			}
			got, want := make([]byte, 2*n), make([]byte, 2*n)
			roundAct(got, x, id)
			roundActGo(want, x, id)
			gs, ws := make([]byte, n/8), make([]byte, n/8)
			groupSums(gs, want)
			groupSumsGo(ws, want)
			if !bytes.Equal(gs, ws) {
				t.Fatalf("trial %d: the sums by groups of 32 differ from the Go loop's", trial)
			}
			if !bytes.Equal(got, want) {
				for j := range n {
					if got[2*j] != want[2*j] || got[2*j+1] != want[2*j+1] {
						t.Fatalf("trial %d: x[%d] = %v times %v: quant %d, want %d", trial, j, x[j], id, int16(le16(got[2*j:])), int16(le16(want[2*j:])))
					}
				}
			}
		}
	}
}
