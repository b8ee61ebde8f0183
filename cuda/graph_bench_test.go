//go:build cuda

package cuda

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// copyRate measures the device's copy rate (bytes read and written per
// second, a 1 GiB device-to-device copy), the ceiling the GEMVs' rates are
// judged against.
func copyRate(b *testing.B, be *Backend) float64 {
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
	best := 0.0
	for range 5 {
		t0 := time.Now()
		if err := be.CopyRows(dst, 0, src, 0, size/4); err != nil {
			b.Fatal(err)
		}
		if err := be.Sync(); err != nil {
			b.Fatal(err)
		}
		best = max(best, 2*size/time.Since(t0).Seconds())
	}
	return best
}

// BenchmarkGEMVShapes times the F16 and BF16 decode GEMV (M = 1) on the
// 7B and 8B models' shapes: N = K = 4096 (q, o; 32 MiB, the hard one),
// 11008×4096 and 4096×11008 (Llama-2-7B's MLP), 14336×4096 and 4096×14336
// (Llama-3-8B's MLP), and TinyLlama-1.1B's 2048×2048, 5632×2048 and
// 2048×5632 (8 to 23 MiB: one short wave of warps, where the decode of a
// small model spends its time); the fused gate-up GEMV (GateUpSiLU) on the
// MLP shapes against the two products and SiLUMul it replaces; and the
// q, k and v products of a block as one MatMulMany. Each iteration queues
// 8 products on rotating matrices (past the 60 MB L2) and syncs. The
// modes (gemvModes): "launch" launches each product from the host as eager
// decode does, with the default kernel for the shape (rowsPerWarp),
// "launch-m1", "launch-r1" and "launch-r2" with the m1, r1 and r2 kernels
// (kernels/gemv.cuh); "graph" replays the 8 captured as one graph, which
// shows the kernels back to back without the host's launch cost, and
// "graph-NAME" does so with kernel NAME: m1, r1, r2 or one of
// gemvVariants (kernels/gemv_split.cuh). It reports weight GB/s, us per
// product and the percentage of the device's copy rate measured at the
// start (the target is 85%). With -test.benchtime 200x the whole
// benchmark takes about a minute.
func BenchmarkGEMVShapes(b *testing.B) {
	be := openGPU(b)
	ceiling := copyRate(b, be)
	b.Logf("device copy rate %.0f GB/s", ceiling/1e9)
	const perIter = 8
	shapes := []struct{ n, k int }{{4096, 4096}, {11008, 4096}, {4096, 11008}, {14336, 4096}, {4096, 14336}, {2048, 2048}, {5632, 2048}, {2048, 5632}}
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16} {
		for _, s := range shapes {
			ws := weightSet(b, be, dt, (512<<20)/(2*s.n*s.k)+1, s.n, s.k)
			x, _ := put(b, be, tensor.F32, tensor.Shape{1, s.k}, uniform(newRand(b), s.k, -1, 1))
			out, _ := put(b, be, tensor.F32, tensor.Shape{1, s.n}, make([]float32, s.n))
			i := 0
			queue := func() error {
				for range perIter {
					if err := be.MatMul(out, x, ws[i%len(ws)], nil); err != nil {
						return err
					}
					i++
				}
				return nil
			}
			for _, mode := range gemvModes() {
				b.Run(fmt.Sprintf("%v/N%d_K%d/%s", dt, s.n, s.k, mode), func(b *testing.B) {
					setGEMVMode(b, be, mode)
					run := queue
					if strings.HasPrefix(mode, "graph") {
						g, err := be.Capture(queue)
						if err != nil {
							b.Fatal(err)
						}
						defer g.Close()
						run = g.Replay
					}
					for b.Loop() {
						if err := run(); err != nil {
							b.Fatal(err)
						}
						if err := be.Sync(); err != nil {
							b.Fatal(err)
						}
					}
					sec := b.Elapsed().Seconds() / float64(b.N*perIter)
					rate := float64(ws[0].NumBytes()) / sec
					b.ReportMetric(rate/1e9, "GB/s")
					b.ReportMetric(sec*1e6, "us/product")
					b.ReportMetric(100*rate/ceiling, "%copy")
				})
			}
			for _, w := range ws {
				be.Free(w)
			}
		}
	}
	fusedModes := []string{"false", "true"}
	for i := range gemvVariants {
		fusedModes = append(fusedModes, gemvVariants[i].name)
	}
	for _, s := range []struct{ n, k int }{{11008, 4096}, {14336, 4096}, {5632, 2048}} {
		for _, fm := range fusedModes {
			fused := fm != "false"
			b.Run(fmt.Sprintf("gate-up/F16/N%d_K%d/fused=%s", s.n, s.k, fm), func(b *testing.B) {
				if fm != "false" && fm != "true" {
					setGEMVMode(b, be, "graph-"+fm)
				}
				count := (512<<20)/(4*s.n*s.k) + 1
				gs, us := weightSet(b, be, tensor.F16, count, s.n, s.k), weightSet(b, be, tensor.F16, count, s.n, s.k)
				x, _ := put(b, be, tensor.F32, tensor.Shape{1, s.k}, uniform(newRand(b), s.k, -1, 1))
				out, _ := put(b, be, tensor.F32, tensor.Shape{1, s.n}, make([]float32, s.n))
				up, _ := put(b, be, tensor.F32, tensor.Shape{1, s.n}, make([]float32, s.n))
				k := tensor.Checked(be)
				i := 0
				l0 := be.Launches()
				for b.Loop() {
					for range perIter {
						g, u := gs[i%count], us[i%count]
						var err error
						if fused {
							err = tensor.GateUpSiLU(k, out, up, x, g, u)
						} else if err = k.MatMul(out, x, g, nil); err == nil {
							if err = k.MatMul(up, x, u, nil); err == nil {
								err = k.SiLUMul(out, out, up)
							}
						}
						if err != nil {
							b.Fatal(err)
						}
						i++
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N*perIter)
				rate := 2 * float64(gs[0].NumBytes()) / sec
				b.ReportMetric(rate/1e9, "GB/s")
				b.ReportMetric(sec*1e6, "us/pair")
				b.ReportMetric(100*rate/ceiling, "%copy")
				b.ReportMetric(float64(be.Launches().Sub(l0).Total())/float64(b.N*perIter), "launches/pair")
			})
		}
	}
}

