package loader_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// ggufParts are a GGUF file's metadata and tensors before they are
// written, for tests to edit.
type ggufParts struct {
	kvs     []loader.GGUFKV
	tensors []loader.GGUFWriteTensor
}

func (p *ggufParts) set(key string, v any) {
	for i := range p.kvs {
		if p.kvs[i].Key == key {
			p.kvs[i].Value = v
			return
		}
	}
	p.kvs = append(p.kvs, loader.GGUFKV{Key: key, Value: v})
}

func (p *ggufParts) drop(key string) {
	for i := range p.kvs {
		if p.kvs[i].Key == key {
			p.kvs = append(p.kvs[:i], p.kvs[i+1:]...)
			return
		}
	}
}

func (p *ggufParts) tensor(name string) *loader.GGUFWriteTensor {
	for i := range p.tensors {
		if p.tensors[i].Name == name {
			return &p.tensors[i]
		}
	}
	return nil
}

func (p *ggufParts) write(t *testing.T, path string) string {
	t.Helper()
	if err := loader.WriteGGUF(path, p.kvs, p.tensors); err != nil {
		t.Fatal(err)
	}
	return path
}

// storedTypes keeps every tensor's dtype.
func storedTypes(_ arch.Spec, dt tensor.DType) quant.Type {
	q, _ := dt.Quant()
	return q
}

