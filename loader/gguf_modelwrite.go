package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync/atomic"

	"golang.org/x/sync/errgroup"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/tokenizer"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// Writing a model as a GGUF file the way llama.cpp's converter and
// quantizer write one: llama.cpp's names and metadata, the query and key
// rows of the llama architecture permuted, each tensor in the type a
// recipe gives it, quantized row by row as the file is written so that a
// model far larger than memory streams straight to disk.

// GGUFModel is a model for WriteGGUFModel.
type GGUFModel struct {
	Config *arch.Config
	Vocab  *tokenizer.GGUFVocab // nil: the file has no tokenizer
	Name   string               // general.name; "" for none
	// Types gives the stored type of every tensor Config.ExpectedTensors
	// lists, by Hugging Face name (GGUFTensorTypes makes it).
	Types map[string]quant.Type
	// FileType is general.file_type (GGUFFileType).
	FileType uint32
	// Rows fills dst with rows [r0, r1) of the tensor spec names, in
	// Hugging Face's row order, as float32: a row is the last dimension
	// (a 1-D tensor is one row). It is called for one tensor at a time,
	// ranges in order, possibly more than once for a row.
	Rows func(spec arch.Spec, r0, r1 int, dst []float32) error
	// Workers bounds the goroutines quantizing rows; 0 means GOMAXPROCS.
	Workers int
	// Progress, if set, is called with the tensor bytes written so far and
	// the total.
	Progress func(written, total int64)
}

// WriteGGUFModel writes m as a GGUF file at path (through a temporary file
// renamed into place: a failure leaves path as it was): the config's and
// the tokenizer's metadata (GGUFConfigKVs, GGUFTokenizerKVs; the config's
// BOS and EOS win over the tokenizer's), the rope_freqs.weight factors of
// llama3 rope scaling, then every tensor under llama.cpp's name, the
// routed experts of a block stacked per projection (GGUFExpertName). A value
// that is not finite, or that overflows a block's scale, is an error
// naming the tensor and row.
func WriteGGUFModel(ctx context.Context, path string, m GGUFModel) error {
	c := m.Config
	cfgKVs, err := GGUFConfigKVs(c)
	if err != nil {
		return fmt.Errorf("loader: write %s: %w", path, err)
	}
	a := cfgKVs[0].Value.(string)
	kvs := []GGUFKV{cfgKVs[0]}
	if m.Name != "" {
		kvs = append(kvs, GGUFKV{"general.name", m.Name})
	}
	kvs = append(kvs, GGUFKV{"general.file_type", m.FileType})
	quantized := false
	for _, t := range m.Types {
		quantized = quantized || t.BlockSize() > 1
	}
	if quantized {
		kvs = append(kvs, GGUFKV{"general.quantization_version", uint32(2)})
	}
	var special []GGUFKV
	for _, kv := range cfgKVs[1:] {
		if len(kv.Key) > 15 && kv.Key[:15] == "tokenizer.ggml." {
			special = append(special, kv)
		} else {
			kvs = append(kvs, kv)
		}
	}
	if m.Vocab != nil {
		if len(m.Vocab.Tokens) != c.VocabSize {
			return fmt.Errorf("loader: write %s: the tokenizer has %d tokens, the model a vocabulary of %d", path, len(m.Vocab.Tokens), c.VocabSize)
		}
		kvs = append(kvs, mergeKVs(GGUFTokenizerKVs(m.Vocab), special...)...)
	} else {
		kvs = append(kvs, special...)
	}

	var tensors []GGUFWriteTensor
	var total int64
	if f := GGUFRopeFreqs(c); f != nil {
		data := make([]byte, 4*len(f))
		for i, v := range f {
			binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(v))
		}
		tensors = append(tensors, GGUFWriteTensor{Name: GGUFRopeFreqsName, Type: quant.F32, Dims: []int64{int64(len(f))}, Data: data})
		total += int64(len(data))
	}
	var written atomic.Int64
	scratch := &rowScratch{} // the tensors are written one at a time
	specs := c.ExpectedTensors()
	stacks := map[string][]arch.Spec{} // a block's experts of one projection, by llama.cpp name
	for _, spec := range specs {
		if name, ok := GGUFExpertName(spec); ok && spec.Role.IsExpert() {
			stacks[name] = append(stacks[name], spec)
		}
	}
	for _, spec := range specs {
		name, ok := HFToGGUFName(spec.Name)
		if !ok {
			name, ok = GGUFExpertName(spec)
		}
		if !ok {
			return fmt.Errorf("loader: write %s: tensor %s has no llama.cpp name", path, spec.Name)
		}
		stack := stacks[name]
		if len(stack) > 0 && spec.Expert > 0 {
			continue // written with expert 0
		}
		typ, ok := m.Types[spec.Name]
		if !ok {
			return fmt.Errorf("loader: write %s: no type for tensor %s", path, spec.Name)
		}
		for _, s := range stack {
			if t := m.Types[s.Name]; t != typ {
				return fmt.Errorf("loader: write %s: tensors %s (%v) and %s (%v) are stacked in %s: they need one type", path, spec.Name, typ, s.Name, t, name)
			}
		}
		dims := make([]int64, len(spec.Shape))
		for i, d := range spec.Shape {
			dims[len(dims)-1-i] = int64(d)
		}
		rows := m.Rows
		if len(stack) > 0 {
			dims = append(dims, int64(len(stack)))
			rows = stackedRows(stack, m.Rows)
		}
		heads := 0
		if GGUFPermutesQK(a) {
			switch spec.Role {
			case arch.Q, arch.QBias:
				heads = c.NumHeads
			case arch.K, arch.KBias:
				heads = c.NumKVHeads
			}
		}
		w := &rowWriter{ctx: ctx, spec: spec, typ: typ, heads: heads, rows: rows, workers: m.Workers, rowScratch: scratch}
		if w.workers <= 0 {
			w.workers = runtime.GOMAXPROCS(0)
		}
		w.cols = spec.Shape[len(spec.Shape)-1]
		w.nrows = int(spec.Shape.NumElements()) / w.cols * max(1, len(stack))
		rb, err := typ.Bytes(int64(w.cols))
		if err != nil {
			return fmt.Errorf("loader: write %s: tensor %s: %w", path, name, err)
		}
		w.rowBytes = int(rb)
		size := rb * int64(w.nrows)
		total += size
		fill := w.fill
		if m.Progress != nil {
			fill = func(dst []byte, off int64) error {
				if err := w.fill(dst, off); err != nil {
					return err
				}
				m.Progress(written.Add(int64(len(dst))), total)
				return nil
			}
		}
		tensors = append(tensors, GGUFWriteTensor{Name: name, Type: typ, Dims: dims, Fill: fill})
	}
	return WriteGGUF(path, kvs, tensors)
}

