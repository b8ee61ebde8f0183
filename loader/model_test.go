package loader

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

var blockSuffixes = []string{
	"input_layernorm.weight",
	"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
	"post_attention_layernorm.weight",
	"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}

func openFixture(t *testing.T, name string) *Model {
	t.Helper()
	m, err := Open(fixtures.Dir(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func TestOpenFixtures(t *testing.T) {
	for _, fx := range []struct {
		name  string
		dtype tensor.DType
		files int
	}{
		{fixtures.TinyLlamaF16Sharded, tensor.F16, 22},
		{fixtures.TinyLlamaBF16, tensor.BF16, 1},
	} {
		t.Run(fx.name, func(t *testing.T) {
			m := openFixture(t, fx.name)
			// The values in the fixtures' config.json.
			want := &arch.Config{
				Family:     arch.Llama,
				HiddenSize: 64, IntermediateSize: 172, NumLayers: 4, NumHeads: 4, NumKVHeads: 2, HeadDim: 16,
				VocabSize: 512, RMSNormEps: 1e-5, RopeTheta: 10000, MaxPositions: 256,
				BOS: 1, EOS: []int{2}, DType: fx.dtype,
			}
			if !reflect.DeepEqual(m.Config, want) {
				t.Errorf("config\n got %+v\nwant %+v", m.Config, want)
			}
			if len(m.Files()) != fx.files {
				t.Errorf("%d weight files, want %d", len(m.Files()), fx.files)
			}
			if len(m.Extras()) != 0 {
				t.Errorf("extras %v, want none", m.Extras())
			}
			layers := m.Layers()
			if len(layers) != 6 {
				t.Fatalf("%d layers, want 6", len(layers))
			}
			names := func(l Layer) []string {
				var out []string
				for _, ti := range l.Tensors {
					out = append(out, ti.Name)
				}
				return out
			}
			if got := names(layers[0]); !reflect.DeepEqual(got, []string{"model.embed_tokens.weight"}) || layers[0].Kind != arch.Embedding || layers[0].Block != -1 {
				t.Errorf("layer 0: %v %v %v", layers[0].Kind, layers[0].Block, got)
			}
			for i := 1; i <= 4; i++ {
				l := layers[i]
				var want []string
				for _, s := range blockSuffixes {
					want = append(want, fmt.Sprintf("model.layers.%d.%s", i-1, s))
				}
				if got := names(l); !reflect.DeepEqual(got, want) || l.Kind != arch.Block || l.Block != i-1 || l.Index != i {
					t.Errorf("layer %d: %v block %d: %v", i, l.Kind, l.Block, got)
				}
				// q 64x64, k/v 32x64, o 64x64, gate/up 172x64, down 64x172, two norms of 64.
				wantBytes := int64(2 * (64*64*2 + 32*64*2 + 3*172*64 + 2*64))
				if l.Bytes != wantBytes {
					t.Errorf("layer %d: %d bytes, want %d", i, l.Bytes, wantBytes)
				}
			}
			if got := names(layers[5]); !reflect.DeepEqual(got, []string{"model.norm.weight", "lm_head.weight"}) || layers[5].Kind != arch.Head {
				t.Errorf("layer 5: %v %v", layers[5].Kind, got)
			}
			// 247360 parameters of 2 bytes (the shard index's total_size).
			if m.WeightBytes() != 494720 {
				t.Errorf("WeightBytes %d, want 494720", m.WeightBytes())
			}
		})
	}
}

// TestReadTensorStoredBytes compares every tensor with the bytes a separate
// minimal parser finds in the files.
func TestReadTensorStoredBytes(t *testing.T) {
	ctx := context.Background()
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16} {
		m := openFixture(t, name)
		raws := map[string]*rawFile{}
		for _, ti := range m.Tensors() {
			r := raws[ti.File]
			if r == nil {
				r = readRaw(t, filepath.Join(m.Dir, ti.File))
				raws[ti.File] = r
			}
			got, err := m.ReadTensor(ctx, ti.Name)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), r.tensorBytes(t, ti.Name)) {
				t.Errorf("%s %s: bytes differ from the file", name, ti.Name)
			}
			if got.DType() != ti.DType || !got.Shape().Equal(ti.Shape) {
				t.Errorf("%s: %v %v, info says %v %v", ti.Name, got.DType(), got.Shape(), ti.DType, ti.Shape)
			}
		}
	}
}

// The two fixtures hold the same weights in F16 (22 shards) and BF16 (one
// file): reading both must agree to BF16 precision, tensor by tensor.
func TestFixturesAgree(t *testing.T) {
	ctx := context.Background()
	f16, bf16 := openFixture(t, fixtures.TinyLlamaF16Sharded), openFixture(t, fixtures.TinyLlamaBF16)
	for _, ti := range f16.Tensors() {
		a, err := f16.ReadTensor(ctx, ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		b, err := bf16.ReadTensor(ctx, ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		av, bv := a.ToF32(), b.ToF32()
		var maxAbs float64
		for _, v := range av {
			maxAbs = max(maxAbs, math.Abs(float64(v)))
		}
		for i := range av {
			if d := math.Abs(float64(av[i] - bv[i])); d > 1.0/128*math.Abs(float64(av[i]))+1e-3*maxAbs {
				t.Fatalf("%s[%d]: F16 %v, BF16 %v", ti.Name, i, av[i], bv[i])
			}
		}
	}
}

func TestReadIntoConcurrentAndClose(t *testing.T) {
	ctx := context.Background()
	m, err := Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{}
	for _, ti := range m.Tensors() {
		tt, err := m.ReadTensor(ctx, ti.Name)
		if err != nil {
			t.Fatal(err)
		}
		want[ti.Name] = tt.Bytes()
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			for round := range 5 {
				for i, ti := range m.Tensors() {
					if (i+g+round)%3 != 0 {
						continue
					}
					dst := make([]byte, ti.Size)
					if err := m.ReadInto(ctx, ti, dst); err != nil {
						errs <- err
						return
					}
					if !bytes.Equal(dst, want[ti.Name]) {
						errs <- fmt.Errorf("%s: concurrent read differs", ti.Name)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	ti, _ := m.Tensor("model.norm.weight")
	if err := m.ReadInto(ctx, ti, make([]byte, ti.Size-1)); err == nil || !errors.Is(err, ErrMismatch) {
		t.Errorf("short destination: %v", err)
	}
	// A part of a tensor: row 3 of the embedding.
	emb, _ := m.Tensor(arch.EmbedName)
	row := make([]byte, 64*2)
	if err := m.ReadRange(ctx, emb, 3*128, row); err != nil || !bytes.Equal(row, want[arch.EmbedName][3*128:4*128]) {
		t.Errorf("ReadRange row 3: %v", err)
	}
	if err := m.ReadRange(ctx, emb, emb.Size-10, row); err == nil {
		t.Error("ReadRange past the tensor's end succeeded")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := m.ReadInto(cctx, ti, make([]byte, ti.Size)); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled read: %v", err)
	}
	if _, err := m.ReadTensor(ctx, "no.such.tensor"); err == nil {
		t.Error("ReadTensor of a missing name succeeded")
	}
	foreign := *ti
	foreign.File = "other.safetensors"
	if err := m.ReadInto(ctx, &foreign, make([]byte, ti.Size)); err == nil {
		t.Error("read of a tensor from another file succeeded")
	}
	sec, err := m.Section(ti)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := readAll(sec); err != nil || !bytes.Equal(b, want[ti.Name]) {
		t.Errorf("Section: %v", err)
	}

	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := m.ReadInto(ctx, ti, make([]byte, ti.Size)); !errors.Is(err, ErrClosed) {
		t.Errorf("read after Close: %v", err)
	}
}

func readAll(r interface {
	ReadAt([]byte, int64) (int, error)
	Size() int64
}) ([]byte, error) {
	b := make([]byte, r.Size())
	_, err := r.ReadAt(b, 0)
	return b, err
}

func TestOpenSafetensorsReference(t *testing.T) {
	f, err := OpenSafetensors(filepath.Join(fixtures.Dir(fixtures.TinyLlamaBF16), "reference.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ids, err := f.ReadTensor(context.Background(), "input_ids")
	if err != nil {
		t.Fatal(err)
	}
	var ref struct {
		PromptLen int `json:"prompt_len"`
	}
	data, err := os.ReadFile(filepath.Join(fixtures.Dir(fixtures.TinyLlamaBF16), "reference.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &ref); err != nil {
		t.Fatal(err)
	}
	if ids.DType() != tensor.I64 || !ids.Shape().Equal(tensor.Shape{int(ref.PromptLen)}) {
		t.Fatalf("input_ids %v %v, reference.json says %d ids", ids.DType(), ids.Shape(), ref.PromptLen)
	}
	for _, id := range ids.I64() {
		if id < 0 || id >= 512 {
			t.Errorf("input id %d outside the vocabulary", id)
		}
	}
	// Offsets are in increasing order.
	ts := f.Tensors()
	for i := 1; i < len(ts); i++ {
		if ts[i].Offset < ts[i-1].Offset+ts[i-1].Size {
			t.Errorf("%s before %s", ts[i].Name, ts[i-1].Name)
		}
	}
}
