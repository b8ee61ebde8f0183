package loader

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/tensor"
)

// Fuzz targets for everything the loader reads from a downloaded model
// directory: safetensors headers and tensor byte ranges, the shard index and
// config.json. Each asserts that bad input is an error (never a panic), that
// what is accepted is consistent by checks written independently of the
// parser, and that no read leaves a tensor's bytes.

// spanReader is an io.ReaderAt over b that records every range read and
// fails a read that starts outside b, so a fuzz target can check that the
// parser reads only inside the file it was given.
type spanReader struct {
	b        []byte
	maxEnd   int64
	negative bool
}

func (r *spanReader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		r.negative = true
		return 0, errors.New("negative offset")
	}
	r.maxEnd = max(r.maxEnd, off+int64(len(p)))
	if off >= int64(len(r.b)) {
		return 0, io.EOF
	}
	n := copy(p, r.b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// smallShards returns the smallest weight files of the fixtures, whole, as
// seeds: real headers with real data after them.
func smallShards(tb testing.TB, limit int64) [][]byte {
	tb.Helper()
	var out [][]byte
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16} {
		paths, _ := filepath.Glob(filepath.Join(fixtures.Dir(name), "*.safetensors"))
		slices.Sort(paths)
		seen := map[int64]bool{}
		for _, p := range paths {
			st, err := os.Stat(p)
			if err != nil || st.Size() > limit || seen[st.Size()] {
				continue
			}
			seen[st.Size()] = true // one shard of each shape is enough
			b, err := os.ReadFile(p)
			if err != nil {
				tb.Fatal(err)
			}
			out = append(out, b)
		}
	}
	if len(out) == 0 {
		tb.Skip("no fixture shards to seed the corpus")
	}
	return out
}

// rawSafetensors assembles a file from a header and data, declaring the
// header's real length.
func rawSafetensors(header string, data []byte) []byte {
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(out, header...), data...)
}

// headerSeeds are hand-made files on the edges of the format.
func headerSeeds() [][]byte {
	hostile := binary.LittleEndian.AppendUint64(nil, 1<<60)
	hostile = append(hostile, `{"a":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}}`...)
	return [][]byte{
		rawSafetensors(`{}`, nil),
		rawSafetensors(`{"__metadata__":{"format":"pt"}}`, nil),
		rawSafetensors(`{"a":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[],"data_offsets":[8,10]}}`, make([]byte, 10)),
		rawSafetensors(`{"e":{"dtype":"F32","shape":[0,4],"data_offsets":[4,4]},"x":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}  `, make([]byte, 8)),
		rawSafetensors(`{"a":{"dtype":"I32","shape":[2147483647,2147483647,2147483647],"data_offsets":[0,4]}}`, make([]byte, 4)),
		rawSafetensors(`{"a":{"dtype":"F16","shape":[1],"data_offsets":[0,9223372036854775807]}}`, make([]byte, 2)),
		rawSafetensors(`{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"F16","shape":[2],"data_offsets":[2,6]}}`, make([]byte, 6)),
		hostile,
	}
}

// checkHeader verifies ReadHeader's result against the file bytes without
// using the parser: every span inside the data region, sizes matching dtype
// and shape, no two non-empty spans sharing a byte, names unique.
func checkHeader(tensors []*TensorInfo, data []byte) error {
	n := int64(binary.LittleEndian.Uint64(data))
	dataStart := 8 + n
	// The format pads the header with spaces; the parser also accepts NULs.
	hdr := bytes.TrimRight(data[8:dataStart], " \t\r\n\x00")
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(hdr, &raw); err != nil {
		return fmt.Errorf("accepted a header encoding/json rejects: %v", err)
	}
	want := len(raw)
	if _, ok := raw["__metadata__"]; ok {
		want--
	}
	if len(tensors) != want {
		return fmt.Errorf("%d tensors returned, the header has %d entries", len(tensors), want)
	}
	names := map[string]bool{}
	for _, t := range tensors {
		if names[t.Name] {
			return fmt.Errorf("tensor %s returned twice", t.Name)
		}
		names[t.Name] = true
		if _, ok := raw[t.Name]; !ok {
			return fmt.Errorf("tensor %s is not in the header", t.Name)
		}
		if t.Offset < dataStart || t.Size < 0 || t.Offset+t.Size > int64(len(data)) {
			return fmt.Errorf("tensor %s: span [%d, %d) outside the data region [%d, %d)", t.Name, t.Offset, t.Offset+t.Size, dataStart, len(data))
		}
		elems := 1.0 // exact: the size is bounded by the file's length
		for _, d := range t.Shape {
			elems *= float64(d)
		}
		if elems*float64(t.DType.Size()) != float64(t.Size) {
			return fmt.Errorf("tensor %s: %v %v is not %d bytes", t.Name, t.DType, t.Shape, t.Size)
		}
	}
	// No two non-empty spans share a byte: sorted by start, each starts
	// at or after the furthest end so far.
	spans := slices.Clone(tensors)
	slices.SortFunc(spans, func(a, b *TensorInfo) int { return int(min(max(a.Offset-b.Offset, -1), 1)) })
	var end int64
	var last string
	for _, t := range spans {
		if t.Size == 0 {
			continue
		}
		if t.Offset < end {
			return fmt.Errorf("tensors %s and %s overlap", last, t.Name)
		}
		if t.Offset+t.Size > end {
			end, last = t.Offset+t.Size, t.Name
		}
	}
	return nil
}

