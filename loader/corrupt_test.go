package loader

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/tensor"
)

// tinyModel synthesises the tiny preset into a fresh directory, in one file
// or in shards, and returns the directory.
func tinyModel(t *testing.T, sharded bool) string {
	t.Helper()
	cfg, err := arch.Preset("tiny")
	if err != nil {
		t.Fatal(err)
	}
	cfg.NumLayers = 2
	opts := SynthOptions{Seed: 3}
	if sharded {
		opts.MaxShardBytes = 40_000
	}
	dir := t.TempDir()
	if err := Synthesize(context.Background(), dir, cfg, opts); err != nil {
		t.Fatal(err)
	}
	return dir
}

// shardOf returns the shard holding name, from the index.
func shardOf(t *testing.T, dir, name string) string {
	t.Helper()
	var idx indexJSON
	data, err := os.ReadFile(filepath.Join(dir, IndexFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &idx); err != nil {
		t.Fatal(err)
	}
	return idx.WeightMap[name]
}

func editIndex(t *testing.T, dir string, mutate func(wm map[string]string)) {
	t.Helper()
	path := filepath.Join(dir, IndexFile)
	var idx indexJSON
	data, _ := os.ReadFile(path)
	if err := json.Unmarshal(data, &idx); err != nil {
		t.Fatal(err)
	}
	mutate(idx.WeightMap)
	out, _ := json.Marshal(idx)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

func editConfig(t *testing.T, dir string, mutate func(c map[string]any)) {
	t.Helper()
	path := filepath.Join(dir, ConfigFile)
	var c map[string]any
	data, _ := os.ReadFile(path)
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	mutate(c)
	out, _ := json.Marshal(c)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestOpenCorrupt(t *testing.T) {
	const q0 = "model.layers.0.self_attn.q_proj.weight"
	const k1 = "model.layers.1.self_attn.k_proj.weight"
	single := func(dir string) string { return filepath.Join(dir, SingleFile) }
	cases := []struct {
		name    string
		sharded bool
		corrupt func(t *testing.T, dir string)
		kind    error
		want    []string // substrings of the error
	}{
		{"file too short", false, func(t *testing.T, dir string) {
			os.WriteFile(single(dir), []byte{1, 2, 3}, 0o644)
		}, ErrFormat, []string{"model.safetensors", "too short"}},
		{"header length beyond file", false, func(t *testing.T, dir string) {
			r := readRaw(t, single(dir))
			writeRaw(t, single(dir), r.header, r.data, 1<<20)
		}, ErrFormat, []string{"model.safetensors", "header length 1048576 runs past the end"}},
		{"hostile header length", false, func(t *testing.T, dir string) {
			r := readRaw(t, single(dir))
			writeRaw(t, single(dir), r.header, r.data, 1<<60)
		}, ErrFormat, []string{"model.safetensors", "header length 1152921504606846976"}},
		{"header length over the cap", false, func(t *testing.T, dir string) {
			// A sparse 200 MB file claiming a 150 MB header: inside the
			// file, but over the limit, and refused before allocating.
			writeRaw(t, single(dir), "{}", nil, 150<<20)
			if err := os.Truncate(single(dir), 200<<20); err != nil {
				t.Fatal(err)
			}
		}, ErrFormat, []string{"model.safetensors", "exceeds the limit of 104857600"}},
		{"bad JSON", false, func(t *testing.T, dir string) {
			r := readRaw(t, single(dir))
			writeRaw(t, single(dir), `{"a": {"dtype": "F16", `, r.data, -1)
		}, ErrFormat, []string{"model.safetensors", "bad JSON"}},
		{"header not an object", false, func(t *testing.T, dir string) {
			writeRaw(t, single(dir), `[1, 2]`, nil, -1)
		}, ErrFormat, []string{"model.safetensors", "not a JSON object"}},
		{"trailing data after header", false, func(t *testing.T, dir string) {
			writeRaw(t, single(dir), `{} {}`, nil, -1)
		}, ErrFormat, []string{"model.safetensors", "trailing"}},
		{"duplicate tensor in header", false, func(t *testing.T, dir string) {
			writeRaw(t, single(dir), `{"x": {"dtype":"F16","shape":[1],"data_offsets":[0,2]}, "x": {"dtype":"F16","shape":[1],"data_offsets":[2,4]}}`, make([]byte, 4), -1)
		}, ErrFormat, []string{"model.safetensors", "tensor x", "twice"}},
		{"unknown dtype", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h[q0].(map[string]any)["dtype"] = "F8_E4M3" })
		}, ErrFormat, []string{"model.safetensors", q0, `unsupported dtype "F8_E4M3"`}},
		{"missing dtype", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { delete(h[q0].(map[string]any), "dtype") })
		}, ErrFormat, []string{q0, "no dtype"}},
		{"negative dimension", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h[q0].(map[string]any)["shape"] = []int{-64, -64} })
		}, ErrFormat, []string{q0, "bad dimension -64"}},
		{"shape does not match span", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h[q0].(map[string]any)["shape"] = []int{64, 63} })
		}, ErrFormat, []string{q0, "shape [64, 63] of F16 needs 8064 bytes", "span 8192"}},
		{"dtype does not match span", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h[q0].(map[string]any)["dtype"] = "F32" })
		}, ErrFormat, []string{q0, "needs 16384 bytes"}},
		{"offsets outside the file", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) {
				e := h[arch.LMHeadName].(map[string]any)
				off := e["data_offsets"].([]any)
				e["data_offsets"] = []float64{off[0].(float64) + 1000, off[1].(float64) + 1000}
			})
		}, ErrFormat, []string{arch.LMHeadName, "run past the end of the data"}},
		{"offsets reversed", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h[q0].(map[string]any)["data_offsets"] = []int{100, 50} })
		}, ErrFormat, []string{q0, "bad data_offsets [100, 50]"}},
		{"offsets overlap", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) {
				// k_proj of block 1 moved half onto its neighbour.
				e := h[k1].(map[string]any)
				off := e["data_offsets"].([]any)
				e["data_offsets"] = []float64{off[0].(float64) - 2048, off[1].(float64) - 2048}
			})
		}, ErrFormat, []string{"model.safetensors", "overlap"}},
		{"bad metadata", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h["__metadata__"] = map[string]any{"n": 1} })
		}, ErrFormat, []string{"__metadata__"}},
		{"index points to missing file", true, func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, shardOf(t, dir, k1)))
		}, ErrFormat, []string{IndexFile, "does not exist"}},
		{"index points to missing tensor", true, func(t *testing.T, dir string) {
			editIndex(t, dir, func(wm map[string]string) { wm[k1] = wm[arch.EmbedName] })
		}, ErrFormat, []string{IndexFile, k1, "no such tensor"}},
		{"index names a path outside the directory", true, func(t *testing.T, dir string) {
			editIndex(t, dir, func(wm map[string]string) { wm[k1] = "../" + wm[k1] })
		}, ErrFormat, []string{IndexFile, k1, "not a file name"}},
		{"index bad JSON", true, func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, IndexFile), []byte(`{"weight_map": [`), 0o644)
		}, ErrFormat, []string{IndexFile, "bad JSON"}},
		{"index empty", true, func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, IndexFile), []byte(`{"metadata": {}}`), 0o644)
		}, ErrFormat, []string{IndexFile, "no weight_map"}},
		{"corrupt shard", true, func(t *testing.T, dir string) {
			shard := filepath.Join(dir, shardOf(t, dir, k1))
			rewrite(t, shard, func(h map[string]any) { h[k1].(map[string]any)["shape"] = []int{1} })
		}, ErrFormat, []string{"model-0000", k1, "shape [1]"}},
		{"tensor in two shards", true, func(t *testing.T, dir string) {
			shard := filepath.Join(dir, shardOf(t, dir, arch.EmbedName))
			other := filepath.Join(dir, shardOf(t, dir, k1))
			r := readRaw(t, shard)
			// Append the embedding's bytes to another shard under the same name.
			o := readRaw(t, other)
			emb := r.tensorBytes(t, arch.EmbedName)
			o.header[arch.EmbedName] = entry("F16", []int{512, 64}, int64(len(o.data)), int64(len(o.data)+len(emb)))
			writeRaw(t, other, o.header, append(o.data, emb...), -1)
		}, ErrFormat, []string{arch.EmbedName, "also stored in"}},
		{"no weights", false, func(t *testing.T, dir string) {
			os.Remove(single(dir))
		}, fs.ErrNotExist, []string{"no model.safetensors or model.safetensors.index.json"}},
		{"no config", false, func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, ConfigFile))
		}, fs.ErrNotExist, []string{"config.json"}},
		{"config bad JSON", false, func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, ConfigFile), []byte(`{"hidden_size": 64,`), 0o644)
		}, ErrConfig, []string{"config.json", "bad JSON"}},
		{"unsupported architecture", false, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) {
				c["architectures"] = []string{"GPTNeoXForCausalLM"}
				delete(c, "model_type")
			})
		}, ErrConfig, []string{"config.json", `unsupported architecture "GPTNeoXForCausalLM"`}},
		{"missing tensor", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { delete(h, k1) })
		}, ErrMismatch, []string{k1, "missing"}},
		{"missing biases for qwen2", false, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) {
				c["architectures"], c["model_type"] = []string{"Qwen2ForCausalLM"}, "qwen2"
			})
		}, ErrMismatch, []string{"model.layers.0.self_attn.q_proj.bias", "missing", "qwen2", "(and 5 more problems)"}},
		{"missing biases for attention_bias", false, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["attention_bias"] = true })
		}, ErrMismatch, []string{"model.layers.0.self_attn.q_proj.bias", "missing"}},
		{"missing lm_head", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { delete(h, arch.LMHeadName) })
		}, ErrMismatch, []string{arch.LMHeadName, "missing"}},
		{"wrong shape for the config", false, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["intermediate_size"] = 128 })
		}, ErrMismatch, []string{"model.layers.0.mlp.gate_proj.weight", "has shape [172, 64], the config needs [128, 64]"}},
		{"wrong kv heads for the config", true, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["num_key_value_heads"] = 4 })
		}, ErrMismatch, []string{"model.layers.0.self_attn.k_proj.weight", "has shape [32, 64], the config needs [64, 64]"}},
		{"wrong vocab for the config", false, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["vocab_size"] = 1000 })
		}, ErrMismatch, []string{arch.EmbedName, "[1000, 64]"}},
		{"integer weight", false, func(t *testing.T, dir string) {
			r := readRaw(t, single(dir))
			r.header["model.norm.weight"] = entry("I32", []int{64}, int64(len(r.data)), int64(len(r.data)+256))
			writeRaw(t, single(dir), r.header, append(r.data, make([]byte, 256)...), -1)
		}, ErrMismatch, []string{"model.norm.weight", "has dtype I32"}},
	}
	// Pieces of the input that hold line breaks stay on the error's line.
	cases = append(cases, []struct {
		name    string
		sharded bool
		corrupt func(t *testing.T, dir string)
		kind    error
		want    []string
	}{
		{"eos list over several lines", false, func(t *testing.T, dir string) {
			path := filepath.Join(dir, ConfigFile)
			var c map[string]any
			data, _ := os.ReadFile(path)
			if err := json.Unmarshal(data, &c); err != nil {
				t.Fatal(err)
			}
			c["eos_token_id"] = []any{2, "end\nof text"}
			out, _ := json.MarshalIndent(c, "", "  ")
			os.WriteFile(path, out, 0o644)
		}, ErrConfig, []string{`eos_token_id [2,"end\nof text"] is neither a token id nor a list of them`}},
		{"bos over several lines", false, func(t *testing.T, dir string) {
			editConfig(t, dir, func(c map[string]any) { c["bos_token_id"] = []int{1, 2} })
		}, ErrConfig, []string{"bos_token_id [1,2] is not one token id"}},
		{"tensor name with a line break", false, func(t *testing.T, dir string) {
			rewrite(t, single(dir), func(h map[string]any) { h["evil\nname"] = entry("F8_E4M3", []int{1}, 0, 1) })
		}, ErrFormat, []string{`tensor "evil\nname"`, "unsupported dtype"}},
		{"index names a tensor with a line break", true, func(t *testing.T, dir string) {
			editIndex(t, dir, func(wm map[string]string) { wm["odd\r\nname"] = "model-99.safetensors" })
		}, ErrFormat, []string{`tensor "odd\r\nname"`, "does not exist"}},
	}...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := tinyModel(t, tc.sharded)
			tc.corrupt(t, dir)
			m, err := Open(dir)
			if err == nil {
				m.Close()
				t.Fatal("Open succeeded")
			}
			if !errors.Is(err, tc.kind) {
				t.Errorf("error %q does not wrap %v", err, tc.kind)
			}
			msg := err.Error()
			t.Log(msg)
			if !strings.HasPrefix(msg, "loader: ") {
				t.Errorf("error %q lacks the package prefix", msg)
			}
			if strings.ContainsAny(msg, "\r\n") {
				t.Errorf("error %q is more than one line", msg)
			}
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not mention %q", msg, w)
				}
			}
		})
	}
}

