package nn

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// HostKV keeps the KV cache of some decoder blocks in host memory while the
// blocks compute on the model's device (a GPU whose budget cannot hold the
// whole cache). Such a block attends where its cache is:
//
//   - a chunk of fewer than DeviceMinTokens tokens (a decode step) sends
//     its queries, keys and values (after the rotary embedding, a few KB)
//     down, appends the keys and values to the host cache, attends on CPU
//     over it and sends the output back up; the copy engine keeps
//     streaming the layers ahead (their copies were queued when the layer
//     before was acquired, and the CPU's work waits for none of them);
//   - a larger chunk (a prompt's prefill, compute-bound) uploads the
//     cache's earlier rows into a device scratch, attends on the device,
//     and downloads the chunk's new rows into the host cache. Two scratch
//     buffers alternate, so that the next host block's rows upload on the
//     copy engine while this block computes.
//
// The scratch (paging.KVScratchBuffers blocks' worth at most) is charged
// to the model's Allocator; the host caches and the CPU's buffers to
// Alloc.
type HostKV struct {
	// Blocks are the decoder blocks whose cache is in host memory.
	Blocks []int
	// CPU attends over the host caches; Alloc allocates them and the
	// CPU's query and output buffers (pinned host memory, so that they
	// cross the link at full speed).
	CPU   tensor.Backend
	Alloc paging.Allocator
	// DeviceMinTokens is the chunk from which a host block attends on the
	// device; 0 always attends on the CPU.
	DeviceMinTokens int
	// DeviceMaxPos, when > 0, has smaller chunks (decode steps) attend on
	// the device too, over uploaded rows, while the context is at most
	// this long: at short contexts the upload costs less than the CPU's
	// round trip (paging.KVUploadMaxPos predicts where).
	DeviceMaxPos int
}

// KVStats count the work of the KV caches in host memory.
type KVStats struct {
	// CPUAttention is the time the CPU spent attending over host caches,
	// CPUAttentions how many times (a block in a step).
	CPUAttention  time.Duration `json:"cpu_attention_ns"`
	CPUAttentions int64         `json:"cpu_attentions"`
	// UploadBytes are the host cache rows copied to the device's scratch
	// for prefill; DownloadBytes the rows (and queries) copied down.
	UploadBytes   int64 `json:"kv_upload_bytes"`
	DownloadBytes int64 `json:"kv_download_bytes"`
}

type kvCounters struct {
	cpuNanos, cpuCalls, up, down atomic.Int64
}

// SetHostKV places the KV cache of h.Blocks in host memory for the
// sessions made after it. It fails for a block the model does not run,
// or without a CPU backend and allocator.
func (m *Model) SetHostKV(h HostKV) error {
	if len(h.Blocks) == 0 {
		m.hostKV = nil
		return nil
	}
	if h.CPU == nil || h.Alloc == nil {
		return errors.New("nn: host KV cache needs a CPU backend and a host allocator")
	}
	if h.DeviceMinTokens < 0 || h.DeviceMaxPos < 0 {
		return fmt.Errorf("nn: host KV cache: device chunk of %d tokens, context of %d positions", h.DeviceMinTokens, h.DeviceMaxPos)
	}
	for _, b := range h.Blocks {
		if b < m.lo || b >= m.hi {
			return fmt.Errorf("nn: host KV cache of block %d: the model runs blocks %d..%d", b, m.lo, m.hi-1)
		}
	}
	h.Blocks = slices.Clone(h.Blocks)
	h.CPU = tensor.Checked(h.CPU)
	m.hostKV = &h
	return nil
}

// KVStats returns the counters of the host KV caches' work so far.
func (m *Model) KVStats() KVStats {
	return KVStats{
		CPUAttention:  time.Duration(m.kv.cpuNanos.Load()),
		CPUAttentions: m.kv.cpuCalls.Load(),
		UploadBytes:   m.kv.up.Load(),
		DownloadBytes: m.kv.down.Load(),
	}
}

// KVStats adds up the stages' Model.KVStats.
func (p *Pipeline) KVStats() KVStats {
	var t KVStats
	for _, m := range p.stages {
		st := m.KVStats()
		t.CPUAttention += st.CPUAttention
		t.CPUAttentions += st.CPUAttentions
		t.UploadBytes += st.UploadBytes
		t.DownloadBytes += st.DownloadBytes
	}
	return t
}

// hostKVSession is a session's part of HostKV.
type hostKVSession struct {
	cfg     *HostKV
	onHost  []bool           // per block of the model's range
	owned   []*tensor.Tensor // from cfg.Alloc
	q, attn *tensor.Tensor   // [chunk, QDim] in host memory
	// k and v [rows, KVDim] in host memory take a batch step's new keys
	// and values down (a session's go straight into its cache).
	k, v *tensor.Tensor
	// scratch are the alternating device pairs (keys, values) a prefill
	// chunk attends over; turn counts the host blocks of the chunk so far.
	scratch [][2]*tensor.Tensor
	turn    int
	// pending is the upload into scratch[turn%len] queued for the next
	// host block (block), or nil.
	pending func() error
	block   int
}

