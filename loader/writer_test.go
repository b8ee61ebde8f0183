package loader

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

func TestWriteSafetensorsRoundTrip(t *testing.T) {
	f32, _ := tensor.FromF32(tensor.Shape{2, 3}, []float32{1, -2, 3.5, 0, float32(math.Inf(1)), 1e-30})
	f16 := tensor.New(tensor.F16, tensor.Shape{5})
	for i, v := range []float32{0.5, -1, 2, 65504, 1e-7} {
		f16.U16()[i] = tensor.F16FromF32(v)
	}
	bf16 := tensor.New(tensor.BF16, tensor.Shape{1, 1, 3})
	tensor.F32ToBF16(bf16.U16(), []float32{3, -4, 1e30})
	i32 := tensor.New(tensor.I32, tensor.Shape{3})
	copy(i32.I32(), []int32{7, -8, 1 << 30})
	i64 := tensor.New(tensor.I64, tensor.Shape{})
	i64.I64()[0] = -1 << 40
	empty := tensor.New(tensor.F32, tensor.Shape{0, 4})
	in := []NamedTensor{{"w.f32", f32}, {"w.f16", f16}, {"empty", empty}, {"w.bf16", bf16}, {"ids", i32}, {"scalar", i64}}
	path := filepath.Join(t.TempDir(), "x.safetensors")
	meta := map[string]string{"format": "pt", "note": "round trip"}
	if err := WriteSafetensors(path, in, meta); err != nil {
		t.Fatal(err)
	}
	// The data starts 8-byte aligned and the header parses as plain JSON.
	raw := readRaw(t, path)
	st, _ := os.Stat(path)
	if (st.Size()-int64(len(raw.data)))%8 != 0 {
		t.Errorf("data starts at %d, not a multiple of 8", st.Size()-int64(len(raw.data)))
	}
	f, err := OpenSafetensors(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !reflect.DeepEqual(f.Metadata, meta) {
		t.Errorf("metadata %v, want %v", f.Metadata, meta)
	}
	if len(f.Tensors()) != len(in) {
		t.Errorf("%d tensors, want %d", len(f.Tensors()), len(in))
	}
	for _, nt := range in {
		got, err := f.ReadTensor(context.Background(), nt.Name)
		if err != nil {
			t.Fatal(err)
		}
		if got.DType() != nt.T.DType() || !got.Shape().Equal(nt.T.Shape()) || !bytes.Equal(got.Bytes(), nt.T.Bytes()) {
			t.Errorf("%s: got %v, want %v", nt.Name, got, nt.T)
		}
		if !bytes.Equal(raw.tensorBytes(t, nt.Name), nt.T.Bytes()) {
			t.Errorf("%s: bytes in the file differ", nt.Name)
		}
	}
	// Errors: duplicate names, device tensors.
	if err := WriteSafetensors(path, []NamedTensor{{"a", f32}, {"a", f32}}, nil); err == nil {
		t.Error("duplicate names accepted")
	}
	if err := WriteSafetensors(path, []NamedTensor{{"d", tensor.NewDevice(tensor.F32, tensor.Shape{4}, 0x1000)}}, nil); err == nil {
		t.Error("device tensor accepted")
	}
}

// TestShardedWriterRoundTrip copies the F16 fixture through the sharded
// writer with several shard sizes and checks the index and every byte.
func TestShardedWriterRoundTrip(t *testing.T) {
	ctx := context.Background()
	src := openFixture(t, fixtures.TinyLlamaF16Sharded)
	cfgJSON, err := os.ReadFile(filepath.Join(src.Dir, ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		maxShard   int64
		wantShards int
	}{
		{0, 1},
		{1 << 30, 1},
		{100_000, 6},
		{1, 39}, // one tensor per shard
	} {
		dir := t.TempDir()
		w := NewShardedWriter(dir, tc.maxShard)
		w.Workers = 3
		var want []string
		for _, l := range src.Layers() {
			for _, ti := range l.Tensors {
				ti := ti
				if err := w.Add(ti.Name, ti.DType, ti.Shape, func(dst []byte, off int64) error {
					return src.ReadRange(ctx, ti, off, dst)
				}); err != nil {
					t.Fatal(err)
				}
				want = append(want, ti.Name)
			}
		}
		res, err := w.Write(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Files) != tc.wantShards || res.DataBytes != src.WeightBytes() {
			t.Errorf("max %d: %d files, %d bytes; want %d files, %d bytes", tc.maxShard, len(res.Files), res.DataBytes, tc.wantShards, src.WeightBytes())
		}
		if err := os.WriteFile(filepath.Join(dir, ConfigFile), cfgJSON, 0o644); err != nil {
			t.Fatal(err)
		}
		if tc.wantShards > 1 {
			var idx struct {
				Metadata  map[string]int64  `json:"metadata"`
				WeightMap map[string]string `json:"weight_map"`
			}
			data, err := os.ReadFile(filepath.Join(dir, IndexFile))
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(data, &idx); err != nil {
				t.Fatal(err)
			}
			if idx.Metadata["total_size"] != src.WeightBytes() || len(idx.WeightMap) != len(want) {
				t.Errorf("index: total_size %d, %d entries", idx.Metadata["total_size"], len(idx.WeightMap))
			}
			if idx.WeightMap[want[0]] != "model-00001-of-"+pad5(tc.wantShards)+".safetensors" {
				t.Errorf("first tensor in %s", idx.WeightMap[want[0]])
			}
			var total int64
			for _, f := range res.Files {
				st, err := os.Stat(filepath.Join(dir, f))
				if err != nil {
					t.Fatal(err)
				}
				total += st.Size()
				if tc.maxShard > 1 && len(readRaw(t, filepath.Join(dir, f)).data) > int(tc.maxShard) {
					t.Errorf("%s holds more than %d bytes of data", f, tc.maxShard)
				}
			}
			if total != res.TotalBytes {
				t.Errorf("files hold %d bytes, Write says %d", total, res.TotalBytes)
			}
		} else if _, err := os.Stat(filepath.Join(dir, IndexFile)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("index written for a single file: %v", err)
		}
		m, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Files()) != tc.wantShards {
			t.Errorf("Open found %d files", len(m.Files()))
		}
		for _, name := range want {
			a, err := src.ReadTensor(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			b, err := m.ReadTensor(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a.Bytes(), b.Bytes()) {
				t.Errorf("max %d: %s differs after the round trip", tc.maxShard, name)
			}
		}
		m.Close()
		leftovers, _ := filepath.Glob(filepath.Join(dir, "*.tmp"))
		if len(leftovers) > 0 {
			t.Errorf("temporary files left: %v", leftovers)
		}
	}
}

func pad5(n int) string {
	s := []byte("00000")
	for i := 4; n > 0; i-- {
		s[i] = byte('0' + n%10)
		n /= 10
	}
	return string(s)
}

func TestShardedWriterFillError(t *testing.T) {
	dir := t.TempDir()
	w := NewShardedWriter(dir, 0)
	boom := errors.New("boom")
	if err := w.Add("a", tensor.F32, tensor.Shape{1 << 20}, func(dst []byte, off int64) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if err := w.Add("b", tensor.F32, tensor.Shape{1 << 20}, func(dst []byte, off int64) error { return boom }); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(context.Background()); !errors.Is(err, boom) {
		t.Fatalf("Write: %v, want boom", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Errorf("files left after a failed write: %v", entries)
	}
	// Bad declarations.
	for _, bad := range []func() error{
		func() error { return w.Add("a", tensor.F32, tensor.Shape{1}, func([]byte, int64) error { return nil }) },
		func() error {
			return w.Add("__metadata__", tensor.F32, tensor.Shape{1}, func([]byte, int64) error { return nil })
		},
		func() error {
			return w.Add("c", tensor.Invalid, tensor.Shape{1}, func([]byte, int64) error { return nil })
		},
		func() error {
			return w.Add("c", tensor.F32, tensor.Shape{-1}, func([]byte, int64) error { return nil })
		},
		func() error { return w.Add("c", tensor.F32, tensor.Shape{1}, nil) },
	} {
		if err := bad(); err == nil {
			t.Error("bad Add accepted")
		}
	}
	if _, err := NewShardedWriter(t.TempDir(), 0).Write(context.Background()); err == nil {
		t.Error("Write with no tensors succeeded")
	}
}

func TestSynthesizeOpens(t *testing.T) {
	ctx := context.Background()
	base, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		family arch.Family
		tie    bool
		dtype  tensor.DType
		shard  int64
		extra  func(c *arch.Config)
		biases bool
	}{
		{name: "llama-f16-sharded", family: arch.Llama, dtype: tensor.F16, shard: 50_000},
		{name: "llama-bf16", family: arch.Llama, dtype: tensor.BF16},
		{name: "llama-f32-tied", family: arch.Llama, dtype: tensor.F32, tie: true, shard: 100_000},
		{name: "mistral", family: arch.Mistral, dtype: tensor.F16, extra: func(c *arch.Config) { c.SlidingWindow = 128 }},
		{name: "qwen2", family: arch.Qwen2, dtype: tensor.BF16, shard: 70_000, biases: true},
		{name: "qwen2-tied", family: arch.Qwen2, dtype: tensor.F16, tie: true, biases: true},
		{name: "llama-attention-bias", family: arch.Llama, dtype: tensor.F16, biases: true,
			extra: func(c *arch.Config) { c.QKVBias, c.OutBias = true, true }},
		{name: "llama3-rope", family: arch.Llama, dtype: tensor.F16, extra: func(c *arch.Config) {
			c.RopeTheta = 500000
			c.RopeScaling = &arch.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}
			c.EOS = []int{2, 3}
			c.HeadDim = 32 // not hidden/heads
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base.Clone()
			cfg.SetFamily(tc.family)
			cfg.TieEmbeddings = tc.tie
			if tc.extra != nil {
				tc.extra(cfg)
			}
			dir := t.TempDir()
			m, err := SynthesizeOpen(ctx, dir, cfg, SynthOptions{DType: tc.dtype, Seed: 7, MaxShardBytes: tc.shard})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			want := cfg.Clone()
			want.DType = tc.dtype
			if !reflect.DeepEqual(m.Config, want) {
				t.Errorf("config read back\n got %+v\nwant %+v", m.Config, want)
			}
			if len(m.Layers()) != cfg.NumLayers+2 || len(m.Extras()) != 0 {
				t.Errorf("%d layers, extras %v", len(m.Layers()), m.Extras())
			}
			var params int64
			for _, ti := range m.Tensors() {
				if ti.DType != tc.dtype {
					t.Errorf("%s is %v", ti.Name, ti.DType)
				}
				params += ti.Shape.NumElements()
			}
			if params != cfg.NumParams() || m.WeightBytes() != params*int64(tc.dtype.Size()) {
				t.Errorf("%d parameters in the files, config says %d; %d bytes", params, cfg.NumParams(), m.WeightBytes())
			}
			_, hasBias := m.Tensor("model.layers.0.self_attn.k_proj.bias")
			if hasBias != tc.biases {
				t.Errorf("k_proj.bias present: %v, want %v", hasBias, tc.biases)
			}
			head := m.Layers()[cfg.NumLayers+1]
			_, hasLMHead := m.Tensor(arch.LMHeadName)
			if hasLMHead == tc.tie || head.Tensors[1].Name != map[bool]string{true: arch.EmbedName, false: arch.LMHeadName}[tc.tie] {
				t.Errorf("tied %v: lm_head present %v, head layer holds %s", tc.tie, hasLMHead, head.Tensors[1].Name)
			}
			if tc.shard > 0 && len(m.Files()) < 2 {
				t.Errorf("shard size %d gave %d files", tc.shard, len(m.Files()))
			}
			// transformers reads the config: the fields it needs are there.
			var raw map[string]any
			data, _ := os.ReadFile(filepath.Join(dir, ConfigFile))
			if err := json.Unmarshal(data, &raw); err != nil {
				t.Fatal(err)
			}
			for _, k := range []string{"architectures", "model_type", "hidden_size", "num_key_value_heads", "rope_parameters", "rope_theta", "dtype", "torch_dtype", "vocab_size", "tie_word_embeddings"} {
				if _, ok := raw[k]; !ok {
					t.Errorf("config.json has no %s", k)
				}
			}
		})
	}
}

func synthBytes(t *testing.T, cfg *arch.Config, opts SynthOptions) map[string][]byte {
	t.Helper()
	m, err := SynthesizeOpen(context.Background(), t.TempDir(), cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	out := map[string][]byte{}
	for _, ti := range m.Tensors() {
		tt, err := m.ReadTensor(context.Background(), ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		out[ti.Name] = tt.Bytes()
	}
	return out
}

func TestSynthesizeDeterministic(t *testing.T) {
	cfg, _ := arch.Preset("tiny")
	cfg.NumLayers = 2
	a := synthBytes(t, cfg, SynthOptions{Seed: 42, Workers: 1})
	b := synthBytes(t, cfg, SynthOptions{Seed: 42, Workers: 4, MaxShardBytes: 30_000})
	if !reflect.DeepEqual(a, b) {
		t.Error("same seed, different shards or workers: different weights")
	}
	c := synthBytes(t, cfg, SynthOptions{Seed: 43})
	for name := range a {
		if bytes.Equal(a[name], c[name]) {
			t.Errorf("%s is the same for seeds 42 and 43", name)
		}
	}
	// Tensors of the same shape get different values.
	if bytes.Equal(a["model.layers.0.mlp.gate_proj.weight"], a["model.layers.0.mlp.up_proj.weight"]) {
		t.Error("gate_proj and up_proj are equal")
	}

	// Whole files are byte-identical too.
	d1, d2 := t.TempDir(), t.TempDir()
	for _, d := range []string{d1, d2} {
		if err := Synthesize(context.Background(), d, cfg, SynthOptions{Seed: 5, MaxShardBytes: 40_000}); err != nil {
			t.Fatal(err)
		}
	}
	files, _ := filepath.Glob(filepath.Join(d1, "*"))
	if len(files) < 4 {
		t.Fatalf("only %v written", files)
	}
	for _, f := range files {
		x, _ := os.ReadFile(f)
		y, err := os.ReadFile(filepath.Join(d2, filepath.Base(f)))
		if err != nil || !bytes.Equal(x, y) {
			t.Errorf("%s differs between runs (%v)", filepath.Base(f), err)
		}
	}
}

// The same seed in F32, F16 and BF16 gives the same values rounded to each
// dtype, and the values have the documented spread.
func TestSynthesizeValues(t *testing.T) {
	cfg, _ := arch.Preset("tiny")
	cfg.NumLayers = 2
	f32 := synthBytes(t, cfg, SynthOptions{Seed: 9, DType: tensor.F32})
	f16 := synthBytes(t, cfg, SynthOptions{Seed: 9, DType: tensor.F16})
	bf16 := synthBytes(t, cfg, SynthOptions{Seed: 9, DType: tensor.BF16})
	for name, b := range f32 {
		x, _ := tensor.FromBytes(tensor.F32, tensor.Shape{len(b) / 4}, b)
		v := x.F32()
		h, b16 := f16[name], bf16[name]
		for i, f := range v {
			if got, want := uint16(h[2*i])|uint16(h[2*i+1])<<8, tensor.F16FromF32(f); got != want {
				t.Fatalf("%s[%d]: F16 %#x, F32 %v rounds to %#x", name, i, got, f, want)
			}
			if got, want := uint16(b16[2*i])|uint16(b16[2*i+1])<<8, tensor.BF16FromF32(f); got != want {
				t.Fatalf("%s[%d]: BF16 %#x, F32 %v rounds to %#x", name, i, got, f, want)
			}
		}
		var sum, sq float64
		for _, f := range v {
			sum += float64(f)
			sq += float64(f) * float64(f)
		}
		n := float64(len(v))
		mean := sum / n
		std := math.Sqrt(sq/n - mean*mean)
		var wantMean, wantStd float64
		switch {
		case name == arch.EmbedName || name == arch.LMHeadName:
			wantStd = 1 / math.Sqrt(64)
		case filepath.Ext(name) == ".bias":
			wantStd = 0.02
		case len(name) > 11 && name[len(name)-11:] == "norm.weight":
			wantMean, wantStd = 1, 0.02
		case slices.Contains([]string{"model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"}, name):
			wantStd = 1 / math.Sqrt(64) / math.Sqrt(4)
		case name == "model.layers.0.mlp.down_proj.weight" || name == "model.layers.1.mlp.down_proj.weight":
			wantStd = 1 / math.Sqrt(172) / math.Sqrt(4)
		default:
			wantStd = 1 / math.Sqrt(64)
		}
		tol := 4 * wantStd / math.Sqrt(n) * 2 // a few standard errors
		if math.Abs(mean-wantMean) > 4*wantStd/math.Sqrt(n)+1e-6 || math.Abs(std-wantStd) > tol+0.05*wantStd {
			t.Errorf("%s: mean %.4f std %.4f, want %.4f and %.4f", name, mean, std, wantMean, wantStd)
		}
	}
}

func TestSynthesizeTokenizer(t *testing.T) {
	ctx := context.Background()
	src := fixtures.Dir(fixtures.TinyLlamaBF16)
	cfg, _ := arch.Preset("tiny")
	dir := t.TempDir()
	if err := Synthesize(ctx, dir, cfg, SynthOptions{Seed: 1, TokenizerFrom: src}); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{TokenizerFile, TokenizerConfig} {
		a, _ := os.ReadFile(filepath.Join(src, name))
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || !bytes.Equal(a, b) {
			t.Errorf("%s not copied: %v", name, err)
		}
	}
	small := cfg.Clone()
	small.VocabSize = 100
	if err := Synthesize(ctx, t.TempDir(), small, SynthOptions{TokenizerFrom: src}); err == nil || !bytes.Contains([]byte(err.Error()), []byte("vocabulary of 100")) {
		t.Errorf("tokenizer larger than the vocabulary: %v", err)
	}
	if err := Synthesize(ctx, t.TempDir(), cfg, SynthOptions{TokenizerFrom: t.TempDir()}); err == nil {
		t.Error("tokenizer from an empty directory accepted")
	}
	// A rewrite with fewer shards leaves no stale shard behind.
	if err := Synthesize(ctx, dir, cfg, SynthOptions{MaxShardBytes: 50_000}); err != nil {
		t.Fatal(err)
	}
	if err := Synthesize(ctx, dir, cfg, SynthOptions{}); err != nil {
		t.Fatal(err)
	}
	if shards, _ := filepath.Glob(filepath.Join(dir, "model-*")); len(shards) != 0 || fileExists(filepath.Join(dir, IndexFile)) {
		t.Errorf("stale shards left: %v", shards)
	}
	bad := cfg.Clone()
	bad.NumKVHeads = 3
	if err := Synthesize(ctx, t.TempDir(), bad, SynthOptions{}); !errors.Is(err, ErrConfig) {
		t.Errorf("invalid config: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := Synthesize(cctx, t.TempDir(), cfg, SynthOptions{}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
}
