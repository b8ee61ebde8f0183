package paging

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/strata-llm/strata/tensor"
)

// Unified serves a model's weights from managed (unified) memory instead of
// explicit copies: every weight lives in one managed allocation per tensor,
// preferring host memory.
//
// With prefetch (memory mode "unified"), the plan's resident tensors are
// migrated to the device once and stay; streamed tensors stay in host
// memory, mapped for the device (tensor.ManagedAllocator's
// AdviseDeviceAccess), and kernels read them in place over the link. That
// is the fast way to stream through managed memory: migrating each layer
// to the device and back, page by page, ran at 9 GB/s on an H200 where
// reading in place ran at 51 GB/s and pinned copies at 54 GB/s
// (cuda.BenchmarkManagedStreaming). The device-resident weight pages are the
// plan's resident bytes; its ring is charged to the budget all the same.
// Without prefetch ("unified-noprefetch") nothing is prefetched or mapped:
// pages move when the device touches them and the driver decides what
// stays: the budget is charged the same way, but the device-resident bytes
// are the driver's business, which is the contrast this mode exists to
// show.
//
// The managed bytes must fit in the device's free memory: AllocManaged
// refuses anything else, so managed memory never oversubscribes the GPU.
// Its charges to the budget are reservations that last until Close;
// nothing of them can be evicted, so a Unified is not an Evictor of its
// budget.
type Unified struct {
	src      Source
	bg       *Budget
	m        tensor.ManagedAllocator
	plan     *PlanResult
	prefetch bool

	mu       sync.Mutex
	layers   [][]*tensor.Tensor // every tensor of each layer, managed
	names    [][]string
	streamed [][]bool // per tensor: passes through the "ring"
	bytes    []int64  // streamed bytes per layer
	// shared are the tensors each layer borrows from the layer before it
	// (LayerPlan.Shared), served from that layer's allocation.
	shared  [][]string
	pins    []int
	charged [2]int64 // resident, ring
	closed  bool
	st      Stats
	steps   steps
}

// NewUnified allocates the model's weights in managed memory on the
// budget's backend, reads them from src and, with prefetch, migrates the
// plan's resident tensors to the device.
func NewUnified(ctx context.Context, src Source, bg *Budget, plan *PlanResult, prefetch bool) (*Unified, error) {
	b := bg.Backend()
	m, ok := tensor.Managed(b)
	if !ok {
		return nil, fmt.Errorf("paging: unified memory: backend %s has no managed memory", b.Name())
	}
	n := src.NumLayers()
	if n != len(plan.Layers) {
		return nil, fmt.Errorf("paging: plan has %d layers, source has %d", len(plan.Layers), n)
	}
	if plan.Experts > 0 {
		return nil, fmt.Errorf("paging: unified memory serves whole layers: plan without an expert cache (WithExpertCache)")
	}
	u := &Unified{src: src, bg: bg, m: m, plan: plan, prefetch: prefetch,
		layers: make([][]*tensor.Tensor, n), names: make([][]string, n), streamed: make([][]bool, n),
		bytes: make([]int64, n), pins: make([]int, n), shared: make([][]string, n)}
	u.st.Strategy, u.st.Device, u.st.Layers = plan.Strategy, bg.Device(), n
	if err := bg.reserve(ResidentWeights, plan.ResidentBytes); err != nil {
		return nil, err
	}
	u.charged[0] = plan.ResidentBytes
	if err := bg.reserve(StreamedWeights, plan.RingBytes); err != nil {
		u.Close()
		return nil, err
	}
	u.charged[1] = plan.RingBytes
	var buf []byte
	for l := range n {
		specs := src.LayerTensors(l)
		if err := checkSpecs(l, specs); err != nil {
			u.Close()
			return nil, err
		}
		lp := plan.Layers[l]
		str := map[string]bool{}
		for _, name := range lp.Streamed {
			str[name] = true
		}
		isShared := map[string]bool{}
		var sharedBytes int64
		if sh := lp.Shared; sh != nil {
			if sh.From < 0 || sh.From >= n || sh.From == l || plan.Layers[sh.From].Shared != nil {
				u.Close()
				return nil, fmt.Errorf("paging: unified memory: layer %d: plan shares its tensors with layer %d, which cannot lend them", l, sh.From)
			}
			for _, name := range sh.Names {
				isShared[name] = true
			}
			sharedBytes = sh.Bytes
		}
		whole := len(lp.Streamed) == 0 && lp.StreamedBytes > 0 && lp.StreamedBytes == lp.Bytes-sharedBytes
		for _, s := range specs {
			if isShared[s.Name] {
				u.shared[l] = append(u.shared[l], s.Name) // the lender's
				continue
			}
			t, err := m.AllocManaged(s.DType, s.Shape)
			if err != nil {
				u.Close()
				return nil, fmt.Errorf("paging: unified memory: layer %d tensor %s: %w", l, s.Name, err)
			}
			u.layers[l] = append(u.layers[l], t)
			u.names[l] = append(u.names[l], s.Name)
			isStr := whole || str[s.Name]
			u.streamed[l] = append(u.streamed[l], isStr)
			if isStr {
				u.bytes[l] += s.Bytes
			}
			if int64(cap(buf)) < s.Bytes {
				buf = make([]byte, s.Bytes)
			}
			src := buf[:s.Bytes]
			err = errors.Join(m.AdviseHost(t), u.src.ReadTensor(ctx, l, s.Name, src))
			if err == nil {
				err = b.Upload(t, 0, src)
			}
			if err == nil && isStr && prefetch {
				err = m.AdviseDeviceAccess(t)
			}
			if err == nil && isStr {
				err = m.PrefetchToHost(t)
			}
			if err == nil && !isStr && prefetch {
				err = m.PrefetchToDevice(t)
				u.st.BytesHostToDevice += s.Bytes
			}
			if err != nil {
				u.Close()
				return nil, fmt.Errorf("paging: unified memory: layer %d tensor %s: %w", l, s.Name, err)
			}
			u.st.BytesDiskToHost += s.Bytes
		}
	}
	for l, names := range u.shared {
		for _, name := range names {
			if from := plan.Layers[l].Shared.From; !slices.Contains(u.names[from], name) {
				u.Close()
				return nil, fmt.Errorf("paging: unified memory: layer %d: plan shares tensor %s with layer %d, which does not have it", l, name, from)
			}
		}
	}
	if err := tensor.Sync(b); err != nil {
		u.Close()
		return nil, err
	}
	return u, nil
}