// BenchmarkDecodeBlock times one decoder block's decode step (F16
// weights; position 1000) of the Llama-2-7B shape (404 MiB of weights)
// and the TinyLlama-1.1B shape (44 MiB) eagerly, launch by launch
// ("eager", with Open's GEMV kernels), and replayed as a captured graph
// with the per-shape GEMV kernels ("graph") and with each candidate
// ("graph-NAME", gemvModes; decode's default on the H200 is graph-s2p):
// us per block, the weight GB/s, its percentage of the copy rate measured
// at the start, and the launches per block. 32 blocks make a 7B token;
// the bound at 4.1 TB/s is about 100 us a block (7B), 11 us (1.1B).
func BenchmarkDecodeBlock(b *testing.B) {
	be := openGPU(b)
	ceiling := copyRate(b, be)
	b.Logf("device copy rate %.0f GB/s", ceiling/1e9)
	r := newRand(b)
	const pos = 1000
	for _, shape := range []struct {
		name string
		dims blockDims
	}{{"7B", llama7B}, {"1.1B", tinyLlama}} {
		s := newMiniStep(b, be, shape.dims, uniform(r, shape.dims.d, -1, 1), randomWeights(r))
		bytes := float64(0)
		for _, w := range []*tensor.Tensor{s.wq, s.wk, s.wv, s.wo, s.wg, s.wu, s.wd} {
			bytes += float64(w.NumBytes())
		}
		modes := []string{"eager"}
		for _, m := range gemvModes() {
			if strings.HasPrefix(m, "graph") {
				modes = append(modes, m)
			}
		}
		for _, mode := range modes {
			b.Run(shape.name+"/"+mode, func(b *testing.B) {
				setGEMVMode(b, be, mode)
				run := func() error { return s.run(pos, -1) }
				if mode != "eager" {
					g, err := be.Capture(func() error { return s.run(0, 2047) })
					if err != nil {
						b.Fatal(err)
					}
					defer g.Close()
					if err := be.SetPosition(s.pos, pos); err != nil {
						b.Fatal(err)
					}
					run = g.Replay
				}
				l0 := be.Launches()
				for b.Loop() {
					if err := run(); err != nil {
						b.Fatal(err)
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(sec*1e6, "us/block")
				b.ReportMetric(bytes/sec/1e9, "GB/s")
				b.ReportMetric(100*bytes/sec/ceiling, "%copy")
				b.ReportMetric(float64(be.Launches().Sub(l0).Total())/float64(b.N), "launches/block")
			})
		}
	}
}

// BenchmarkDecodeRun times the 22 blocks of a TinyLlama-1.1B decode step
// (F16, 970 MB of weights; position 1000) replayed as 22 graphs of a
// block each ("blocks", nn's graphs of streamed layers) and as one graph
// of all 22 ("run", nn's graph of resident layers), with the default GEMV
// kernels and, for the run, each candidate ("run-NAME"): us and launches
// per step, tok/s of the blocks alone (no embedding, head or sampling),
// weight GB/s and its percentage of the copy rate. The target is
// 1,000 tok/s for the whole step.
func BenchmarkDecodeRun(b *testing.B) {
	be := openGPU(b)
	ceiling := copyRate(b, be)
	b.Logf("device copy rate %.0f GB/s", ceiling/1e9)
	r := newRand(b)
	const layers, pos = 22, 1000
	x0 := uniform(r, tinyLlama.d, -1, 1)
	weights := randomWeights(r)
	steps := make([]*miniStep, layers)
	bytes := float64(0)
	for i := range steps {
		steps[i] = newMiniStep(b, be, tinyLlama, x0, weights)
		for _, w := range []*tensor.Tensor{steps[i].wq, steps[i].wk, steps[i].wv, steps[i].wo, steps[i].wg, steps[i].wu, steps[i].wd} {
			bytes += float64(w.NumBytes())
		}
	}
	modes := []string{"blocks", "run", "run-" + gemvShaped.name}
	for i := range gemvVariants {
		modes = append(modes, "run-"+gemvVariants[i].name)
	}
	for _, mode := range modes {
		b.Run(mode, func(b *testing.B) {
			if name, ok := strings.CutPrefix(mode, "run-"); ok {
				setGEMVMode(b, be, "graph-"+name)
			}
			var graphs []tensor.Graph
			capture := func(f func() error) {
				g, err := be.Capture(f)
				if err != nil {
					b.Fatal(err)
				}
				graphs = append(graphs, g)
			}
			if mode == "blocks" {
				for _, s := range steps {
					capture(func() error { return s.run(0, 2047) })
				}
			} else {
				capture(func() error {
					for _, s := range steps {
						if err := s.run(0, 2047); err != nil {
							return err
						}
					}
					return nil
				})
			}
			defer func() {
				for _, g := range graphs {
					g.Close()
				}
			}()
			for _, s := range steps {
				if err := be.SetPosition(s.pos, pos); err != nil {
					b.Fatal(err)
				}
			}
			l0 := be.Launches()
			for b.Loop() {
				for _, g := range graphs {
					if err := g.Replay(); err != nil {
						b.Fatal(err)
					}
				}
				if err := be.Sync(); err != nil {
					b.Fatal(err)
				}
			}
			sec := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(sec*1e6, "us/step")
			b.ReportMetric(1/sec, "tok/s")
			b.ReportMetric(bytes/sec/1e9, "GB/s")
			b.ReportMetric(100*bytes/sec/ceiling, "%copy")
			b.ReportMetric(float64(be.Launches().Sub(l0).Total())/float64(b.N), "launches/step")
		})
	}
}

// gemvModes are BenchmarkGEMVShapes's modes: the host-launched default and
// r1, r2 kernels, then every kernel replayed as a graph.
func gemvModes() []string {
	modes := []string{"launch", "launch-m1", "launch-r1", "launch-r2", "graph", "graph-m1", "graph-r1", "graph-r2", "graph-" + gemvShaped.name}
	for i := range gemvVariants {
		modes = append(modes, "graph-"+gemvVariants[i].name)
	}
	return modes
}

// setGEMVMode sets be's GEMV kernels for a mode of gemvModes until the
// benchmark ends, and then gives back those it had (Open's choice: on
// compute capability 9.0 and newer, defaultGEMV rather than the per-shape
// kernels of "graph").
func setGEMVMode(b *testing.B, be *Backend, mode string) {
	_, name, _ := strings.Cut(mode, "-")
	v, rows, err := gemvVariantNamed(name)
	if err != nil {
		b.Fatal(err)
	}
	prev, prevRows := be.gemvSplit, be.gemvRows
	be.gemvSplit, be.gemvRows = v, rows
	b.Cleanup(func() { be.gemvSplit, be.gemvRows = prev, prevRows })
}

// BenchmarkGEMVMany times a block's q, k and v products as one MatMulMany
// (F16, M = 1) on the 7B shape (3 × 4096 rows of 4096) and TinyLlama's
// (2048 + 256 + 256 rows of 2048), replayed as graphs of 8 with each
// kernel of gemvModes' graph modes; it reports weight GB/s, us per call
// and the percentage of the copy rate.
func BenchmarkGEMVMany(b *testing.B) {
	be := openGPU(b)
	ceiling := copyRate(b, be)
	b.Logf("device copy rate %.0f GB/s", ceiling/1e9)
	const perIter = 8
	for _, s := range []struct {
		name string
		n    [3]int
		k    int
	}{{"7B", [3]int{4096, 4096, 4096}, 4096}, {"1.1B", [3]int{2048, 256, 256}, 2048}} {
		bytes := 2 * (s.n[0] + s.n[1] + s.n[2]) * s.k
		count := (512<<20)/bytes + 1
		var sets [3][]*tensor.Tensor
		outs := make([]*tensor.Tensor, 3)
		for j := range 3 {
			sets[j] = weightSet(b, be, tensor.F16, count, s.n[j], s.k)
			outs[j], _ = put(b, be, tensor.F32, tensor.Shape{1, s.n[j]}, make([]float32, s.n[j]))
		}
		x, _ := put(b, be, tensor.F32, tensor.Shape{1, s.k}, uniform(newRand(b), s.k, -1, 1))
		for _, mode := range gemvModes() {
			if !strings.HasPrefix(mode, "graph") {
				continue
			}
			b.Run(fmt.Sprintf("%s/%s", s.name, mode), func(b *testing.B) {
				setGEMVMode(b, be, mode)
				i := 0
				g, err := be.Capture(func() error {
					for range perIter {
						ws := []*tensor.Tensor{sets[0][i%count], sets[1][i%count], sets[2][i%count]}
						if err := be.MatMulMany(outs, x, ws); err != nil {
							return err
						}
						i++
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
				defer g.Close()
				for b.Loop() {
					if err := g.Replay(); err != nil {
						b.Fatal(err)
					}
					if err := be.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds() / float64(b.N*perIter)
				rate := float64(bytes) / sec
				b.ReportMetric(rate/1e9, "GB/s")
				b.ReportMetric(sec*1e6, "us/call")
				b.ReportMetric(100*rate/ceiling, "%copy")
			})
		}
		for j := range 3 {
			for _, w := range sets[j] {
				be.Free(w)
			}
		}
	}
}
