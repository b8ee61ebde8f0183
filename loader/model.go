package loader

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sync/errgroup"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/internal/infile"
	"github.com/strata-llm/strata/tensor"
)

// File names in a Hugging Face model directory.
const (
	ConfigFile      = "config.json"
	SingleFile      = "model.safetensors"
	IndexFile       = "model.safetensors.index.json"
	TokenizerFile   = "tokenizer.json"
	TokenizerConfig = "tokenizer_config.json"
)

// Layer is the unit the runtime pages: the tensors one step of the forward
// pass needs, as arch numbers and groups them.
type Layer struct {
	Index   int            // position in Model.Layers
	Kind    arch.LayerKind //
	Block   int            // decoder block number, -1 unless Kind is arch.Block
	Tensors []*TensorInfo
	Bytes   int64 // sum of the tensors' sizes
}

// String names the layer: "embedding", "block 3", "head".
func (l Layer) String() string {
	if l.Kind == arch.Block {
		return fmt.Sprintf("block %d", l.Block)
	}
	return l.Kind.String()
}

// Model is an opened Hugging Face model directory or GGUF file: the parsed
// config, the validated headers of its weight files, and its tensors
// grouped into layers. Opening reads only the headers; tensor bytes are
// read on demand. A Model is safe for concurrent use.
type Model struct {
	// Dir is the model directory: a path of the OS, or for a model opened
	// by OpenFS, the directory in its file system; for a GGUF model, the
	// file's path.
	Dir    string
	Config *arch.Config

	src     source
	indexed bool             // the weights are listed by an index
	files   map[string]*File // by base name
	names   []string         // weight file base names, sorted
	tensors map[string]*TensorInfo
	layers  []Layer
	extras  []string
	bytes   int64

	gguf       *GGUFFile // the file of a GGUF model, else nil
	ggufExtras []string  // its tensors of types strata does not store

	checked sync.Map // *TensorInfo -> struct{}: read whole and found finite
	// ranges remembers the large ranges ReadRange found finite:
	// rangeKey -> the end of the longest range checked from that offset.
	ranges     sync.Map
	rangeCount atomic.Int64 // entries in ranges, at most maxCheckedRanges

	closeOnce sync.Once
	closeErr  error
}

// Open opens the model at path: a Hugging Face directory (config.json, and
// model.safetensors or the shards listed in model.safetensors.index.json;
// model.safetensors wins when both exist), or a GGUF file (a path ending in
// .gguf, or any file starting with GGUF's magic), whose metadata gives the
// config (GGUFConfig) and whose tensors are named as Hugging Face names
// them. It validates every header and checks that each tensor the
// architecture needs is present with the shape the config implies.
// Tensors it does not need (a rotary inv_freq, say) are ignored and listed
// by Extras. A file that is not a regular file (a named pipe, a device) is
// refused before it is opened.
func Open(path string) (*Model, error) {
	if st, err := os.Stat(path); err == nil && !st.IsDir() {
		if !isGGUFPath(path) && st.Mode().IsRegular() {
			return nil, &fileError{file: path, kind: ErrFormat, msg: "is a file that is not GGUF; give a model directory or a GGUF file"}
		}
		return openGGUF(path)
	}
	return open(source{dir: path})
}

// OpenFS is Open for the model in directory dir of fsys (an embedded
// model: "." for the root). Its weight files are read in place, through
// ReadAt when fsys's files have it (embed.FS's do), else from a copy in
// memory.
func OpenFS(fsys fs.FS, dir string) (*Model, error) {
	if !fs.ValidPath(dir) {
		return nil, fmt.Errorf("loader: %q is not a directory name in the file system", dir)
	}
	return open(source{dir: dir, fsys: fsys})
}

