package nn

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// TestCUDABatch runs the batch test's mix of sequences (random prompt
// lengths, joins at random steps, prompts cut into chunks that share
// steps with decode rows) on the GPU, on every fixture: each sequence's
// logits within 1e-2 of the same sequence alone in a batch on the GPU
// (the GPU's products of several rows round as they like, so not bit for
// bit: cuBLAS's path casts the rows to F16 where the one-row GEMV keeps
// them F32, a few 1e-3 on the F16 fixture on the H200), within 2e-2 of the CPU batch's (8-bit pools: 3e-2, 6e-2), and its greedy ids those of the
// CPU batch where the CPU's margin between the two best exceeds 5e-2; with
// the pools in F32, F16 and Q8_B8 (BatchOptions.KVDType), the CPU's in the
// same dtype. It logs the differences it measures. Skips without a CUDA
// device.
func TestCUDABatch(t *testing.T) {
	b := openCUDA(t)
	for _, name := range batchFixtures {
		t.Run(name, func(t *testing.T) {
			lm, hw := fixtureWeights(t, b, name)
			gm, err := New(lm.Config, b, nil, hw)
			if err != nil {
				t.Fatal(err)
			}
			cm, _ := residentModel(t, lm, 2)
			mix := func() []*batchSeq {
				r := rand.New(rand.NewPCG(7, uint64(len(name))))
				var seqs []*batchSeq
				for i := range 9 {
					p := make([]int32, 1+r.IntN(40))
					for j := range p {
						p[j] = int32(r.IntN(lm.Config.VocabSize))
					}
					seqs = append(seqs, &batchSeq{prompt: p, join: r.IntN(6) * i % 9, steps: 1 + r.IntN(8)})
				}
				return seqs
			}
			for _, kv := range []tensor.DType{tensor.F32, tensor.F16, tensor.Q8_B8} {
				run := func(m *Model, seqs []*batchSeq, rows int) {
					bt, err := m.NewBatch(BatchOptions{MaxPos: 64, MaxRows: rows, BlockSize: 16, Blocks: 48, KVDType: kv})
					if err != nil {
						t.Fatal(err)
					}
					defer bt.Close()
					runBatch(t, bt, seqs, rows)
				}
				// An 8-bit pool rounds K and V to codes a step of 1/127 of
				// their block's largest apart: the last-bit differences of
				// the products before it (another kernel for 12 rows than
				// for one, the CPU's order of sums) flip a few codes, and
				// the logits move by up to about 1e-2 per flip on these
				// fixtures (H200: 1.1e-2 from alone, 2.4e-2 from the CPU,
				// 4.9e-2 where a flip changes a router's choice).
				boundAlone, boundCPU := 1e-2, 2e-2
				if kv == tensor.Q8_B8 {
					boundAlone, boundCPU = 3e-2, 6e-2
				}
				// A flip of an F16 pool's last bit moves a mixture's
				// router as an 8-bit code's flip does (H200, session 5,
				// with the batched step's RopeRows: 4.8e-2 from the CPU on
				// tiny-qwen3-moe-f16's F16 pool, 1.5e-3 from alone).
				if kv == tensor.F16 && lm.Config.MoE != nil {
					boundCPU = 6e-2
				}
				gpu, cpu := mix(), mix()
				run(gm, gpu, 12)
				run(cm, cpu, 12)
				worstAlone, worstCPU := 0.0, 0.0
				for i, s := range gpu {
					alone := &batchSeq{prompt: s.prompt, steps: s.steps}
					run(gm, []*batchSeq{alone}, 64)
					for j := range s.logits {
						da, dc := maxAbsDiff(s.logits[j], alone.logits[j]), maxAbsDiff(s.logits[j], cpu[i].logits[j])
						worstAlone, worstCPU = max(worstAlone, da), max(worstCPU, dc)
						if da > boundAlone || dc > boundCPU {
							t.Errorf("sequence %d token %d: logits %g from alone on the GPU, %g from the CPU batch", i, j, da, dc)
						}
						if g, c := Argmax(s.logits[j]), Argmax(cpu[i].logits[j]); g != c && margin(cpu[i].logits[j]) > 5e-2 {
							t.Errorf("sequence %d token %d: greedy id %d on the GPU, %d on the CPU (margin %g)", i, j, g, c, margin(cpu[i].logits[j]))
						}
						if g := Argmax(s.logits[j]); g != Argmax(cpu[i].logits[j]) || g != Argmax(alone.logits[j]) {
							break // the sequences went different ways (a near tie): the rest differ
						}
					}
				}
				t.Logf("%s, %v pools: %d sequences, logits at most %.3g from each alone on the GPU, %.3g from the CPU batch", name, kv, len(gpu), worstAlone, worstCPU)
			}
		})
	}
}