// ggufParts builds a fixture as llama.cpp's converter writes it, from the
// exported pieces and independently of WriteGGUFModel: the config's and
// tokenizer's metadata, the tensors under llama.cpp's names with ggml's
// dimension order, the query and key rows permuted (PermuteQK) for the
// llama architecture, each
// tensor in the type typ gives it (the stored bytes when it is the stored
// dtype, else its values quantized row by row).
func fixtureParts(t *testing.T, name string, typ func(arch.Spec, tensor.DType) quant.Type) (*ggufParts, *loader.Model) {
	t.Helper()
	src, err := loader.Open(fixtures.Dir(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	cfg := src.Config
	p := &ggufParts{}
	kvs, err := loader.GGUFConfigKVs(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range kvs {
		if !strings.HasPrefix(kv.Key, "tokenizer.") { // the tokenizer's say it
			p.kvs = append(p.kvs, kv)
		}
	}
	tok, err := src.Tokenizer()
	if err != nil {
		t.Fatal(err)
	}
	v, err := tok.GGUFVocab(cfg.VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	p.kvs = append(p.kvs, loader.GGUFTokenizerKVs(v)...)
	a, err := loader.GGUFArchitecture(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, spec := range cfg.ExpectedTensors() {
		ti, _ := src.Tensor(spec.Name)
		x, err := src.ReadTensor(ctx, spec.Name)
		if err != nil {
			t.Fatal(err)
		}
		data := x.Bytes()
		q := typ(spec, ti.DType)
		if stored, _ := ti.DType.Quant(); q != stored {
			data = quantizeRows(t, src, ti, q)
		}
		heads := 0
		switch spec.Role {
		case arch.Q, arch.QBias:
			heads = cfg.NumHeads
		case arch.K, arch.KBias:
			heads = cfg.NumKVHeads
		}
		if heads > 0 && loader.GGUFPermutesQK(a) {
			perm := make([]byte, len(data))
			if err := loader.PermuteQK(perm, data, spec.Shape[0], heads); err != nil {
				t.Fatal(err)
			}
			data = perm
		}
		gname, ok := loader.HFToGGUFName(spec.Name)
		if !ok {
			gname, _ = loader.GGUFExpertName(spec)
		}
		dims := make([]int64, len(spec.Shape))
		for i, d := range spec.Shape {
			dims[len(dims)-1-i] = int64(d)
		}
		if spec.Role.IsExpert() { // the block's experts stacked, [in, out, n_expert]
			if spec.Expert > 0 {
				st := p.tensor(gname)
				st.Data = append(st.Data, data...)
				st.Dims[2]++
				continue
			}
			dims = append(dims, 1)
			data = slices.Clone(data)
		}
		p.tensors = append(p.tensors, loader.GGUFWriteTensor{Name: gname, Type: q, Dims: dims, Data: data})
	}
	return p, src
}

// quantizeRows returns the tensor's values encoded as q.
func quantizeRows(t *testing.T, src *loader.Model, ti *loader.TensorInfo, q quant.Type) []byte {
	t.Helper()
	rows := ti.Shape[0]
	if len(ti.Shape) == 1 {
		rows = 1
	}
	vals := make([]float32, ti.Shape.NumElements())
	if err := src.ReadRows(context.Background(), ti, 0, rows, vals); err != nil {
		t.Fatal(err)
	}
	n, err := q.Bytes(int64(len(vals)))
	if err != nil {
		t.Fatal(err)
	}
	out := make([]byte, n)
	if err := q.Quantize(out, vals); err != nil {
		t.Fatal(err)
	}
	return out
}

// logitsOf runs ids through the model on the CPU, every weight resident:
// the prompt's logits, then those of four greedy steps.
func logitsOf(t *testing.T, lm *loader.Model, ids []int32) ([]float32, error) {
	t.Helper()
	ctx := context.Background()
	b := tensor.NewCPU(1)
	defer b.Close()
	w, err := nn.LoadWeights(ctx, lm, b, nil)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	m, err := nn.New(lm.Config, b, nil, w)
	if err != nil {
		return nil, err
	}
	s, err := m.NewSession(32, 4)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	logits, err := s.Forward(ctx, ids, true, nil)
	if err != nil {
		return nil, err
	}
	all := append([]float32(nil), logits...)
	last := logits[len(logits)-lm.Config.VocabSize:]
	for range 4 {
		if last, err = s.Forward(ctx, []int32{int32(nn.Argmax(last))}, false, nil); err != nil {
			return nil, err
		}
		all = append(all, last...)
	}
	return all, nil
}

var prompt = []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}

// refCases reads a fixture's tokenizer cases.
func refCases(t *testing.T, name string) []struct {
	Text string `json:"text"`
	IDs  []int  `json:"ids"`
} {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(fixtures.Dir(name), "reference.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ref struct {
		Tokenizer struct {
			Encode []struct {
				Text string `json:"text"`
				IDs  []int  `json:"ids"`
			} `json:"encode"`
		} `json:"tokenizer"`
	}
	if err := json.Unmarshal(raw, &ref); err != nil {
		t.Fatal(err)
	}
	return ref.Tokenizer.Encode
}

// TestGGUFModelFixtures: each fixture written as llama.cpp writes a GGUF
// file opens as the same model: the same config, layers and tensor bytes
// (the query and key rows back in Hugging Face's order, whole or in part),
// the same tokenization of the reference cases, and bit-identical logits
// on the CPU.
func TestGGUFModelFixtures(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16, fixtures.TinyQwen3F16,
		fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16} {
		t.Run(name, func(t *testing.T) {
			p, src := fixtureParts(t, name, storedTypes)
			path := p.write(t, filepath.Join(t.TempDir(), "model.gguf"))
			m, err := loader.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			wantCfg := *src.Config
			if wantCfg.BOS < 0 && len(wantCfg.EOS) == 0 {
				// config.json names none (tiny-qwen3-f16): the GGUF has
				// those of the tokenizer, <s> and </s>, as llama.cpp's
				// converter writes them.
				wantCfg.BOS, wantCfg.EOS = 1, []int{2}
			}
			if !reflect.DeepEqual(m.Config, &wantCfg) {
				t.Errorf("config\n got %+v\nwant %+v", m.Config, &wantCfg)
			}
			if m.GGUF() == nil || src.GGUF() != nil || m.Dir != path {
				t.Errorf("GGUF() %v, %v; Dir %q", m.GGUF(), src.GGUF(), m.Dir)
			}
			if got := m.InputFiles(); !reflect.DeepEqual(got, []string{path}) {
				t.Errorf("InputFiles = %v", got)
			}
			if len(m.Extras()) != 0 || m.WeightBytes() != src.WeightBytes() {
				t.Errorf("extras %v, %d weight bytes (want %d)", m.Extras(), m.WeightBytes(), src.WeightBytes())
			}
			for i, l := range m.Layers() {
				want := src.Layers()[i]
				if l.Kind != want.Kind || l.Block != want.Block || l.Bytes != want.Bytes || len(l.Tensors) != len(want.Tensors) {
					t.Fatalf("layer %d: %v %d bytes, want %v %d", i, l, l.Bytes, want, want.Bytes)
				}
				for j, ti := range l.Tensors {
					wt := want.Tensors[j]
					if ti.Name != wt.Name || ti.DType != wt.DType || !ti.Shape.Equal(wt.Shape) {
						t.Errorf("layer %d: %v, want %v", i, ti, wt)
					}
					got, err := m.ReadTensor(ctx, ti.Name)
					if err != nil {
						t.Fatal(err)
					}
					ref, err := src.ReadTensor(ctx, ti.Name)
					if err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got.Bytes(), ref.Bytes()) {
						t.Errorf("%s: bytes differ from the safetensors model's", ti.Name)
					}
					// A part of a tensor, across heads.
					if len(ti.Shape) == 2 && ti.Shape[0] > 4 {
						rb := ti.Size / int64(ti.Shape[0])
						off, n := 3*rb+5, rb*int64(min(ti.Shape[0]-4, 18))
						part := make([]byte, n)
						if err := m.ReadRange(ctx, ti, off, part); err != nil {
							t.Fatal(err)
						}
						if !bytes.Equal(part, ref.Bytes()[off:off+n]) {
							t.Errorf("%s: bytes [%d, %d) differ", ti.Name, off, off+n)
						}
					}
				}
			}
			// The file system holds the config.
			cj, err := fs.ReadFile(m.FS(), loader.ConfigFile)
			if err != nil {
				t.Fatal(err)
			}
			if c, err := arch.ParseConfig(cj); err != nil || !reflect.DeepEqual(c, m.Config) {
				t.Errorf("config.json of the file system: %v, %v", c, err)
			}
			if ents, err := fs.ReadDir(m.FS(), "."); err != nil || len(ents) != 1 || ents[0].Name() != loader.ConfigFile {
				t.Errorf("ReadDir: %v, %v", ents, err)
			}

			tok, err := m.Tokenizer()
			if err != nil || tok == nil {
				t.Fatalf("tokenizer %v, %v", tok, err)
			}
			for _, c := range refCases(t, name) {
				got, err := tok.Encode(c.Text, false)
				if err != nil || !reflect.DeepEqual(got, append([]int{}, c.IDs...)) {
					t.Errorf("Encode(%q) = %v, %v; want %v", c.Text, got, err, c.IDs)
				}
			}

			want, err := logitsOf(t, src, prompt)
			if err != nil {
				t.Fatal(err)
			}
			got, err := logitsOf(t, m, prompt)
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("logit %d is %v, the safetensors model's %v", i, got[i], want[i])
				}
			}
		})
	}
}

