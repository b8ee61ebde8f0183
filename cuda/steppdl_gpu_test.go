//go:build cuda

package cuda

import (
	"math"
	"testing"
)

// TestStepPDL runs a decoder block's decode step (miniStep: the norms,
// rope_kv, the split attention and the residual add among its kernels)
// over 300 positions with programmatic dependent launch of the step's
// small kernels (runStep) and without, eagerly and replayed as graphs,
// and checks that each path's residual stream is bit for bit the same
// either way after every step: a twin that read its input before the
// kernel before it had written it, or wrote what that kernel still read,
// would change bits (the step's buffers start as NaNs). It also checks
// that the twins ran (pdlLaunches) only where they should. Each step
// starts from the same residual; the caches carry the positions.
func TestStepPDL(t *testing.T) {
	b := openGPU(t)
	if b.info.Major < 9 {
		t.Skipf("compute capability %d.%d: the PDL twins need 9.0", b.info.Major, b.info.Minor)
	}
	if !b.pdl {
		t.Skipf("%s turns programmatic dependent launch off", PDLEnv)
	}
	t.Cleanup(func() { b.pdl = true })
	dims := blockDims{d: 512, heads: 8, kvHeads: 2, headDim: 64, inter: 1408, maxPos: 320}
	r := newRand(t)
	weights := randomWeights(r)
	x0 := uniform(r, dims.d, -1, 1)
	const steps = 300
	for _, graphed := range []bool{false, true} {
		var runs [2]*miniStep // PDL off, on
		for i := range runs {
			runs[i] = newMiniStep(t, b, dims, x0, weights)
		}
		graphs := [2]interface {
			Replay() error
			Close() error
		}{}
		if graphed {
			for i, s := range runs {
				b.pdl = i == 1
				n0 := b.pdlLaunches.Load()
				g, err := b.Capture(func() error { return s.run(0, dims.maxPos-1) })
				if err != nil {
					t.Fatalf("capture (pdl %v): %v", b.pdl, err)
				}
				if n := b.pdlLaunches.Load() - n0; (n > 0) != b.pdl {
					t.Fatalf("capture, pdl %v: %d PDL launches", b.pdl, n)
				}
				defer g.Close()
				graphs[i] = g
			}
		}
		for p := range steps {
			var got [2][]float32
			for i, s := range runs {
				b.pdl = i == 1
				// Each step starts from x0, so that the residual stays
				// finite while the caches fill.
				if err := b.Upload(s.x, 0, f32Bytes(x0)); err != nil {
					t.Fatal(err)
				}
				n0 := b.pdlLaunches.Load()
				if graphed {
					s.setPos(t, p)
					if err := graphs[i].Replay(); err != nil {
						t.Fatalf("graph, pdl %v, position %d: %v", b.pdl, p, err)
					}
				} else if err := s.run(p, -1); err != nil {
					t.Fatalf("eager, pdl %v, position %d: %v", b.pdl, p, err)
				}
				if n := b.pdlLaunches.Load() - n0; !graphed && (n > 0) != b.pdl {
					t.Fatalf("eager, pdl %v, position %d: %d PDL launches", b.pdl, p, n)
				}
				got[i] = get(t, b, s.x)
			}
			for j := range got[0] {
				if math.Float32bits(got[0][j]) != math.Float32bits(got[1][j]) || math.IsNaN(float64(got[1][j])) {
					t.Fatalf("graph %v, position %d: residual[%d] is %v with PDL, %v without", graphed, p, j, got[1][j], got[0][j])
				}
			}
		}
	}
}