// margin is the gap between the two largest logits.
func margin(l []float32) float64 {
	a, b := float32(-1e38), float32(-1e38)
	for _, v := range l {
		if v > a {
			a, b = v, a
		} else if v > b {
			b = v
		}
	}
	return float64(a - b)
}

// TestCUDABatchHostKV runs the batch test's mix of sequences on the GPU
// with the pool of blocks 0 and 2 in host memory (SetHostKV: their rows go
// down each step and the CPU attends over them) beside the same mix with
// the whole pool on the GPU: logits within 1e-2 (the CPU's attention
// rounds otherwise than the GPU's), the same greedy ids where the margin
// between the two best exceeds 5e-2, and two CPU attentions a step. It
// logs the differences, the CPU's time and the bytes sent down. Skips
// without a CUDA device.
func TestCUDABatchHostKV(t *testing.T) {
	b := openCUDA(t)
	cpu := tensor.NewCPU(4)
	defer cpu.Close()
	for _, name := range []string{fixtures.TinyLlamaF16Sharded, fixtures.TinyQwen3F16} {
		t.Run(name, func(t *testing.T) {
			lm, hw := fixtureWeights(t, b, name)
			dm, err := New(lm.Config, b, nil, hw)
			if err != nil {
				t.Fatal(err)
			}
			hm, err := New(lm.Config, b, nil, hw)
			if err != nil {
				t.Fatal(err)
			}
			hostA := &countingAlloc{b: cpu, bytes: map[paging.Category]int64{}}
			if err := hm.SetHostKV(HostKV{Blocks: []int{0, 2}, CPU: cpu, Alloc: hostA}); err != nil {
				t.Fatal(err)
			}
			mix := func() []*batchSeq {
				r := rand.New(rand.NewPCG(11, uint64(len(name))))
				var seqs []*batchSeq
				for i := range 9 {
					p := make([]int32, 1+r.IntN(40))
					for j := range p {
						p[j] = int32(r.IntN(lm.Config.VocabSize))
					}
					seqs = append(seqs, &batchSeq{prompt: p, join: r.IntN(6) * i % 9, steps: 1 + r.IntN(8)})
				}
				return seqs
			}
			run := func(m *Model, seqs []*batchSeq) int {
				bt, err := m.NewBatch(BatchOptions{MaxPos: 64, MaxRows: 12, BlockSize: 16, Blocks: 48})
				if err != nil {
					t.Fatal(err)
				}
				defer bt.Close()
				return runBatch(t, bt, seqs, 12)
			}
			dev, host := mix(), mix()
			run(dm, dev)
			st0 := hm.KVStats()
			steps := run(hm, host)
			st := hm.KVStats()
			if hostA.live != 0 {
				t.Errorf("%d host tensors live after the batch closed", hostA.live)
			}
			worst := 0.0
			for i, s := range host {
				for j := range s.logits {
					d := maxAbsDiff(s.logits[j], dev[i].logits[j])
					worst = max(worst, d)
					if d > 1e-2 {
						t.Errorf("sequence %d token %d: logits %g from the pool on the GPU", i, j, d)
					}
					g, w := Argmax(s.logits[j]), Argmax(dev[i].logits[j])
					if g != w && margin(dev[i].logits[j]) > 5e-2 {
						t.Errorf("sequence %d token %d: greedy id %d with the host pool, %d on the GPU (margin %g)", i, j, g, w, margin(dev[i].logits[j]))
					}
					if g != w {
						break // the sequences went different ways (a near tie): the rest differ
					}
				}
			}
			calls := st.CPUAttentions - st0.CPUAttentions
			t.Logf("%s: %d steps, logits at most %.3g from the pool on the GPU; %d CPU attentions (%v), %d bytes down",
				name, steps, worst, calls, st.CPUAttention-st0.CPUAttention, st.DownloadBytes-st0.DownloadBytes)
			if calls != int64(2*steps) {
				t.Errorf("%d CPU attentions in %d steps, want two a step", calls, steps)
			}
		})
	}
}

