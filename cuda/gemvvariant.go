package cuda

import (
	"fmt"
	"strings"
)

// GEMVEnv names the environment variable that picks the M = 1 GEMV
// kernels of F16 and BF16 weights when a backend opens, so that a whole
// decode can be timed with each candidate: "" for the default (per
// shape: gemv_*_r1 or gemv_*_m1 for MatMul, gemv_many_*,
// gemv_gate_up_*_m1), "m1", "r1" or "r2" for that MatMul kernel on every
// shape, the name of one of gemvVariants, or "auto" for the PDL variant
// each product's shape reads fastest with (the default on compute
// capability 9.0).
const GEMVEnv = "STRATA_CUDA_GEMV"

// gemvVariant is a candidate M = 1 GEMV of kernels/gemv_split.cuh for F16
// and BF16 weights: the MatMul and MatMulMany kernel with r rows per warp,
// u loads in flight per row and lane and s warps per row, and the
// GateUpSiLU kernel with gu loads per matrix and gs warps per row.
type gemvVariant struct {
	name    string
	r, u, s int
	gu, gs  int
	// pdl: the _pdl kernels of kernels/gemv_pdl_*.cu (compute capability
	// 9.0), launched with programmatic dependent launch: the first loads
	// of weights overlap the kernel before.
	pdl bool
	// shaped marks gemvShaped, which names no kernels of its own: each
	// product runs on the PDL variant forShape picks for its shape.
	shaped bool
}

// gemvVariants are the instantiations of GEMV_SPLIT_ALL in
// kernels/gemv_split.cuh; keep the two lists together.
var gemvVariants = []gemvVariant{
	{name: "b8", r: 1, u: 8, s: 1, gu: 4, gs: 1},   // gemv_rows r1 for every caller: the products of m1, bit for bit
	{name: "b16", r: 1, u: 16, s: 1, gu: 8, gs: 1}, // twice the loads in flight: a 4096-wide F16 row in one batch
	{name: "r2b8", r: 2, u: 8, s: 1, gu: 8, gs: 1}, // two rows per warp, 16 loads in flight
	{name: "s2", r: 1, u: 8, s: 2, gu: 4, gs: 2},   // two warps per row
	{name: "s4", r: 1, u: 4, s: 4, gu: 2, gs: 4},   // four warps per row
	{name: "b8p", r: 1, u: 8, s: 1, gu: 4, gs: 1, pdl: true},
	{name: "s2p", r: 1, u: 8, s: 2, gu: 4, gs: 2, pdl: true},
	{name: "s4p", r: 1, u: 4, s: 4, gu: 2, gs: 4, pdl: true},
}

// gemvSplitThreads is GEMV_SPLIT_THREADS, the block of the split kernels.
const gemvSplitThreads = 256

func (v *gemvVariant) kernel(sfx string) string {
	return fmt.Sprintf("gemv_split_%s%s_r%du%ds%d", v.pdlPrefix(), sfx, v.r, v.u, v.s)
}

func (v *gemvVariant) gateUpKernel(sfx string) string {
	return fmt.Sprintf("gemv_gate_up_split_%s%s_u%ds%d", v.pdlPrefix(), sfx, v.gu, v.gs)
}

func (v *gemvVariant) pdlPrefix() string {
	if v.pdl {
		return "pdl_"
	}
	return ""
}

// grid is the blocks of the MatMul kernel over rows rows.
func (v *gemvVariant) grid(rows int) [3]uint32 {
	per := gemvSplitThreads / 32 / v.s * v.r
	return [3]uint32{uint32((rows + per - 1) / per), 1, 1}
}

// gateUpGrid is the blocks of the gate-up kernel over n rows.
func (v *gemvVariant) gateUpGrid(n int) [3]uint32 {
	per := gemvSplitThreads / 32 / v.gs
	return [3]uint32{uint32((n + per - 1) / per), 1, 1}
}

// gemvShaped ("auto") runs each M = 1 product on the PDL variant its
// shape reads fastest with (forShape).
var gemvShaped = &gemvVariant{name: "auto", pdl: true, shaped: true}

// forShape is the variant an n x k product (n rows of k) runs on: v, or
// for gemvShaped the PDL variant that BenchmarkGEMVShapes timed fastest on
// such shapes on the H200 (session 4; us a product, b8p / s2p / s4p):
// rows of at most 2048 take b8p, a warp a row (N2048 K2048 4.23 / 5.46 /
// 5.54, N5632 K2048 8.18 / 8.96 / 11.44); rows of 2.5 times as many
// elements as there are rows or more, s4p (N4096 K11008 26.20 / 26.03 /
// 24.53, N2048 K5632 9.44 / 10.17 / 8.04, N4096 K14336 32.75 / 31.96 /
// 30.16); the rest s2p (N11008 K4096 25.78 / 22.61 / 26.07, N14336 K4096
// 31.93 / 28.55 / 33.33, N4096 K4096 10.77 / 10.69 / 10.70).
func (v *gemvVariant) forShape(n, k int) *gemvVariant {
	if !v.shaped {
		return v
	}
	switch {
	case k <= 2048:
		return gemvPDL[0]
	case 2*k >= 5*n:
		return gemvPDL[2]
	}
	return gemvPDL[1]
}

// gemvPDL are the PDL variants forShape picks from: b8p, s2p, s4p.
var gemvPDL = func() [3]*gemvVariant {
	var out [3]*gemvVariant
	for i, name := range []string{"b8p", "s2p", "s4p"} {
		for j := range gemvVariants {
			if gemvVariants[j].name == name {
				out[i] = &gemvVariants[j]
			}
		}
	}
	return out
}()

// defaultGEMV is the variant M = 1 products of F16 and BF16 weights run
// on when GEMVEnv is empty, on devices of compute capability 9.0 or newer
// (they launch with programmatic dependent launch): each product's by its
// shape (forShape). s2p for every shape decoded TinyLlama-1.1B at 828.7
// tok/s where the per-shape kernels made 768.1, and the 7B shape 3%
// faster (cuda/PERF.md). Older devices, and GEMVEnv=shape, keep the
// per-shape kernels.
const defaultGEMV = "auto"

// gemvVariantNamed returns the variant called name, or nil for the
// per-shape kernels ("" and "shape"; Open picks defaultGEMV for "");
// rows is the gemvRows of "m1", "r1" and "r2".
func gemvVariantNamed(name string) (v *gemvVariant, rows int, err error) {
	switch name {
	case "", "shape":
		return nil, 0, nil
	case "m1":
		return nil, -1, nil
	case "r1":
		return nil, 1, nil
	case "r2":
		return nil, 2, nil
	}
	if name == gemvShaped.name {
		return gemvShaped, 0, nil
	}
	names := []string{"m1", "r1", "r2", "shape"}
	for i := range gemvVariants {
		if gemvVariants[i].name == name {
			return &gemvVariants[i], 0, nil
		}
		names = append(names, gemvVariants[i].name)
	}
	names = append(names, gemvShaped.name)
	return nil, 0, fmt.Errorf("cuda: %s=%q names no GEMV kernel (have %s)", GEMVEnv, name, strings.Join(names, ", "))
}
