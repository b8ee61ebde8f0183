package loader

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

// bench1GB is a Llama shape of about 1 GB in F16 (483M parameters): the
// TinyLlama block shape with 8 layers.
func bench1GB() *arch.Config {
	c, _ := arch.Preset("tinyllama-1.1b")
	c.NumLayers = 8
	return c
}

// BenchmarkOpen opens a synthesised ~1 GB model in 5 shards: config,
// headers, validation, grouping.
func BenchmarkOpen(b *testing.B) {
	dir := b.TempDir()
	cfg := bench1GB()
	if err := Synthesize(context.Background(), dir, cfg, SynthOptions{Seed: 1, MaxShardBytes: 200e6}); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	n := 0
	for b.Loop() {
		m, err := Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		m.Close()
		n++
	}
	b.ReportMetric(float64(time.Since(start).Microseconds())/1e3/float64(n), "ms/open")
	b.ReportMetric(float64(cfg.NumParams()*2)/1e9, "GB-model")
}

// BenchmarkSynthesize writes the ~1 GB model (or the 100m preset with
// -short) in 200 MB shards and reports the write speed, page cache
// included.
func BenchmarkSynthesize(b *testing.B) {
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16, tensor.F32} {
		b.Run(dt.String(), func(b *testing.B) {
			cfg := bench1GB()
			if testing.Short() {
				cfg, _ = arch.Preset("100m")
			}
			dir := b.TempDir()
			bytes := cfg.NumParams() * int64(dt.Size())
			var elapsed time.Duration
			n := 0
			for b.Loop() {
				start := time.Now()
				if err := Synthesize(context.Background(), dir, cfg, SynthOptions{Seed: int64(n), DType: dt, MaxShardBytes: 200e6}); err != nil {
					b.Fatal(err)
				}
				elapsed += time.Since(start)
				n++
			}
			b.ReportMetric(float64(bytes)*float64(n)/1e6/elapsed.Seconds(), "MB/s")
			b.ReportMetric(float64(bytes)/1e9, "GB")
			files, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
			for _, f := range files {
				os.Remove(f)
			}
		})
	}
}

// BenchmarkFill measures weight generation alone, one goroutine.
func BenchmarkFill(b *testing.B) {
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16, tensor.F32} {
		b.Run(dt.String(), func(b *testing.B) {
			buf := make([]byte, 4<<20)
			g := &uniformGen{tab: newLevelTable(dt, 0, 0.02), key: 12345}
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				g.fill(buf, 0)
			}
		})
	}
}

// BenchmarkReadChecked reads a 256 MiB weight (in the page cache after the
// first read) as File.ReadInto does, without the check, as Model.ReadInto
// does, with the check of each piece for NaN and infinities, and runs the
// check alone over the bytes read, for each float dtype. One goroutine;
// the figures are GB/s of tensor bytes.
func BenchmarkReadChecked(b *testing.B) {
	const size = 256 << 20
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16, tensor.F32} {
		data := make([]byte, size)
		g := &uniformGen{tab: newLevelTable(dt, 0, 0.02), key: 7}
		g.fill(data, 0)
		path := filepath.Join(b.TempDir(), "w.safetensors")
		writeRaw(b, path, map[string]any{"w": entry(dt.String(), []int{size / dt.Size()}, 0, size)}, data, -1)
		f, err := OpenSafetensors(path)
		if err != nil {
			b.Fatal(err)
		}
		ti, _ := f.Tensor("w")
		ctx := context.Background()
		gbps := func(b *testing.B) {
			b.ReportMetric(float64(size)*float64(b.N)/1e9/b.Elapsed().Seconds(), "GB/s")
		}
		b.Run(dt.String()+"/read", func(b *testing.B) {
			for b.Loop() {
				if err := f.readInto(ctx, ti, data, false); err != nil {
					b.Fatal(err)
				}
			}
			gbps(b)
		})
		b.Run(dt.String()+"/read+check", func(b *testing.B) {
			for b.Loop() {
				if err := f.readInto(ctx, ti, data, true); err != nil {
					b.Fatal(err)
				}
			}
			gbps(b)
		})
		b.Run(dt.String()+"/check", func(b *testing.B) {
			for b.Loop() {
				if tensor.FirstNonFinite(dt, data) >= 0 {
					b.Fatal("finite weights flagged")
				}
			}
			gbps(b)
		})
		f.Close()
	}
}

// BenchmarkReadMapped reads a 512 MiB tensor from the page cache in 16
// MiB pieces on 1 to GOMAXPROCS goroutines, through the file's mapping (the
// default) and through pread (STRATA_MMAP=0), in GB/s: the staging ring's
// reads under the aggressive strategy.
func BenchmarkReadMapped(b *testing.B) {
	const size, piece = 512 << 20, 16 << 20
	data := make([]byte, size)
	g := &uniformGen{tab: newLevelTable(tensor.F16, 0, 0.02), key: 7}
	g.fill(data, 0)
	path := filepath.Join(b.TempDir(), "w.safetensors")
	writeRaw(b, path, map[string]any{"w": entry("F16", []int{size / 2}, 0, size)}, data, -1)
	ctx := context.Background()
	for _, how := range []string{"mmap", "pread"} {
		if how == "pread" {
			b.Setenv(MmapEnv, "0")
		}
		f, err := OpenSafetensors(path)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if _, mapped := f.r.(*mappedFile); mapped != (how == "mmap") {
			b.Fatalf("%s: mapped %v", how, mapped)
		}
		ti, _ := f.Tensor("w")
		grs := []int{1, 2, 4, 8, 16, runtime.GOMAXPROCS(0)}
		slices.Sort(grs)
		for _, gr := range slices.Compact(grs) {
			if gr > runtime.GOMAXPROCS(0) {
				continue
			}
			b.Run(fmt.Sprintf("%s/g=%d", how, gr), func(b *testing.B) {
				for b.Loop() {
					var next atomic.Int64
					var wg sync.WaitGroup
					for i := range gr {
						wg.Add(1)
						go func() {
							defer wg.Done()
							own := data[i*piece : (i+1)*piece]
							for {
								off := next.Add(piece) - piece
								if off >= size {
									return
								}
								if err := f.ReadRange(ctx, ti, off, own); err != nil {
									b.Error(err)
									return
								}
							}
						}()
					}
					wg.Wait()
				}
				b.ReportMetric(float64(size)*float64(b.N)/1e9/b.Elapsed().Seconds(), "GB/s")
			})
		}
	}
}
