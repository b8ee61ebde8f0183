//go:build cuda

package cuda

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// hostModel is a paging.Source held in host memory: a read is a memcpy on
// the reading goroutine, as a read from the page cache is. Every tensor is
// one random block with its name's number and its page's written at the
// start of each 4 KiB page, so that no two tensors, and no two pages of
// one, hold the same bytes.
type hostModel struct {
	layers [][]paging.TensorSpec
	data   map[string][]byte
}

// newHostModel makes a model shaped like Llama-2-7B (F16): an embedding
// table of 32000x4096 (250 MiB), blocks of four 4096x4096 attention
// projections and three 11008x4096 MLP projections (386 MiB a block), and
// a head of 32000x4096 after a norm.
func newHostModel(blocks int) *hostModel {
	attn, mlpIn, mlpOut := tensor.Shape{4096, 4096}, tensor.Shape{11008, 4096}, tensor.Shape{4096, 11008}
	layers := [][]tensor.Shape{{{32000, 4096}}}
	for range blocks {
		layers = append(layers, []tensor.Shape{attn, attn, attn, attn, mlpIn, mlpIn, mlpOut})
	}
	layers = append(layers, []tensor.Shape{{4096}, {32000, 4096}})
	block := make([]byte, 32000*4096*2)
	rng := rand.NewChaCha8([32]byte{7})
	rng.Read(block)
	m := &hostModel{data: map[string][]byte{}}
	id := uint64(0)
	for l, shapes := range layers {
		var specs []paging.TensorSpec
		for k, s := range shapes {
			name := fmt.Sprintf("layers.%d.w%d", l, k)
			n := s.NumElements() * 2
			specs = append(specs, paging.TensorSpec{Name: name, DType: tensor.F16, Shape: s, Bytes: n})
			b := make([]byte, n)
			copy(b, block)
			id++
			for off := 0; off+16 <= len(b); off += 4096 {
				binary.LittleEndian.PutUint64(b[off:], id)
				binary.LittleEndian.PutUint64(b[off+8:], uint64(off))
			}
			m.data[name] = b
		}
		m.layers = append(m.layers, specs)
	}
	return m
}

func (m *hostModel) NumLayers() int                             { return len(m.layers) }
func (m *hostModel) LayerTensors(layer int) []paging.TensorSpec { return m.layers[layer] }

func (m *hostModel) ReadTensor(ctx context.Context, layer int, name string, dst []byte) error {
	if b, ok := m.data[name]; !ok || len(b) != len(dst) {
		return fmt.Errorf("host model: layer %d: no tensor %s of %d bytes", layer, name, len(dst))
	}
	return m.ReadTensorRange(ctx, layer, name, 0, dst)
}

// ReadTensorRange makes hostModel a paging.RangeSource: the staging ring
// reads its large tensors in pieces.
func (m *hostModel) ReadTensorRange(ctx context.Context, layer int, name string, off int64, dst []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b, ok := m.data[name]
	if !ok || off < 0 || off+int64(len(dst)) > int64(len(b)) {
		return fmt.Errorf("host model: layer %d: tensor %s has no %d bytes at %d", layer, name, len(dst), off)
	}
	copy(dst, b[off:])
	return nil
}