func open(src source) (*Model, error) {
	cfgPath := src.path(ConfigFile)
	data, err := src.readFile(ConfigFile)
	if err != nil {
		return nil, fmt.Errorf("loader: %w", err)
	}
	cfg, err := arch.ParseConfig(data)
	if err != nil {
		var ce *arch.ConfigError
		if errors.As(err, &ce) {
			return nil, &fileError{file: cfgPath, kind: ErrConfig, msg: ce.Msg}
		}
		return nil, err
	}
	m := &Model{Dir: src.dir, Config: cfg, src: src, files: map[string]*File{}, tensors: map[string]*TensorInfo{}}
	if err := m.openWeights(); err != nil {
		m.Close()
		return nil, err
	}
	if err := m.group(); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// openWeights opens the weight files and builds the tensor table.
func (m *Model) openWeights() error {
	indexPath := m.src.path(IndexFile)
	var weightMap map[string]string
	switch {
	case m.src.exists(SingleFile):
		m.names = []string{SingleFile}
	case m.src.exists(IndexFile):
		wm, names, err := readIndex(m.src)
		if err != nil {
			return err
		}
		weightMap, m.names, m.indexed = wm, names, true
	default:
		return &fileError{file: m.Dir, kind: fs.ErrNotExist, msg: "no " + SingleFile + " or " + IndexFile}
	}

	opened := make([]*File, len(m.names))
	var g errgroup.Group
	g.SetLimit(8)
	for i, name := range m.names {
		g.Go(func() error {
			f, err := m.src.openSafetensors(name)
			opened[i] = f
			return err
		})
	}
	err := g.Wait()
	for i, f := range opened {
		if f != nil {
			m.files[m.names[i]] = f
		}
	}
	if err != nil {
		return err
	}

	for _, name := range m.names {
		for _, t := range m.files[name].tensors {
			if prev, dup := m.tensors[t.Name]; dup {
				return &fileError{file: m.src.path(name), tensor: t.Name, kind: ErrFormat,
					msg: "also stored in " + prev.File}
			}
			m.tensors[t.Name] = t
		}
	}
	// Every index entry must point to a tensor in the shard it names.
	names := make([]string, 0, len(weightMap))
	for n := range weightMap {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		shard := weightMap[n]
		if _, ok := m.files[shard].byName[n]; !ok {
			return &fileError{file: indexPath, tensor: n, kind: ErrFormat,
				msg: "index maps it to " + shard + ", which has no such tensor"}
		}
	}
	return nil
}

func fileExists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir()
}

// source is where a model's files are read from: a directory of the OS,
// or a directory of an fs.FS.
type source struct {
	dir  string
	fsys fs.FS // nil: the OS
}

// path names a file of the model in messages (and, for the OS, to open).
func (s source) path(name string) string {
	if s.fsys != nil {
		return path.Join(s.dir, name)
	}
	return filepath.Join(s.dir, name)
}

func (s source) stat(name string) (fs.FileInfo, error) {
	if s.fsys != nil {
		return fs.Stat(s.fsys, s.path(name))
	}
	return os.Stat(s.path(name))
}

// exists reports whether name is there, in any form: what is not a
// regular file is refused when it is opened.
func (s source) exists(name string) bool {
	_, err := s.stat(name)
	return err == nil
}

// readFile reads a regular file of the model.
func (s source) readFile(name string) ([]byte, error) {
	if s.fsys != nil {
		data, err := infile.ReadFileFS(s.fsys, s.path(name))
		if err != nil {
			return nil, err
		}
		return data, nil
	}
	return infile.ReadFile(context.Background(), s.path(name))
}

// openSafetensors opens a weight file of the model.
func (s source) openSafetensors(name string) (*File, error) {
	if s.fsys == nil {
		return OpenSafetensors(s.path(name))
	}
	p := s.path(name)
	st, err := fs.Stat(s.fsys, p)
	if err != nil {
		return nil, fmt.Errorf("loader: %w", err)
	}
	if err := infile.CheckMode(p, st.Mode()); err != nil {
		return nil, fmt.Errorf("loader: %w", err)
	}
	f, err := s.fsys.Open(p)
	if err != nil {
		return nil, fmt.Errorf("loader: %w", err)
	}
	r, ok := f.(readerAtCloser)
	if !ok {
		data, err := io.ReadAll(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("loader: %s: %w", p, err)
		}
		r = bytesFile{bytes.NewReader(data)}
	}
	return newFile(p, r, st.Size())
}

// bytesFile serves a weight file copied into memory.
type bytesFile struct{ *bytes.Reader }

func (bytesFile) Close() error { return nil }

// FS returns the model directory as a file system, for the files beside
// the weights (the tokenizer, say). A GGUF model's holds only config.json,
// its config as MarshalJSON writes it (the tokenizer is Tokenizer's).
func (m *Model) FS() fs.FS {
	if m.gguf != nil {
		return ggufConfigFS(m.Config)
	}
	if m.src.fsys == nil {
		return os.DirFS(m.Dir)
	}
	sub, err := fs.Sub(m.src.fsys, m.Dir)
	if err != nil { // m.Dir was checked by OpenFS
		panic(err)
	}
	return sub
}

