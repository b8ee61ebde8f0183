package nn

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// hostKVRig is the F16 fixture's model on a CPU backend standing in for
// the GPU, its weights resident, with a CPU backend of other threads for
// the host KV caches; both allocators count.
type hostKVRig struct {
	lm        *loader.Model
	dev, cpu  tensor.Backend
	w         *HostWeights
	devA, cpA *countingAlloc
}

func newHostKVRig(t *testing.T) *hostKVRig {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	r := &hostKVRig{lm: lm, dev: tensor.NewCPU(1), cpu: tensor.NewCPU(3)}
	r.devA = &countingAlloc{b: r.dev, bytes: map[paging.Category]int64{}}
	r.cpA = &countingAlloc{b: r.cpu, bytes: map[paging.Category]int64{}}
	if r.w, err = LoadWeights(context.Background(), lm, r.dev, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.w.Close()
		r.dev.Close()
		r.cpu.Close()
		lm.Close()
	})
	return r
}

// model returns the rig's model with the caches of blocks in host memory.
func (r *hostKVRig) model(t *testing.T, blocks []int, devMin int, cpu tensor.Backend) *Model {
	t.Helper()
	m, err := New(r.lm.Config, r.dev, r.devA, r.w)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.SetHostKV(HostKV{Blocks: blocks, CPU: cpu, Alloc: r.cpA, DeviceMinTokens: devMin}); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestHostKVMatchesDevice: blocks whose KV cache is in host memory give
// logits and ids bit-identical to every cache on the device, whether the
// prompt's chunks attend on the CPU or over the device scratch (uploaded
// rows, alternating buffers); the caches are where the placement says
// (bytes by allocator), the CPU attends in every decode step of every
// host block, prefill uploads rows only when it attends on the device,
// and Close frees everything on both sides.
func TestHostKVMatchesDevice(t *testing.T) {
	r := newHostKVRig(t)
	cfg := r.lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	const maxPos, chunk, steps = 32, 4, 8
	ref, err := New(cfg, r.dev, nil, r.w)
	if err != nil {
		t.Fatal(err)
	}
	wantLogits, wantIDs := generateIDs(t, ref, prompt, steps, maxPos, chunk)
	perBlock := int64(2 * 4 * maxPos * cfg.KVDim())
	for _, tc := range []struct {
		name           string
		blocks         []int
		devMin, devMax int
	}{
		{"last block, CPU attention", []int{3}, 0, 0},
		{"two blocks, prefill on the device", []int{0, 2}, 4, 0},
		{"every block, CPU attention", []int{0, 1, 2, 3}, 0, 0},
		{"every block, prefill on the device", []int{0, 1, 2, 3}, 4, 0},
		{"every block, decode on the device up to 15 positions", []int{0, 1, 2, 3}, 4, 15},
		{"one block, all on the device", []int{1}, 0, maxPos},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(r.devA.bytes)
			clear(r.cpA.bytes)
			m := r.model(t, tc.blocks, tc.devMin, r.cpu)
			m.hostKV.DeviceMaxPos = tc.devMax
			got, ids := generateIDs(t, m, prompt, steps, maxPos, chunk)
			if !slices.Equal(ids, wantIDs) {
				t.Fatalf("ids %v, all on the device %v", ids, wantIDs)
			}
			for i := range got {
				if got[i] != wantLogits[i] {
					t.Fatalf("logit %d: %v, all on the device %v", i, got[i], wantLogits[i])
				}
			}
			n := int64(len(tc.blocks))
			scratch := int64(0)
			if tc.devMin > 0 || tc.devMax > 0 {
				scratch = min(n, paging.KVScratchBuffers)
			}
			if h, d := r.cpA.bytes[paging.KVCache], r.devA.bytes[paging.KVCache]; h != n*perBlock || d != (int64(cfg.NumLayers)-n+scratch)*perBlock {
				t.Errorf("KV bytes: host %d, device %d; want %d and %d", h, d, n*perBlock, (int64(cfg.NumLayers)-n+scratch)*perBlock)
			}
			st := m.KVStats()
			t.Logf("%+v", st)
			// Decode steps past devMax positions attend on the CPU.
			cpuSteps := int64(min(steps, len(prompt)+steps-tc.devMax))
			if st.CPUAttentions < cpuSteps*n || cpuSteps > 0 && st.CPUAttention <= 0 || tc.devMax == maxPos && st.CPUAttentions != 0 {
				t.Errorf("%d CPU attentions, want at least %d decode steps x %d blocks", st.CPUAttentions, cpuSteps, n)
			}
			if (st.UploadBytes > 0) != (tc.devMin > 0 || tc.devMax > 0) {
				t.Errorf("uploaded %d bytes of KV rows with device chunks from %d tokens, up to %d positions", st.UploadBytes, tc.devMin, tc.devMax)
			}
			if r.devA.live != 0 || r.cpA.live != 0 {
				t.Errorf("left allocated after Close: device %d, host %d tensors", r.devA.live, r.cpA.live)
			}
		})
	}
}