// TestPagerStagedGPU streams a 7B-shaped model (the embedding table, 4
// blocks of 386 MiB, the head; a paging.RangeSource, so the staging ring
// reads its large tensors in pieces) with the aggressive strategy,
// through the pager's staging ring (tensor.StagedUploader) and, for
// comparison, without it and without a host cache (reads into pageable memory on one goroutine, synchronous
// copies: the aggressive strategy before the ring), and checks:
//   - every byte of every layer, on passes that download each layer whole
//     before and after the timed passes: a staging buffer refilled before
//     its copy landed (UploadStaged's landed returning early) shows up as
//     another tensor's bytes;
//   - the ring's pinned memory is what the pager reports (Stats.Staging*)
//     and the plan predicted, the only pinned memory held, and freed at
//     Close;
//   - every byte uploaded went through the ring;
//   - streaming rate: the timed passes (acquire and release, no compute:
//     the copy engine and the reads are the limit) move at least half the
//     measured pinned copy rate and 1.5 times the rate without the ring.
//
// It logs the rates, the ratios, the pager's summary and the time each
// phase ended at (the whole took over 120 s on the H200 with 12 blocks and
// 4 passes; it should take about 15 s now). It skips without a CUDA
// device.
func TestPagerStagedGPU(t *testing.T) {
	began := time.Now()
	phase := func(what string) { t.Logf("[+%.1fs] %s", time.Since(began).Seconds(), what) }
	b := openGPU(t)
	src := newHostModel(4)
	phase("model made")
	layers := src.NumLayers()
	var layerBytes int64 // the largest layer's
	for _, specs := range src.layers {
		var n int64
		for _, s := range specs {
			n += s.Bytes
		}
		layerBytes = max(layerBytes, n)
	}
	info, err := paging.DescribeSource(src)
	if err != nil {
		t.Fatal(err)
	}
	model := paging.ModelInfo{Layers: info, NumLayers: layers - 2}
	probe, err := paging.Plan(model, 1<<40, paging.StrategyAggressive, 16, 1, paging.WithDevice(b))
	if err != nil {
		t.Fatal(err)
	}
	budget := probe.MinBudgetBytes + 3*layerBytes
	plan, err := paging.Plan(model, budget, paging.StrategyAggressive, 16, 1, paging.WithDevice(b))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("plan: %s", plan)
	if plan.PrefetchDepth != 2 || plan.StagingBytes == 0 {
		t.Fatalf("plan: prefetch depth %d, staging %d bytes; want depth 2 and a staging ring", plan.PrefetchDepth, plan.StagingBytes)
	}
	pinnedGBps := pinnedRate(t, b, layerBytes)
	phase("pinned rate measured")

	ctx := context.Background()
	// run pages the model and returns the timed passes' GB/s.
	run := func(name string, opts paging.Options) float64 {
		bud, err := paging.NewBudget(b, budget, b.Name())
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := bud.Close(); err != nil {
				t.Errorf("%s: budget Close: %v", name, err)
			}
		}()
		p, err := paging.NewPager(src, bud, plan, opts)
		if err != nil {
			t.Fatal(err)
		}
		verify := func(what string) {
			for l := range layers {
				ws, err := p.Acquire(ctx, l)
				if err != nil {
					t.Fatalf("%s: %s: acquire %d: %v", name, what, l, err)
				}
				for _, s := range src.layers[l] {
					got := make([]byte, s.Bytes)
					if err := b.Download(got, ws[s.Name]); err != nil {
						t.Fatalf("%s: %s: download %s: %v", name, what, s.Name, err)
					}
					if want := src.data[s.Name]; !bytes.Equal(got, want) {
						i := 0
						for got[i] == want[i] {
							i++
						}
						t.Fatalf("%s: %s: layer %d tensor %s differs from byte %d (page %d holds tensor %d's page at %d): a copy read a staging buffer after it was refilled, or never landed",
							name, what, l, s.Name, i, i/4096, binary.LittleEndian.Uint64(got[i&^4095:]), binary.LittleEndian.Uint64(got[i&^4095+8:]))
					}
				}
				p.Release(l)
			}
		}
		verify("first check")
		phase(name + ": first check done")
		const passes = 3
		st0 := p.Stats()
		start := time.Now()
		for range passes {
			for l := range layers {
				if _, err := p.Acquire(ctx, l); err != nil {
					t.Fatalf("%s: acquire %d: %v", name, l, err)
				}
				p.Release(l)
			}
		}
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		el := time.Since(start)
		st := p.Stats()
		moved := st.BytesHostToDevice - st0.BytesHostToDevice
		gbps := float64(moved) / el.Seconds() / 1e9
		t.Logf("%s: %d passes of %d layers (%s the largest): %s in %v, %.1f GB/s (%.0f%% of the pinned copy rate, %.2f passes/s); staging ring %s in %d buffers, %s staged, waited %v for a free buffer; %d readers, reading at %.1f GB/s while they read",
			name, passes, layers, paging.FormatSize(layerBytes), paging.FormatSize(moved), el.Round(time.Millisecond), gbps, 100*gbps/pinnedGBps,
			float64(passes)/el.Seconds(), paging.FormatSize(st.StagingBytes), st.StagingSlots, paging.FormatSize(st.BytesStaged-st0.BytesStaged), st.StagingWait.Round(time.Millisecond),
			st.StagingReaders, float64(st.BytesStaged-st0.BytesStaged)/max(st.StagingReadTime-st0.StagingReadTime, 1).Seconds()/1e9)
		verify("second check")
		phase(name + ": second check done")
		st = p.Stats()
		if pinned := b.Stats().Pinned; pinned != st.StagingBytes+st.PinnedHostBytes {
			t.Errorf("%s: the backend holds %d pinned bytes, the pager reports a staging ring of %d and a host cache of %d", name, pinned, st.StagingBytes, st.PinnedHostBytes)
		}
		if opts.StagingSlots >= 0 {
			if st.StagingBytes != plan.StagingBytes || st.StagingSlots != 3 {
				t.Errorf("%s: staging ring of %d bytes in %d buffers, the plan's is %d in 3", name, st.StagingBytes, st.StagingSlots, plan.StagingBytes)
			}
			if st.BytesStaged != st.BytesHostToDevice {
				t.Errorf("%s: %d bytes staged of %d uploaded: every aggressive upload goes through the ring", name, st.BytesStaged, st.BytesHostToDevice)
			}
		} else if st.StagingSlots != 0 || st.BytesStaged != 0 {
			t.Errorf("%s: a staging ring of %d buffers with StagingSlots -1", name, st.StagingSlots)
		}
		t.Logf("%s: %s", name, paging.Summary(bud))
		if err := p.Close(); err != nil {
			t.Errorf("%s: pager Close: %v", name, err)
		}
		if pinned := b.Stats().Pinned; pinned != 0 {
			t.Errorf("%s: %d pinned bytes after the pager's Close", name, pinned)
		}
		phase(name + ": closed")
		return gbps
	}
	staged := run("staged", paging.Options{})
	// Without the ring and without a host cache, as the aggressive
	// strategy ran before it: every read into pageable memory.
	plain := run("without staging", paging.Options{StagingSlots: -1, HostCacheBytes: -1})
	t.Logf("staged %.1f GB/s, without staging %.1f GB/s (%.1fx), pinned copy rate %.1f GB/s (staged at %.0f%% of it)",
		staged, plain, staged/plain, pinnedGBps, 100*staged/pinnedGBps)
	if staged < pinnedGBps/2 {
		t.Errorf("staged streaming at %.1f GB/s, under half the pinned copy rate %.1f GB/s: reads and copies do not overlap", staged, pinnedGBps)
	}
	if staged < 1.5*plain {
		t.Errorf("staged streaming at %.1f GB/s, without staging %.1f GB/s: the ring does not pay", staged, plain)
	}
}

