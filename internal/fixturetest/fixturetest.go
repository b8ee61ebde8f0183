// Package fixturetest makes altered copies of the loader's fixtures for
// tests of bad weights: a copy in the test's temporary directory with one
// element set to a chosen bit pattern (a NaN, an infinity), or with one
// tensor's values changed and stored in another dtype. Only tests import
// it.
//
//	dir := fixturetest.Copy(t, fixtures.TinyLlamaBF16)
//	fixturetest.SetBits(t, dir, "model.layers.1.mlp.up_proj.weight", 7, 0x7fc0) // a BF16 NaN
package fixturetest

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// Copy extracts the named fixture into a fresh t.TempDir() and returns the
// model directory.
func Copy(t testing.TB, fixture string) string {
	t.Helper()
	dir, err := fixtures.Extract(fixture, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// locate returns where the named tensor's bytes are in the model directory.
func locate(t testing.TB, dir, name string) loader.TensorInfo {
	t.Helper()
	m, err := loader.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ti, ok := m.Tensor(name)
	if !ok {
		t.Fatalf("fixturetest: %s has no tensor %s", dir, name)
	}
	return *ti
}

// SetBits overwrites element index of the named tensor in the model
// directory dir with bits, the element's bit pattern in the tensor's dtype
// (the low 16 bits for F16 and BF16). The rest of the file is unchanged.
func SetBits(t testing.TB, dir, name string, index int64, bits uint32) {
	t.Helper()
	ti := locate(t, dir, name)
	size := int64(ti.DType.Size())
	if index < 0 || (index+1)*size > ti.Size {
		t.Fatalf("fixturetest: element %d is outside %s", index, ti.String())
	}
	b := binary.LittleEndian.AppendUint32(nil, bits)[:size]
	f, err := os.OpenFile(filepath.Join(dir, ti.File), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, ti.Offset+index*size); err != nil {
		t.Fatal(err)
	}
}

// Replace rewrites the weight file holding the named tensor with that
// tensor's values mapped by fn and stored as dt; the file's other tensors
// keep their bytes. fn gets the element's index and value.
func Replace(t testing.TB, dir, name string, dt tensor.DType, fn func(i int, v float32) float32) {
	t.Helper()
	ti := locate(t, dir, name)
	path := filepath.Join(dir, ti.File)
	f, err := loader.OpenSafetensors(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []loader.NamedTensor
	ctx := context.Background()
	for _, info := range f.Tensors() {
		x, err := f.ReadTensor(ctx, info.Name)
		if err != nil {
			f.Close()
			t.Fatal(err)
		}
		if info.Name == name {
			v := x.ToF32()
			for i := range v {
				v[i] = fn(i, v[i])
			}
			x = tensor.New(dt, x.Shape())
			switch dt {
			case tensor.F32:
				copy(x.F32(), v)
			case tensor.F16:
				tensor.F32ToF16(x.U16(), v)
			case tensor.BF16:
				tensor.F32ToBF16(x.U16(), v)
			default:
				t.Fatalf("fixturetest: cannot store %s as %v", name, dt)
			}
		}
		out = append(out, loader.NamedTensor{Name: info.Name, T: x})
	}
	meta := f.Metadata
	f.Close()
	if err := loader.WriteSafetensors(path, out, meta); err != nil {
		t.Fatal(err)
	}
}

// EditConfig rewrites the config.json of the model in dir with edit, which
// changes the decoded JSON object in place.
func EditConfig(t testing.TB, dir string, edit func(cfg map[string]any)) {
	t.Helper()
	path := filepath.Join(dir, "config.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg := map[string]any{}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	edit(cfg)
	if raw, err = json.Marshal(cfg); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
}

// Mistral writes a copy of the BF16 fixture as a Mistral model whose
// sliding attention window is window positions (the fixture has 256), and
// returns its directory.
func Mistral(t testing.TB, window int) string {
	t.Helper()
	dir := Copy(t, fixtures.TinyLlamaBF16)
	EditConfig(t, dir, func(cfg map[string]any) {
		cfg["architectures"], cfg["model_type"], cfg["sliding_window"] = []string{"MistralForCausalLM"}, "mistral", window
		delete(cfg, "attention_bias")
		delete(cfg, "mlp_bias")
	})
	return dir
}
