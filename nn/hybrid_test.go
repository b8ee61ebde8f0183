package nn

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// countingAlloc counts the bytes allocated by category and frees.
type countingAlloc struct {
	b     tensor.Backend
	bytes map[paging.Category]int64
	live  int
}

func (c *countingAlloc) Alloc(cat paging.Category, dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	t, err := c.b.Alloc(dt, shape)
	if err == nil {
		c.bytes[cat] += t.NumBytes()
		c.live++
	}
	return t, err
}

func (c *countingAlloc) Free(t *tensor.Tensor) {
	if t != nil {
		c.live--
	}
	c.b.Free(t)
}

// TestHybridStages places the F16 fixture's layers on two CPU backends
// standing in for a GPU and the CPU, alternating as a hybrid placement
// does, with stages of the embedding or the head alone, and CPU stages
// with twins on the "GPU" for large chunks: logits and ids are
// bit-identical to one device for every placement, stages on one device
// share one set of activation buffers, a prompt longer than a chunk runs
// its second chunk on the twins with the earlier positions' keys copied in,

// hybridReference loads the sharded TinyLlama fixture (4 blocks) on a CPU
// of one thread: its config, the weights the tests' stages share, and the
// one-device model their logits are checked against.
func hybridReference(t *testing.T) (*arch.Config, *HostWeights, *Model) {
	t.Helper()
	ref := tensor.NewCPU(1)
	t.Cleanup(func() { ref.Close() })
	lm, hw := fixtureWeights(t, ref, fixtures.TinyLlamaF16Sharded)
	rm, err := New(lm.Config, ref, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	return lm.Config, hw, rm
}

// and decode after it reads the keys the twins copied back.
func TestHybridStages(t *testing.T) {
	ctx := context.Background()
	cfg, hw, rm := hybridReference(t) // 4 blocks
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}
	const maxPos, chunk, steps = 32, 4, 8
	wantLogits, wantIDs := generateIDs(t, rm, prompt, steps, maxPos, chunk)

	type place struct {
		gpu    bool
		lo, hi int
		twin   bool
	}
	for _, tc := range []struct {
		name   string
		places []place
		twinAt int
	}{
		{"alternating", []place{{true, 0, 1, false}, {false, 1, 2, false}, {true, 2, 3, false}, {false, 3, 4, false}}, 0},
		{"embedding and head alone on the CPU", []place{{false, 0, 0, false}, {true, 0, 2, false}, {false, 2, 3, false}, {true, 3, 4, false}, {false, 4, 4, false}}, 0},
		{"CPU stages with twins", []place{{true, 0, 1, false}, {false, 1, 3, true}, {true, 3, 4, false}}, chunk},
		{"twins at both ends", []place{{false, 0, 2, true}, {true, 2, 3, false}, {false, 3, 4, true}}, chunk},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu, cpu := tensor.NewCPU(1), tensor.NewCPU(1)
			defer gpu.Close()
			defer cpu.Close()
			ga := &countingAlloc{b: gpu, bytes: map[paging.Category]int64{}}
			ca := &countingAlloc{b: cpu, bytes: map[paging.Category]int64{}}
			var told []bool
			var stages []Stage
			gpuBlocks, cpuBlocks, twinStages := 0, 0, 0
			for _, p := range tc.places {
				st := Stage{Backend: cpu, Alloc: ca, Weights: hw, FirstBlock: p.lo, EndBlock: p.hi}
				if p.gpu {
					st.Backend, st.Alloc = gpu, ga
					gpuBlocks += p.hi - p.lo
				} else {
					cpuBlocks += p.hi - p.lo
				}
				if p.twin {
					st.Twin = &Twin{Backend: gpu, Alloc: ga, Weights: hw}
					twinStages++
				}
				stages = append(stages, st)
			}
			pl, err := NewPipeline(cfg, stages, PipelineOptions{TwinMinTokens: tc.twinAt, OnTwins: func(on bool) { told = append(told, on) }})
			if err != nil {
				t.Fatal(err)
			}
			ps, err := pl.NewSession(maxPos, chunk)
			if err != nil {
				t.Fatal(err)
			}
			// One set of activations per device, the KV cache of each
			// device's own blocks, and one scratch pair for the twins.
			act := ActivationBytes(cfg, chunk)
			kv := func(blocks int) int64 { return int64(blocks) * 2 * 4 * int64(maxPos) * int64(cfg.KVDim()) }
			logits := 4 * int64(chunk) * int64(cfg.VocabSize)
			gpuAct, cpuAct := act-logits, act-logits
			lastGPU := tc.places[len(tc.places)-1].gpu
			if lastGPU || tc.places[len(tc.places)-1].twin {
				gpuAct += logits
			}
			if !lastGPU {
				cpuAct += logits
			}
			wantGPUKV := kv(gpuBlocks)
			if twinStages > 0 {
				wantGPUKV += kv(1)
			}
			if ga.bytes[paging.Activations] != gpuAct || ca.bytes[paging.Activations] != cpuAct {
				t.Errorf("activations: %d on the GPU, %d on the CPU; want %d and %d (one set per device)",
					ga.bytes[paging.Activations], ca.bytes[paging.Activations], gpuAct, cpuAct)
			}
			if ga.bytes[paging.KVCache] != wantGPUKV || ca.bytes[paging.KVCache] != kv(cpuBlocks) {
				t.Errorf("KV cache: %d on the GPU, %d on the CPU; want %d and %d",
					ga.bytes[paging.KVCache], ca.bytes[paging.KVCache], wantGPUKV, kv(cpuBlocks))
			}
			logitsAll, err := ps.Forward(ctx, prompt, true, nil)
			if err != nil {
				t.Fatal(err)
			}
			got, ids := greedy(t, ps, logitsAll, cfg.VocabSize, steps)
			if fmt.Sprint(ids) != fmt.Sprint(wantIDs) {
				t.Errorf("ids %v, one device %v", ids, wantIDs)
			}
			sameLogits(t, "the stages against one device", got, wantLogits)
			if tc.twinAt > 0 && (len(told) < 2 || !told[0] || told[len(told)-1]) {
				t.Errorf("OnTwins told %v; want the prompt's chunks on the twins, then decode off them", told)
			}
			ps.Close()
			if ga.live != 0 || ca.live != 0 {
				t.Errorf("after Close %d tensors live on the GPU, %d on the CPU", ga.live, ca.live)
			}
		})
	}
}

