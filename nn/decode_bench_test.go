package nn_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/tensor"
)

// The TinyLlama-1.1B benchmarks (hidden 2048, 22 layers, 32 heads, 4 KV
// heads, intermediate 5632, vocab 32000) run on the CPU backend with random
// weights written by the synthesiser. They need STRATA_BENCH_LARGE=1 (the
// F16 model is 2.2 GB, the F32 one 4.4 GB, held on disk and in memory);
// STRATA_BENCH_DIR, if set, keeps the synthesised models there between runs
// (and between BenchmarkDecode and BenchmarkPrefill) instead of in a
// temporary directory of each benchmark. make bench-cpu sets both.
const (
	benchLargeEnv = "STRATA_BENCH_LARGE"
	benchDirEnv   = "STRATA_BENCH_DIR"
	benchPreset   = "tinyllama-1.1b"
	benchSeed     = 11
	// benchPrompt is the prompt before the timed decode steps; benchPrefill
	// the prompt length of the prefill benchmark.
	benchPrompt  = 8
	benchPrefill = 128
	benchMaxPos  = 1024
)

// benchModels are the synthesised models of one top-level benchmark, one
// directory per dtype: under STRATA_BENCH_DIR (kept, and reused by later
// runs) or in the benchmark's temporary directory (removed when it ends).
type benchModels struct {
	parent *testing.B
	mu     sync.Mutex
	dirs   map[tensor.DType]string
}

// dir returns the directory of the synthesised TinyLlama model in dtype
// dt, writing it on first use, or skips b when the large benchmarks are
// not enabled.
func (ms *benchModels) dir(b *testing.B, dt tensor.DType) string {
	b.Helper()
	if os.Getenv(benchLargeEnv) != "1" {
		b.Skipf("the %s benchmarks synthesise and load a model of several GB: set %s=1 (make bench-cpu does)", benchPreset, benchLargeEnv)
	}
	if testing.Short() {
		b.Skipf("the %s benchmarks are long: not run with -short", benchPreset)
	}
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if dir, ok := ms.dirs[dt]; ok {
		return dir
	}
	parent := os.Getenv(benchDirEnv)
	if parent == "" {
		parent = ms.parent.TempDir()
	}
	dir := filepath.Join(parent, fmt.Sprintf("%s-%v-seed%d", benchPreset, dt, benchSeed))
	done := filepath.Join(dir, ".complete")
	if _, err := os.Stat(done); err != nil {
		cfg, err := arch.Preset(benchPreset)
		if err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		opts := loader.SynthOptions{DType: dt, Seed: benchSeed, MaxShardBytes: 1 << 30}
		if err := loader.Synthesize(context.Background(), dir, cfg, opts); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(done, nil, 0o644); err != nil {
			b.Fatal(err)
		}
		b.Logf("synthesised %s %v in %v", benchPreset, dt, time.Since(start).Round(time.Millisecond))
	}
	if ms.dirs == nil {
		ms.dirs = map[tensor.DType]string{}
	}
	ms.dirs[dt] = dir
	return dir
}

// benchSetup is a loaded model on a CPU backend.
type benchSetup struct {
	cpu     *tensor.CPU
	weights *nn.HostWeights
	model   *nn.Model
	cfg     *arch.Config
	// tokenBytes is the weight bytes one decode step reads: everything
	// but the embedding table, of which it reads one row.
	tokenBytes int64
}

func loadBench(b *testing.B, ms *benchModels, dt tensor.DType, threads int) *benchSetup {
	b.Helper()
	dir := ms.dir(b, dt)
	lm, err := loader.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	cpu := tensor.NewCPU(threads)
	hw, err := nn.LoadWeights(context.Background(), lm, cpu, nil)
	if err != nil {
		cpu.Close()
		b.Fatal(err)
	}
	m, err := nn.New(cfg, cpu, nil, hw)
	if err != nil {
		b.Fatal(err)
	}
	s := &benchSetup{cpu: cpu, weights: hw, model: m, cfg: cfg, tokenBytes: lm.WeightBytes()}
	if emb, ok := lm.Tensor(arch.EmbedName); ok && !cfg.TieEmbeddings {
		s.tokenBytes -= emb.Size - emb.Size/int64(cfg.VocabSize)
	}
	b.Cleanup(func() {
		hw.Close()
		cpu.Close()
		runtime.GC()
		debug.FreeOSMemory() // before the next sub-benchmark loads its model
	})
	return s
}

