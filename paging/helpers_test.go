package paging

import (
	"bytes"
	"context"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/strata-llm/strata/tensor"
)

// fakeBackend is a host-memory tensor.Memory that counts what is
// allocated: paging only allocates, uploads and downloads. Uploads and
// downloads accept the tensors it allocated and views into them.
type fakeBackend struct {
	mu          sync.Mutex
	live        map[*tensor.Tensor]int64
	liveBytes   int64
	peakBytes   int64
	total       int64 // reported by MemInfo
	pinned      map[*byte]int64
	pinnedBytes int64
	uploads     atomic.Int64
	allocs      atomic.Int64 // Alloc calls
	frees       atomic.Int64 // Free calls
	pinnedCalls atomic.Int64 // AllocPinned calls
}

func newFake() *fakeBackend {
	return &fakeBackend{live: map[*tensor.Tensor]int64{}, pinned: map[*byte]int64{}, total: 16 * GiB}
}

func (f *fakeBackend) Name() string { return "fake" }

func (f *fakeBackend) Alloc(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	f.allocs.Add(1)
	t := tensor.New(dt, shape)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.live[t] = t.NumBytes()
	f.liveBytes += t.NumBytes()
	f.peakBytes = max(f.peakBytes, f.liveBytes)
	return t, nil
}

func (f *fakeBackend) Free(t *tensor.Tensor) {
	if t == nil {
		return
	}
	f.frees.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.live[t]
	if !ok {
		panic("fake backend: double free or foreign tensor")
	}
	delete(f.live, t)
	f.liveBytes -= n
}

// isLive reports a tensor the fake allocated and has not freed, or a view
// into one.
func (f *fakeBackend) isLive(t *tensor.Tensor) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.live[t]; ok {
		return true
	}
	b := t.Bytes()
	if len(b) == 0 {
		return false
	}
	lo := uintptr(unsafe.Pointer(&b[0]))
	for u := range f.live {
		if ub := u.Bytes(); len(ub) > 0 {
			ulo := uintptr(unsafe.Pointer(&ub[0]))
			if lo >= ulo && lo+uintptr(len(b)) <= ulo+uintptr(len(ub)) {
				return true
			}
		}
	}
	return false
}

func (f *fakeBackend) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	if !f.isLive(dst) {
		return fmt.Errorf("fake backend: upload to a tensor that is not live")
	}
	if off < 0 || off+int64(len(src)) > dst.NumBytes() {
		return fmt.Errorf("fake backend: upload out of range")
	}
	copy(dst.Bytes()[off:], src)
	f.uploads.Add(int64(len(src)))
	return nil
}

func (f *fakeBackend) Download(dst []byte, src *tensor.Tensor) error {
	if !f.isLive(src) {
		return fmt.Errorf("fake backend: download of a tensor that is not live (evicted?)")
	}
	if int64(len(dst)) != src.NumBytes() {
		return fmt.Errorf("fake backend: download size")
	}
	copy(dst, src.Bytes())
	return nil
}

func (f *fakeBackend) MemInfo() (int64, int64, error) { return f.total - f.liveBytes, f.total, nil }

func (f *fakeBackend) AllocPinned(n int64) ([]byte, error) {
	f.pinnedCalls.Add(1)
	b := make([]byte, n)
	if n == 0 {
		return b, nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pinned[&b[0]] = n
	f.pinnedBytes += n
	return b, nil
}

func (f *fakeBackend) FreePinned(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.pinned[&b[0]]
	if !ok {
		return fmt.Errorf("fake backend: FreePinned of memory it did not allocate")
	}
	delete(f.pinned, &b[0])
	f.pinnedBytes -= n
	return nil
}

func (f *fakeBackend) outstanding() (int, int64, int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.live), f.liveBytes, f.pinnedBytes
}

func (f *fakeBackend) Close() error { return nil }

// pageableBackend hides the fake's PinnedAllocator.
type pageableBackend struct{ tensor.Memory }

// synthSource is a model whose tensor bytes are a deterministic pattern of
// (layer, name), so every Acquire can check it got the right bytes.
type synthSource struct {
	patterns sync.Map // "layer/name" -> []byte
	layers   [][]TensorSpec
	reads    atomic.Int64 // bytes read
	calls    []atomic.Int64
	// block, when set, makes ReadTensor of that layer wait for ctx or the
	// channel to close.
	blockLayer int
	block      chan struct{}
	started    chan struct{}
	// tied are the tensors listed by two layers (tiedSynth).
	tied map[string]bool
}

