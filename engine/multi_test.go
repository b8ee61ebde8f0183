package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
	"github.com/strata-llm/strata/tensor/quant"
)

// namedCPUs are n CPU backends named cpu0, cpu1, ..., so that a report
// per device tells them apart.
func namedCPUs(n int) []tensor.Backend {
	var bs []tensor.Backend
	for i := range n {
		bs = append(bs, namedCPU{CPU: tensor.NewCPU(1), name: fmt.Sprintf("cpu%d", i)})
	}
	return bs
}

type namedCPU struct {
	*tensor.CPU
	name string
}

func (c namedCPU) Name() string { return c.name }

// weightBytes is every tensor's bytes in lm's files.
func weightBytes(lm *loader.Model) int64 {
	var w int64
	for _, ti := range lm.Tensors() {
		w += ti.Size
	}
	return w
}

// runAlone decodes each prompt in a session of its own on e and returns
// the greedy ids and every step's logits.
func runAlone(t *testing.T, e *Engine, prompts [][]int32, steps int) ([][]int32, [][][]float32) {
	t.Helper()
	ids, logits := make([][]int32, len(prompts)), make([][][]float32, len(prompts))
	for i, p := range prompts {
		s, err := e.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		logits[i] = decode(t, s, p, steps)
		for _, l := range logits[i] {
			ids[i] = append(ids[i], int32(nn.Argmax(l)))
		}
		s.Close()
	}
	return ids, logits
}

// runBatched submits every prompt to a batcher on e at once and returns
// each request's ids.
func runBatched(t *testing.T, e *Engine, prompts [][]int32, steps int, bo BatchOptions) ([][]int32, BatchStats) {
	t.Helper()
	b, err := e.NewBatcher(bo)
	if err != nil {
		t.Fatal(err)
	}
	got, ends := submitAll(t, b, greedyRequests(prompts, steps+1))
	for i, end := range ends {
		if end.Err != nil {
			t.Errorf("request %d: %v", i, end.Err)
		}
	}
	st := b.Stats()
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	return got, st
}

// TestMultiDeviceQuantized: a fixture converted to GGUF Q8_0 and a 256-wide
// model written as GGUF Q4_K, split over two and three devices, resident
// and under budgets that stream some layers on each device, decode the
// logits of one device bit for bit (so the same ids), alone and through
// the batcher (each request the ids of its session alone); each device's
// peak stays within its budget.
func TestMultiDeviceQuantized(t *testing.T) {
	const ctxLen, steps = 32, 5
	prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77, 12, 8, 40, 2, 6}, {7}, {3, 4, 5, 6, 7}}
	for _, m := range []struct {
		base quant.Type
		open func(t *testing.T) *loader.Model
	}{
		{quant.Q8_0, func(t *testing.T) *loader.Model { return openGGUF(t, fixtures.TinyLlamaF16Sharded, quant.Q8_0) }},
		{quant.Q4_K, func(t *testing.T) *loader.Model { return synthGGUF(t, quant.Q4_K) }},
	} {
		lm := m.open(t)
		w := weightBytes(lm)
		one, err := Open(context.Background(), lm, Options{Backends: cpus(1), Context: ctxLen, Chunk: 8})
		if err != nil {
			t.Fatal(err)
		}
		wantIDs, wantLogits := runAlone(t, one, prompts, steps)
		one.Close()
		for _, tc := range []struct {
			name    string
			devices int
			budget  int64 // per device
		}{
			{"two devices, resident", 2, 0},
			{"two devices, streamed", 2, w / 2},
			{"three devices, resident", 3, 0},
			{"three devices, streamed", 3, w / 2},
		} {
			t.Run(m.base.String()+"/"+tc.name, func(t *testing.T) {
				o := Options{Backends: namedCPUs(tc.devices), Context: ctxLen, Chunk: 8, KVPositions: 2 * ctxLen}
				if tc.budget > 0 {
					o.Memory = Memory{Budgets: []int64{tc.budget}, Strategy: paging.StrategyBalanced}
				}
				e, err := Open(context.Background(), lm, o)
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				devs := e.Devices()
				if len(devs) != tc.devices {
					t.Fatalf("%d devices, want %d", len(devs), tc.devices)
				}
				ids, logits := runAlone(t, e, prompts, steps)
				for i := range prompts {
					if fmt.Sprint(ids[i]) != fmt.Sprint(wantIDs[i]) {
						t.Errorf("prompt %d: ids %v, one device %v", i, ids[i], wantIDs[i])
					}
					for s := range logits[i] {
						if d := maxDiff(logits[i][s], wantLogits[i][s]); d != 0 {
							t.Errorf("prompt %d step %d: logits differ from one device's by %g", i, s, d)
						}
					}
				}
				got, st := runBatched(t, e, prompts, steps, BatchOptions{MaxSequences: 3, StepTokens: 8, BlockSize: 4})
				for i := range prompts {
					if fmt.Sprint(got[i]) != fmt.Sprint(wantIDs[i]) {
						t.Errorf("batched request %d: %v, alone %v", i, got[i], wantIDs[i])
					}
				}
				if st.BatchSizeSum <= st.Steps {
					t.Errorf("no step ran more than one sequence: %+v", st)
				}
				streamed := 0
				for _, d := range e.Devices() {
					if tc.budget > 0 && d.PeakDeviceBytes > tc.budget {
						t.Errorf("%s: peak %d over the budget %d", d.Name, d.PeakDeviceBytes, tc.budget)
					}
					streamed += len(d.Plan.StreamedLayers)
				}
				if tc.budget > 0 && streamed == 0 {
					t.Errorf("nothing streamed under budgets of %d", tc.budget)
				}
			})
		}
	}
}

