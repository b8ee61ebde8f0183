package loader

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync/atomic"

	"golang.org/x/sync/errgroup"

	"github.com/strata-llm/strata/internal/atomicfile"
	"github.com/strata-llm/strata/tensor"
)

// NamedTensor is a host tensor with its safetensors name.
type NamedTensor struct {
	Name string
	T    *tensor.Tensor
}

// WriteSafetensors writes host tensors to one safetensors file at path, in
// the order given, with metadata as the header's __metadata__ (nil for
// none). The file is written under a fresh temporary name beside path and
// renamed over it when complete: a failed write leaves path as it was.
func WriteSafetensors(path string, tensors []NamedTensor, metadata map[string]string) error {
	w := &ShardedWriter{Metadata: metadata}
	for _, nt := range tensors {
		if err := w.AddTensor(nt.Name, nt.T); err != nil {
			return err
		}
	}
	_, err := w.writeFiles(context.Background(), []string{path}, [][]*pending{w.pending})
	return err
}

// FillFunc produces a tensor's bytes: it fills dst with the len(dst) bytes
// that start off bytes into the tensor. Ranges are byte ranges (a range may
// start or end inside an element when a file mixes dtypes). It is called
// concurrently for disjoint ranges of the same tensor, and must produce the
// same bytes for a range however the tensor is cut.
type FillFunc func(dst []byte, off int64) error

type pending struct {
	name  string
	dtype tensor.DType
	shape tensor.Shape
	size  int64
	fill  FillFunc
}

// ShardedWriter writes a Hugging Face checkpoint to a directory: one
// model.safetensors, or, when the tensors add up to more than MaxShardBytes,
// shards model-00001-of-0000N.safetensors with model.safetensors.index.json.
// Tensors are declared first with Add (their bytes come later from a
// callback), so a model far larger than memory streams straight to disk:
// Write cuts the data into chunks, fills them in parallel and writes each
// with one positioned write.
//
// Tensors are assigned to shards in the order added; a shard is closed when
// the next tensor would take it past MaxShardBytes (a tensor larger than
// that gets a shard of its own).
type ShardedWriter struct {
	Dir           string
	MaxShardBytes int64             // 0: always one file
	Metadata      map[string]string // __metadata__ of every file
	// Workers bounds the goroutines filling chunks; 0 means GOMAXPROCS.
	Workers int
	// Progress, if set, is called after each chunk is written with the
	// bytes written so far and the total. It may be called from several
	// goroutines at once.
	Progress func(written, total int64)

	pending []*pending
	names   map[string]bool
}

// NewShardedWriter returns a writer into dir (created by Write if needed).
func NewShardedWriter(dir string, maxShardBytes int64) *ShardedWriter {
	return &ShardedWriter{Dir: dir, MaxShardBytes: maxShardBytes, Metadata: map[string]string{"format": "pt"}}
}

// Add declares a tensor whose bytes fill will produce during Write.
func (w *ShardedWriter) Add(name string, dt tensor.DType, shape tensor.Shape, fill FillFunc) error {
	if name == "" || name == "__metadata__" {
		return fmt.Errorf("loader: write: bad tensor name %q", name)
	}
	if w.names[name] {
		return fmt.Errorf("loader: write: tensor %s added twice", name)
	}
	if _, ok := safetensorsDTypes[dt.String()]; !ok {
		return fmt.Errorf("loader: write: tensor %s: unsupported dtype %v", name, dt)
	}
	n := shape.NumElements()
	if n < 0 || n > (1<<62)/int64(dt.Size()) {
		return fmt.Errorf("loader: write: tensor %s: bad shape %v", name, shape)
	}
	if fill == nil {
		return fmt.Errorf("loader: write: tensor %s: no fill function", name)
	}
	if w.names == nil {
		w.names = map[string]bool{}
	}
	w.names[name] = true
	w.pending = append(w.pending, &pending{name: name, dtype: dt, shape: shape.Clone(), size: n * int64(dt.Size()), fill: fill})
	return nil
}

