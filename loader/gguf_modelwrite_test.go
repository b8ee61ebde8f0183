package loader_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// TestWriteGGUFModel: WriteGGUFModel writes the fixture, from the rows
// ReadRows gives, as the converter would: the tensors of the F16 model
// and of its Q8_0 quantization have the bytes of the independently built
// files, the norms are F32 and the logits of the F16 one are those of the
// safetensors model.
func TestWriteGGUFModel(t *testing.T) {
	ctx := context.Background()
	for _, base := range []quant.Type{quant.F16, quant.Q8_0} {
		t.Run(base.String(), func(t *testing.T) {
			src, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			types, fallbacks, err := loader.GGUFTensorTypes(src.Config, base)
			if err != nil {
				t.Fatal(err)
			}
			if base == quant.Q8_0 && len(fallbacks) != src.Config.NumLayers || base == quant.F16 && len(fallbacks) != 0 {
				t.Errorf("fallbacks %q", fallbacks)
			}
			tok, _ := src.Tokenizer()
			v, err := tok.GGUFVocab(src.Config.VocabSize)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "out.gguf")
			var last, total int64
			err = loader.WriteGGUFModel(ctx, path, loader.GGUFModel{Config: src.Config, Vocab: v, Name: "tiny", Types: types,
				FileType: loader.GGUFFileType(base),
				Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
					ti, _ := src.Tensor(spec.Name)
					return src.ReadRows(ctx, ti, r0, r1, dst)
				},
				Progress: func(w, tot int64) { last, total = w, tot }})
			if err != nil {
				t.Fatal(err)
			}
			m, err := loader.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if last != total || total != m.WeightBytes() {
				t.Errorf("progress ended at %d of %d, the model has %d bytes", last, total, m.WeightBytes())
			}
			if name, _ := m.GGUF().Metadata.String("general.name"); name != "tiny" {
				t.Errorf("general.name %q", name)
			}
			want := linearQ8
			if base == quant.F16 {
				want = storedTypes
			}
			p, _ := fixtureParts(t, fixtures.TinyLlamaF16Sharded, want)
			for _, pt := range p.tensors {
				gt, ok := m.GGUF().Tensor(pt.Name)
				if !ok {
					t.Fatalf("no tensor %s", pt.Name)
				}
				got := make([]byte, gt.Size)
				if err := m.GGUF().ReadTensorBytes(ctx, pt.Name, got); err != nil {
					t.Fatal(err)
				}
				if len(gt.Dims) == 1 {
					if gt.Type != quant.F32 {
						t.Errorf("%s is %v, want F32", pt.Name, gt.Type)
					}
					continue
				}
				if gt.Type != pt.Type || !bytes.Equal(got, pt.Data) {
					t.Errorf("%s: %v, want the bytes of the %v built by the test", pt.Name, gt.Type, pt.Type)
				}
			}
			if base != quant.F16 {
				return
			}
			wantLogits, err := logitsOf(t, src, prompt)
			if err != nil {
				t.Fatal(err)
			}
			got, err := logitsOf(t, m, prompt)
			if err != nil {
				t.Fatal(err)
			}
			for i := range wantLogits {
				if math.Float32bits(got[i]) != math.Float32bits(wantLogits[i]) {
					t.Fatalf("logit %d is %v, the safetensors model's %v", i, got[i], wantLogits[i])
				}
			}
		})
	}
}

// testValue is element i of a tensor written by TestGGUFConfigRoundTrip.
func testValue(name string, i int) float32 {
	h := 0
	for _, c := range name {
		h = h*31 + int(c)
	}
	return float32(math.Sin(float64(h%1000)+float64(i)*0.37)) * 0.1
}