// maxDiff is the largest absolute difference between a and b, +Inf when
// their lengths differ.
func maxDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return float64(len(a) + len(b))
	}
	var d float64
	for i := range a {
		d = max(d, float64(a[i]-b[i]), float64(b[i]-a[i]))
	}
	return d
}

// TestMultiDeviceExperts: a mixture of experts over two and three devices,
// each with a budget that holds a few of its experts, decodes the logits
// of one device; the expert report has each device's part (its cache
// within the budget, hits and misses adding up to the totals, bytes per
// token over a window), in the summary and the -json fields; batching
// over the devices gives each request its ids alone.
func TestMultiDeviceExperts(t *testing.T) {
	lm := openFixture(t, fixtures.TinyQwen3MoEF16)
	prompt := []int32{1, 5, 9, 200, 3, 77, 18}
	const steps, chunk = 8, 8
	ctxLen := 24
	want := reference(t, lm, prompt, steps)
	k := lm.Config.MoE.ExpertsPerToken
	for _, devices := range []int{2, 3} {
		t.Run(fmt.Sprintf("%d devices", devices), func(t *testing.T) {
			budget := expertBudget(t, lm, ctxLen, chunk, devices*(k+2)) / int64(devices)
			e, err := Open(context.Background(), lm, Options{Backends: namedCPUs(devices), Context: ctxLen, Chunk: chunk, KVPositions: 2 * ctxLen,
				Memory: Memory{Budgets: []int64{budget}, Strategy: paging.StrategyBalanced}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			before := e.Experts()
			if before == nil || len(before.Devices) != devices {
				t.Fatalf("report %+v: want %d devices", before, devices)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			logits, err := s.Forward(context.Background(), prompt, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			for i := range steps {
				if d := maxDiff(logits, want[i]); d != 0 {
					t.Fatalf("step %d: logits differ from one device's by %g", i, d)
				}
				if logits, err = s.Forward(context.Background(), []int32{int32(nn.Argmax(logits))}, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			s.Close()
			r := e.Experts().Since(before, steps)
			var acq, hits, misses, moved int64
			experts, slots := 0, 0
			for d, x := range r.Devices {
				if x.Device != fmt.Sprintf("cpu%d", d) || x.Experts == 0 || x.Slots == 0 || x.Slots >= x.Experts || x.Acquires == 0 {
					t.Errorf("device %d: %+v: want a cache of some of its experts, used", d, x)
				}
				if x.HitRate != float64(x.Hits)/float64(x.Acquires) || x.BytesPerToken != float64(x.BytesMoved)/steps {
					t.Errorf("device %d: rates %+v", d, x)
				}
				acq, hits, misses, moved = acq+x.Acquires, hits+x.Hits, misses+x.Misses, moved+x.BytesMoved
				experts, slots = experts+x.Experts, slots+x.Slots
			}
			if acq != r.Acquires || hits != r.Hits || misses != r.Misses || moved != r.BytesMoved || experts != r.Experts || slots != r.Slots {
				t.Errorf("devices add up to %d acquires, %d hits, %d misses, %d bytes, %d experts in %d slots; report %+v", acq, hits, misses, moved, experts, slots, r)
			}
			for _, d := range e.Devices() {
				if d.PeakDeviceBytes > budget {
					t.Errorf("%s: peak %d over the budget %d", d.Name, d.PeakDeviceBytes, budget)
				}
			}
			str := r.String()
			for d := range devices {
				if !strings.Contains(str, fmt.Sprintf("device %d (cpu%d): cache of", d, d)) {
					t.Errorf("report without device %d:\n%s", d, str)
				}
			}
			if !strings.Contains(str, "per token:") {
				t.Errorf("window report without bytes per token per device:\n%s", str)
			}
			if !strings.Contains(e.Summary(), "device 1 (cpu1)") {
				t.Errorf("summary without the devices' expert caches:\n%s", e.Summary())
			}

			prompts := [][]int32{prompt, {1, 200, 3}, {7}}
			wantIDs, _ := runAlone(t, e, prompts, 4)
			got, _ := runBatched(t, e, prompts, 4, BatchOptions{MaxSequences: 3, StepTokens: 4, BlockSize: 4, KVBlocks: 6})
			for i := range prompts {
				if fmt.Sprint(got[i]) != fmt.Sprint(wantIDs[i]) {
					t.Errorf("batched request %d: %v, alone %v", i, got[i], wantIDs[i])
				}
			}
		})
	}
}

// TestBatcherRoomPerStage: the batcher's room check counts on each device
// the buffers its stage allocates: a device without the LM head holds no
// logits, so a pool and step rows that fit beside its stage's buffers, and
// not beside the logits too, start (and decode each request's ids alone,
// within the budget); a step one row larger than fits is refused with
// ErrKVRoom.
func TestBatcherRoomPerStage(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	cfg := lm.Config
	const ctxLen, block, blocks = 16, 4, 4
	prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77}, {7}}
	for _, devices := range []int{2, 3} {
		t.Run(fmt.Sprintf("%d devices", devices), func(t *testing.T) {
			// The first device's budget: its plan with no budget, and
			// room for a few steps' rows beyond; the others unbounded.
			probe, err := Open(context.Background(), lm, Options{Backends: namedCPUs(devices), Context: ctxLen, Chunk: 4})
			if err != nil {
				t.Fatal(err)
			}
			first := probe.Devices()[0]
			probe.Close()
			budgets := make([]int64, devices)
			budgets[0] = first.Plan.PredictedPeakBytes + 4*nn.ActivationBytes(cfg, 8)
			o := Options{Backends: namedCPUs(devices), Context: ctxLen, Chunk: 4, Memory: Memory{Budgets: budgets}}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if len(e.Devices()[0].Plan.StreamedLayers) != 0 {
				t.Fatalf("device 0 streams under %d", budgets[0])
			}
			// The most step rows whose stage buffers fit beside the pool.
			p := e.Devices()[0].Placement
			kv := nn.KVCacheBytes(cfg, block*blocks, tensor.F32) / int64(cfg.NumLayers) * int64(p.EndBlock-p.FirstBlock)
			room := freeRoom(e.budgets[0]) - kv - nn.RopeBytes(cfg, ctxLen)
			logits := 4 * int64(cfg.VocabSize)
			rows := 0
			for nn.ActivationBytes(cfg, rows+1)-int64(rows+1)*logits <= room {
				rows++
			}
			if rows < len(prompts) || nn.ActivationBytes(cfg, rows) <= room {
				t.Fatalf("%d rows fit %d bytes, with the logits too: the fixture cannot tell the stages apart", rows, room)
			}
			wantIDs, _ := runAlone(t, e, prompts, 3)
			got, _ := runBatched(t, e, prompts, 3, BatchOptions{MaxSequences: len(prompts), StepTokens: rows, BlockSize: block, KVBlocks: blocks})
			for i := range prompts {
				if fmt.Sprint(got[i]) != fmt.Sprint(wantIDs[i]) {
					t.Errorf("batched request %d: %v, alone %v", i, got[i], wantIDs[i])
				}
			}
			if d := e.Devices()[0]; d.PeakDeviceBytes > budgets[0] {
				t.Errorf("%s: peak %d over the budget %d", d.Name, d.PeakDeviceBytes, budgets[0])
			}
			if _, err := e.NewBatcher(BatchOptions{MaxSequences: len(prompts), StepTokens: rows + 1, BlockSize: block, KVBlocks: blocks}); !errors.Is(err, ErrKVRoom) {
				t.Errorf("%d rows a step: %v, want ErrKVRoom", rows+1, err)
			}
		})
	}
}

// peerCPU is a CPU backend that copies to the other peerCPUs of its group
// "device to device" (a plain copy of the bytes), counting the copies, so
// that the pipeline's peer hand-over runs on any machine; can false makes
// it refuse every peer (tensor.PeerCopy then falls back to host memory).
type peerCPU struct {
	*tensor.CPU
	name   string
	can    bool
	copies *int
}

func (p *peerCPU) Name() string { return p.name }

func (p *peerCPU) CanCopyToPeer(to tensor.Memory) bool {
	for {
		if q, ok := to.(*peerCPU); ok {
			return p.can && q.can && q != p
		}
		u, ok := to.(interface{ Unwrap() tensor.Backend }) // nn's checked front
		if !ok {
			return false
		}
		to = u.Unwrap()
	}
}

func (p *peerCPU) CopyToPeer(to tensor.Memory, dst, src *tensor.Tensor) error {
	if !p.CanCopyToPeer(to) {
		return fmt.Errorf("%s: no peer access to %s", p.name, to.Name())
	}
	if dst.NumBytes() != src.NumBytes() {
		return fmt.Errorf("%s: peer copy of %d bytes into %d", p.name, src.NumBytes(), dst.NumBytes())
	}
	copy(dst.Bytes(), src.Bytes())
	*p.copies++
	return nil
}

func peerCPUs(n int, can bool, copies *int) []tensor.Backend {
	var bs []tensor.Backend
	for i := range n {
		bs = append(bs, &peerCPU{CPU: tensor.NewCPU(1), name: fmt.Sprintf("peer%d", i), can: can, copies: copies})
	}
	return bs
}

// TestPeerHandover: over two and three devices that copy to each other,
// the hidden state goes device to device (one peer copy per hand-over, for
// a session and for the batcher), unless Options.NoPeerCopies or the
// devices refuse (host memory then); the logits are the direct run's in
// every case.
func TestPeerHandover(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77, 12, 400, 8, 91, 17}
	const steps, chunk = 4, 4
	want := reference(t, lm, prompt, steps)
	chunks := (len(prompt) + chunk - 1) / chunk
	for _, tc := range []struct {
		name    string
		devices int
		can     bool
		noPeer  bool
	}{
		{"two devices, peer copies", 2, true, false},
		{"three devices, peer copies", 3, true, false},
		{"two devices, NoPeerCopies", 2, true, true},
		{"two devices without peer access", 2, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			copies := 0
			e, err := Open(context.Background(), lm, Options{Backends: peerCPUs(tc.devices, tc.can, &copies), Context: len(prompt) + steps + 4, Chunk: chunk,
				NoPeerCopies: tc.noPeer})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			s.Close()
			for i := range want {
				if d := maxDiff(got[i], want[i]); d != 0 {
					t.Errorf("step %d: logits differ from the direct run's by %g", i, d)
				}
			}
			wantCopies := 0
			if tc.can && !tc.noPeer {
				wantCopies = (tc.devices - 1) * (chunks + steps)
			}
			if copies != wantCopies {
				t.Errorf("%d peer copies, want %d", copies, wantCopies)
			}
			copies = 0
			prompts := [][]int32{{1, 5, 9}, {7, 8}}
			wantIDs, _ := runAlone(t, e, prompts, 3)
			alone := copies
			got2, _ := runBatched(t, e, prompts, 3, BatchOptions{MaxSequences: 2, StepTokens: 4, BlockSize: 4})
			for i := range prompts {
				if fmt.Sprint(got2[i]) != fmt.Sprint(wantIDs[i]) {
					t.Errorf("batched request %d: %v, alone %v", i, got2[i], wantIDs[i])
				}
			}
			if batched := copies - alone; (batched > 0) != (wantCopies > 0) {
				t.Errorf("the batcher made %d peer copies, sessions %d", batched, alone)
			}
		})
	}
}

// overlapCPU is a named CPU backend that records how many of its group
// compute at once: each RMSNorm counts itself active for a moment.
type overlapCPU struct {
	namedCPU
	active, most *atomic.Int32
}

func (o overlapCPU) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	n := o.active.Add(1)
	defer o.active.Add(-1)
	for {
		m := o.most.Load()
		if n <= m || o.most.CompareAndSwap(m, n) {
			break
		}
	}
	time.Sleep(100 * time.Microsecond)
	return o.CPU.RMSNorm(out, x, w, eps)
}

// TestBatcherPipelined: the batcher over two and three devices with
// BatchOptions.Pipeline gives every request the greedy ids of its session
// run alone, as without it, the devices computing at once (two or more
// active together, never without Pipeline); a request cancelled while its
// step is in flight ends with its context's error once the step has left,
// the others unaffected; every KV block comes back.
func TestBatcherPipelined(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompts := [][]int32{{1, 5, 9}, {1, 200, 3, 77, 12, 8, 40, 2, 6}, {7}, {3, 4, 5, 6, 7}, {11, 12}, {90, 91, 92, 93}}
	const steps = 6
	for _, devices := range []int{2, 3} {
		for _, pipeline := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d devices, pipeline %v", devices, pipeline), func(t *testing.T) {
				var active, most atomic.Int32
				var bs []tensor.Backend
				for i := range devices {
					bs = append(bs, overlapCPU{namedCPU: namedCPU{CPU: tensor.NewCPU(1), name: fmt.Sprintf("cpu%d", i)}, active: &active, most: &most})
				}
				e, err := Open(context.Background(), lm, Options{Backends: bs, Context: 32, Chunk: 8})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				want, _ := runAlone(t, e, prompts, steps)
				most.Store(0)
				bo := BatchOptions{MaxSequences: 4, StepTokens: 8, BlockSize: 4, Pipeline: pipeline}
				got, st := runBatched(t, e, prompts, steps, bo)
				for i := range prompts {
					if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) {
						t.Errorf("request %d: %v, alone %v", i, got[i], want[i])
					}
				}
				if m := most.Load(); pipeline != (m >= 2) {
					t.Errorf("pipeline %v: at most %d devices computed at once", pipeline, m)
				}
				t.Logf("%d steps, mean batch %.2f, %d devices at once at most", st.Steps, float64(st.BatchSizeSum)/float64(st.Steps), most.Load())

				// A request cancelled while its step is in flight.
				b, err := e.NewBatcher(bo)
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				cch, err := b.Submit(ctx, Request{Prompt: prompts[1], MaxTokens: 20, IgnoreEOS: true})
				if err != nil {
					t.Fatal(err)
				}
				och, err := b.Submit(context.Background(), Request{Prompt: prompts[0], MaxTokens: steps + 1, IgnoreEOS: true})
				if err != nil {
					t.Fatal(err)
				}
				var cancelled Token
				for tok := range cch {
					if tok.Emitted && tok.GeneratedTokens == 2 {
						cancel()
					}
					cancelled = tok
				}
				other, end := collect(t, och)
				if !errors.Is(cancelled.Err, context.Canceled) || fmt.Sprint(other) != fmt.Sprint(want[0]) || end.Err != nil {
					t.Errorf("cancelled request ended %+v; the other %v (end %+v), alone %v", cancelled, other, end, want[0])
				}
				if err := b.Close(context.Background()); err != nil {
					t.Fatal(err)
				}
				if st := b.Stats(); st.KVBlocksFree != st.KVBlocks {
					t.Errorf("%d of %d KV blocks free after Close", st.KVBlocksFree, st.KVBlocks)
				}
			})
		}
	}
}