// handCounter is a CPU backend standing in for a GPU that counts the
// downloads that wait for its copies and those that wait for its compute
// only.
type handCounter struct {
	*tensor.CPU
	downloads, computed int
}

func (h *handCounter) Download(dst []byte, src *tensor.Tensor) error {
	h.downloads++
	return h.CPU.Download(dst, src)
}

func (h *handCounter) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	h.computed++
	return h.CPU.Download(dst, src)
}

// TestHybridHandoffLeavesCopies: what leaves a device stage for the host
// (the hidden state handed to the CPU, the logits, a twin's keys and
// values) goes through DownloadComputed, which does not wait for the
// copies a pager queued for later layers, and the logits are the one
// device's, with the head on the CPU or on the "GPU" and with twins.
func TestHybridHandoffLeavesCopies(t *testing.T) {
	ctx := context.Background()
	cfg, hw, rm := hybridReference(t) // 4 blocks
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78}
	const maxPos, chunk, steps = 32, 4, 5
	wantLogits, _ := generateIDs(t, rm, prompt, steps, maxPos, chunk)
	forwards := (len(prompt)+chunk-1)/chunk + steps
	for _, tc := range []struct {
		name   string
		gpu    []bool // each stage's side, blocks [k, k+1)
		twins  bool
		want   int // DownloadComputed calls a forward; 0: some
		twinAt int
	}{
		// two hand-overs to the CPU a forward
		{"head on the CPU", []bool{true, false, true, false}, false, 2, 0},
		// one hand-over and the logits
		{"head on the GPU", []bool{false, true, false, true}, false, 2, 0},
		// the prompt's chunks on the twins, keys and values copied back
		{"twins", []bool{true, false, true, false}, true, 0, chunk},
	} {
		gpu, cpu := &handCounter{CPU: tensor.NewCPU(1)}, tensor.NewCPU(1)
		var stages []Stage
		for k, g := range tc.gpu {
			st := Stage{Backend: cpu, Weights: hw, FirstBlock: k, EndBlock: k + 1}
			if g {
				st.Backend = gpu
			} else if tc.twins {
				st.Twin = &Twin{Backend: gpu, Weights: hw}
			}
			stages = append(stages, st)
		}
		pl, err := NewPipeline(cfg, stages, PipelineOptions{TwinMinTokens: tc.twinAt})
		if err != nil {
			t.Fatal(err)
		}
		ps, err := pl.NewSession(maxPos, chunk)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ps.Forward(ctx, prompt, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		all, _ := greedy(t, ps, got, cfg.VocabSize, steps)
		sameLogits(t, tc.name+" against one device", all, wantLogits)
		ps.Close()
		gpu.Close()
		cpu.Close()
		if gpu.downloads != 0 || tc.want > 0 && gpu.computed != tc.want*forwards || gpu.computed == 0 {
			t.Errorf("%s: from the GPU %d downloads by DownloadComputed and %d by Download over %d forwards; want %d a forward and none",
				tc.name, gpu.computed, gpu.downloads, forwards, tc.want)
		}
	}
}