// TestGGUFConfigRoundTrip: configs of every family and quirk written by
// WriteGGUFModel open as themselves, and every tensor reads back with the
// values written: llama biases permuted and un-permuted, qwen2's and
// qwen3's stored as they are.
func TestGGUFConfigRoundTrip(t *testing.T) {
	ctx := context.Background()
	tiny := func(edit func(c *arch.Config)) *arch.Config {
		c, _ := arch.Preset("tiny")
		c.NumLayers = 2
		edit(c)
		return c
	}
	for _, tc := range []struct {
		name string
		cfg  *arch.Config
	}{
		{"llama", tiny(func(c *arch.Config) {})},
		{"llama tied, three EOS", tiny(func(c *arch.Config) { c.TieEmbeddings, c.EOS = true, []int{2, 7, 9} })},
		{"llama with attention biases", tiny(func(c *arch.Config) { c.QKVBias, c.OutBias = true, true })},
		{"llama3 rope scaling", tiny(func(c *arch.Config) {
			c.RopeTheta, c.MaxPositions = 500000, 131072
			c.RopeScaling = &arch.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}
		})},
		{"llama head size 32", tiny(func(c *arch.Config) { c.HeadDim = 32 })},
		{"mistral", tiny(func(c *arch.Config) { c.SetFamily(arch.Mistral); c.SlidingWindow = 4096; c.RMSNormEps = 1e-6 })},
		{"qwen2", tiny(func(c *arch.Config) { c.SetFamily(arch.Qwen2); c.RopeTheta = 1e6; c.BOS = -1 })},
		{"qwen3 tied, head size 32", tiny(func(c *arch.Config) {
			c.SetFamily(arch.Qwen3)
			c.RopeTheta, c.RMSNormEps, c.HeadDim, c.TieEmbeddings = 1e6, 1e-6, 32, true
		})},
		{"qwen3 with attention biases", tiny(func(c *arch.Config) { c.SetFamily(arch.Qwen3); c.QKVBias, c.OutBias = true, true })},
		{"qwen3 head size hidden/heads", tiny(func(c *arch.Config) { c.SetFamily(arch.Qwen3) })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.cfg
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			types, _, err := loader.GGUFTensorTypes(c, quant.F16)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "m.gguf")
			rows := func(spec arch.Spec, r0, r1 int, dst []float32) error {
				cols := spec.Shape[len(spec.Shape)-1]
				for i := range dst {
					dst[i] = testValue(spec.Name, r0*cols+i)
				}
				return nil
			}
			if err := loader.WriteGGUFModel(ctx, path, loader.GGUFModel{Config: c, Types: types, Rows: rows}); err != nil {
				t.Fatal(err)
			}
			m, err := loader.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if !reflect.DeepEqual(m.Config, c) {
				t.Errorf("config\n got %+v\nwant %+v", m.Config, c)
			}
			if rs := m.Config.RopeScaling; rs != nil && !reflect.DeepEqual(*rs, *c.RopeScaling) {
				t.Errorf("rope scaling %+v, want %+v", *rs, *c.RopeScaling)
			}
			for _, spec := range c.ExpectedTensors() {
				ti, ok := m.Tensor(spec.Name)
				if !ok {
					t.Fatalf("no %s", spec.Name)
				}
				n := int(spec.Shape.NumElements())
				rows := n / spec.Shape[len(spec.Shape)-1]
				got := make([]float32, n)
				if err := m.ReadRows(ctx, ti, 0, rows, got); err != nil {
					t.Fatal(err)
				}
				for i, v := range got {
					want := testValue(spec.Name, i)
					if ti.DType == tensor.F16 {
						want = tensor.F16ToF32One(tensor.F16FromF32(want))
					}
					if v != want {
						t.Fatalf("%s: element %d is %v, want %v", spec.Name, i, v, want)
					}
				}
			}
			// qwen3 files name the head size whatever it is, as llama.cpp's
			// converter writes them.
			if kl, err := m.GGUF().Metadata.Uint("qwen3.attention.key_length"); c.Family == arch.Qwen3 && (err != nil || kl != uint64(c.HeadDim)) {
				t.Errorf("qwen3.attention.key_length: %v, %v; want %d", kl, err, c.HeadDim)
			}
			// Qwen2's and Qwen3's biases are stored in Hugging Face's order.
			if c.Family != arch.Llama && c.QKVBias {
				gt, _ := m.GGUF().Tensor("blk.0.attn_q.bias")
				raw := make([]byte, gt.Size)
				m.GGUF().ReadTensorBytes(ctx, gt.Name, raw)
				if v := math.Float32frombits(binary.LittleEndian.Uint32(raw[4:])); v != testValue("model.layers.0.self_attn.q_proj.bias", 1) {
					t.Errorf("%v q bias element 1 stored as %v", c.Family, v)
				}
			}
		})
	}
}