// failingAttn is a CPU backend whose Attention fails while armed.
type failingAttn struct {
	tensor.Backend
	fail bool
}

func (f *failingAttn) Attention(out *tensor.Tensor, a tensor.Attn) error {
	if f.fail {
		return errors.New("injected attention fault")
	}
	return f.Backend.Attention(out, a)
}

// failAlloc fails its n-th allocation.
type failAlloc struct {
	*countingAlloc
	n int
}

func (f *failAlloc) Alloc(cat paging.Category, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	if f.n--; f.n == 0 {
		return nil, tensor.ErrOutOfMemory
	}
	return f.countingAlloc.Alloc(cat, dt, shape)
}

// TestHostKVFaults: a failed CPU attention fails the step with an error
// naming it and adds no position, and the retried step gives the logits
// of a run without the fault; an allocation that fails at any point of a
// session's host or device memory fails NewSession and leaves nothing
// allocated on either side; a block outside the model is refused.
func TestHostKVFaults(t *testing.T) {
	r := newHostKVRig(t)
	ctx := context.Background()
	prompt := []int32{1, 42, 71, 345, 81, 14}
	const maxPos, chunk, steps = 16, 4, 4
	m := r.model(t, []int{1, 3}, 4, r.cpu)
	want, _ := generateIDs(t, m, prompt, steps, maxPos, chunk)

	fa := &failingAttn{Backend: r.cpu}
	m = r.model(t, []int{1, 3}, 4, fa)
	s, err := m.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	logits, err := s.Forward(ctx, prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := slices.Clone(logits)
	last := logits[len(logits)-r.lm.Config.VocabSize:]
	for range steps {
		id := int32(Argmax(last))
		fa.fail = true
		_, err := s.Forward(ctx, []int32{id}, false, nil)
		if err == nil || !strings.Contains(err.Error(), "injected attention fault") || s.Pos() != len(got)/r.lm.Config.VocabSize {
			t.Fatalf("faulty step: %v at position %d", err, s.Pos())
		}
		fa.fail = false
		if last, err = s.Forward(ctx, []int32{id}, false, nil); err != nil {
			t.Fatal(err)
		}
		got = append(got, last...)
	}
	s.Close()
	if !slices.Equal(got, want) {
		t.Errorf("logits after retried faults differ from a run without them")
	}

	for _, side := range []string{"host", "device"} {
		for n := 1; ; n++ {
			m, err := New(r.lm.Config, r.dev, r.devA, r.w)
			if err != nil {
				t.Fatal(err)
			}
			hostA := &failAlloc{countingAlloc: r.cpA}
			devA := &failAlloc{countingAlloc: r.devA}
			if side == "host" {
				hostA.n = n
			} else {
				devA.n = n
			}
			m.alloc = devA
			if err := m.SetHostKV(HostKV{Blocks: []int{0, 2, 3}, CPU: r.cpu, Alloc: hostA, DeviceMinTokens: 4}); err != nil {
				t.Fatal(err)
			}
			s, err := m.NewSession(maxPos, chunk)
			if err == nil {
				s.Close()
				if r.devA.live != 0 || r.cpA.live != 0 {
					t.Fatalf("left allocated after Close: device %d, host %d", r.devA.live, r.cpA.live)
				}
				break
			}
			if !errors.Is(err, tensor.ErrOutOfMemory) {
				t.Fatalf("%s allocation %d failed: %v", side, n, err)
			}
			if r.devA.live != 0 || r.cpA.live != 0 {
				t.Fatalf("%s allocation %d failed: left device %d, host %d tensors", side, n, r.devA.live, r.cpA.live)
			}
		}
	}
	m, _ = New(r.lm.Config, r.dev, r.devA, r.w)
	if err := m.SetHostKV(HostKV{Blocks: []int{4}, CPU: r.cpu, Alloc: r.cpA}); err == nil {
		t.Error("host KV of block 4 of 4 accepted")
	}
}

// computeDownloader is a CPU backend standing in for a GPU whose Download
// waits for its copy engine: it counts the downloads that wait for
// compute alone.
type computeDownloader struct {
	*tensor.CPU
	computeOnly int
}

func (c *computeDownloader) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	c.computeOnly++
	return c.Download(dst, src)
}

