package nn

import (
	"context"
	"fmt"
	"github.com/strata-llm/strata/arch"
	"math"
	"sync/atomic"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Params are a model's trainable weights for mixed-precision training: an
// F32 master copy of every tensor, which the optimizer updates, and a
// working copy in the stored dtype (F16, BF16 or F32), which the forward
// reads. After an update the working copy is the master rounded to the
// stored dtype. F32 tensors are their own master.
//
// Params implement Weights (every layer on the host, for the CPU backend)
// and paging.Source (so a paging.Pager can serve them under a budget).
// Params are safe for concurrent reads; updates (Optimizer.Step, Sync) must
// not run concurrently with anything else.
type Params struct {
	cfg    *arch.Config
	layers [][]*param // in Weights' numbering; a tied embedding is in two
	byName map[string]*param
	names  []string // each once, in layer order
}

type param struct {
	name   string
	work   *tensor.Tensor // stored dtype, host
	master []float32      // aliases work's storage when F32
}

// LoadParams reads every weight of lm into host memory and makes its F32
// master copy.
func LoadParams(ctx context.Context, lm *loader.Model) (*Params, error) {
	p := &Params{cfg: lm.Config.Clone(), byName: map[string]*param{}}
	for _, l := range lm.Layers() {
		var layer []*param
		for _, ti := range l.Tensors {
			if pr, ok := p.byName[ti.Name]; ok {
				layer = append(layer, pr)
				continue
			}
			t, err := lm.ReadTensor(ctx, ti.Name)
			if err != nil {
				return nil, err
			}
			pr := &param{name: ti.Name, work: t}
			switch t.DType() {
			case tensor.F32:
				pr.master = t.F32()
			case tensor.F16, tensor.BF16:
				pr.master = t.ToF32()
			default:
				return nil, fmt.Errorf("nn: params: %s has dtype %v, not a float type", ti.Name, t.DType())
			}
			p.byName[ti.Name] = pr
			p.names = append(p.names, ti.Name)
			layer = append(layer, pr)
		}
		p.layers = append(p.layers, layer)
	}
	return p, nil
}

// Config is the configuration of the model the parameters were read from.
func (p *Params) Config() *arch.Config { return p.cfg }

// Names lists the parameters, each once, in layer order.
func (p *Params) Names() []string { return append([]string(nil), p.names...) }

// Master returns the F32 master copy of a parameter (nil when there is no
// such parameter). Changing it changes the parameter once Sync runs.
func (p *Params) Master(name string) []float32 {
	if pr := p.byName[name]; pr != nil {
		return pr.master
	}
	return nil
}

// Tensor returns the working copy of a parameter in its stored dtype, or
// nil. It must not be changed.
func (p *Params) Tensor(name string) *tensor.Tensor {
	if pr := p.byName[name]; pr != nil {
		return pr.work
	}
	return nil
}

// Sync rounds the master copy of each named parameter (every parameter when
// none is named) into its working copy.
func (p *Params) Sync(names ...string) {
	if len(names) == 0 {
		names = p.names
	}
	for _, n := range names {
		if pr := p.byName[n]; pr != nil {
			pr.sync()
		}
	}
}

// sync rounds the master copy into the working copy and returns the first
// element of the working copy that is a NaN or an infinity (a master value
// too large for F16 becomes one), or -1. Each chunk is checked right after
// its conversion, while it is in cache.
func (pr *param) sync() int {
	work, master := pr.work, pr.master
	dt, b, size := work.DType(), work.Bytes(), work.DType().Size()
	var first firstIndex
	first.init()
	chunks(len(master), func(lo, hi int) {
		switch dt {
		case tensor.F16:
			tensor.F32ToF16(work.U16()[lo:hi], master[lo:hi])
		case tensor.BF16:
			tensor.F32ToBF16(work.U16()[lo:hi], master[lo:hi])
		}
		first.offer(lo, tensor.FirstNonFinite(dt, b[lo*size:hi*size]))
	})
	return first.get()
}

// nonFinite returns an error wrapping ErrNonFinite, naming the parameter and
// its first element that is a NaN or an infinity in the master or the
// working copy, or nil when there is none.
func (pr *param) nonFinite() error {
	check := func(dt tensor.DType, b []byte) int {
		var first firstIndex
		first.init()
		chunks(len(b)/dt.Size(), func(lo, hi int) {
			first.offer(lo, tensor.FirstNonFinite(dt, b[lo*dt.Size():hi*dt.Size()]))
		})
		return first.get()
	}
	if i := check(tensor.F32, f32View(pr.master)); i >= 0 {
		return fmt.Errorf("%s holds %w: element %d is %v", pr.name, ErrNonFinite, i, pr.master[i])
	}
	if dt := pr.work.DType(); dt != tensor.F32 {
		if i := check(dt, pr.work.Bytes()); i >= 0 {
			return fmt.Errorf("%s holds %w: element %d is %v in %v (its F32 master copy %v)",
				pr.name, ErrNonFinite, i, tensor.ElementF64(dt, pr.work.Bytes(), i), dt, pr.master[i])
		}
	}
	return nil
}

// CheckFinite returns an error wrapping ErrNonFinite naming the first
// parameter, in layer order, whose master or working copy holds a NaN or
// an infinity, and the element; nil when every weight is finite. Save
// calls it before writing anything.
func (p *Params) CheckFinite() error {
	for _, n := range p.names {
		if err := p.byName[n].nonFinite(); err != nil {
			return err
		}
	}
	return nil
}

// firstIndex is the smallest index offered by the goroutines of a chunks
// call.
type firstIndex struct{ v atomic.Int64 }

func (f *firstIndex) init() { f.v.Store(math.MaxInt64) }

// offer records lo+i when i >= 0 (a hit at index i of the chunk from lo).
func (f *firstIndex) offer(lo, i int) {
	if i < 0 {
		return
	}
	for v := int64(lo + i); ; {
		cur := f.v.Load()
		if v >= cur || f.v.CompareAndSwap(cur, v) {
			return
		}
	}
}

// get returns the smallest index offered, or -1.
func (f *firstIndex) get() int {
	if v := f.v.Load(); v != math.MaxInt64 {
		return int(v)
	}
	return -1
}

// Bytes is the size of the working copies, each parameter counted once.
func (p *Params) Bytes() int64 {
	var n int64
	for _, pr := range p.byName {
		n += pr.work.NumBytes()
	}
	return n
}

// Acquire returns the layer's working copies.
func (p *Params) Acquire(ctx context.Context, layer int) (LayerWeights, error) {
	if layer < 0 || layer >= len(p.layers) {
		return nil, fmt.Errorf("nn: params: no layer %d (model has %d)", layer, len(p.layers))
	}
	lw := make(LayerWeights, len(p.layers[layer]))
	for _, pr := range p.layers[layer] {
		lw[pr.name] = pr.work
	}
	return lw, ctx.Err()
}

// Release does nothing: the parameters stay in memory.
func (p *Params) Release(int) {}

// NumLayers is the number of layers in Weights' numbering.
func (p *Params) NumLayers() int { return len(p.layers) }

// LayerTensors lists a layer's tensors for paging.
func (p *Params) LayerTensors(layer int) []paging.TensorSpec {
	if layer < 0 || layer >= len(p.layers) {
		return nil
	}
	specs := make([]paging.TensorSpec, 0, len(p.layers[layer]))
	for _, pr := range p.layers[layer] {
		specs = append(specs, paging.TensorSpec{Name: pr.name, DType: pr.work.DType(), Shape: pr.work.Shape(), Bytes: pr.work.NumBytes()})
	}
	return specs
}

// ReadTensor copies a working copy's bytes into dst for paging.
func (p *Params) ReadTensor(ctx context.Context, layer int, name string, dst []byte) error {
	var pr *param
	if layer >= 0 && layer < len(p.layers) {
		for _, q := range p.layers[layer] {
			if q.name == name {
				pr = q
			}
		}
	}
	if pr == nil {
		return fmt.Errorf("nn: params: layer %d has no tensor %s", layer, name)
	}
	if int64(len(dst)) != pr.work.NumBytes() {
		return fmt.Errorf("nn: params: %s is %d bytes, asked for %d", name, pr.work.NumBytes(), len(dst))
	}
	copy(dst, pr.work.Bytes())
	return ctx.Err()
}

var (
	_ Weights       = (*Params)(nil)
	_ paging.Source = (*Params)(nil)
)