// Acquire returns the layer's tensors. With prefetch its streamed part is
// read in place over the link, and counted as bytes to the device.
func (u *Unified) Acquire(ctx context.Context, layer int) (map[string]*tensor.Tensor, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closed {
		return nil, fmt.Errorf("paging: acquire layer %d: %w", layer, errClosed)
	}
	if layer < 0 || layer >= len(u.layers) {
		return nil, fmt.Errorf("paging: acquire layer %d: have layers 0..%d", layer, len(u.layers)-1)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	u.st.Acquires++
	if u.bytes[layer] == 0 || !u.prefetch {
		u.st.Hits++
	} else {
		u.st.Misses++
		u.st.Loads++
		u.st.BytesHostToDevice += u.bytes[layer]
	}
	u.pins[layer]++
	m := make(map[string]*tensor.Tensor, len(u.layers[layer])+len(u.shared[layer]))
	for i, t := range u.layers[layer] {
		m[u.names[layer][i]] = t
	}
	if names := u.shared[layer]; len(names) > 0 {
		from := u.plan.Layers[layer].Shared.From
		for i, name := range u.names[from] {
			if slices.Contains(names, name) {
				m[name] = u.layers[from][i]
			}
		}
	}
	return m, nil
}

// Release unpins a layer.
func (u *Unified) Release(layer int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if layer < 0 || layer >= len(u.layers) || u.pins[layer] == 0 {
		u.st.BadReleases++
		return
	}
	u.pins[layer]--
}

// MarkStep marks a decoded token and returns the streamed bytes the device
// read in place since the previous mark.
func (u *Unified) MarkStep() int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.steps.mark(&u.st)
}

// Stats returns the counters in the pager's form. Bytes to the device are
// the resident bytes prefetched at load and the streamed bytes of every
// acquire, read over the link; without prefetch the driver's own
// migrations are not seen.
func (u *Unified) Stats() Stats {
	peak := u.bg.Peak()
	u.mu.Lock()
	defer u.mu.Unlock()
	s := u.st
	s.BytesPerStep = u.steps.mean()
	s.ResidentWeightBytes = u.plan.ResidentBytes
	s.RingBytes = u.plan.RingBytes
	s.PeakDeviceBytes = peak
	for l, pins := range u.pins {
		if pins > 0 {
			s.PinnedLayers++
			if u.prefetch {
				s.StreamedWeightBytes += u.bytes[l] // being read over the link
			}
		}
	}
	return s
}

// Close frees the managed memory and returns the budget's charges. It is
// idempotent.
func (u *Unified) Close() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closed {
		return nil
	}
	u.closed = true
	b := u.bg.Backend()
	_ = tensor.Sync(b) // kernels may still read the weights
	for _, ts := range u.layers {
		for _, t := range ts {
			b.Free(t)
		}
	}
	u.layers = nil
	if u.charged[0] > 0 {
		u.bg.unreserve(ResidentWeights, u.charged[0])
	}
	if u.charged[1] > 0 {
		u.bg.unreserve(StreamedWeights, u.charged[1])
	}
	u.charged = [2]int64{}
	return nil
}