// TestGGUFTensorTypes: the recipe of each base type, on shapes whose rows
// are and are not whole blocks.
func TestGGUFTensorTypes(t *testing.T) {
	c, _ := arch.Preset("tiny")
	c.NumLayers = 1
	k := c.Clone() // rows of 256 but down_proj's
	k.HiddenSize, k.HeadDim = 256, 64
	for _, tc := range []struct {
		name      string
		cfg       *arch.Config
		base      quant.Type
		tie       bool
		dtype     tensor.DType
		q, down   quant.Type // the q projection's and down_proj's types
		embed     quant.Type
		head      quant.Type
		fallbacks int
	}{
		{"f16", c, quant.F16, false, tensor.F16, quant.F16, quant.F16, quant.F16, quant.F16, 0},
		{"q8_0", c, quant.Q8_0, false, tensor.F16, quant.Q8_0, quant.F16, quant.Q8_0, quant.Q8_0, 1},
		{"q8_0 of bf16", c, quant.Q8_0, false, tensor.BF16, quant.Q8_0, quant.BF16, quant.Q8_0, quant.Q8_0, 1},
		{"q4_0: head Q8_0 for want of Q6_K", c, quant.Q4_0, false, tensor.F16, quant.Q4_0, quant.F16, quant.Q4_0, quant.Q8_0, 2},
		{"q4_k on rows of 64", c, quant.Q4_K, false, tensor.F16, quant.F16, quant.F16, quant.F16, quant.Q8_0, 9},
		{"q4_k", k, quant.Q4_K, false, tensor.F16, quant.Q4_K, quant.F16, quant.Q4_K, quant.Q6_K, 1},
		{"q4_k tied", k, quant.Q4_K, true, tensor.F16, quant.Q4_K, quant.F16, quant.Q6_K, 0, 1},
		{"q6_k", k, quant.Q6_K, false, tensor.F16, quant.Q6_K, quant.F16, quant.Q6_K, quant.Q6_K, 1},
	} {
		cfg := tc.cfg.Clone()
		cfg.TieEmbeddings, cfg.DType = tc.tie, tc.dtype
		types, fb, err := loader.GGUFTensorTypes(cfg, tc.base)
		if err != nil {
			t.Fatal(err)
		}
		got := []quant.Type{types["model.layers.0.self_attn.q_proj.weight"], types["model.layers.0.mlp.down_proj.weight"],
			types[arch.EmbedName], types[arch.LMHeadName], types[arch.NormName], types["model.layers.0.input_layernorm.weight"]}
		want := []quant.Type{tc.q, tc.down, tc.embed, tc.head, quant.F32, quant.F32}
		if !reflect.DeepEqual(got, want) || len(fb) != tc.fallbacks {
			t.Errorf("%s: q, down, embed, head, norms %v, want %v; fallbacks %q", tc.name, got, want, fb)
		}
	}
	if _, _, err := loader.GGUFTensorTypes(c, quant.Q2_K); err == nil {
		t.Error("Q2_K accepted")
	}
}