// linearQ8 stores the linear weights and the embedding whose rows are
// whole blocks as Q8_0, the rest as stored.
func linearQ8(spec arch.Spec, dt tensor.DType) quant.Type {
	if len(spec.Shape) == 2 && spec.Shape[1]%32 == 0 {
		return quant.Q8_0
	}
	return storedTypes(spec, dt)
}

// TestGGUFModelQuantized: a GGUF of quantized weights opens with those
// dtypes, smaller; its query and key rows read back un-permuted, the
// quantized bytes of the Hugging Face rows; ReadRows dequantizes them.
func TestGGUFModelQuantized(t *testing.T) {
	ctx := context.Background()
	p, src := fixtureParts(t, fixtures.TinyLlamaF16Sharded, linearQ8)
	m, err := loader.Open(p.write(t, filepath.Join(t.TempDir(), "q8.gguf")))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.WeightBytes() >= src.WeightBytes()*3/4 {
		t.Errorf("%d weight bytes, the F16 model %d", m.WeightBytes(), src.WeightBytes())
	}
	for _, spec := range m.Config.ExpectedTensors() {
		ti, _ := m.Tensor(spec.Name)
		sti, _ := src.Tensor(spec.Name)
		if want, _ := tensor.FromQuant(linearQ8(spec, sti.DType)); ti.DType != want {
			t.Errorf("%s is %v, want %v", spec.Name, ti.DType, want)
		}
		got, err := m.ReadTensor(ctx, spec.Name)
		if err != nil {
			t.Fatal(err)
		}
		if q, _ := ti.DType.Quant(); ti.DType.IsQuantized() && !bytes.Equal(got.Bytes(), quantizeRows(t, src, sti, q)) {
			t.Errorf("%s: the bytes are not the quantized Hugging Face rows", spec.Name)
		}
		if spec.Role == arch.K {
			rows := make([]float32, 3*spec.Shape[1])
			if err := m.ReadRows(ctx, ti, 5, 8, rows); err != nil {
				t.Fatal(err)
			}
			ref := make([]float32, len(rows))
			src.ReadRows(ctx, sti, 5, 8, ref)
			for i := range rows {
				if math.Abs(float64(rows[i]-ref[i])) > 0.01 {
					t.Fatalf("%s: ReadRows value %d is %v, the F16 model's %v", spec.Name, i, rows[i], ref[i])
				}
			}
		}
	}
}