// asyncGPU is a CPU backend standing in for a GPU whose copies back to
// the host run on a stream of their own (tensor.AsyncDownloader): a copy
// reads its source when the caller first makes compute wait for it
// (ready) or waits for it (landed), as late as a real device may, so that
// a caller that overwrites the source before ready, or reads the
// destination before landed, gets other numbers. It counts the downloads
// of each kind, the waits, and fails the copy numbered fail (from 1).
type asyncGPU struct {
	*tensor.CPU
	computed, async, readies, landings int
	fail                               int
}

func (g *asyncGPU) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	g.computed++
	return g.CPU.Download(dst, src)
}

func (g *asyncGPU) DownloadAsync(dst []byte, src *tensor.Tensor) (ready, landed func() error, err error) {
	g.async++
	if g.async == g.fail {
		return nil, nil, fmt.Errorf("injected failure of copy %d", g.async)
	}
	var once sync.Once
	var cerr error
	read := func() { once.Do(func() { cerr = g.CPU.Download(dst, src) }) }
	ready = func() error { g.readies++; read(); return cerr }
	landed = func() error { g.landings++; read(); return cerr }
	return ready, landed, nil
}

// TestHybridTwinCopiesBackAsync: on a device with asynchronous downloads
// the twins queue their keys' and values' copies back to the host
// (DownloadAsync, two a block) instead of waiting for each block's compute
// (DownloadComputed, which the hand-overs and logits alone use); each
// copy's compute wait and host wait are made once, the next twin block
// orders its compute after the copies before it overwrites the scratch
// pair, and the chunk waits for them before the CPU reads the cache: with
// twin stages of one block and of two (whose second block overwrites the
// pair while the first's copies are under way), a prompt whose last chunk
// runs on the CPU, and decode steps after it, the logits are the one
// device's. A copy that fails fails the forward, which adds no positions,
// and the retried forward is exact.
func TestHybridTwinCopiesBackAsync(t *testing.T) {
	ctx := context.Background()
	cfg, hw, rm := hybridReference(t)                       // 4 blocks
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265, 78} // chunks of 4, 4 (twins) and 1 (CPU)
	const maxPos, chunk, steps = 32, 4, 4
	wantLogits, _ := generateIDs(t, rm, prompt, steps, maxPos, chunk)
	for _, tc := range []struct {
		name       string
		places     [][3]int // gpu (1) or CPU with a twin (0), blocks [lo, hi)
		twinBlocks int
		fail       int
	}{
		{"twin stages of one block", [][3]int{{1, 0, 1}, {0, 1, 2}, {1, 2, 3}, {0, 3, 4}}, 2, 0},
		{"a twin stage of two blocks", [][3]int{{1, 0, 1}, {0, 1, 3}, {1, 3, 4}}, 2, 0},
		{"the third copy fails", [][3]int{{1, 0, 1}, {0, 1, 3}, {1, 3, 4}}, 2, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu, cpu := &asyncGPU{CPU: tensor.NewCPU(1), fail: tc.fail}, tensor.NewCPU(1)
			defer gpu.Close()
			defer cpu.Close()
			var stages []Stage
			for _, p := range tc.places {
				st := Stage{Backend: gpu, Weights: hw, FirstBlock: p[1], EndBlock: p[2]}
				if p[0] == 0 {
					st.Backend, st.Twin = cpu, &Twin{Backend: gpu, Weights: hw}
				}
				stages = append(stages, st)
			}
			pl, err := NewPipeline(cfg, stages, PipelineOptions{TwinMinTokens: chunk})
			if err != nil {
				t.Fatal(err)
			}
			ps, err := pl.NewSession(maxPos, chunk)
			if err != nil {
				t.Fatal(err)
			}
			defer ps.Close()
			if tc.fail > 0 {
				if _, err := ps.Forward(ctx, prompt, true, nil); err == nil || !strings.Contains(err.Error(), "injected failure") || ps.Pos() != 0 {
					t.Fatalf("the injected failure gave %v, position %d", err, ps.Pos())
				}
				if gpu.readies != gpu.landings || gpu.landings != gpu.async-1 {
					t.Errorf("after the failure: %d copies queued, %d compute waits and %d host waits made", gpu.async-1, gpu.readies, gpu.landings)
				}
				*gpu = asyncGPU{CPU: gpu.CPU}
			}
			got, err := ps.Forward(ctx, prompt, true, nil)
			if err != nil {
				t.Fatal(err)
			}
			all, _ := greedy(t, ps, got, cfg.VocabSize, steps)
			sameLogits(t, "the twins against one device", all, wantLogits)
			twinChunks := len(prompt) / chunk
			if want := 2 * tc.twinBlocks * twinChunks; gpu.async != want || gpu.readies != want || gpu.landings != want {
				t.Errorf("%d copies back queued, %d compute waits and %d host waits made; want %d of each", gpu.async, gpu.readies, gpu.landings, want)
			}
			// The twins' chunks hand nothing to the CPU but the logits of
			// the last chunk's head (on the GPU); the CPU chunk and the
			// steps hand the hidden state over once a stage switch and
			// their logits come from the GPU's head.
			forwards := 1 + steps
			if gpu.computed > (len(tc.places)/2+1)*forwards+twinChunks {
				t.Errorf("%d downloads waited for the compute: the twins' copies back among them", gpu.computed)
			}
		})
	}
}