func newSynth(layerTensors [][]TensorSpec) *synthSource {
	return &synthSource{layers: layerTensors, calls: make([]atomic.Int64, len(layerTensors)), blockLayer: -1}
}

// randomSynth makes n layers of 1..maxT F16 tensors with random shapes.
func randomSynth(rng *rand.Rand, n, maxT, maxRows int) *synthSource {
	var ls [][]TensorSpec
	for l := range n {
		var ts []TensorSpec
		for k := range 1 + rng.IntN(maxT) {
			s := tensor.Shape{1 + rng.IntN(maxRows), 8}
			ts = append(ts, spec(fmt.Sprintf("layers.%d.t%d", l, k), tensor.F16, s))
		}
		ls = append(ls, ts)
	}
	return newSynth(ls)
}

// llamaSynth lays out layers like a Llama model: embedding, blocks of nine
// tensors, final norm and head.
func llamaSynth(blocks, hidden, inter, kvDim, vocab int) *synthSource {
	ls := [][]TensorSpec{{spec("model.embed_tokens.weight", tensor.F16, tensor.Shape{vocab, hidden})}}
	for i := range blocks {
		p := fmt.Sprintf("model.layers.%d.", i)
		ls = append(ls, []TensorSpec{
			spec(p+"input_layernorm.weight", tensor.F16, tensor.Shape{hidden}),
			spec(p+"self_attn.q_proj.weight", tensor.F16, tensor.Shape{hidden, hidden}),
			spec(p+"self_attn.k_proj.weight", tensor.F16, tensor.Shape{kvDim, hidden}),
			spec(p+"self_attn.v_proj.weight", tensor.F16, tensor.Shape{kvDim, hidden}),
			spec(p+"self_attn.o_proj.weight", tensor.F16, tensor.Shape{hidden, hidden}),
			spec(p+"post_attention_layernorm.weight", tensor.F16, tensor.Shape{hidden}),
			spec(p+"mlp.gate_proj.weight", tensor.F16, tensor.Shape{inter, hidden}),
			spec(p+"mlp.up_proj.weight", tensor.F16, tensor.Shape{inter, hidden}),
			spec(p+"mlp.down_proj.weight", tensor.F16, tensor.Shape{hidden, inter}),
		})
	}
	ls = append(ls, []TensorSpec{
		spec("model.norm.weight", tensor.F16, tensor.Shape{hidden}),
		spec("lm_head.weight", tensor.F16, tensor.Shape{vocab, hidden}),
	})
	return newSynth(ls)
}

// tiedSynth is llamaSynth with tied embeddings: the head's weight is the
// embedding table, listed by the first layer and the last.
func tiedSynth(blocks, hidden, inter, kvDim, vocab int) *synthSource {
	s := llamaSynth(blocks, hidden, inter, kvDim, vocab)
	last := s.layers[len(s.layers)-1]
	last[1].Name = "model.embed_tokens.weight"
	s.tied = map[string]bool{last[1].Name: true}
	return s
}

func spec(name string, dt tensor.DType, s tensor.Shape) TensorSpec {
	return TensorSpec{Name: name, DType: dt, Shape: s, Bytes: s.NumElements() * int64(dt.Size())}
}

func (s *synthSource) NumLayers() int { return len(s.layers) }

func (s *synthSource) LayerTensors(l int) []TensorSpec { return s.layers[l] }

func (s *synthSource) ReadTensor(ctx context.Context, l int, name string, dst []byte) error {
	if l < 0 || l >= len(s.layers) {
		return fmt.Errorf("synth: no layer %d", l)
	}
	for _, t := range s.layers[l] {
		if t.Name != name {
			continue
		}
		if int64(len(dst)) != t.Bytes {
			return fmt.Errorf("synth: %s: dst has %d bytes, want %d", name, len(dst), t.Bytes)
		}
		if l == s.blockLayer && s.block != nil {
			if s.started != nil {
				select {
				case s.started <- struct{}{}:
				default:
				}
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-s.block:
			}
		}
		copy(dst, s.pattern(l, name, t.Bytes))
		s.reads.Add(t.Bytes)
		s.calls[l].Add(1)
		return nil
	}
	return fmt.Errorf("synth: layer %d has no tensor %s", l, name)
}

// pattern returns the tensor's bytes, computed once. A tensor that
// several layers list (tied embeddings) has the same bytes in each.
func (s *synthSource) pattern(l int, name string, n int64) []byte {
	if s.tied[name] {
		l = -1
	}
	key := fmt.Sprintf("%d/%s", l, name)
	if b, ok := s.patterns.Load(key); ok {
		return b.([]byte)
	}
	b := make([]byte, n)
	fill(b, l, name)
	s.patterns.Store(key, b)
	return b
}