// AddTensor declares a host tensor; its bytes are copied during Write, so
// it must not change until then.
func (w *ShardedWriter) AddTensor(name string, t *tensor.Tensor) error {
	if t == nil || !t.OnHost() {
		return fmt.Errorf("loader: write: tensor %s is not a host tensor", name)
	}
	data := t.Bytes()
	return w.Add(name, t.DType(), t.Shape(), func(dst []byte, off int64) error {
		copy(dst, data[off:])
		return nil
	})
}

// TotalBytes is the size of the tensors declared so far.
func (w *ShardedWriter) TotalBytes() int64 {
	var n int64
	for _, p := range w.pending {
		n += p.size
	}
	return n
}

// WriteResult says what Write produced.
type WriteResult struct {
	Files      []string // base names of the safetensors files written
	DataBytes  int64    // tensor bytes (the index's total_size)
	TotalBytes int64    // bytes written to safetensors files, headers included
}

// Write writes the declared tensors to Dir, replacing files of the same
// names. Each file is written under a fresh temporary name and renamed
// when complete, the shards once all are complete and the index last; on
// any error no temporary file remains. Replacing a sharded model file by
// file is not atomic as a whole: to replace a model directory, write into
// the temporary directory of ReplaceModelDir.
func (w *ShardedWriter) Write(ctx context.Context) (*WriteResult, error) {
	if len(w.pending) == 0 {
		return nil, fmt.Errorf("loader: write: no tensors")
	}
	if err := os.MkdirAll(w.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("loader: write: %w", err)
	}
	// Assign tensors to shards in order.
	var groups [][]*pending
	var cur []*pending
	var curBytes int64
	for _, p := range w.pending {
		if w.MaxShardBytes > 0 && len(cur) > 0 && curBytes+p.size > w.MaxShardBytes {
			groups = append(groups, cur)
			cur, curBytes = nil, 0
		}
		cur = append(cur, p)
		curBytes += p.size
	}
	groups = append(groups, cur)

	paths := make([]string, len(groups))
	if len(groups) == 1 {
		paths[0] = filepath.Join(w.Dir, SingleFile)
	} else {
		for i := range groups {
			paths[i] = filepath.Join(w.Dir, ShardName(i+1, len(groups)))
		}
	}
	res, err := w.writeFiles(ctx, paths, groups)
	if err != nil {
		return nil, err
	}
	indexPath := filepath.Join(w.Dir, IndexFile)
	if len(groups) == 1 {
		// A stale index next to the new single file would be misleading.
		if err := os.Remove(indexPath); err != nil && !os.IsNotExist(err) {
			return nil, fmt.Errorf("loader: write: %w", err)
		}
		return res, nil
	}
	var params int64
	weightMap := map[string]string{}
	for i, g := range groups {
		for _, p := range g {
			weightMap[p.name] = filepath.Base(paths[i])
			params += p.shape.NumElements()
		}
	}
	idx, err := json.MarshalIndent(map[string]any{
		"metadata":   map[string]int64{"total_size": res.DataBytes, "total_parameters": params},
		"weight_map": weightMap,
	}, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("loader: write: index: %w", err)
	}
	if err := atomicfile.WriteFile(indexPath, append(idx, '\n')); err != nil {
		return nil, fmt.Errorf("loader: write: %w", err)
	}
	return res, nil
}

// ShardName is the Hugging Face name of shard i (from 1) of n:
// model-00001-of-00003.safetensors.
func ShardName(i, n int) string {
	return fmt.Sprintf("model-%05d-of-%05d.safetensors", i, n)
}