// TestGGUFModelQuantizedForward: a Q8_0 model's logits are those of the
// same model with its weights dequantized to F32, within the error of the
// CPU rounding activations to 16 bits per block (8.5e-5 RMS measured).
func TestGGUFModelQuantizedForward(t *testing.T) {
	p, _ := fixtureParts(t, fixtures.TinyLlamaF16Sharded, linearQ8)
	dir := t.TempDir()
	q, err := loader.Open(p.write(t, filepath.Join(dir, "q8.gguf")))
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	// The same weights, dequantized: F32 where the file has Q8_0.
	for i, gt := range p.tensors {
		if gt.Type != quant.Q8_0 {
			continue
		}
		vals := make([]float32, len(gt.Data)/34*32)
		quant.Q8_0.Dequantize(vals, gt.Data)
		data := make([]byte, 4*len(vals))
		quant.F32.Quantize(data, vals)
		p.tensors[i].Type, p.tensors[i].Data = quant.F32, data
	}
	f, err := loader.Open(p.write(t, filepath.Join(dir, "f32.gguf")))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got, err := logitsOf(t, q, prompt[:6])
	if err != nil {
		t.Fatal(err)
	}
	want, err := logitsOf(t, f, prompt[:6])
	if err != nil {
		t.Fatal(err)
	}
	var d2, w2 float64
	for i := range want {
		d := float64(got[i] - want[i])
		d2 += d * d
		w2 += float64(want[i]) * float64(want[i])
	}
	if rel := math.Sqrt(d2 / w2); !(rel < 1e-3) {
		t.Errorf("Q8_0 logits differ from the dequantized model's by %.3g RMS (relative)", rel)
	} else {
		t.Logf("Q8_0 logits differ from the dequantized model's by %.3g RMS (relative)", rel)
	}
}