// allocHostKV allocates the session's host caches and buffers (the
// blocks' k and v it returns, per block of the model's range, nil for a
// device block) and the device scratch from dev: the session's own, or,
// with shared buffers (a pipeline's stages on one device), theirs, grown
// as far as this stage needs.
func (m *Model) allocHostKV(maxPos, chunk int, dev *allocator, shared *buffers, kv tensor.DType) (*hostKVSession, []*tensor.Tensor, []*tensor.Tensor, error) {
	h := m.hostKV
	c := &m.cfg
	hs := &hostKVSession{cfg: h, onHost: make([]bool, m.hi-m.lo)}
	al := &allocator{a: h.Alloc}
	k, v := make([]*tensor.Tensor, m.hi-m.lo), make([]*tensor.Tensor, m.hi-m.lo)
	for _, b := range h.Blocks {
		j := b - m.lo
		hs.onHost[j] = true
		k[j] = al.allocDT(paging.KVCache, kv, maxPos, c.KVDim())
		v[j] = al.allocDT(paging.KVCache, kv, maxPos, c.KVDim())
	}
	hs.q = al.alloc(paging.Activations, chunk, c.QDim())
	hs.attn = al.alloc(paging.Activations, chunk, c.QDim())
	hs.owned = al.owned
	if al.err != nil {
		hs.free()
		return nil, nil, nil, fmt.Errorf("host KV cache: %w", al.err)
	}
	if h.DeviceMinTokens > 0 && chunk >= h.DeviceMinTokens || h.DeviceMaxPos > 0 {
		if shared != nil {
			hs.scratch = shared.kvScratch
		}
		for len(hs.scratch) < min(len(h.Blocks), paging.KVScratchBuffers) {
			hs.scratch = append(hs.scratch, [2]*tensor.Tensor{
				dev.allocDT(paging.KVCache, kv, maxPos, c.KVDim()), dev.allocDT(paging.KVCache, kv, maxPos, c.KVDim())})
		}
		if dev.err != nil {
			hs.free()
			return nil, nil, nil, fmt.Errorf("device scratch for the host KV cache: %w", dev.err)
		}
		if shared != nil {
			shared.kvScratch = hs.scratch
		}
	}
	return hs, k, v, nil
}

func (hs *hostKVSession) free() {
	if hs == nil {
		return
	}
	for _, t := range hs.owned {
		hs.cfg.Alloc.Free(t)
	}
	hs.owned = nil
}

// startChunk forgets the uploads of an earlier chunk.
func (hs *hostKVSession) startChunk() {
	if hs != nil {
		hs.turn, hs.pending = 0, nil
	}
}

// attend appends the chunk's keys and values (kk, vv, T rows at pos0) to
// block i's cache and computes the attention of q into attn: on the
// model's device over its own cache, or, for a block whose cache is in
// host memory, on the CPU or over a device scratch (HostKV).
func (s *Session) attend(ctx context.Context, i, T, pos0 int, q, kk, vv, attn *tensor.Tensor, at tensor.Attn) error {
	b, j := s.m.backend, i-s.m.lo
	kc, vc := s.k[j], s.v[j]
	hs := s.hkv
	if hs == nil || !hs.onHost[j] {
		if err := b.CopyRows(kc, pos0, kk, 0, T); err != nil {
			return err
		}
		if err := b.CopyRows(vc, pos0, vv, 0, T); err != nil {
			return err
		}
		at.Q, at.K, at.V = q, kc, vc
		return b.Attention(attn, at)
	}
	// The chunk's rows go down into the host cache either way.
	if err := s.downloadRows(kc, pos0, kk); err != nil {
		return fmt.Errorf("keys to host memory: %w", err)
	}
	if err := s.downloadRows(vc, pos0, vv); err != nil {
		return fmt.Errorf("values to host memory: %w", err)
	}
	if hs.onDevice(T, pos0) {
		return s.attendScratch(ctx, i, T, pos0, q, kk, vv, attn, at)
	}
	cq, ca := rows(hs.q, T), rows(hs.attn, T)
	if err := s.fetch(cq.Bytes(), q); err != nil {
		return fmt.Errorf("queries to host memory: %w", err)
	}
	s.m.kv.down.Add(cq.NumBytes())
	t0 := time.Now()
	at.Q, at.K, at.V = cq, kc, vc
	err := hs.cfg.CPU.Attention(ca, at)
	s.m.kv.cpuNanos.Add(int64(time.Since(t0)))
	s.m.kv.cpuCalls.Add(1)
	if err != nil {
		return fmt.Errorf("attention on %s: %w", hs.cfg.CPU.Name(), err)
	}
	if err := b.Upload(attn, 0, ca.Bytes()); err != nil {
		return fmt.Errorf("attention output to %s: %w", b.Name(), err)
	}
	return nil
}