// TestHostKVDownloadsSkipCopies: the queries, keys and values a host block
// sends down in a decode step are downloaded without waiting for the
// device's copies in flight (the pager's prefetches of the next layers),
// where the device can: three downloads per host block per step, and the
// step's logits.
func TestHostKVDownloadsSkipCopies(t *testing.T) {
	r := newHostKVRig(t)
	dev := &computeDownloader{CPU: tensor.NewCPU(1)}
	defer dev.Close()
	w, err := LoadWeights(context.Background(), r.lm, dev, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	m, err := New(r.lm.Config, dev, nil, w)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.SetHostKV(HostKV{Blocks: []int{0, 3}, CPU: r.cpu, Alloc: r.cpA}); err != nil {
		t.Fatal(err)
	}
	s, err := m.NewSession(16, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Forward(context.Background(), []int32{1, 2, 3}, false, nil); err != nil {
		t.Fatal(err)
	}
	before := dev.computeOnly
	const steps = 5
	for i := range steps {
		if _, err := s.Forward(context.Background(), []int32{int32(10 + i)}, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := dev.computeOnly-before, (3*2+1)*steps; got != want {
		t.Errorf("%d downloads past the copies in %d steps of 2 host blocks, want %d", got, steps, want)
	}
}

// TestHostKVPipeline: a pipeline whose "GPU" stages keep their blocks'
// KV cache in host memory (one HostKV for every stage, each taking its
// own blocks) beside a CPU stage gives logits bit-identical to one device,
// the GPU stages share the device scratch, and the pipeline's KVStats
// count the GPU stages' CPU attention.
func TestHostKVPipeline(t *testing.T) {
	r := newHostKVRig(t)
	cfg := r.lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78}
	const maxPos, chunk, steps = 32, 4, 6
	ref, err := New(cfg, r.dev, nil, r.w)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := generateIDs(t, ref, prompt, steps, maxPos, chunk)
	other := tensor.NewCPU(2)
	defer other.Close()
	ow, err := LoadWeights(context.Background(), r.lm, other, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ow.Close()
	hk := &HostKV{Blocks: []int{0, 1, 3}, CPU: r.cpu, Alloc: r.cpA, DeviceMinTokens: 4}
	p, err := NewPipeline(cfg, []Stage{
		{Backend: r.dev, Alloc: r.devA, Weights: r.w, FirstBlock: 0, EndBlock: 2, HostKV: hk},
		{Backend: other, Weights: ow, FirstBlock: 2, EndBlock: 3},
		{Backend: r.dev, Alloc: r.devA, Weights: r.w, FirstBlock: 3, EndBlock: 4, HostKV: hk},
	})
	if err != nil {
		t.Fatal(err)
	}
	s, err := p.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	logits, err := s.Forward(ctx, prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := slices.Clone(logits)
	last := logits[len(logits)-cfg.VocabSize:]
	for range steps {
		if last, err = s.Forward(ctx, []int32{int32(Argmax(last))}, false, nil); err != nil {
			t.Fatal(err)
		}
		got = append(got, last...)
	}
	s.Close()
	if !slices.Equal(got, want) {
		t.Fatal("logits differ from one device's")
	}
	// The two GPU stages share one scratch pair of pairs.
	if got, want := r.devA.bytes[paging.KVCache], int64(2*2*4*maxPos*cfg.KVDim()); got != want {
		t.Errorf("device KV bytes %d, want %d: the scratch of two blocks, shared by the stages", got, want)
	}
	if st := p.KVStats(); st.CPUAttentions < 3*steps || st.UploadBytes == 0 {
		t.Errorf("pipeline KV stats %+v: want the CPU attending for 3 blocks in %d steps and prefill uploads", st, steps)
	}
	if r.cpA.live != 0 || r.devA.live != 0 {
		t.Errorf("left allocated: host %d, device %d", r.cpA.live, r.devA.live)
	}
}

// TestHostKVDType: with the KV cache in F16, BF16 or Q8_0, host blocks
// hold their cache in that dtype (its bytes by allocator, the device
// scratch too) and give logits bit-identical to every cache on the device
// in the same dtype, whether the CPU attends or prefill uploads the rows:
// the rows computed on the device go down as F32 and the host converts
// them as the device would.
func TestHostKVDType(t *testing.T) {
	r := newHostKVRig(t)
	cfg := r.lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	const maxPos, chunk, steps = 32, 4, 6
	run := func(t *testing.T, m *Model, dt tensor.DType) []float32 {
		s, err := m.NewSessionWith(maxPos, chunk, SessionOptions{KVDType: dt})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		logits, err := s.Forward(context.Background(), prompt, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		all := append([]float32(nil), logits...)
		for k := range steps {
			step, err := s.Forward(context.Background(), []int32{int32(5 + k)}, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, step...)
		}
		return all
	}
	for _, dt := range []tensor.DType{tensor.F16, tensor.BF16, tensor.Q8_0} {
		ref, err := New(cfg, r.dev, nil, r.w)
		if err != nil {
			t.Fatal(err)
		}
		want := run(t, ref, dt)
		perBlock := KVCacheBytes(cfg, maxPos, dt) / int64(cfg.NumLayers)
		for _, tc := range []struct {
			name   string
			blocks []int
			devMin int
		}{
			{"two blocks, CPU attention", []int{1, 3}, 0},
			{"every block, prefill on the device", []int{0, 1, 2, 3}, 4},
		} {
			t.Run(dt.String()+"/"+tc.name, func(t *testing.T) {
				clear(r.devA.bytes)
				clear(r.cpA.bytes)
				m := r.model(t, tc.blocks, tc.devMin, r.cpu)
				got := run(t, m, dt)
				for i := range want {
					if got[i] != want[i] {
						t.Fatalf("logit %d: %v, all on the device %v", i, got[i], want[i])
					}
				}
				n := int64(len(tc.blocks))
				scratch := int64(0)
				if tc.devMin > 0 {
					scratch = min(n, paging.KVScratchBuffers)
				}
				if h, d := r.cpA.bytes[paging.KVCache], r.devA.bytes[paging.KVCache]; h != n*perBlock || d != (int64(cfg.NumLayers)-n+scratch)*perBlock {
					t.Errorf("KV bytes: host %d, device %d; want %d and %d", h, d, n*perBlock, (int64(cfg.NumLayers)-n+scratch)*perBlock)
				}
				if st := m.KVStats(); st.CPUAttentions == 0 {
					t.Errorf("no CPU attention: %+v", st)
				}
			})
		}
	}
}

// TestBatchHostKV: a batch over a model whose blocks 0 and 2 keep their
// KV cache in host memory keeps those blocks' part of the pool there (the
// host allocator's KV bytes are theirs, the device's the other blocks')
// and attends on the CPU over it in every step, prompt chunks and decode
// rows alike; the logits are bit-identical to the same batch with every
// block's pool on the device, and Close frees both sides.
func TestBatchHostKV(t *testing.T) {
	r := newHostKVRig(t)
	cfg := r.lm.Config
	const maxPos, rows, bs, blocks = 32, 9, 4, 24
	mkSeqs := func() []*batchSeq {
		rng := rand.New(rand.NewPCG(5, 7))
		var seqs []*batchSeq
		for i := range 5 {
			p := make([]int32, 1+rng.IntN(14))
			for j := range p {
				p[j] = int32(rng.IntN(cfg.VocabSize))
			}
			seqs = append(seqs, &batchSeq{prompt: p, join: i % 3, steps: 2 + rng.IntN(4)})
		}
		return seqs
	}
	ref, err := New(r.lm.Config, r.dev, r.devA, r.w)
	if err != nil {
		t.Fatal(err)
	}
	want := mkSeqs()
	rb, err := ref.NewBatch(BatchOptions{MaxPos: maxPos, MaxRows: rows, BlockSize: bs, Blocks: blocks})
	if err != nil {
		t.Fatal(err)
	}
	runBatch(t, rb, want, rows)
	rb.Close()

	m := r.model(t, []int{0, 2}, 4, r.cpu)
	dev0, host0 := r.devA.bytes[paging.KVCache], r.cpA.bytes[paging.KVCache]
	devLive, hostLive := r.devA.live, r.cpA.live
	b, err := m.NewBatch(BatchOptions{MaxPos: maxPos, MaxRows: rows, BlockSize: bs, Blocks: blocks})
	if err != nil {
		t.Fatal(err)
	}
	perBlock := int64(2 * 4 * blocks * bs * cfg.KVDim()) // keys and values, F32
	if dev, host := r.devA.bytes[paging.KVCache]-dev0, r.cpA.bytes[paging.KVCache]-host0; dev != int64(cfg.NumLayers-2)*perBlock || host != 2*perBlock {
		t.Errorf("the pool took %d bytes on the device and %d in host memory, want %d and %d", dev, host, int64(cfg.NumLayers-2)*perBlock, 2*perBlock)
	}
	st0 := m.KVStats()
	got := mkSeqs()
	steps := runBatch(t, b, got, rows)
	for i := range want {
		for j := range want[i].logits {
			for k, v := range want[i].logits[j] {
				if math.Float32bits(v) != math.Float32bits(got[i].logits[j][k]) {
					t.Fatalf("sequence %d token %d logit %d: %v with blocks 0 and 2 in host memory, %v on the device", i, j, k, got[i].logits[j][k], v)
				}
			}
		}
	}
	st := m.KVStats()
	t.Logf("%d CPU attentions over the host pool (%v), %d bytes down", st.CPUAttentions-st0.CPUAttentions, st.CPUAttention-st0.CPUAttention, st.DownloadBytes-st0.DownloadBytes)
	if calls := st.CPUAttentions - st0.CPUAttentions; calls != int64(2*steps) || steps == 0 {
		t.Errorf("%d CPU attentions in %d steps, want two a step (blocks 0 and 2)", calls, steps)
	}
	b.Close()
	if r.devA.live != devLive || r.cpA.live != hostLive {
		t.Errorf("after Close %d tensors live on the device (%d before), %d in host memory (%d before)", r.devA.live, devLive, r.cpA.live, hostLive)
	}
}