// InputFiles lists the paths of the files a run of this model reads: the
// config, the index and the weight files, and the tokenizer and generation
// files that are present; for a GGUF model, the file. A command checks its
// outputs against them (atomicfile.CheckNotInput). A model opened by
// OpenFS has none on disk: InputFiles returns nil.
func (m *Model) InputFiles() []string {
	if m.src.fsys != nil {
		return nil
	}
	if m.gguf != nil {
		return []string{m.Dir}
	}
	out := []string{m.src.path(ConfigFile)}
	if m.indexed {
		out = append(out, m.src.path(IndexFile))
	}
	for _, n := range m.names {
		out = append(out, m.src.path(n))
	}
	for _, n := range ModelFiles[1:] {
		if m.src.exists(n) {
			out = append(out, m.src.path(n))
		}
	}
	return out
}

type indexJSON struct {
	Metadata  map[string]any    `json:"metadata"`
	WeightMap map[string]string `json:"weight_map"`
}

// readIndex parses model.safetensors.index.json and checks that every shard
// it names is a file in the model directory. It returns the weight map and
// the sorted shard names.
func readIndex(src source) (map[string]string, []string, error) {
	path := src.path(IndexFile)
	data, err := src.readFile(IndexFile)
	if err != nil {
		return nil, nil, fmt.Errorf("loader: %w", err)
	}
	var idx indexJSON
	if err := json.Unmarshal(data, &idx); err != nil {
		return nil, nil, &fileError{file: path, kind: ErrFormat, msg: "bad JSON: " + err.Error()}
	}
	if len(idx.WeightMap) == 0 {
		return nil, nil, &fileError{file: path, kind: ErrFormat, msg: "no weight_map entries"}
	}
	shards := map[string]bool{}
	names := make([]string, 0, len(idx.WeightMap))
	for n := range idx.WeightMap {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		shard := idx.WeightMap[n]
		if shards[shard] {
			continue
		}
		if shard == "" || shard != filepath.Base(shard) || shard == "." || shard == ".." || strings.ContainsAny(shard, `/\`) {
			return nil, nil, &fileError{file: path, tensor: n, kind: ErrFormat, msg: fmt.Sprintf("shard name %q is not a file name in the model directory", shard)}
		}
		st, err := src.stat(shard)
		if err != nil {
			return nil, nil, &fileError{file: path, tensor: n, kind: ErrFormat, msg: fmt.Sprintf("shard %s does not exist", shard)}
		}
		if !st.Mode().IsRegular() {
			return nil, nil, &fileError{file: src.path(shard), kind: ErrNotRegular, msg: fmt.Sprintf("%v (%s)", ErrNotRegular, infile.Describe(st.Mode()))}
		}
		shards[shard] = true
	}
	files := make([]string, 0, len(shards))
	for s := range shards {
		files = append(files, s)
	}
	slices.Sort(files)
	return idx.WeightMap, files, nil
}

// group checks the tensors against the config and builds the layers.
func (m *Model) group() error {
	c := m.Config
	// num_hidden_layers comes from a downloaded file: refuse blocks the
	// weight files hold nothing of before building tables sized by it.
	if i := firstEmptyBlock(m.tensors, c.NumLayers); i >= 0 {
		return &fileError{file: m.Dir, tensor: c.BlockTensors(i)[0].Name, kind: ErrMismatch,
			msg: fmt.Sprintf("missing (the %s config has %d decoder blocks; the weight files hold no tensor of block %d)", c.Family, c.NumLayers, i)}
	}
	used := map[string]bool{}
	var problems []error
	m.layers = make([]Layer, c.LayerCount())
	for i := range m.layers {
		kind, block, _ := c.LayerKind(i)
		l := Layer{Index: i, Kind: kind, Block: block}
		for _, spec := range c.LayerTensors(i) {
			t, ok := m.tensors[spec.Name]
			if !ok {
				problems = append(problems, &fileError{file: m.Dir, tensor: spec.Name, kind: ErrMismatch,
					msg: fmt.Sprintf("missing (the %s config needs it with shape %v)", c.Family, spec.Shape)})
				continue
			}
			if !t.Shape.Equal(spec.Shape) {
				problems = append(problems, &fileError{file: m.src.path(t.File), tensor: t.Name, kind: ErrMismatch,
					msg: fmt.Sprintf("has shape %v, the config needs %v", t.Shape, spec.Shape)})
				continue
			}
			if !t.DType.IsFloat() && !(t.DType.IsQuantized() && quantizable(spec.Role)) {
				want := "a float type"
				if quantizable(spec.Role) {
					want = "a float or quantized type"
				}
				problems = append(problems, &fileError{file: m.src.path(t.File), tensor: t.Name, kind: ErrMismatch,
					msg: fmt.Sprintf("has dtype %v, want %s", t.DType, want)})
				continue
			}
			used[t.Name] = true
			l.Tensors = append(l.Tensors, t)
			l.Bytes += t.Size
		}
		m.layers[i] = l
	}
	if len(problems) > 0 {
		err := problems[0]
		switch len(problems) {
		case 1:
		case 2:
			err = fmt.Errorf("%w (and 1 more problem)", err)
		default:
			err = fmt.Errorf("%w (and %d more problems)", err, len(problems)-1)
		}
		return err
	}
	for n, t := range m.tensors {
		if used[n] {
			m.bytes += t.Size
		} else {
			m.extras = append(m.extras, n)
		}
	}
	slices.Sort(m.extras)
	return nil
}

// quantizable reports whether a tensor of the role may be quantized: the
// weights of the linear layers (the routed experts' among them) and the
// embedding table, not the norms, biases and routers.
func quantizable(r arch.Role) bool {
	switch r {
	case arch.Embed, arch.Q, arch.K, arch.V, arch.O, arch.Gate, arch.Up, arch.Down, arch.LMHead,
		arch.ExpertGate, arch.ExpertUp, arch.ExpertDown:
		return true
	}
	return false
}

// firstEmptyBlock returns the first of decoder blocks 0..n-1 that no tensor
// belongs to, or -1. Its work is bounded by the number of tensors, not by n.
func firstEmptyBlock(tensors map[string]*TensorInfo, n int) int {
	have := map[int]bool{}
	for name := range tensors {
		if i, ok := arch.BlockOf(name); ok && i < n {
			have[i] = true
		}
	}
	for i := range n { // at most len(have)+1 iterations
		if !have[i] {
			return i
		}
	}
	return -1
}

// Tensor returns the named tensor's location, for any tensor in the weight
// files (extras included).
func (m *Model) Tensor(name string) (*TensorInfo, bool) {
	t, ok := m.tensors[name]
	return t, ok
}

// Tensors returns every tensor in the weight files, sorted by name.
func (m *Model) Tensors() []*TensorInfo {
	out := make([]*TensorInfo, 0, len(m.tensors))
	for _, t := range m.tensors {
		out = append(out, t)
	}
	slices.SortFunc(out, func(a, b *TensorInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Layers returns the layers in arch's numbering (arch.Config.LayerTensors):
// 0 the embedding, 1..NumLayers the decoder blocks, NumLayers+1 the final
// norm and LM head (with tied embeddings it holds model.embed_tokens.weight
// in place of lm_head.weight, so that tensor appears in two layers). Callers
// must not modify the result.
func (m *Model) Layers() []Layer { return m.layers }

// WeightBytes is the size of the tensors the layers hold, each counted once.
func (m *Model) WeightBytes() int64 { return m.bytes }

// Extras lists the names of tensors in the weight files that no layer
// holds, sorted. They are never read.
func (m *Model) Extras() []string { return m.extras }

// Files lists the weight files' base names, sorted.
func (m *Model) Files() []string { return m.names }

// File returns the open weight file with the given base name.
func (m *Model) File(name string) (*File, bool) {
	f, ok := m.files[name]
	return f, ok
}

func (m *Model) fileOf(t *TensorInfo) (*File, error) {
	f, ok := m.files[t.File]
	if !ok {
		return nil, &fileError{file: m.Dir, tensor: t.Name, kind: ErrMismatch, msg: "weight file " + strconv.Quote(t.File) + " is not part of this model"}
	}
	return f, nil
}

// ReadInto reads t's bytes, in their stored dtype, into dst, which must be
// exactly t.Size bytes. It is safe for concurrent use and checks ctx between
// 16 MiB pieces. Every weight is read through it (ReadTensor, and the
// pagers through nn's Source): a float tensor holding a NaN or an infinity
// is an error wrapping ErrNonFinite, a *NonFiniteError naming the file,
// the tensor and the first such element. The check runs on each piece as
// it is read, eight bytes at a time, at over 20 GB/s on one core
// (BenchmarkReadChecked): a third more time than a read from the page
// cache, far less than a read from disk. A tensor is checked on its first
// whole read only: a pager that reads the same layer from the page cache
// for every token (the aggressive strategy) pays for the check once.
func (m *Model) ReadInto(ctx context.Context, t *TensorInfo, dst []byte) error {
	f, err := m.fileOf(t)
	if err != nil {
		return err
	}
	_, done := m.checked.Load(t)
	if err := f.readInto(ctx, t, dst, !done); err != nil {
		return err
	}
	if !done {
		m.checked.Store(t, struct{}{})
	}
	return nil
}

// ReadRange reads len(dst) bytes of t starting off bytes into the tensor
// (rows of an embedding table, say), checking the elements the range holds
// whole as ReadInto does. As ReadInto checks a tensor once, ReadRange
// checks nothing in a tensor read whole before, nor in a range within one
// it checked before from the same offset: the pager's staging ring reads
// the same large pieces of every streamed tensor for every token (the
// aggressive strategy), and the check cost a third more time than the
// read from the page cache. It remembers ranges of at least 1/64 of
// their tensor (pieces, not rows), at most maxCheckedRanges of them.
func (m *Model) ReadRange(ctx context.Context, t *TensorInfo, off int64, dst []byte) error {
	f, err := m.fileOf(t)
	if err != nil {
		return err
	}
	n := int64(len(dst))
	key := rangeKey{t, off}
	check := true
	if _, done := m.checked.Load(t); done {
		check = false
	} else if end, ok := m.ranges.Load(key); ok && off+n <= end.(int64) {
		check = false
	}
	if err := f.readRange(ctx, t, off, dst, check); err != nil {
		return err
	}
	if check && n > 0 && n >= t.Size/64 {
		m.rememberRange(key, off+n)
	}
	return nil
}

// maxCheckedRanges bounds the ranges ReadRange remembers: a 70B model's
// streamed tensors in 16 MiB pieces are about 9,000.
const maxCheckedRanges = 1 << 16

// rangeKey is a range ReadRange checked: its tensor and its offset.
type rangeKey struct {
	t   *TensorInfo
	off int64
}

// rememberRange notes that t's bytes from key.off to end were found
// finite.
func (m *Model) rememberRange(key rangeKey, end int64) {
	for {
		old, ok := m.ranges.Load(key)
		if !ok {
			if m.rangeCount.Load() >= maxCheckedRanges {
				return
			}
			if _, loaded := m.ranges.LoadOrStore(key, end); !loaded {
				m.rangeCount.Add(1)
				return
			}
			continue
		}
		if old.(int64) >= end || m.ranges.CompareAndSwap(key, old, end) {
			return
		}
	}
}

// Section returns a reader of t's bytes, as stored: nothing is checked,
// and the rows of a GGUF llama's query and key projections are in the
// file's order (ReadInto and ReadRange give Hugging Face's).
func (m *Model) Section(t *TensorInfo) (*io.SectionReader, error) {
	f, err := m.fileOf(t)
	if err != nil {
		return nil, err
	}
	return io.NewSectionReader(f.r, t.Offset, t.Size), nil
}

// ReadTensor reads the named tensor into a new host tensor of its stored
// dtype.
func (m *Model) ReadTensor(ctx context.Context, name string) (*tensor.Tensor, error) {
	t, ok := m.tensors[name]
	if !ok {
		return nil, &fileError{file: m.Dir, tensor: name, kind: ErrMismatch, msg: "no such tensor"}
	}
	out := tensor.New(t.DType, t.Shape)
	if err := m.ReadInto(ctx, t, out.Bytes()); err != nil {
		return nil, err
	}
	return out, nil
}

// Close closes the weight files. It is safe to call more than once; reads
// after Close return an error wrapping ErrClosed.
func (m *Model) Close() error {
	m.closeOnce.Do(func() {
		var errs []error
		for _, f := range m.files {
			errs = append(errs, f.Close())
		}
		m.closeErr = errors.Join(errs...)
	})
	return m.closeErr
}