// acquireCounter counts the acquisitions of each layer.
type acquireCounter struct {
	Weights
	n map[int]int
}

func (a *acquireCounter) Acquire(ctx context.Context, layer int) (LayerWeights, error) {
	a.n[layer]++
	return a.Weights.Acquire(ctx, layer)
}

// TestHybridTwinEmbedsOnCPU: when the first stage is a CPU stage whose
// blocks run on a twin, the CPU embeds the chunk from its own copy of the
// table and hands the rows to the twin, which never acquires the table
// (on a GPU it would stream all of it for a chunk's rows); the logits and
// the decode after them are the one device's.
func TestHybridTwinEmbedsOnCPU(t *testing.T) {
	ctx := context.Background()
	cfg, hw, rm := hybridReference(t)                   // 4 blocks
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265} // two chunks on the twins
	const maxPos, chunk, steps = 32, 4, 3
	wantLogits, _ := generateIDs(t, rm, prompt, steps, maxPos, chunk)
	gpu, cpu := tensor.NewCPU(1), tensor.NewCPU(1)
	defer gpu.Close()
	defer cpu.Close()
	onCPU, onTwin := &acquireCounter{Weights: hw, n: map[int]int{}}, &acquireCounter{Weights: hw, n: map[int]int{}}
	stages := []Stage{
		{Backend: cpu, Weights: onCPU, FirstBlock: 0, EndBlock: 2, Twin: &Twin{Backend: gpu, Weights: onTwin}},
		{Backend: gpu, Weights: hw, FirstBlock: 2, EndBlock: 4},
	}
	pl, err := NewPipeline(cfg, stages, PipelineOptions{TwinMinTokens: chunk})
	if err != nil {
		t.Fatal(err)
	}
	ps, err := pl.NewSession(maxPos, chunk)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	got, err := ps.Forward(ctx, prompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	emb := cfg.EmbedLayer()
	if onTwin.n[emb] != 0 || onCPU.n[emb] != len(prompt)/chunk || onTwin.n[cfg.BlockLayer(0)] != len(prompt)/chunk {
		t.Errorf("the prompt's %d chunks acquired the embedding %d times on the twin and %d on the CPU, block 0 %d times on the twin; want 0, %d and %d",
			len(prompt)/chunk, onTwin.n[emb], onCPU.n[emb], onTwin.n[cfg.BlockLayer(0)], len(prompt)/chunk, len(prompt)/chunk)
	}
	all, _ := greedy(t, ps, got, cfg.VocabSize, steps)
	sameLogits(t, "the twin's chunks against one device", all, wantLogits)
}