// pinnedRate is the copy rate in GB/s from pinned host memory of n bytes
// to the device, the best of five.
func pinnedRate(t testing.TB, b *Backend, n int64) float64 {
	t.Helper()
	host, err := b.AllocPinned(n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreePinned(host)
	dst, err := b.Alloc(tensor.F16, tensor.Shape{int(n / 2)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(dst)
	best := time.Duration(1 << 62)
	for range 5 {
		start := time.Now()
		ready, landed, err := b.UploadStaged(context.Background(), dst, 0, host)
		if err != nil {
			t.Fatal(err)
		}
		if err := landed(); err != nil {
			t.Fatal(err)
		}
		if err := ready(); err != nil {
			t.Fatal(err)
		}
		best = min(best, time.Since(start))
	}
	gbps := float64(n) / best.Seconds() / 1e9
	t.Logf("pinned copy rate: %.1f GB/s (%s, best of 5)", gbps, paging.FormatSize(n))
	return gbps
}

// BenchmarkPagerStaged streams the 7B-shaped host model (TestPagerStagedGPU)
// with the aggressive strategy, one pass over its layers an iteration
// (acquire and release, no compute), through the staging ring and without
// it; it reports the rate in GB/s and as a share of the pinned copy rate.
func BenchmarkPagerStaged(b *testing.B) {
	g := openGPU(b)
	src := newHostModel(12)
	info, err := paging.DescribeSource(src)
	if err != nil {
		b.Fatal(err)
	}
	var largest int64
	for _, li := range info {
		largest = max(largest, li.Bytes)
	}
	model := paging.ModelInfo{Layers: info, NumLayers: len(info) - 2}
	probe, err := paging.Plan(model, 1<<40, paging.StrategyAggressive, 16, 1, paging.WithDevice(g))
	if err != nil {
		b.Fatal(err)
	}
	budget := probe.MinBudgetBytes + 3*largest
	plan, err := paging.Plan(model, budget, paging.StrategyAggressive, 16, 1, paging.WithDevice(g))
	if err != nil {
		b.Fatal(err)
	}
	pinned := pinnedRate(b, g, largest)
	for _, bc := range []struct {
		name string
		opts paging.Options
	}{
		{"staged", paging.Options{}},
		{"pageable", paging.Options{StagingSlots: -1, HostCacheBytes: -1}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			bud, err := paging.NewBudget(g, budget, g.Name())
			if err != nil {
				b.Fatal(err)
			}
			defer bud.Close()
			p, err := paging.NewPager(src, bud, plan, bc.opts)
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			ctx := context.Background()
			pass := func() {
				for l := range src.NumLayers() {
					if _, err := p.Acquire(ctx, l); err != nil {
						b.Fatal(err)
					}
					p.Release(l)
				}
			}
			pass() // warm the ring
			before := p.Stats().BytesHostToDevice
			for b.Loop() {
				pass()
			}
			if err := g.Sync(); err != nil {
				b.Fatal(err)
			}
			gbps := float64(p.Stats().BytesHostToDevice-before) / b.Elapsed().Seconds() / 1e9
			b.ReportMetric(gbps, "GB/s")
			b.ReportMetric(100*gbps/pinned, "%pinned")
		})
	}
}