// TestCUDABatchStepSplit: decode steps of 1, 16 and 64 sequences on the
// GPU (each at positions of its own) split their time (Batch.Times): the
// device's time from events on its compute queue, positive and within
// the launch and the wait; the step's launches counted and the same for
// 16 sequences as for 64 (no launch a sequence: the rows' rotations are
// one launch a layer for q and one for k, tensor.RopeRows). It logs each
// count's mean split. Skips without a CUDA device.
func TestCUDABatchStepSplit(t *testing.T) {
	b := openCUDA(t)
	ctx := context.Background()
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	hw, err := LoadWeights(ctx, lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	m, err := New(lm.Config, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	launches := map[int]int64{}
	for _, n := range []int{1, 16, 64} {
		bt, err := m.NewBatch(BatchOptions{MaxPos: 64, MaxRows: 64, BlockSize: 16, Blocks: 4 * n})
		if err != nil {
			t.Fatal(err)
		}
		var works []Work
		for i := range n {
			s := bt.NewSeq()
			if err := s.Reserve(64); err != nil {
				t.Fatal(err)
			}
			prompt := make([]int32, 1+i%13)
			for j := range prompt {
				prompt[j] = int32(1 + (i+j)%100)
			}
			if _, err := bt.Step(ctx, []Work{{Seq: s, IDs: prompt}}); err != nil {
				t.Fatal(err)
			}
			works = append(works, Work{Seq: s, IDs: []int32{5}, Logits: true})
		}
		const steps = 8
		var sum StepTimes
		for range steps {
			out, err := bt.Step(ctx, works)
			if err != nil {
				t.Fatal(err)
			}
			for i := range works {
				works[i].IDs[0] = int32(Argmax(out[i]))
			}
			tm := bt.Times()
			if tm.Device <= 0 || tm.Launches <= 0 || tm.Device > tm.Launch+tm.Wait+time.Millisecond {
				t.Errorf("%d sequences: step %+v: want a device time within launch and wait, and launches", n, tm)
			}
			if launches[n] != 0 && tm.Launches != launches[n] {
				t.Errorf("%d sequences: %d launches a step, then %d", n, launches[n], tm.Launches)
			}
			launches[n] = tm.Launches
			sum.Prepare += tm.Prepare
			sum.Launch += tm.Launch
			sum.Wait += tm.Wait
			sum.Device += tm.Device
			sum.Download += tm.Download
		}
		t.Logf("%d sequences, %d layers: a decode step's prepare %v, launch %v, wait %v, download %v; device %v; %d launches",
			n, lm.Config.NumLayers, sum.Prepare/steps, sum.Launch/steps, sum.Wait/steps, sum.Download/steps, sum.Device/steps, launches[n])
		bt.Close()
	}
	if launches[64] != launches[16] {
		t.Errorf("a decode step launches %d times for 16 sequences, %d for 64: some launch is per sequence", launches[16], launches[64])
	}
}