// TestGGUFModelRefuses: GGUF files strata cannot run are refused at Open
// with one line naming the file and the problem.
func TestGGUFModelRefuses(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		edit func(p *ggufParts)
		kind error
		msg  string
	}{
		{"architecture", func(p *ggufParts) { p.set("general.architecture", "gemma2") }, loader.ErrConfig, `"gemma2" is not supported yet`},
		{"experts", func(p *ggufParts) { p.set("llama.expert_count", uint32(8)) }, loader.ErrConfig, "llama.expert_used_count is missing"},
		{"qwen3 experts", func(p *ggufParts) {
			for i := range p.kvs {
				p.kvs[i].Key = strings.Replace(p.kvs[i].Key, "llama.", "qwen3.", 1)
			}
			p.set("general.architecture", "qwen3")
			p.set("qwen3.expert_count", uint32(8))
		}, loader.ErrConfig, "a qwen3 model with 8 experts"},
		{"no context length", func(p *ggufParts) { p.drop("llama.context_length") }, loader.ErrNoKey, "llama.context_length: missing"},
		{"partial rope", func(p *ggufParts) { p.set("llama.rope.dimension_count", uint32(8)) }, loader.ErrConfig, "partial rotary"},
		{"key and value sizes", func(p *ggufParts) {
			p.set("llama.attention.key_length", uint32(16))
			p.set("llama.attention.value_length", uint32(8))
		}, loader.ErrConfig, "differs"},
		{"rope scaling", func(p *ggufParts) { p.set("llama.rope.scaling.type", "linear") }, loader.ErrConfig, `"linear"`},
		{"rope factors", func(p *ggufParts) {
			p.tensors = append(p.tensors, loader.GGUFWriteTensor{Name: "rope_freqs.weight", Type: quant.F32, Dims: []int64{8},
				Data: bytes.Repeat(binary.LittleEndian.AppendUint32(nil, math.Float32bits(2)), 8)})
		}, loader.ErrConfig, "other scalings are not supported"},
		{"bos outside", func(p *ggufParts) { p.set("tokenizer.ggml.bos_token_id", uint32(600)) }, loader.ErrFormat, "outside the 512 tokens"},
		{"quantized norm", func(p *ggufParts) {
			w := p.tensor("blk.1.attn_norm.weight")
			w.Type, w.Data = quant.Q8_0, make([]byte, 68)
		}, loader.ErrMismatch, "want a float type"},
		{"unsupported type", func(p *ggufParts) {
			w := p.tensor("blk.0.ffn_up.weight")
			w.Type, w.Data = quant.IQ4_NL, make([]byte, 172*2*18)
		}, loader.ErrMismatch, "IQ4_NL, which strata does not compute with"},
		{"wrong size", func(p *ggufParts) { p.set("llama.feed_forward_length", uint32(100)) }, loader.ErrMismatch, "the config needs [100, 64]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := fixtureParts(t, fixtures.TinyLlamaF16Sharded, storedTypes)
			tc.edit(p)
			path := p.write(t, filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".gguf"))
			m, err := loader.Open(path)
			if err == nil {
				m.Close()
			}
			if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), path) || strings.Contains(err.Error(), "\n") {
				t.Errorf("Open: %v; want one line naming %s with %q (%v)", err, path, tc.msg, tc.kind)
			}
		})
	}
	// Files that are not GGUF.
	text := filepath.Join(dir, "notes.txt")
	os.WriteFile(text, []byte("not a model"), 0o644)
	fake := filepath.Join(dir, "fake.gguf")
	os.WriteFile(fake, []byte("GGML and more"), 0o644)
	for path, msg := range map[string]string{text: "not GGUF", fake: "not a GGUF file"} {
		if _, err := loader.Open(path); !errors.Is(err, loader.ErrFormat) || !strings.Contains(err.Error(), msg) {
			t.Errorf("Open(%s): %v; want %q", path, err, msg)
		}
	}
}