func benchCases(b *testing.B, run func(b *testing.B, ms *benchModels, dt tensor.DType, threads int)) {
	ms := &benchModels{parent: b}
	for _, dt := range []tensor.DType{tensor.F16, tensor.F32} {
		for _, threads := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/%v/threads=%d", benchPreset, dt, threads), func(b *testing.B) {
				run(b, ms, dt, threads)
			})
		}
	}
}

// benchIDs returns n token ids spread over the vocabulary.
func benchIDs(n, vocab int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32((i*7919 + 1) % vocab)
	}
	return ids
}

// BenchmarkDecode measures one decode step (one token through every layer
// and the LM head, greedy choice of the next) after an 8-token prompt, on
// 1 and 2 threads, F16 and F32 weights. It reports tokens per second, the
// weight bytes read per second at that rate, and allocations per step.
func BenchmarkDecode(b *testing.B) {
	benchCases(b, func(b *testing.B, ms *benchModels, dt tensor.DType, threads int) {
		s := loadBench(b, ms, dt, threads)
		sess, err := s.model.NewSession(benchMaxPos, benchPrompt)
		if err != nil {
			b.Fatal(err)
		}
		defer sess.Close()
		ctx := context.Background()
		prompt := benchIDs(benchPrompt, s.cfg.VocabSize)
		next := []int32{0}
		start := func() {
			sess.Reset()
			logits, err := sess.Forward(ctx, prompt, false, nil)
			if err != nil {
				b.Fatal(err)
			}
			next[0] = int32(nn.Argmax(logits))
		}
		start()
		b.Logf("kernels %s, %d threads", s.cpu.Kernels(), s.cpu.Threads())
		b.ReportAllocs()
		for b.Loop() {
			if sess.Pos() == sess.MaxPos() {
				b.StopTimer()
				start()
				b.StartTimer()
			}
			logits, err := sess.Forward(ctx, next, false, nil)
			if err != nil {
				b.Fatal(err)
			}
			next[0] = int32(nn.Argmax(logits))
		}
		sec := b.Elapsed().Seconds() / float64(b.N)
		b.ReportMetric(1/sec, "tok/s")
		b.ReportMetric(float64(s.tokenBytes)/sec/1e9, "GB/s")
	})
}

// BenchmarkPrefill measures a 128-token prompt in one chunk, on 1 and 2
// threads, F16 and F32 weights, in tokens per second and the arithmetic
// rate of the decoder blocks' matrix products (2 flops per weight per token;
// the LM head runs for the last token only).
func BenchmarkPrefill(b *testing.B) {
	benchCases(b, func(b *testing.B, ms *benchModels, dt tensor.DType, threads int) {
		s := loadBench(b, ms, dt, threads)
		sess, err := s.model.NewSession(benchMaxPos, benchPrefill)
		if err != nil {
			b.Fatal(err)
		}
		defer sess.Close()
		ctx := context.Background()
		prompt := benchIDs(benchPrefill, s.cfg.VocabSize)
		b.Logf("kernels %s, %d threads", s.cpu.Kernels(), s.cpu.Threads())
		b.ReportAllocs()
		for b.Loop() {
			sess.Reset()
			if _, err := sess.Forward(ctx, prompt, false, nil); err != nil {
				b.Fatal(err)
			}
		}
		sec := b.Elapsed().Seconds() / float64(b.N)
		b.ReportMetric(benchPrefill/sec, "tok/s")
		c := s.cfg
		perBlock := c.HiddenSize*(2*c.QDim()+2*c.KVDim()) + 3*c.HiddenSize*c.IntermediateSize
		flops := 2 * float64(c.NumLayers*perBlock) * benchPrefill
		b.ReportMetric(flops/sec/1e9, "GFLOP/s")
	})
}