// stackedRows returns the Rows function of the experts stack, written one
// after the other as one tensor (llama.cpp's ffn_*_exps): its row r is row
// r mod out of expert r / out.
func stackedRows(stack []arch.Spec, rows func(arch.Spec, int, int, []float32) error) func(arch.Spec, int, int, []float32) error {
	out, cols := stack[0].Shape[0], stack[0].Shape[1]
	return func(_ arch.Spec, r0, r1 int, dst []float32) error {
		for r0 < r1 {
			e, r := r0/out, r0%out
			n := min(r1-r0, out-r)
			if err := rows(stack[e], r, r+n, dst[:n*cols]); err != nil {
				return err
			}
			dst, r0 = dst[n*cols:], r0+n
		}
		return nil
	}
}

// rowWriter produces the bytes of one tensor from its float rows.
type rowWriter struct {
	ctx      context.Context
	spec     arch.Spec
	typ      quant.Type
	heads    int // rows (or a 1-D tensor's elements) permuted in this many heads
	rows     func(spec arch.Spec, r0, r1 int, dst []float32) error
	workers  int
	cols     int
	nrows    int
	rowBytes int
	*rowScratch
}

// rowScratch holds the buffers a rowWriter reuses from call to call; the
// writers of a file share one.
type rowScratch struct {
	src, perm []float32
	out       []byte
}