// FuzzReadHeader parses arbitrary bytes as a safetensors file through a
// reader that records what is read: an error or a consistent header, never
// a panic, never a read outside the file, and never a buffer larger than
// the file.
func FuzzReadHeader(f *testing.F) {
	for _, b := range smallShards(f, 32<<10) {
		f.Add(b)
	}
	for _, b := range headerSeeds() {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &spanReader{b: data}
		tensors, meta, err := ReadHeader(r, int64(len(data)), "fuzz.safetensors")
		if r.negative || r.maxEnd > int64(len(data)) {
			t.Fatalf("read outside the file: up to byte %d of %d (negative offset: %v)", r.maxEnd, len(data), r.negative)
		}
		if err != nil {
			if !strings.HasPrefix(err.Error(), "loader: fuzz.safetensors: ") {
				t.Fatalf("error %q does not name the file", err)
			}
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error %q does not wrap ErrFormat", err)
			}
			return
		}
		if len(data) < 8 {
			t.Fatalf("accepted a file of %d bytes", len(data))
		}
		if err := checkHeader(tensors, data); err != nil {
			t.Fatal(err)
		}
		_ = meta
	})
}

// FuzzReadRange opens arbitrary bytes as a safetensors file and reads a
// range of one of its tensors: a range inside the tensor returns exactly
// those bytes of the file, any other range is an error wrapping
// ErrMismatch and reads nothing.
func FuzzReadRange(f *testing.F) {
	// Small seeds: each execution writes the file, and minimising a large
	// input costs thousands of executions.
	for _, b := range smallShards(f, 10<<10) {
		f.Add(b, uint16(3), int64(100), uint32(1<<12))
	}
	for _, b := range headerSeeds() {
		f.Add(b, uint16(1), int64(2), uint32(2))
	}
	f.Add(rawSafetensors(`{"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}`, make([]byte, 8)), uint16(0), int64(math.MaxInt64-3), uint32(8))
	f.Add(rawSafetensors(`{"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}`, make([]byte, 8)), uint16(0), int64(-1), uint32(2))
	f.Add(rawSafetensors(`{"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}}`, []byte{0, 0, 0, 0, 0xc0, 0x7f, 0, 0}), uint16(0), int64(1), uint32(6))
	f.Add(rawSafetensors(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, []byte{0, 0, 0x80, 0xff, 0, 0, 0, 0}), uint16(0), int64(0), uint32(8))
	dir := f.TempDir()
	path := filepath.Join(dir, "fuzz.safetensors")
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, data []byte, which uint16, off int64, n uint32) {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		sf, err := OpenSafetensors(path)
		if err != nil {
			if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), path) {
				t.Fatalf("error %q does not wrap ErrFormat or name the file", err)
			}
			return
		}
		defer sf.Close()
		ts := sf.Tensors()
		if len(ts) == 0 {
			return
		}
		ti := ts[int(which)%len(ts)]
		dst := make([]byte, n%(1<<16))
		want := off >= 0 && off <= ti.Size && int64(len(dst)) <= ti.Size-off
		err = sf.ReadRange(ctx, ti, off, dst)
		switch {
		case want && err != nil:
			t.Fatalf("ReadRange(%s, %d, %d) inside the tensor's %d bytes: %v", ti.Name, off, len(dst), ti.Size, err)
		case want:
			if exp := data[ti.Offset+off : ti.Offset+off+int64(len(dst))]; !bytes.Equal(dst, exp) {
				t.Fatalf("ReadRange(%s, %d, %d) returned bytes other than the file's", ti.Name, off, len(dst))
			}
			checkedRead(t, sf, ti, off, data[ti.Offset:ti.Offset+ti.Size], len(dst))
		case err == nil:
			t.Fatalf("ReadRange(%s, %d, %d) outside the tensor's %d bytes succeeded", ti.Name, off, len(dst), ti.Size)
		case !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), ti.Name):
			t.Fatalf("ReadRange outside the tensor: error %q does not wrap ErrMismatch or name the tensor", err)
		}
		if ti.Size <= 1<<16 {
			whole, err := sf.ReadTensor(ctx, ti.Name)
			if err != nil {
				t.Fatalf("ReadTensor(%s): %v", ti.Name, err)
			}
			if !bytes.Equal(whole.Bytes(), data[ti.Offset:ti.Offset+ti.Size]) {
				t.Fatalf("ReadTensor(%s) returned bytes other than the file's", ti.Name)
			}
		}
	})
}

