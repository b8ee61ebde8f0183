package loader

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/tensor"
)

// A GGUF file opened as a Model: the config from its metadata
// (GGUFConfig), its tensors under their Hugging Face names (GGUFToHFName)
// in their stored dtypes, the query and key rows of the llama
// architecture un-permuted as they are read, so that everything above the
// loader sees the model a safetensors directory would give.

// isGGUFPath reports whether path is a file to open as GGUF: it ends in
// .gguf, or starts with the GGUF magic.
func isGGUFPath(path string) bool {
	if strings.EqualFold(filepath.Ext(path), ".gguf") {
		return true
	}
	f, err := infile.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	var magic [4]byte
	_, err = io.ReadFull(f, magic[:])
	return err == nil && string(magic[:]) == ggufMagic
}

// openGGUF opens the GGUF file at path as a Model.
func openGGUF(path string) (*Model, error) {
	f, err := infile.Open(path)
	if err != nil {
		if errors.Is(err, infile.ErrNotRegular) {
			return nil, &fileError{file: path, kind: ErrNotRegular, msg: strings.TrimPrefix(err.Error(), path+": ")}
		}
		return nil, fmt.Errorf("loader: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("loader: %w", err)
	}
	g, err := ParseGGUF(f, st.Size(), path)
	if err != nil {
		f.Close()
		return nil, err
	}
	r := mapOrFile(f, st.Size())
	m, err := newGGUFModel(path, g, r, st.Size())
	if err != nil {
		r.Close()
		return nil, err
	}
	return m, nil
}

// newGGUFModel builds the Model of the parsed file g, read through r.
func newGGUFModel(path string, g *GGUFFile, r readerAtCloser, size int64) (*Model, error) {
	cfg, err := GGUFConfig(context.Background(), g)
	if err != nil {
		return nil, err
	}
	base := filepath.Base(path)
	sf := &File{Path: path, byName: map[string]*TensorInfo{}, r: r, size: size, closed: make(chan struct{})}
	m := &Model{Dir: path, Config: cfg, src: source{dir: filepath.Dir(path)}, files: map[string]*File{base: sf},
		names: []string{base}, tensors: map[string]*TensorInfo{}, gguf: g}
	permute := GGUFPermutesQK(g.arch())
	experts := map[string][]arch.Spec{} // the router and stacked experts, by llama.cpp name
	for _, spec := range cfg.ExpectedTensors() {
		if name, ok := GGUFExpertName(spec); ok {
			experts[name] = append(experts[name], spec)
		}
	}
	add := func(t *TensorInfo) {
		sf.tensors = append(sf.tensors, t)
		sf.byName[t.Name] = t
		m.tensors[t.Name] = t
	}
	for _, gt := range g.Tensors() {
		dt, storable := tensor.FromQuant(gt.Type)
		if specs, ok := experts[gt.Name]; ok {
			if !storable {
				return nil, &fileError{file: path, tensor: gt.Name, kind: ErrMismatch,
					msg: fmt.Sprintf("has ggml type %v, which strata does not compute with (it does %s)", gt.Type, storableTypes())}
			}
			views, err := ggufExpertViews(gt, dt, specs, base)
			if err != nil {
				return nil, &fileError{file: path, tensor: gt.Name, kind: ErrMismatch, msg: err.Error()}
			}
			for _, t := range views {
				add(t)
			}
			continue
		}
		name, mapped := GGUFToHFName(gt.Name)
		switch {
		case !mapped && !storable:
			m.ggufExtras = append(m.ggufExtras, gt.Name)
			continue
		case !mapped:
			name = gt.Name
		case !storable:
			return nil, &fileError{file: path, tensor: gt.Name, kind: ErrMismatch,
				msg: fmt.Sprintf("has ggml type %v, which strata does not compute with (it does %s)", gt.Type, storableTypes())}
		}
		t := &TensorInfo{Name: name, DType: dt, Shape: gt.Shape(), File: base, Offset: gt.Offset, Size: gt.Size}
		if permute && mapped {
			switch {
			case strings.HasSuffix(name, ".self_attn.q_proj.weight"), strings.HasSuffix(name, ".self_attn.q_proj.bias"):
				t.qkHeads = cfg.NumHeads
			case strings.HasSuffix(name, ".self_attn.k_proj.weight"), strings.HasSuffix(name, ".self_attn.k_proj.bias"):
				t.qkHeads = cfg.NumKVHeads
			}
		}
		add(t)
	}
	slices.SortStableFunc(sf.tensors, func(a, b *TensorInfo) int { return cmpInt64(a.Offset, b.Offset) })
	if err := m.group(); err != nil {
		return nil, err
	}
	m.extras = append(m.extras, m.ggufExtras...)
	slices.Sort(m.extras)
	return m, nil
}

// ggufExpertViews returns the tensors a mixture of experts' tensor gt
// holds, specs in order: the router as it is; each routed expert of a
// stacked tensor as the range of its bytes (expert e the e-th n-th), so
// that the experts are read and paged one by one.
func ggufExpertViews(gt *GGUFTensor, dt tensor.DType, specs []arch.Spec, file string) ([]*TensorInfo, error) {
	shape := gt.Shape()
	if specs[0].Role == arch.Router {
		return []*TensorInfo{{Name: specs[0].Name, DType: dt, Shape: shape, File: file, Offset: gt.Offset, Size: gt.Size}}, nil
	}
	n := len(specs)
	want := append(tensor.Shape{n}, specs[0].Shape...)
	if !shape.Equal(want) {
		return nil, fmt.Errorf("has shape %v, the config needs %d experts of %v", shape, n, specs[0].Shape)
	}
	per := gt.Size / int64(n)
	out := make([]*TensorInfo, n)
	for e, s := range specs {
		out[e] = &TensorInfo{Name: s.Name, DType: dt, Shape: s.Shape, File: file, Offset: gt.Offset + int64(e)*per, Size: per}
	}
	return out, nil
}

// storableTypes names the dtypes a GGUF tensor may have.
func storableTypes() string {
	var names []string
	for _, d := range []tensor.DType{tensor.F32, tensor.F16, tensor.BF16, tensor.Q8_0, tensor.Q4_0, tensor.Q4_1,
		tensor.Q5_0, tensor.Q5_1, tensor.Q4_K, tensor.Q5_K, tensor.Q6_K, tensor.Q8_K} {
		names = append(names, d.String())
	}
	return strings.Join(names, ", ")
}

// GGUF returns the GGUF file a model was opened from (its metadata, its
// tensors under llama.cpp's names as stored), nil for a Hugging Face
// directory.
func (m *Model) GGUF() *GGUFFile { return m.gguf }

// Tokenizer returns the model's tokenizer, nil when it has none: for a
// Hugging Face directory the one tokenizer.json (with
// tokenizer_config.json) describes, for a GGUF file the one of its
// tokenizer.ggml.* metadata.
func (m *Model) Tokenizer() (*tokenizer.Tokenizer, error) {
	if m.gguf != nil {
		return ggufTokenizer(m.gguf.Metadata)
	}
	if _, err := m.src.stat(tokenizer.TokenizerFile); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if m.src.fsys != nil {
		return tokenizer.LoadFS(m.FS())
	}
	return tokenizer.Load(m.Dir) // its errors name the files
}

// configFS is the file system of a GGUF model: config.json as Config
// writes it, the one file of a model directory a checkpoint saved from the
// model needs besides its weights.
type configFS struct {
	data []byte
}

func (c configFS) Open(name string) (fs.File, error) {
	switch name {
	case ".":
		return &memFile{name: ".", dir: true, data: c.data}, nil
	case ConfigFile:
		return &memFile{name: ConfigFile, data: c.data}, nil
	}
	return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
}

// memFile is a file of a configFS.
type memFile struct {
	name string
	data []byte
	off  int
	dir  bool
	done bool // a directory's entries were read
}

func (f *memFile) Stat() (fs.FileInfo, error) { return memInfo{f}, nil }
func (f *memFile) Close() error               { return nil }

func (f *memFile) Read(b []byte) (int, error) {
	if f.dir {
		return 0, &fs.PathError{Op: "read", Path: f.name, Err: errors.New("is a directory")}
	}
	if f.off >= len(f.data) {
		return 0, io.EOF
	}
	n := copy(b, f.data[f.off:])
	f.off += n
	return n, nil
}

// ReadDir lists config.json in the root.
func (f *memFile) ReadDir(n int) ([]fs.DirEntry, error) {
	if !f.dir {
		return nil, &fs.PathError{Op: "readdir", Path: f.name, Err: errors.New("not a directory")}
	}
	if f.done {
		if n > 0 {
			return nil, io.EOF
		}
		return nil, nil
	}
	f.done = true
	return []fs.DirEntry{fs.FileInfoToDirEntry(memInfo{&memFile{name: ConfigFile, data: f.data}})}, nil
}

type memInfo struct{ f *memFile }

func (i memInfo) Name() string { return i.f.name }
func (i memInfo) Size() int64 {
	if i.f.dir {
		return 0
	}
	return int64(len(i.f.data))
}
func (i memInfo) Mode() fs.FileMode {
	if i.f.dir {
		return fs.ModeDir | 0o555
	}
	return 0o444
}
func (i memInfo) ModTime() time.Time { return time.Time{} }
func (i memInfo) IsDir() bool        { return i.f.dir }
func (i memInfo) Sys() any           { return nil }

// ggufConfigFS returns the configFS of a GGUF model.
func ggufConfigFS(c *arch.Config) fs.FS {
	data, err := c.MarshalJSON()
	if err != nil { // not reached: the config was validated
		data = nil
	}
	return configFS{data: data}
}

// ReadRows reads rows [r0, r1) of t into dst as float32, dequantizing a
// quantized or half-precision tensor: a row is the last dimension (a 1-D
// tensor is one row), in Hugging Face's order, checked as ReadRange checks
// (len(dst) must be the rows' elements).
func (m *Model) ReadRows(ctx context.Context, t *TensorInfo, r0, r1 int, dst []float32) error {
	if len(t.Shape) == 0 {
		return &fileError{file: m.Dir, tensor: t.Name, kind: ErrMismatch, msg: "a scalar has no rows"}
	}
	cols := t.Shape[len(t.Shape)-1]
	rows := 0
	if cols > 0 {
		rows = int(t.Shape.NumElements()) / cols
	}
	q, ok := t.DType.Quant()
	rb, err := t.DType.Bytes(int64(cols))
	switch {
	case !ok || err != nil:
		return &fileError{file: m.Dir, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("has dtype %v, which has no float values", t.DType)}
	case r0 < 0 || r1 < r0 || r1 > rows:
		return &fileError{file: m.Dir, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("rows [%d, %d) outside its %d rows", r0, r1, rows)}
	case len(dst) != (r1-r0)*cols:
		return &fileError{file: m.Dir, tensor: t.Name, kind: ErrMismatch, msg: fmt.Sprintf("%d values for %d rows of %d", len(dst), r1-r0, cols)}
	}
	raw := make([]byte, int64(r1-r0)*rb)
	if err := m.ReadRange(ctx, t, int64(r0)*rb, raw); err != nil {
		return err
	}
	return q.Dequantize(dst, raw)
}