// TestGGUFModelRefusesQwen3: a qwen3 file whose metadata is missing or
// contradicts its tensors is refused at Open with one line naming the key.
func TestGGUFModelRefusesQwen3(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		edit func(p *ggufParts)
		kind error
		msg  string
	}{
		{"no key length", func(p *ggufParts) {
			p.drop("qwen3.attention.key_length")
			p.drop("qwen3.attention.value_length")
			p.drop("qwen3.rope.dimension_count")
		}, loader.ErrConfig, "qwen3.attention.key_length is missing and the head size hidden/heads = 16, but blk.0.attn_q_norm.weight holds 32"},
		{"no head size", func(p *ggufParts) {
			p.drop("qwen3.attention.key_length")
			p.drop("qwen3.attention.value_length")
		}, loader.ErrConfig, "qwen3.attention.key_length is missing"},
		{"wrong key length", func(p *ggufParts) {
			p.set("qwen3.attention.key_length", uint32(16))
			p.set("qwen3.attention.value_length", uint32(16))
			p.set("qwen3.rope.dimension_count", uint32(16))
		}, loader.ErrConfig, "qwen3.attention.key_length is 16, but blk.0.attn_q_norm.weight holds 32"},
		{"key and value sizes", func(p *ggufParts) { p.set("qwen3.attention.value_length", uint32(16)) }, loader.ErrConfig, "qwen3.attention.value_length 16"},
		{"no block count", func(p *ggufParts) { p.drop("qwen3.block_count") }, loader.ErrNoKey, "qwen3.block_count: missing"},
		{"no epsilon", func(p *ggufParts) { p.drop("qwen3.attention.layer_norm_rms_epsilon") }, loader.ErrNoKey, "qwen3.attention.layer_norm_rms_epsilon: missing"},
		{"head count", func(p *ggufParts) { p.set("qwen3.attention.head_count_kv", uint32(3)) }, loader.ErrConfig, "num_key_value_heads 3"},
		{"no k norm", func(p *ggufParts) {
			p.tensors = slices.DeleteFunc(p.tensors, func(w loader.GGUFWriteTensor) bool { return w.Name == "blk.2.attn_k_norm.weight" })
		}, loader.ErrMismatch, "model.layers.2.self_attn.k_norm.weight"},
		{"llama keys", func(p *ggufParts) {
			for i := range p.kvs {
				p.kvs[i].Key = strings.Replace(p.kvs[i].Key, "qwen3.", "llama.", 1)
			}
		}, loader.ErrNoKey, "qwen3.block_count: missing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := fixtureParts(t, fixtures.TinyQwen3F16, storedTypes)
			tc.edit(p)
			path := p.write(t, filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".gguf"))
			m, err := loader.Open(path)
			if err == nil {
				m.Close()
			}
			if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), path) || strings.Contains(err.Error(), "\n") {
				t.Errorf("Open: %v; want one line naming %s with %q (%v)", err, path, tc.msg, tc.kind)
			}
		})
	}
}

