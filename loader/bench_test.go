package loader

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// bench1GB is a Llama shape of about 1 GB in F16 (483M parameters): the
// TinyLlama block shape with 8 layers.
func bench1GB() *Config {
	c, _ := Preset("tinyllama-1.1b")
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
				cfg, _ = Preset("100m")
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