// failingWeights fails the acquisition of one layer while armed.
type failingWeights struct {
	Weights
	layer int
	armed bool
}

func (f *failingWeights) Acquire(ctx context.Context, layer int) (LayerWeights, error) {
	if f.armed && layer == f.layer {
		f.armed = false
		return nil, fmt.Errorf("injected failure loading layer %d", layer)
	}
	return f.Weights.Acquire(ctx, layer)
}

// TestHybridStageFailure: a CPU stage whose weights fail to load fails the
// forward with that error, adds no positions, and the retried forward and
// the decode after it are exact, on the stages and on the twins.
func TestHybridStageFailure(t *testing.T) {
	ctx := context.Background()
	cfg, hw, rm := hybridReference(t) // 4 blocks
	prompt := []int32{1, 42, 71, 345, 81, 14, 289, 265}
	const maxPos, chunk, steps = 32, 4, 4
	wantLogits, _ := generateIDs(t, rm, prompt, steps, maxPos, chunk)
	for _, twinAt := range []int{0, chunk} {
		gpu, cpu := tensor.NewCPU(1), tensor.NewCPU(1)
		defer gpu.Close()
		defer cpu.Close()
		fw := &failingWeights{Weights: hw, layer: cfg.BlockLayer(2), armed: true}
		twin := &Twin{Backend: gpu, Weights: fw}
		stages := []Stage{
			{Backend: gpu, Weights: hw, FirstBlock: 0, EndBlock: 2},
			{Backend: cpu, Weights: fw, FirstBlock: 2, EndBlock: 3, Twin: twin},
			{Backend: gpu, Weights: hw, FirstBlock: 3, EndBlock: 4},
		}
		pl, err := NewPipeline(cfg, stages, PipelineOptions{TwinMinTokens: twinAt})
		if err != nil {
			t.Fatal(err)
		}
		ps, err := pl.NewSession(maxPos, chunk)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ps.Forward(ctx, prompt, true, nil); err == nil || ps.Pos() != 0 {
			t.Fatalf("twins from %d: the injected failure gave %v, position %d", twinAt, err, ps.Pos())
		}
		got, err := ps.Forward(ctx, prompt, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		all, _ := greedy(t, ps, got, cfg.VocabSize, steps)
		sameLogits(t, fmt.Sprintf("twins from %d, after the retry", twinAt), all, wantLogits)
		ps.Close()
	}
}