// TestGGUFModelNonFinite: a NaN in a permuted F16 tensor is reported at
// its Hugging Face place; a quantized block with a NaN scale is reported
// by the block's first element, however the tensor is read.
func TestGGUFModelNonFinite(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	nan16 := binary.LittleEndian.AppendUint16(nil, 0x7e00)
	for _, tc := range []struct {
		name   string
		typ    func(arch.Spec, tensor.DType) quant.Type
		tensor string // GGUF name
		at     int    // byte offset of the bad value in the tensor as stored
		hf     string
		index  int64
		dtype  tensor.DType
	}{
		// Stored row 1 of a head of 16 rows is Hugging Face row 8.
		{"F16 q_proj", storedTypes, "blk.2.attn_q.weight", (1*64 + 5) * 2, "model.layers.2.self_attn.q_proj.weight", 8*64 + 5, tensor.F16},
		{"F16 k_proj", storedTypes, "blk.0.attn_k.weight", ((16+3)*64 + 2) * 2, "model.layers.0.self_attn.k_proj.weight", (16+9)*64 + 2, tensor.F16},
		{"Q8_0 up_proj", linearQ8, "blk.1.ffn_up.weight", 5 * 34, "model.layers.1.mlp.up_proj.weight", 5 * 32, tensor.Q8_0},
		{"Q8_0 q_proj", linearQ8, "blk.3.attn_q.weight", 2 * 34, "model.layers.3.self_attn.q_proj.weight", 8 * 64, tensor.Q8_0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := fixtureParts(t, fixtures.TinyLlamaF16Sharded, tc.typ)
			w := p.tensor(tc.tensor)
			copy(w.Data[tc.at:], nan16)
			m, err := loader.Open(p.write(t, filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".gguf")))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			ti, _ := m.Tensor(tc.hf)
			check := func(what string, err error) {
				t.Helper()
				var nf *loader.NonFiniteError
				if !errors.As(err, &nf) || nf.Index != tc.index || nf.DType != tc.dtype || !math.IsNaN(nf.Value) || nf.Tensor != tc.hf {
					t.Errorf("%s: %v (%+v); want element %d of %s", what, err, nf, tc.index, tc.hf)
				}
				if tc.dtype.IsQuantized() && (err == nil || !strings.Contains(err.Error(), "scale")) {
					t.Errorf("%s: %v does not name the scale", what, err)
				}
			}
			_, err = m.ReadTensor(ctx, tc.hf)
			check("ReadTensor", err)
			check("ReadRange", m.ReadRange(ctx, ti, 0, make([]byte, ti.Size)))
		})
	}
}

// TestGGUFChatTemplate: GGUFTokenizerKVs writes a vocabulary's chat
// template as tokenizer.chat_template and the tokenizer of the file reads
// it back; a file without one has none, and one that is not a string is an
// error naming the key.
func TestGGUFChatTemplate(t *testing.T) {
	const tmpl = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
	for _, tc := range []struct {
		name string
		edit func(t *testing.T, p *ggufParts)
		want string
		err  string
	}{
		{"none", func(*testing.T, *ggufParts) {}, "", ""},
		{"written", func(t *testing.T, p *ggufParts) {
			src, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaBF16))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			tok, err := src.Tokenizer()
			if err != nil {
				t.Fatal(err)
			}
			v, err := tok.GGUFVocab(src.Config.VocabSize)
			if err != nil {
				t.Fatal(err)
			}
			v.ChatTemplate = tmpl
			for _, kv := range loader.GGUFTokenizerKVs(v) {
				p.set(kv.Key, kv.Value)
			}
		}, tmpl, ""},
		{"not a string", func(_ *testing.T, p *ggufParts) { p.set("tokenizer.chat_template", uint32(7)) }, "", "tokenizer.chat_template"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := fixtureParts(t, fixtures.TinyLlamaBF16, storedTypes)
			tc.edit(t, p)
			m, err := loader.Open(p.write(t, filepath.Join(t.TempDir(), "model.gguf")))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			tok, err := m.Tokenizer()
			if tc.err != "" {
				if !errors.Is(err, loader.ErrFormat) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Tokenizer: %v, want a format error naming %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := tok.ChatTemplate(); got != tc.want {
				t.Errorf("ChatTemplate = %q, want %q", got, tc.want)
			}
			if tok.SpecialTokens()["eos_token"] != "</s>" {
				t.Errorf("SpecialTokens = %v", tok.SpecialTokens())
			}
		})
	}
}