// TestWriteGGUFModelMoE: WriteGGUFModel writes the mixtures of experts as
// llama.cpp does, each block's experts stacked per projection: the file
// opens as the fixture's config, every tensor has the bytes of the
// independently built file of the same types (the router F32), and the
// logits of the float files are those of the safetensors model.
func TestWriteGGUFModelMoE(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		fixture string
		base    quant.Type
	}{
		{fixtures.TinyMixtralBF16, quant.F32},
		{fixtures.TinyMixtralBF16, quant.BF16},
		{fixtures.TinyQwen3MoEF16, quant.F16},
		{fixtures.TinyQwen3MoEF16, quant.Q8_0},
	} {
		t.Run(tc.fixture+"/"+tc.base.String(), func(t *testing.T) {
			src, err := loader.Open(fixtures.Dir(tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			types, _, err := loader.GGUFTensorTypes(src.Config, tc.base)
			if err != nil {
				t.Fatal(err)
			}
			for _, spec := range src.Config.ExpectedTensors() {
				if spec.Role == arch.Router && types[spec.Name] != quant.F32 {
					t.Errorf("router %s is %v, want F32", spec.Name, types[spec.Name])
				}
			}
			tok, _ := src.Tokenizer()
			v, err := tok.GGUFVocab(src.Config.VocabSize)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "out.gguf")
			err = loader.WriteGGUFModel(ctx, path, loader.GGUFModel{Config: src.Config, Vocab: v, Types: types,
				FileType: loader.GGUFFileType(tc.base), Workers: 3,
				Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error {
					ti, _ := src.Tensor(spec.Name)
					return src.ReadRows(ctx, ti, r0, r1, dst)
				}})
			if err != nil {
				t.Fatal(err)
			}
			m, err := loader.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			want := *src.Config
			if want.BOS < 0 && len(want.EOS) == 0 { // as in TestGGUFModelFixtures
				want.BOS, want.EOS = 1, []int{2}
			}
			want.DType = m.Config.DType // the float type holding the most bytes
			if !reflect.DeepEqual(m.Config, &want) {
				t.Errorf("config\n got %+v %+v\nwant %+v %+v", m.Config, m.Config.MoE, &want, want.MoE)
			}
			p, _ := fixtureParts(t, tc.fixture, func(spec arch.Spec, _ tensor.DType) quant.Type { return types[spec.Name] })
			if n := len(m.GGUF().Tensors()); n != len(p.tensors) {
				t.Errorf("%d tensors, want %d", n, len(p.tensors))
			}
			for _, pt := range p.tensors {
				gt, ok := m.GGUF().Tensor(pt.Name)
				if !ok {
					t.Fatalf("no tensor %s", pt.Name)
				}
				got := make([]byte, gt.Size)
				if err := m.GGUF().ReadTensorBytes(ctx, pt.Name, got); err != nil {
					t.Fatal(err)
				}
				if gt.Type != pt.Type || !reflect.DeepEqual(gt.Dims, pt.Dims) || !bytes.Equal(got, pt.Data) {
					t.Errorf("%s: %v %v, want the bytes of the %v %v built by the test", pt.Name, gt.Type, gt.Dims, pt.Type, pt.Dims)
				}
			}
			if tc.base == quant.Q8_0 {
				return
			}
			wantLogits, err := logitsOf(t, src, prompt)
			if err != nil {
				t.Fatal(err)
			}
			got, err := logitsOf(t, m, prompt)
			if err != nil {
				t.Fatal(err)
			}
			for i := range wantLogits {
				if math.Float32bits(got[i]) != math.Float32bits(wantLogits[i]) {
					t.Fatalf("logit %d is %v, the safetensors model's %v", i, got[i], wantLogits[i])
				}
			}
		})
	}
}

// TestWriteGGUFModelMixedExperts: experts stacked in one tensor need one
// type; a recipe giving two is an error naming both, and nothing is
// written.
func TestWriteGGUFModelMixedExperts(t *testing.T) {
	src, err := loader.Open(fixtures.Dir(fixtures.TinyQwen3MoEF16))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	types, _, err := loader.GGUFTensorTypes(src.Config, quant.F16)
	if err != nil {
		t.Fatal(err)
	}
	types["model.layers.1.mlp.experts.3.down_proj.weight"] = quant.F32
	path := filepath.Join(t.TempDir(), "out.gguf")
	err = loader.WriteGGUFModel(context.Background(), path, loader.GGUFModel{Config: src.Config, Types: types,
		Rows: func(spec arch.Spec, r0, r1 int, dst []float32) error { return nil }})
	if err == nil || !strings.Contains(err.Error(), "model.layers.1.mlp.experts.3.down_proj.weight (F32)") ||
		!strings.Contains(err.Error(), "blk.1.ffn_down_exps.weight") || strings.Contains(err.Error(), "\n") {
		t.Errorf("WriteGGUFModel: %v, want one line naming the expert, its type and the stacked tensor", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("%s was written: %v", path, err)
	}
}