func seedOf(l int, name string) uint32 {
	h := fnv.New32a()
	fmt.Fprintf(h, "%d/%s", l, name)
	return h.Sum32()
}

func fill(dst []byte, l int, name string) {
	x := seedOf(l, name)
	for i := range dst {
		x = x*1664525 + 1013904223
		dst[i] = byte(x >> 24)
	}
}

// check verifies that the acquired tensors are the layer's, with its bytes.
func check(b tensor.Memory, src *synthSource, l int, ws map[string]*tensor.Tensor) error {
	if len(ws) != len(src.layers[l]) {
		return fmt.Errorf("layer %d: got %d tensors, want %d", l, len(ws), len(src.layers[l]))
	}
	for _, s := range src.layers[l] {
		t := ws[s.Name]
		if t == nil {
			return fmt.Errorf("layer %d: tensor %s missing", l, s.Name)
		}
		if t.DType() != s.DType || !t.Shape().Equal(s.Shape) {
			return fmt.Errorf("layer %d: tensor %s is %v %v, want %v %v", l, s.Name, t.DType(), t.Shape(), s.DType, s.Shape)
		}
		got := make([]byte, t.NumBytes())
		if err := b.Download(got, t); err != nil {
			return fmt.Errorf("layer %d: tensor %s: %v", l, s.Name, err)
		}
		if want := src.pattern(l, s.Name, s.Bytes); !bytes.Equal(got, want) {
			return fmt.Errorf("layer %d: tensor %s: bytes differ from the source's", l, s.Name)
		}
	}
	return nil
}

// smallDims gives a model's reserve for planning: small, so that the KV
// cache and activations are a modest share of the budget. (They are nn's
// buffers for hidden 8, intermediate 16, 2 heads and 1 KV head of 4,
// vocabulary 32, the activations taken together.)
func smallDims(src Source, blocks int) ModelInfo {
	layers, err := DescribeSource(src)
	if err != nil {
		panic(err)
	}
	return ModelInfo{Layers: layers, NumLayers: blocks, Reserve: Reserve{
		{Category: KVCache, Bytes: 4 * 4, Per: PerPosition, Count: 2, PerBlock: true},
		{Category: Workspace, Bytes: 4 * 2, Per: PerPosition, Count: 2},
		{Category: Activations, Bytes: 4 * (3*8 + 2*8 + 2*4 + 2*16), Per: PerToken, Count: 1},
		{Category: Activations, Bytes: 4 * 32, Per: PerToken, Count: 1, LastLayer: true},
	}}
}

// reserveBytes is the model's whole reserve for a plan.
func reserveBytes(info ModelInfo, contextLen, chunk, batch int) int64 {
	var n int64
	for c := range numCategories {
		n += info.Reserve.Bytes(c, info.NumLayers, contextLen, chunk, batch, nil)
	}
	return n
}

// newBudget is NewBudget for a test.
func newBudget(t testing.TB, b tensor.Memory, limit int64, device string) *Budget {
	t.Helper()
	bg, err := NewBudget(b, limit, device)
	if err != nil {
		t.Fatal(err)
	}
	return bg
}

// ringLayer is the largest layer laid out in the ring, each tensor aligned:
// the ring that streaming every layer without prefetch needs.
func ringLayer(info ModelInfo) int64 {
	var most int64
	for _, l := range info.Layers {
		var slab int64
		for _, t := range l.Tensors {
			slab += alignUp(t.Bytes)
		}
		if len(l.Tensors) == 0 {
			slab = alignUp(l.Bytes)
		}
		most = max(most, slab)
	}
	return most
}

func totalAndMax(info ModelInfo) (w, lmax int64) {
	for _, l := range info.Layers {
		w += l.Bytes
		lmax = max(lmax, l.Bytes)
	}
	return
}

func (p *Pager) dump() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := fmt.Sprintf("inflight %d ring %d/%d head %d\n", p.inflight, p.ringUsed, p.ringCap, p.ringHead)
	for _, e := range p.layers {
		slot := "-"
		if e.slot != nil {
			slot = fmt.Sprintf("[%d,%d)", e.slot.start, e.slot.end)
		}
		s += fmt.Sprintf("L%d res %d/%v str %d/%v slot %s pins %d waiters %d loading %v\n", e.layer, e.resBytes, e.resLoaded, e.strBytes, e.strLoaded, slot, e.pins, e.waiters, e.loading)
	}
	s += fmt.Sprintf("%+v\n", p.bg.Categories())
	return s
}