// TestGGUFModelRefusesMoE: a mixture of experts whose metadata is missing,
// out of range or contradicts its stacked expert tensors is refused at
// Open with one line naming the key or the tensor.
func TestGGUFModelRefusesMoE(t *testing.T) {
	dir := t.TempDir()
	mixtral, qwen := fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16
	for _, tc := range []struct {
		name    string
		fixture string
		edit    func(p *ggufParts)
		kind    error
		msg     string
	}{
		{"no expert count", qwen, func(p *ggufParts) { p.drop("qwen3moe.expert_count") }, loader.ErrConfig, "metadata qwen3moe.expert_count is missing"},
		{"zero experts", qwen, func(p *ggufParts) { p.set("qwen3moe.expert_count", uint32(0)) }, loader.ErrConfig, "metadata qwen3moe.expert_count is 0"},
		{"too many used", qwen, func(p *ggufParts) { p.set("qwen3moe.expert_used_count", uint32(17)) }, loader.ErrConfig,
			"metadata qwen3moe.expert_used_count is 17, more than the 16 experts"},
		{"none used", mixtral, func(p *ggufParts) { p.set("llama.expert_used_count", uint32(0)) }, loader.ErrConfig, "metadata llama.expert_used_count is 0"},
		{"no expert size", qwen, func(p *ggufParts) { p.drop("qwen3moe.expert_feed_forward_length") }, loader.ErrConfig,
			"metadata qwen3moe.expert_feed_forward_length is missing"},
		{"norm not bool", qwen, func(p *ggufParts) { p.set("qwen3moe.expert_weights_norm", uint32(1)) }, loader.ErrConfig,
			"metadata qwen3moe.expert_weights_norm is a uint32, want a bool"},
		{"mixtral without count", mixtral, func(p *ggufParts) { p.drop("llama.expert_count") }, loader.ErrConfig,
			"tensor blk.0.ffn_gate_exps.weight holds experts, but metadata llama.expert_count is missing or 0"},
		{"stacked short", qwen, func(p *ggufParts) {
			w := p.tensor("blk.1.ffn_up_exps.weight")
			w.Dims[2]--
			w.Data = w.Data[:len(w.Data)*15/16]
		}, loader.ErrMismatch, "blk.1.ffn_up_exps.weight: has shape [15, 48, 64], the config needs 16 experts of [48, 64]"},
		{"stacked transposed", mixtral, func(p *ggufParts) {
			w := p.tensor("blk.2.ffn_down_exps.weight")
			w.Dims[0], w.Dims[1] = w.Dims[1], w.Dims[0]
		}, loader.ErrMismatch, "blk.2.ffn_down_exps.weight: has shape [8, 96, 64], the config needs 8 experts of [64, 96]"},
		{"qwen2moe", qwen, func(p *ggufParts) { p.set("general.architecture", "qwen2moe") }, loader.ErrConfig,
			`"qwen2moe" (a mixture of experts with a shared expert) is not supported yet`},
		{"synthetic routing without seed", qwen, func(p *ggufParts) {
			p.set(loader.GGUFSyntheticSkew, 1.2)
			p.set(loader.GGUFSyntheticLocality, 0.5)
		}, loader.ErrConfig, "metadata strata.synthetic_routing.seed is missing"},
		{"synthetic skew a string", mixtral, func(p *ggufParts) {
			p.set(loader.GGUFSyntheticSkew, "high")
			p.set(loader.GGUFSyntheticLocality, 0.5)
			p.set(loader.GGUFSyntheticSeed, uint64(3))
		}, loader.ErrFormat, "metadata strata.synthetic_routing.skew: is a string, want a float"},
		{"synthetic locality 1", mixtral, func(p *ggufParts) {
			p.set(loader.GGUFSyntheticSkew, 1.2)
			p.set(loader.GGUFSyntheticLocality, 1.0)
			p.set(loader.GGUFSyntheticSeed, uint64(3))
		}, loader.ErrConfig, "locality 1 must be in [0, 1)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := fixtureParts(t, tc.fixture, storedTypes)
			tc.edit(p)
			path := p.write(t, filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-")+".gguf"))
			m, err := loader.Open(path)
			if err == nil {
				m.Close()
			}
			if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), path) || strings.Contains(err.Error(), "\n") {
				t.Errorf("Open: %v; want one line naming %s with %q (%v)", err, path, tc.msg, tc.kind)
			}
		})
	}
}
