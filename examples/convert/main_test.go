package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/examples/internal/cli"
	"github.com/strata-llm/strata/internal/filetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

func runArgs(args ...string) (stdout, stderr string, err error) {
	return runCtx(context.Background(), args...)
}

func runCtx(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	var o, e bytes.Buffer
	err = run(ctx, args, &o, &e)
	return o.String(), e.String(), err
}

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

// TestConvertFixtures: each fixture converted to its own float type, and
// to Q8_0, opens with the fixture's config and tokenizer; a float
// conversion keeps every value, Q8_0 stores the weights whose rows are
// whole blocks quantized (the rest in the model's half-precision type, as
// convert says) and the norms F32.
func TestConvertFixtures(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		fixture, quantize string
	}{
		{fixtures.TinyLlamaF16Sharded, "f16"},
		{fixtures.TinyLlamaBF16, "bf16"},
		{fixtures.TinyLlamaF16Sharded, "q8_0"},
		{fixtures.TinyLlamaBF16, "Q4_0"},
		{fixtures.TinyQwen3F16, "f16"},
		{fixtures.TinyQwen3F16, "q8_0"},
	} {
		t.Run(tc.fixture+"/"+tc.quantize, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "m.gguf")
			stdout, stderr, err := runArgs("-model", fixtures.Dir(tc.fixture), "-out", out, "-quantize", tc.quantize, "-quiet")
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(stdout, "bits per weight") {
				t.Errorf("stdout %q", stdout)
			}
			src, err := loader.Open(fixtures.Dir(tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			m, err := loader.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			whole, partial := 0, 0 // 2-D tensors of rows of whole 32-element blocks, or not
			for _, spec := range src.Config.ExpectedTensors() {
				if cols := spec.Shape[len(spec.Shape)-1]; len(spec.Shape) == 2 && cols%32 == 0 {
					whole++
				} else if len(spec.Shape) == 2 {
					partial++
				}
			}
			want := *src.Config
			if q := strings.ToLower(tc.quantize); q != "f16" && q != "bf16" && partial == 0 {
				want.DType = tensor.F32 // no float weights left but the F32 norms
			}
			if want.BOS < 0 && len(want.EOS) == 0 {
				// config.json names none (tiny-qwen3-f16): the GGUF has
				// the tokenizer's <s> and </s>, as llama.cpp's converter
				// writes them.
				want.BOS, want.EOS = 1, []int{2}
			}
			if !reflect.DeepEqual(m.Config, &want) {
				t.Errorf("config\n got %+v\nwant %+v", m.Config, &want)
			}
			if name, _ := m.GGUF().Metadata.String("general.name"); name != tc.fixture {
				t.Errorf("general.name %q", name)
			}
			tok, err := m.Tokenizer()
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range refCases(t, tc.fixture) {
				if got, err := tok.Encode(c.Text, false); err != nil || !reflect.DeepEqual(got, append([]int{}, c.IDs...)) {
					t.Errorf("Encode(%q) = %v, %v; want %v", c.Text, got, err, c.IDs)
				}
			}
			quantized := 0
			for _, spec := range src.Config.ExpectedTensors() {
				ti, _ := m.Tensor(spec.Name)
				sti, _ := src.Tensor(spec.Name)
				rows := int(spec.Shape.NumElements()) / spec.Shape[len(spec.Shape)-1]
				got, ref := make([]float32, spec.Shape.NumElements()), make([]float32, spec.Shape.NumElements())
				if err := m.ReadRows(ctx, ti, 0, rows, got); err != nil {
					t.Fatal(err)
				}
				if err := src.ReadRows(ctx, sti, 0, rows, ref); err != nil {
					t.Fatal(err)
				}
				switch {
				case len(spec.Shape) == 1:
					if ti.DType != tensor.F32 || !reflect.DeepEqual(got, ref) {
						t.Errorf("%s: %v, or its values changed", spec.Name, ti.DType)
					}
				case ti.DType.IsQuantized():
					quantized++
					q, _ := ti.DType.Quant()
					enc := make([]byte, ti.Size)
					if err := q.Quantize(enc, ref); err != nil {
						t.Fatal(err)
					}
					raw, _ := m.ReadTensor(ctx, spec.Name)
					if !bytes.Equal(raw.Bytes(), enc) {
						t.Errorf("%s: the %v bytes are not the Hugging Face rows quantized", spec.Name, ti.DType)
					}
				default:
					if !reflect.DeepEqual(got, ref) {
						t.Errorf("%s (%v): values changed", spec.Name, ti.DType)
					}
				}
			}
			fallbacks := strings.Count(stderr, "are not whole 32-element blocks")
			if tc.quantize == "f16" || tc.quantize == "bf16" {
				if quantized != 0 || fallbacks != 0 {
					t.Errorf("%d quantized tensors, stderr %q", quantized, stderr)
				}
			} else if quantized != whole || fallbacks != partial || whole == 0 {
				t.Errorf("%d quantized tensors, want %d; stderr %q, want %d fallbacks", quantized, whole, stderr, partial)
			}
			// qwen3 as llama.cpp's converter writes it: the head size in
			// the metadata, the q/k norms F32 per head.
			a, _ := m.GGUF().Metadata.String("general.architecture")
			if want, _ := loader.GGUFArchitecture(src.Config); a != want {
				t.Errorf("general.architecture %q, want %q", a, want)
			}
			if src.Config.QKNorm {
				for _, k := range []string{"qwen3.attention.key_length", "qwen3.attention.value_length", "qwen3.rope.dimension_count"} {
					if v, err := m.GGUF().Metadata.Uint(k); err != nil || v != uint64(src.Config.HeadDim) {
						t.Errorf("%s: %d, %v; want %d", k, v, err, src.Config.HeadDim)
					}
				}
				for _, n := range []string{"blk.3.attn_q_norm.weight", "blk.3.attn_k_norm.weight"} {
					if gt, ok := m.GGUF().Tensor(n); !ok || gt.Type != quant.F32 || !reflect.DeepEqual(gt.Dims, []int64{int64(src.Config.HeadDim)}) {
						t.Errorf("%s: %+v, %v", n, gt, ok)
					}
				}
			}
		})
	}
}