// TestHostileHeaderNoAllocation: a header claiming 2^60 bytes (or just over
// the cap) in a file that claims to be large enough is rejected before
// anything is allocated.
func TestHostileHeaderNoAllocation(t *testing.T) {
	for _, claim := range []uint64{1 << 60, math.MaxUint64, MaxHeaderBytes + 1} {
		prefix := binary.LittleEndian.AppendUint64(nil, claim)
		r := &spanReader{b: append(prefix, `{"a":{}}`...)}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, _, err := ReadHeader(r, 1<<62, "hostile.safetensors")
		runtime.ReadMemStats(&after)
		if !errors.Is(err, ErrFormat) {
			t.Fatalf("header claiming %d bytes: err %v, want ErrFormat", claim, err)
		}
		if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
			t.Errorf("header claiming %d bytes: %d bytes allocated before rejecting it", claim, got)
		}
		if r.maxEnd > 8 {
			t.Errorf("header claiming %d bytes: read up to byte %d before rejecting it", claim, r.maxEnd)
		}
	}
}

// indexDir is a per-process copy of the sharded fixture whose index each
// fuzz input replaces.
var indexDir struct {
	once sync.Once
	dir  string
	err  error
}

// FuzzIndex writes arbitrary bytes as model.safetensors.index.json next to
// the sharded fixture's shards and opens the model: an error that names the
// index or a shard, or a model whose every file is a shard inside the
// directory; no file stays open either way.
func FuzzIndex(f *testing.F) {
	src := fixtures.Dir(fixtures.TinyLlamaF16Sharded)
	orig, err := os.ReadFile(filepath.Join(src, IndexFile))
	if err != nil {
		f.Skipf("fixture index not available: %v", err)
	}
	f.Add(orig)
	for _, s := range []string{
		`{"weight_map": {}}`,
		`{"weight_map": {"model.embed_tokens.weight": "../model-00001-of-00022.safetensors"}}`,
		`{"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}}`,
		`{"weight_map": {"model.embed_tokens.weight": "."}}`,
		`{"weight_map": {"model.embed_tokens.weight": "model-00002-of-00022.safetensors"}}`,
		`{"metadata": {"total_size": -1}, "weight_map": {"x": "config.json"}}`,
		`{"weight_map": [1, 2]}`,
		`null`,
	} {
		f.Add([]byte(s))
	}
	dir := f.TempDir()
	model, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, dir)
	if err != nil {
		f.Fatal(err)
	}
	path := filepath.Join(model, IndexFile)
	os.Chmod(path, 0o644)
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		fds := openFiles(t)
		m, err := Open(model)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "loader: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
			if now := openFiles(t); now > fds {
				t.Fatalf("failed Open left %d files open", now-fds)
			}
			return
		}
		for _, name := range m.Files() {
			if name != filepath.Base(name) || strings.ContainsAny(name, `/\`) {
				t.Fatalf("model file %q is not a name inside the directory", name)
			}
		}
		emb, _ := m.Tensor(arch.EmbedName)
		if _, err := m.ReadTensor(context.Background(), emb.Name); err != nil {
			t.Fatalf("ReadTensor(%s): %v", emb.Name, err)
		}
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if err := m.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		if now := openFiles(t); now > fds {
			t.Fatalf("Close left %d files open", now-fds)
		}
	})
}

// openFiles counts this process's open file descriptors, or skips where
// /proc is not available.
func openFiles(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count open files: %v", err)
	}
	return len(ents)
}

// FuzzConfig parses arbitrary bytes as config.json: an ErrConfig error, or a
// config that validates, survives MarshalJSON and ParseConfig unchanged, and
// opens against the BF16 fixture's weights or fails with an error, in time
// and memory bounded by the weights rather than by the config's claims.
func FuzzConfig(f *testing.F) {
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyLlamaBF16} {
		b, err := os.ReadFile(filepath.Join(fixtures.Dir(name), ConfigFile))
		if err != nil {
			f.Skipf("fixture config not available: %v", err)
		}
		f.Add(b)
	}
	for _, s := range []string{
		`{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 512}`,
		`{"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "sliding_window": 4096}`,
		`{"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 16777216, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}`,
		`{"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 512, "rope_parameters": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192, "rope_theta": 500000}}`,
		`{"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 512, "eos_token_id": [1, 2, 511], "bos_token_id": null, "torch_dtype": "bfloat16"}`,
	} {
		f.Add([]byte(s))
	}
	dir := f.TempDir()
	if err := os.Symlink(filepath.Join(fixtures.Dir(fixtures.TinyLlamaBF16), SingleFile), filepath.Join(dir, SingleFile)); err != nil {
		f.Skipf("cannot link the fixture weights: %v", err)
	}
	path := filepath.Join(dir, ConfigFile)
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := arch.ParseConfig(data)
		if err != nil {
			if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), "arch: config: ") {
				t.Fatalf("error %q does not wrap ErrConfig with arch's prefix", err)
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("ParseConfig accepted a config Validate rejects: %v", err)
		}
		out, err := c.MarshalJSON()
		if err != nil {
			t.Fatalf("MarshalJSON of a valid config: %v", err)
		}
		back, err := arch.ParseConfig(out)
		if err != nil {
			t.Fatalf("ParseConfig(MarshalJSON(c)): %v\n%s", err, out)
		}
		if len(c.EOS) == 0 { // [] and null both mean none
			c.EOS, back.EOS = nil, nil
		}
		if !reflect.DeepEqual(c, back) {
			t.Fatalf("config changed through MarshalJSON:\n%+v\n%+v", c, back)
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		m, err := Open(dir)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "loader: ") {
				t.Fatalf("error %q lacks the package prefix", err)
			}
			return
		}
		defer m.Close()
		if len(m.Layers()) != c.NumLayers+2 {
			t.Fatalf("%d layers for a config of %d blocks", len(m.Layers()), c.NumLayers)
		}
		for _, l := range m.Layers() {
			for _, ti := range l.Tensors {
				if ti.DType != tensor.BF16 {
					t.Fatalf("layer %v tensor %s has dtype %v, the fixture stores BF16", l, ti.Name, ti.DType)
				}
			}
		}
	})
}