// fill is the tensor's FillFunc: it encodes the rows the range touches and
// copies the range out.
func (w *rowWriter) fill(dst []byte, off int64) error {
	if err := w.ctx.Err(); err != nil {
		return err
	}
	rb := int64(w.rowBytes)
	r0, r1 := int(off/rb), int((off+int64(len(dst))+rb-1)/rb)
	vals, err := w.floats(r0, r1)
	if err != nil {
		return err
	}
	n := (r1 - r0) * w.rowBytes
	if cap(w.out) < n {
		w.out = make([]byte, n)
	}
	out := w.out[:n]
	var g errgroup.Group
	per := max(1, (r1-r0+w.workers-1)/w.workers)
	for s := 0; s < r1-r0; s += per {
		e := min(s+per, r1-r0)
		g.Go(func() error {
			for i := s; i < e; i++ {
				if err := w.typ.Quantize(out[i*w.rowBytes:(i+1)*w.rowBytes], vals[i*w.cols:(i+1)*w.cols]); err != nil {
					if errors.Is(err, quant.ErrNotFinite) {
						return fmt.Errorf("row %d: %w", r0+i, err)
					}
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	copy(dst, out[off-int64(r0)*rb:])
	return nil
}

// floats returns rows [r0, r1) of the tensor as stored (llama.cpp's row
// order), as float32.
func (w *rowWriter) floats(r0, r1 int) ([]float32, error) {
	get := func(a, b int) ([]float32, error) {
		n := (b - a) * w.cols
		if cap(w.src) < n {
			w.src = make([]float32, n)
		}
		buf := w.src[:n]
		if err := w.rows(w.spec, a, b, buf); err != nil {
			return nil, err
		}
		return buf, nil
	}
	switch {
	case w.heads == 0:
		return get(r0, r1)
	case w.nrows == 1: // a bias: its elements are permuted
		src, err := get(0, 1)
		if err != nil {
			return nil, err
		}
		return permuteFloats(w.perm[:0], src, 0, w.cols, w.cols/w.heads, 1), nil
	}
	// The rows come from within the heads they lie in.
	d := w.nrows / w.heads
	h0, h1 := r0/d*d, (r1+d-1)/d*d
	span, err := get(h0, h1)
	if err != nil {
		return nil, err
	}
	w.perm = permuteFloats(w.perm[:0], span, r0-h0, r1-h0, d, w.cols)
	return w.perm, nil
}

// permuteFloats appends to dst the stored rows [g0, g1) of span, whole
// heads of d rows of cols values in Hugging Face's order: stored row g of
// the span is its Hugging Face row hfRow(g, d) (PermuteQK's order).
func permuteFloats(dst, span []float32, g0, g1, d, cols int) []float32 {
	for g := g0; g < g1; g++ {
		f := int(hfRow(int64(g), int64(d)))
		dst = append(dst, span[f*cols:(f+1)*cols]...)
	}
	return dst
}

// GGUFTensorTypes returns the type each tensor of c is stored in when the
// model is written as base, as llama.cpp's quantizer chooses without an
// importance matrix: norms, biases and a mixture of experts' router F32;
// the linear weights and the token embedding base; the LM head (the token
// embedding when tied) Q6_K when base is a 4- or 5-bit format or Q6_K,
// base when it is Q8_0 or a float type. Q4_K is thus llama.cpp's Q4_K_S
// without its few Q5_K tensors. A tensor whose rows are not whole blocks
// of its type is F16 instead (BF16 when c's dtype is BF16, so that no
// value changes; Q8_0 for a head that cannot be Q6_K but can be Q8_0);
// fallbacks lists them, one line each, a block's experts of one
// projection (stacked in one tensor, of one type) in one line.
func GGUFTensorTypes(c *arch.Config, base quant.Type) (types map[string]quant.Type, fallbacks []string, err error) {
	switch base {
	case quant.F32, quant.F16, quant.BF16, quant.Q8_0, quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1,
		quant.Q4_K, quant.Q5_K, quant.Q6_K:
	default:
		return nil, nil, fmt.Errorf("loader: GGUF type %v is not one strata writes models in", base)
	}
	half := quant.F16
	if c.DType == tensor.BF16 {
		half = quant.BF16
	}
	types = map[string]quant.Type{}
	for _, spec := range c.ExpectedTensors() {
		cols := int64(spec.Shape[len(spec.Shape)-1])
		want := base
		head := spec.Role == arch.LMHead || spec.Role == arch.Embed && c.TieEmbeddings
		switch {
		case len(spec.Shape) == 1, spec.Role == arch.Router:
			types[spec.Name] = quant.F32
			continue
		case head && base != quant.Q8_0 && base.BlockSize() > 1:
			want = quant.Q6_K
		}
		typ := want
		if cols%int64(want.BlockSize()) != 0 {
			typ = half
			if head && cols%int64(quant.Q8_0.BlockSize()) == 0 && base.BlockSize() > 1 {
				typ = quant.Q8_0
			}
			name := spec.Name
			if stacked, ok := GGUFExpertName(spec); ok && spec.Role.IsExpert() {
				name = stacked // said once, for expert 0
				if spec.Expert > 0 {
					types[spec.Name] = typ
					continue
				}
			}
			fallbacks = append(fallbacks, fmt.Sprintf("%s: rows of %d are not whole %d-element blocks of %v: written as %v",
				name, cols, want.BlockSize(), want, typ))
		}
		types[spec.Name] = typ
	}
	return types, fallbacks, nil
}

// GGUFFileType is llama.cpp's general.file_type of a model written as base
// by GGUFTensorTypes.
func GGUFFileType(base quant.Type) uint32 {
	switch base {
	case quant.F32:
		return 0
	case quant.F16:
		return 1
	case quant.Q4_0:
		return 2
	case quant.Q4_1:
		return 3
	case quant.Q8_0:
		return 7
	case quant.Q5_0:
		return 8
	case quant.Q5_1:
		return 9
	case quant.Q4_K:
		return 14 // Q4_K_S
	case quant.Q5_K:
		return 16 // Q5_K_S
	case quant.Q6_K:
		return 18
	case quant.BF16:
		return 32
	}
	return 0
}