// TestConvertKQuants: a model whose rows are whole super-blocks converts
// to q4_k with Q4_K weights and embedding, a Q6_K head and F32 norms, each
// the reference quantization of the Hugging Face rows; its values are
// within the format's error of the model's; converted again (from the
// GGUF file) to q6_k it keeps its shape and tokenizer.
func TestConvertKQuants(t *testing.T) {
	ctx := context.Background()
	c, _ := arch.Preset("tiny")
	c.HiddenSize, c.IntermediateSize, c.NumLayers, c.HeadDim = 256, 512, 2, 64
	dir := filepath.Join(t.TempDir(), "model")
	if err := loader.Synthesize(ctx, dir, c, loader.SynthOptions{Seed: 3, TokenizerFrom: fixtures.Dir(fixtures.TinyLlamaF16Sharded)}); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "q4k.gguf")
	if _, stderr, err := runArgs("-model", dir, "-out", out, "-quantize", "q4_k", "-quiet"); err != nil || stderr != "" {
		t.Fatalf("%v; stderr %q", err, stderr)
	}
	src, _ := loader.Open(dir)
	defer src.Close()
	m, err := loader.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if ft, _ := m.GGUF().Metadata.Uint("general.file_type"); ft != 14 {
		t.Errorf("general.file_type %d, want 14 (Q4_K_S)", ft)
	}
	for _, spec := range c.ExpectedTensors() {
		ti, _ := m.Tensor(spec.Name)
		want := map[arch.Role]tensor.DType{arch.LMHead: tensor.Q6_K, arch.AttnNorm: tensor.F32, arch.MLPNorm: tensor.F32, arch.FinalNorm: tensor.F32}[spec.Role]
		if want == tensor.Invalid {
			want = tensor.Q4_K
		}
		if ti.DType != want {
			t.Errorf("%s is %v, want %v", spec.Name, ti.DType, want)
		}
		if len(spec.Shape) != 2 {
			continue
		}
		sti, _ := src.Tensor(spec.Name)
		ref := make([]float32, spec.Shape.NumElements())
		src.ReadRows(ctx, sti, 0, spec.Shape[0], ref)
		q, _ := ti.DType.Quant()
		enc := make([]byte, ti.Size)
		q.Quantize(enc, ref)
		raw, _ := m.ReadTensor(ctx, spec.Name)
		if !bytes.Equal(raw.Bytes(), enc) {
			t.Errorf("%s: the bytes are not the reference %v of the Hugging Face rows", spec.Name, q)
		}
		got := make([]float32, len(ref))
		m.ReadRows(ctx, ti, 0, spec.Shape[0], got)
		var d2, r2 float64
		for i := range ref {
			d := float64(got[i] - ref[i])
			d2, r2 = d2+d*d, r2+float64(ref[i])*float64(ref[i])
		}
		if rel := math.Sqrt(d2 / r2); !(rel < 0.12) {
			t.Errorf("%s: %v values differ by %.3g RMS (relative)", spec.Name, q, rel)
		}
	}

	again := filepath.Join(t.TempDir(), "q6k.gguf")
	if _, _, err := runArgs("-model", out, "-out", again, "-quantize", "q6_k", "-quiet"); err != nil {
		t.Fatal(err)
	}
	m2, err := loader.Open(again)
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	wantCfg := m.Config.Clone()
	wantCfg.DType = tensor.F32
	if !reflect.DeepEqual(m2.Config, wantCfg) {
		t.Errorf("config converted twice\n got %+v\nwant %+v", m2.Config, wantCfg)
	}
	t1, _ := m.Tokenizer()
	t2, _ := m2.Tokenizer()
	v1, _ := t1.GGUFVocab(c.VocabSize)
	v2, _ := t2.GGUFVocab(c.VocabSize)
	if !reflect.DeepEqual(v1, v2) {
		t.Error("the tokenizer changed when converted again")
	}
}