// TestOpenHostileLayerCount: a config.json claiming 2^24 decoder blocks over
// weights of 4 is refused quickly, naming the first block the files lack,
// without building tables sized by the claim.
func TestOpenHostileLayerCount(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink(filepath.Join(fixtures.Dir(fixtures.TinyLlamaBF16), SingleFile), filepath.Join(dir, SingleFile)); err != nil {
		t.Skipf("cannot link the fixture weights: %v", err)
	}
	cfg, err := os.ReadFile(filepath.Join(fixtures.Dir(fixtures.TinyLlamaBF16), ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ConfigFile), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	editConfig(t, dir, func(c map[string]any) { c["num_hidden_layers"] = 1 << 24 })
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	m, err := Open(dir)
	runtime.ReadMemStats(&after)
	if err == nil {
		m.Close()
		t.Fatal("Open accepted 2^24 blocks over a 4-block model")
	}
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "model.layers.4.input_layernorm.weight") {
		t.Errorf("error %q does not wrap ErrMismatch naming block 4's first tensor", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 16<<20 {
		t.Errorf("Open allocated %d MB refusing the config", got>>20)
	}
}

// checkedRead reads n bytes of ti from off as Model's reads do and checks
// the outcome against an element-by-element scan of the tensor's bytes:
// the first element the range holds whole that is a NaN or an infinity
// fails the read, naming it; otherwise the read succeeds.
func checkedRead(t *testing.T, sf *File, ti *TensorInfo, off int64, tensorBytes []byte, n int) {
	t.Helper()
	want := int64(-1)
	if size := int64(ti.DType.Size()); ti.DType.IsFloat() {
		for k := (off + size - 1) / size; (k+1)*size <= off+int64(n); k++ {
			if tensor.IsNonFinite(ti.DType, tensorBytes[k*size:]) {
				want = k
				break
			}
		}
	}
	err := sf.readRange(context.Background(), ti, off, make([]byte, n), true)
	var ne *NonFiniteError
	switch {
	case want < 0 && err != nil:
		t.Fatalf("checked read of finite %v bytes [%d, %d) of %s: %v", ti.DType, off, off+int64(n), ti.Name, err)
	case want >= 0 && (!errors.As(err, &ne) || ne.Index != want || ne.Tensor != ti.Name):
		t.Fatalf("checked read of %v bytes [%d, %d) of %s: %v, want element %d named", ti.DType, off, off+int64(n), ti.Name, err, want)
	}
}