// fetch downloads src, which the device computed, into dst once the
// device's compute queued so far is done; where the device can
// (tensor.DownloadComputed) without waiting for its asynchronous copies,
// so that the pager's prefetches of the next layers keep streaming while
// the CPU attends.
func (s *Session) fetch(dst []byte, src *tensor.Tensor) error {
	return tensor.DownloadComputed(s.m.backend, dst, src)
}

// downloadRows copies the T rows of src into dst's rows from pos0. A
// narrow cache (SessionOptions.KVDType) takes the F32 rows through the
// host attention's output buffer, which is free until the attention, and
// the host CPU converts them as it appends.
func (s *Session) downloadRows(dst *tensor.Tensor, pos0 int, src *tensor.Tensor) error {
	T := src.Shape()[0]
	if dst.DType() != tensor.F32 {
		stage, err := s.hkv.attn.View(0, tensor.F32, src.Shape())
		if err != nil {
			return err
		}
		if err := s.fetch(stage.Bytes(), src); err != nil {
			return err
		}
		s.m.kv.down.Add(stage.NumBytes())
		return s.hkv.cfg.CPU.CopyRows(dst, pos0, stage, 0, T)
	}
	d, err := dst.Rows(pos0, T)
	if err != nil {
		return err
	}
	if err := s.fetch(d.Bytes(), src); err != nil {
		return err
	}
	s.m.kv.down.Add(d.NumBytes())
	return nil
}

// attendScratch attends on the device over a copy of host block i's cache:
// its rows before pos0 uploaded into this turn's scratch (queued while the
// host block before computed, when there was one), the chunk's rows copied
// in from kk and vv. It queues the next host block's upload into the
// other scratch before computing.
func (s *Session) attendScratch(ctx context.Context, i, T, pos0 int, q, kk, vv, attn *tensor.Tensor, at tensor.Attn) error {
	b, hs := s.m.backend, s.hkv
	sc := hs.scratch[hs.turn%len(hs.scratch)]
	ready := hs.pending
	if ready == nil || hs.block != i {
		var err error
		if ready, err = s.uploadKV(ctx, i, pos0, sc); err != nil {
			return err
		}
	}
	hs.pending = nil
	hs.turn++
	if next := s.nextHostBlock(i); next >= 0 && len(hs.scratch) > 1 {
		var err error
		if hs.pending, err = s.uploadKV(ctx, next, pos0, hs.scratch[hs.turn%len(hs.scratch)]); err != nil {
			return err
		}
		hs.block = next
	}
	if err := ready(); err != nil {
		return fmt.Errorf("keys and values of %d positions to %s: %w", pos0, b.Name(), err)
	}
	if err := b.CopyRows(sc[0], pos0, kk, 0, T); err != nil {
		return err
	}
	if err := b.CopyRows(sc[1], pos0, vv, 0, T); err != nil {
		return err
	}
	at.Q, at.K, at.V = q, sc[0], sc[1]
	return b.Attention(attn, at)
}

// onDevice reports whether a chunk of T tokens at pos0 attends on the
// device over the scratch.
func (hs *hostKVSession) onDevice(T, pos0 int) bool {
	h := hs.cfg
	return hs.scratch != nil && (h.DeviceMinTokens > 0 && T >= h.DeviceMinTokens || pos0+T <= h.DeviceMaxPos)
}

// nextHostBlock is the host block after block i, or -1.
func (s *Session) nextHostBlock(i int) int {
	for j := i + 1 - s.m.lo; j < len(s.hkv.onHost); j++ {
		if s.hkv.onHost[j] {
			return j + s.m.lo
		}
	}
	return -1
}

// uploadKV queues the copy of block i's host rows before pos0 into the
// scratch pair sc, on the copy engine when the device has one, and
// returns what makes the device's compute wait for it.
func (s *Session) uploadKV(ctx context.Context, i, pos0 int, sc [2]*tensor.Tensor) (func() error, error) {
	if pos0 == 0 {
		return func() error { return nil }, nil
	}
	b, j := s.m.backend, i-s.m.lo
	au, async := tensor.AsyncUpload(b)
	var waits []func() error
	for x, c := range []*tensor.Tensor{s.k[j], s.v[j]} {
		src, err := c.Rows(0, pos0)
		if err != nil {
			return nil, err
		}
		if async {
			w, err := au.UploadAsync(ctx, sc[x], 0, src.Bytes())
			if err != nil {
				return nil, fmt.Errorf("keys and values of %d positions to %s: %w", pos0, b.Name(), err)
			}
			waits = append(waits, w)
		} else if err := b.Upload(sc[x], 0, src.Bytes()); err != nil {
			return nil, fmt.Errorf("keys and values of %d positions to %s: %w", pos0, b.Name(), err)
		}
		s.m.kv.up.Add(src.NumBytes())
	}
	return func() error {
		for _, w := range waits {
			if err := w(); err != nil {
				return err
			}
		}
		return nil
	}, nil
}