// TestConvertBadInput: bad flags are usage errors, bad models errors, each
// one line; nothing is written, and an -out that exists is left as it was.
func TestConvertBadInput(t *testing.T) {
	tmp := t.TempDir()
	model := fixtures.Dir(fixtures.TinyLlamaBF16)
	old := filepath.Join(tmp, "old.gguf")
	os.WriteFile(old, []byte("an earlier file"), 0o644)
	// A model whose tokenizer GGUF cannot describe.
	odd, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, filepath.Join(tmp, "odd"))
	if err != nil {
		t.Fatal(err)
	}
	var tj map[string]any
	raw, _ := os.ReadFile(filepath.Join(odd, "tokenizer.json"))
	if err := json.Unmarshal(raw, &tj); err != nil {
		t.Fatal(err)
	}
	tj["pre_tokenizer"] = map[string]any{"type": "WhitespaceSplit"}
	raw, _ = json.Marshal(tj)
	os.WriteFile(filepath.Join(odd, "tokenizer.json"), raw, 0o644)
	out := filepath.Join(tmp, "out.gguf")
	for _, tc := range []struct {
		name  string
		args  []string
		usage bool
		msg   string
	}{
		{"no -model", []string{"-out", out}, true, "-model"},
		{"no -out", []string{"-model", model}, true, "-out"},
		{"bad type", []string{"-model", model, "-out", out, "-quantize", "q2_k"}, true, `"q2_k"`},
		{"negative threads", []string{"-model", model, "-out", out, "-threads", "-1"}, true, "-threads"},
		{"extra argument", []string{"-model", model, "-out", out, "x"}, true, `"x"`},
		{"out exists", []string{"-model", model, "-out", old}, true, "-force"},
		{"out is an input", []string{"-model", model, "-out", filepath.Join(model, "model.safetensors"), "-force"}, true, "-out"},
		{"out is the model", []string{"-model", model, "-out", model, "-force"}, true, "-out"},
		{"out in no directory", []string{"-model", model, "-out", filepath.Join(tmp, "none", "x.gguf")}, true, "none"},
		{"no model", []string{"-model", filepath.Join(tmp, "nope"), "-out", out}, false, "no such file"},
		{"odd tokenizer", []string{"-model", odd, "-out", out}, false, "-no-tokenizer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := runArgs(append(tc.args, "-quiet")...)
			if err == nil || cli.IsUsage(err) != tc.usage || !strings.Contains(err.Error(), tc.msg) || strings.Contains(err.Error(), "\n") {
				t.Fatalf("%v; want a one-line error (usage %v) with %q", err, tc.usage, tc.msg)
			}
			if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("-out was written")
			}
			if b, _ := os.ReadFile(old); string(b) != "an earlier file" {
				t.Errorf("the earlier file changed")
			}
			filetest.NoTemps(t, tmp)
		})
	}
	// -no-tokenizer writes the weights alone.
	if _, _, err := runArgs("-model", odd, "-out", out, "-no-tokenizer", "-quiet"); err != nil {
		t.Fatal(err)
	}
	m, err := loader.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if tok, err := m.Tokenizer(); tok != nil || err != nil {
		t.Errorf("tokenizer %v, %v; want none", tok, err)
	}
	var stdout, stderr bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &stdout, &stderr); !errors.Is(err, flag.ErrHelp) || !strings.Contains(stderr.String(), "-quantize") {
		t.Errorf("-h: %v, stderr %q", err, stderr.String())
	}
}

// TestConvertReplaces: with -force an existing file is replaced when the
// conversion completes, and kept whole when it is cancelled or the disk
// fills; no temporary file remains.
func TestConvertReplaces(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name  string
		ctx   context.Context
		limit uint64
		ok    bool
	}{
		{"complete", context.Background(), 0, true},
		{"cancelled", cancelled, 0, false},
		{"disk full", context.Background(), 100_000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "m.gguf")
			os.WriteFile(out, []byte("an earlier file"), 0o644)
			if tc.limit > 0 && !filetest.LimitFileSize(t, tc.limit) {
				t.Skip("cannot limit the file size here")
			}
			_, _, err := runCtx(tc.ctx, "-model", fixtures.Dir(fixtures.TinyLlamaF16Sharded), "-out", out, "-force", "-quiet")
			b, _ := os.ReadFile(out)
			switch {
			case tc.ok && (err != nil || !bytes.HasPrefix(b, []byte("GGUF"))):
				t.Errorf("%v; the file starts %q", err, b[:min(len(b), 8)])
			case !tc.ok && (err == nil || string(b) != "an earlier file" || strings.Contains(err.Error(), "\n")):
				t.Errorf("%v; the file holds %d bytes", err, len(b))
			}
			filetest.NoTemps(t, dir)
		})
	}
}