// Extra tensors are ignored but listed, and a tied model may still store an
// lm_head that nothing reads.
func TestOpenExtras(t *testing.T) {
	dir := tinyModel(t, false)
	path := filepath.Join(dir, SingleFile)
	r := readRaw(t, path)
	extra := make([]byte, 32)
	r.header["model.layers.0.self_attn.rotary_emb.inv_freq"] = entry("F32", []int{8}, int64(len(r.data)), int64(len(r.data)+32))
	r.header["model.layers.9.mlp.gate_proj.weight"] = entry("F16", []int{}, int64(len(r.data)+32), int64(len(r.data)+34))
	writeRaw(t, path, r.header, append(append(r.data, extra...), 0, 0), -1)
	editConfig(t, dir, func(c map[string]any) { c["tie_word_embeddings"] = true })
	m, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	want := []string{arch.LMHeadName, "model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.9.mlp.gate_proj.weight"}
	if strings.Join(m.Extras(), ",") != strings.Join(want, ",") {
		t.Errorf("extras %v, want %v", m.Extras(), want)
	}
	for _, l := range m.Layers() {
		for _, ti := range l.Tensors {
			if ti.Name == arch.LMHeadName || strings.Contains(ti.Name, "inv_freq") {
				t.Errorf("layer %v holds %s", l, ti.Name)
			}
		}
	}
	head := m.Layers()[len(m.Layers())-1]
	emb, _ := m.Tensor(arch.EmbedName)
	if head.Tensors[1] != emb || head.Bytes != emb.Size+64*2 {
		t.Errorf("tied head holds %v, %d bytes", head.Tensors, head.Bytes)
	}
	var sum int64
	for _, l := range m.Layers() {
		sum += l.Bytes
	}
	if m.WeightBytes() != sum-emb.Size {
		t.Errorf("WeightBytes %d counts the tied embedding twice or not at all (layers sum %d)", m.WeightBytes(), sum)
	}
	if ti, ok := m.Tensor("model.layers.0.self_attn.rotary_emb.inv_freq"); !ok || ti.DType != tensor.F32 {
		t.Errorf("extra tensor not findable: %v", ti)
	}
}

func TestOpenSafetensorsErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := OpenSafetensors(filepath.Join(dir, "none.safetensors")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := OpenSafetensors(dir); !errors.Is(err, ErrNotRegular) {
		t.Errorf("directory: %v", err)
	}
	// An empty header and an empty data region are a valid, empty file.
	p := filepath.Join(dir, "empty.safetensors")
	writeRaw(t, p, "{}      ", nil, -1)
	f, err := OpenSafetensors(p)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Tensors()) != 0 {
		t.Errorf("tensors in an empty file: %v", f.Tensors())
	}
	f.Close()
	if _, err := f.ReadTensor(context.Background(), "x"); err == nil {
		t.Error("ReadTensor of a missing tensor succeeded")
	}
}

// TestCheckedReadAcrossPieces: a checked read from any offset sees every
// element it holds whole, those that meet the boundary between two 16 MiB
// read pieces included, and names each by its index in the tensor.
func TestCheckedReadAcrossPieces(t *testing.T) {
	const n = readPiece/2 + 1024 // F16 elements: a little over one piece
	data := make([]byte, 2*n)
	path := filepath.Join(t.TempDir(), "big.safetensors")
	ctx := context.Background()
	for _, bad := range []int64{readPiece/2 - 1, readPiece / 2, readPiece/2 + 1} {
		clear(data)
		data[2*bad+1] = 0x7c // +Inf
		writeRaw(t, path, map[string]any{"w": entry("F16", []int{n}, 0, 2*n)}, data, -1)
		f, err := OpenSafetensors(path)
		if err != nil {
			t.Fatal(err)
		}
		ti, _ := f.Tensor("w")
		for _, off := range []int64{0, 1, 2, 3} {
			err := f.readRange(ctx, ti, off, make([]byte, ti.Size-off), true)
			var ne *NonFiniteError
			if !errors.As(err, &ne) || ne.Index != bad {
				t.Errorf("Inf at %d, read from byte %d: %v", bad, off, err)
			}
		}
		if err := f.ReadRange(ctx, ti, 1, make([]byte, ti.Size-1)); err != nil {
			t.Errorf("an unchecked read: %v", err)
		}
		f.Close()
	}
}