// header builds a safetensors header for tensors laid out in order, padded
// with spaces so that the data starts at a multiple of 8 bytes.
func header(tensors []*pending, metadata map[string]string) ([]byte, error) {
	type entry struct {
		DType       string  `json:"dtype"`
		Shape       []int   `json:"shape"`
		DataOffsets []int64 `json:"data_offsets"`
	}
	m := make(map[string]any, len(tensors)+1)
	if len(metadata) > 0 {
		m["__metadata__"] = metadata
	}
	var off int64
	for _, p := range tensors {
		shape := []int(p.shape)
		if shape == nil {
			shape = []int{}
		}
		m[p.name] = entry{DType: p.dtype.String(), Shape: shape, DataOffsets: []int64{off, off + p.size}}
		off += p.size
	}
	js, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("loader: write: header: %w", err)
	}
	if len(js) > MaxHeaderBytes {
		return nil, fmt.Errorf("loader: write: header of %d bytes exceeds the limit of %d", len(js), MaxHeaderBytes)
	}
	pad := (8 - (8+len(js))%8) % 8
	js = append(js, bytes.Repeat([]byte{' '}, pad)...)
	out := make([]byte, 8, 8+len(js))
	binary.LittleEndian.PutUint64(out, uint64(len(js)))
	return append(out, js...), nil
}

// writeChunk is the unit of parallel work: up to chunkBytes of one file's
// data region.
const chunkBytes = 4 << 20

// writeFiles writes groups[i] to paths[i]. All files are filled together by
// one pool of workers, each chunk written with one WriteAt at its final
// offset.
func (w *ShardedWriter) writeFiles(ctx context.Context, paths []string, groups [][]*pending) (res *WriteResult, err error) {
	type out struct {
		path      string
		f         *atomicfile.File
		dataStart int64
		tensors   []*pending
		starts    []int64 // offset of each tensor in the data region
		dataLen   int64
	}
	outs := make([]*out, len(paths))
	defer func() {
		for _, o := range outs {
			if o != nil {
				o.f.Abort() // nothing after Commit
			}
		}
	}()
	res = &WriteResult{}
	for i, path := range paths {
		hdr, err := header(groups[i], w.Metadata)
		if err != nil {
			return nil, err
		}
		o := &out{path: path, dataStart: int64(len(hdr)), tensors: groups[i]}
		for _, p := range groups[i] {
			o.starts = append(o.starts, o.dataLen)
			o.dataLen += p.size
		}
		f, err := atomicfile.Create(path)
		if err != nil {
			return nil, fmt.Errorf("loader: write: %w", err)
		}
		o.f = f
		outs[i] = o
		if _, err := f.WriteAt(hdr, 0); err != nil {
			return nil, fmt.Errorf("loader: write: %s: %w", path, err)
		}
		if err := f.Truncate(o.dataStart + o.dataLen); err != nil {
			return nil, fmt.Errorf("loader: write: %s: %w", path, err)
		}
		res.DataBytes += o.dataLen
		res.TotalBytes += o.dataStart + o.dataLen
	}

	workers := w.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	bufs := make(chan []byte, workers)
	for range workers {
		bufs <- make([]byte, chunkBytes)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(workers)
	var written atomic.Int64
	total := res.DataBytes
	for _, o := range outs {
		for start := int64(0); start < o.dataLen; start += chunkBytes {
			if gctx.Err() != nil {
				break
			}
			end := min(start+chunkBytes, o.dataLen)
			g.Go(func() error {
				buf := <-bufs
				defer func() { bufs <- buf }()
				buf = buf[:end-start]
				// Fill from every tensor overlapping [start, end).
				i, _ := slices.BinarySearch(o.starts, start)
				if i == len(o.starts) || o.starts[i] > start {
					i--
				}
				for ; i < len(o.tensors) && o.starts[i] < end; i++ {
					p := o.tensors[i]
					a, b := max(start, o.starts[i]), min(end, o.starts[i]+p.size)
					if a >= b {
						continue
					}
					if err := p.fill(buf[a-start:b-start], a-o.starts[i]); err != nil {
						return fmt.Errorf("loader: write: %s: tensor %s: %w", o.path, p.name, err)
					}
				}
				if _, err := o.f.WriteAt(buf, o.dataStart+start); err != nil {
					return fmt.Errorf("loader: write: %s: %w", o.path, err)
				}
				if w.Progress != nil {
					w.Progress(written.Add(end-start), total)
				}
				return nil
			})
		}
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for _, o := range outs {
		if err := o.f.Commit(); err != nil {
			return nil, fmt.Errorf("loader: write: %s: %w", o.path, err)
		}
		res.Files = append(res.Files, filepath.Base(o.path))
	}
	return res, nil
}