// TestConvertMoE: a mixture of experts converts with its experts stacked
// as llama.cpp stacks them and opens as the fixture's model: a float
// conversion keeps every value; Q8_0 quantizes the linear weights whose
// rows are whole blocks, the experts among them (each value within half a
// step of its block's, plus the F16 rounding of the step; a projection whose rows are not whole blocks stays
// in the half type, one line per block says so), and keeps the router F32.
func TestConvertMoE(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		fixture, quantize string
		stacked           quant.Type // the type of blk.0.ffn_up_exps.weight
		fallbacks         int        // stderr's lines on expert tensors kept in the half type
	}{
		{fixtures.TinyMixtralBF16, "f32", quant.F32, 0},
		{fixtures.TinyMixtralBF16, "q8_0", quant.Q8_0, 0},
		{fixtures.TinyQwen3MoEF16, "f16", quant.F16, 0},
		{fixtures.TinyQwen3MoEF16, "q8_0", quant.Q8_0, 3}, // down_proj's rows of 48
	} {
		t.Run(tc.fixture+"/"+tc.quantize, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "m.gguf")
			_, stderr, err := runArgs("-model", fixtures.Dir(tc.fixture), "-out", out, "-quantize", tc.quantize, "-quiet")
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Count(stderr, "_exps.weight: rows of"); got != tc.fallbacks {
				t.Errorf("stderr %q: %d lines on the experts, want %d", stderr, got, tc.fallbacks)
			}
			src, err := loader.Open(fixtures.Dir(tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			m, err := loader.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if !reflect.DeepEqual(m.Config.MoE, src.Config.MoE) || m.Config.Family != src.Config.Family {
				t.Errorf("%v %+v, want %v %+v", m.Config.Family, m.Config.MoE, src.Config.Family, src.Config.MoE)
			}
			c := src.Config
			gt, ok := m.GGUF().Tensor("blk.0.ffn_up_exps.weight")
			wantDims := []int64{int64(c.HiddenSize), int64(c.MoE.ExpertSize), int64(c.MoE.Experts)}
			if !ok || gt.Type != tc.stacked || !reflect.DeepEqual(gt.Dims, wantDims) {
				t.Errorf("blk.0.ffn_up_exps.weight: %+v, want %v %v", gt, tc.stacked, wantDims)
			}
			if gt, ok := m.GGUF().Tensor("blk.0.ffn_gate_inp.weight"); !ok || gt.Type != quant.F32 {
				t.Errorf("router: %+v", gt)
			}
			for _, spec := range c.ExpectedTensors() {
				if !spec.Role.IsExpert() && tc.quantize == "q8_0" {
					continue
				}
				ti, _ := m.Tensor(spec.Name)
				sti, _ := src.Tensor(spec.Name)
				rows := int(spec.Shape.NumElements()) / spec.Shape[len(spec.Shape)-1]
				got, ref := make([]float32, spec.Shape.NumElements()), make([]float32, spec.Shape.NumElements())
				if err := m.ReadRows(ctx, ti, 0, rows, got); err != nil {
					t.Fatal(err)
				}
				if err := src.ReadRows(ctx, sti, 0, rows, ref); err != nil {
					t.Fatal(err)
				}
				if ti.DType == tensor.Q8_0 {
					// Each value within half a step d/2 of its block's (d
					// the largest magnitude / 127), plus the rounding of d
					// to F16 (relative 2^-11) times the largest quant.
					for b := 0; b < len(ref); b += 32 {
						var amax float64
						for _, v := range ref[b : b+32] {
							amax = max(amax, math.Abs(float64(v)))
						}
						for i := b; i < b+32; i++ {
							if bound := amax / 127 * (0.5 + 127.0/2048); math.Abs(float64(got[i]-ref[i])) > bound {
								t.Fatalf("%s (Q8_0) [%d]: %g, want %g within %g", spec.Name, i, got[i], ref[i], bound)
							}
						}
					}
					continue
				}
				if !reflect.DeepEqual(got, ref) {
					t.Fatalf("%s (%v): values changed", spec.Name, ti.DType)
				}
			}
		})
	}
}
