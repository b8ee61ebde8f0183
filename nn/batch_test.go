package nn

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// batchFixtures are the fixtures the batch tests run: every family, dense
// and mixtures of experts.
var batchFixtures = []string{fixtures.TinyLlamaBF16, fixtures.TinyLlamaF16Sharded, fixtures.TinyQwen3F16, fixtures.TinyMixtralBF16, fixtures.TinyQwen3MoEF16}

// residentModel is lm on a CPU of threads threads with every weight loaded,
// its allocations charged to a budget.
func residentModel(t *testing.T, lm *loader.Model, threads int) (*Model, *paging.Budget) {
	t.Helper()
	b := tensor.NewCPU(threads)
	t.Cleanup(func() { b.Close() })
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hw.Close() })
	bud, err := paging.NewBudget(b, 1<<40, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(lm.Config, b, bud, hw)
	if err != nil {
		t.Fatal(err)
	}
	return m, bud
}

// fixtureWeights opens fixture name and loads its weights on b; both are
// closed when the test ends.
func fixtureWeights(t *testing.T, b tensor.Memory, name string) (*loader.Model, *HostWeights) {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	hw, err := LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hw.Close() })
	return lm, hw
}

// fixtureOnCPU is fixtureWeights on a CPU backend of two threads, for
// tests that wrap the backend before New; it is closed when the test ends.
func fixtureOnCPU(t *testing.T, name string) (*loader.Model, *tensor.CPU, *HostWeights) {
	t.Helper()
	cpu := tensor.NewCPU(2)
	t.Cleanup(func() { cpu.Close() })
	lm, hw := fixtureWeights(t, cpu, name)
	return lm, cpu, hw
}

// batchSeq is one sequence of a batch test: its prompt, the greedy tokens
// it decodes and the logits of each.
type batchSeq struct {
	prompt []int32
	join   int // the step it joins at
	steps  int // tokens it decodes
	seq    *Seq
	fed    int   // prompt tokens run so far
	next   int32 // the token to run next, once the prompt is done
	logits [][]float32
}

// runBatch runs the sequences through b with rows tokens a step at most:
// each step the decode rows first, then prompt chunks up to the budget,
// sequences joining at their step and leaving when done. It returns the
// steps it ran.
func runBatch(t *testing.T, b *Batch, seqs []*batchSeq, rows int) int {
	t.Helper()
	ctx := context.Background()
	ran := 0
	for step := 0; ; step++ {
		var works []Work
		var owners []*batchSeq
		budget := rows
		left := 0
		for _, s := range seqs { // decode rows first
			if s.seq != nil && s.fed == len(s.prompt) && len(s.logits) < s.steps && budget > 0 {
				works, owners = append(works, Work{Seq: s.seq, IDs: []int32{s.next}, Logits: true}), append(owners, s)
				budget--
			}
		}
		for _, s := range seqs {
			if s.join <= step && s.seq == nil {
				s.seq = b.NewSeq()
				if err := s.seq.Reserve(len(s.prompt) + s.steps); err != nil {
					t.Fatal(err)
				}
			}
			if s.seq != nil && s.fed < len(s.prompt) && budget > 0 {
				n := min(budget, len(s.prompt)-s.fed)
				works, owners = append(works, Work{Seq: s.seq, IDs: s.prompt[s.fed : s.fed+n], Logits: s.fed+n == len(s.prompt)}), append(owners, s)
				budget -= n
			}
			if len(s.logits) < s.steps {
				left++
			}
		}
		if left == 0 {
			return ran
		}
		ran++
		out, err := b.Step(ctx, works)
		if err != nil {
			t.Fatal(err)
		}
		for i, s := range owners {
			if works[i].Logits == false {
				s.fed += len(works[i].IDs)
				continue
			}
			if s.fed < len(s.prompt) {
				s.fed = len(s.prompt)
			}
			s.logits = append(s.logits, append([]float32(nil), out[i]...))
			s.next = int32(Argmax(out[i]))
			if len(s.logits) == s.steps {
				s.seq.Close()
			}
		}
	}
}

// TestBatchMatchesAlone: on every fixture, sequences of random prompt
// lengths that join at random steps and leave when done, run with a small
// token budget (prompts cut into chunks that share steps with other
// sequences' decode rows), get logits bit-identical to each sequence run
// alone in a batch of its own with its prompt in one step; their greedy
// ids match a Session's, whose logits are within rounding; the pool's
// blocks all come back and the budget returns to its value before the
// batch. With a pool of F16 or Q8_B8 (BatchOptions.KVDType) the same
// holds against a Session whose cache is of that dtype.
func TestBatchMatchesAlone(t *testing.T) {
	type run struct {
		threads int
		kv      tensor.DType
	}
	for _, name := range batchFixtures {
		for _, rn := range []run{{1, tensor.F32}, {3, tensor.F32}, {3, tensor.F16}, {2, tensor.Q8_B8}} {
			threads, kv := rn.threads, rn.kv
			t.Run(fmt.Sprintf("%s/threads=%d/%v", name, threads, kv), func(t *testing.T) {
				lm, err := loader.Open(fixtures.Dir(name))
				if err != nil {
					t.Fatal(err)
				}
				defer lm.Close()
				m, bud := residentModel(t, lm, threads)
				r := rand.New(rand.NewPCG(uint64(threads), uint64(len(name))))
				vocab := lm.Config.VocabSize
				var seqs []*batchSeq
				for i := range 7 {
					p := make([]int32, 1+r.IntN(20))
					for j := range p {
						p[j] = int32(r.IntN(vocab))
					}
					seqs = append(seqs, &batchSeq{prompt: p, join: r.IntN(6) * i % 9, steps: 1 + r.IntN(6)})
				}
				used := bud.Used()
				b, err := m.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 9, BlockSize: 4, Blocks: 64, KVDType: kv})
				if err != nil {
					t.Fatal(err)
				}
				if dt := b.stages[0].k[0].DType(); dt != kv {
					t.Fatalf("the pool is %v, want %v", dt, kv)
				}
				runBatch(t, b, seqs, 9)
				if b.FreeBlocks() != b.Blocks() {
					t.Errorf("%d of %d blocks free after every sequence left", b.FreeBlocks(), b.Blocks())
				}
				b.Close()
				if bud.Used() != used {
					t.Errorf("budget at %d after the batch, %d before", bud.Used(), used)
				}
				for i, s := range seqs {
					a, err := m.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 32, BlockSize: 8, KVDType: kv})
					if err != nil {
						t.Fatal(err)
					}
					alone := &batchSeq{prompt: s.prompt, steps: s.steps}
					runBatch(t, a, []*batchSeq{alone}, 32)
					a.Close()
					for j := range s.logits {
						for k, v := range s.logits[j] {
							if math.Float32bits(v) != math.Float32bits(alone.logits[j][k]) {
								t.Fatalf("sequence %d (prompt %d tokens, joins at %d) token %d logit %d: %v in the batch, %v alone", i, len(s.prompt), s.join, j, k, v, alone.logits[j][k])
							}
						}
					}
					sess, err := m.NewSessionWith(32, 8, SessionOptions{KVDType: kv})
					if err != nil {
						t.Fatal(err)
					}
					logits, err := sess.Forward(context.Background(), s.prompt, false, nil)
					for j := 0; err == nil && j < s.steps; j++ {
						if d := maxAbsDiff(logits, s.logits[j]); d > 1e-3 {
							t.Errorf("sequence %d token %d: logits %g from a session's", i, j, d)
						}
						if Argmax(logits) != Argmax(s.logits[j]) {
							t.Errorf("sequence %d token %d: greedy id %d, a session's %d", i, j, Argmax(s.logits[j]), Argmax(logits))
						}
						logits, err = sess.Forward(context.Background(), []int32{int32(Argmax(s.logits[j]))}, false, nil)
					}
					if err != nil {
						t.Fatal(err)
					}
					sess.Close()
				}
			})
		}
	}
}

// TestBatchErrors: a step's malformed works and a reservation beyond the
// pool or the context are errors that change nothing.
func TestBatchErrors(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaBF16))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	m, _ := residentModel(t, lm, 1)
	b, err := m.NewBatch(BatchOptions{MaxPos: 16, MaxRows: 4, BlockSize: 4, Blocks: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	s1, s2 := b.NewSeq(), b.NewSeq()
	if err := s1.Reserve(8); err != nil {
		t.Fatal(err)
	}
	if err := s2.Reserve(8); !errors.Is(err, ErrNoBlocks) {
		t.Errorf("8 positions with 1 block free: %v", err)
	}
	if b.FreeBlocks() != 1 {
		t.Errorf("a refused reservation took blocks: %d free", b.FreeBlocks())
	}
	if err := s2.Reserve(17); !errors.Is(err, ErrContextFull) {
		t.Errorf("17 positions in a 16-position context: %v", err)
	}
	other, err := m.NewBatch(BatchOptions{MaxPos: 16, MaxRows: 4, BlockSize: 4, Blocks: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	for _, tc := range []struct {
		name  string
		works []Work
	}{
		{"past the reservation", []Work{{Seq: s1, IDs: make([]int32, 9)}}},
		{"unreserved", []Work{{Seq: s2, IDs: []int32{1}}}},
		{"too many rows", []Work{{Seq: s1, IDs: make([]int32, 5)}}},
		{"id outside the vocabulary", []Work{{Seq: s1, IDs: []int32{int32(lm.Config.VocabSize)}}}},
		{"negative id", []Work{{Seq: s1, IDs: []int32{-1}}}},
		{"no tokens", []Work{{Seq: s1}}},
		{"one sequence twice", []Work{{Seq: s1, IDs: []int32{1}}, {Seq: s1, IDs: []int32{2}}}},
		{"another batch's sequence", []Work{{Seq: other.NewSeq(), IDs: []int32{1}}}},
		{"no sequence", []Work{{IDs: []int32{1}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := b.Step(context.Background(), tc.works); err == nil {
				t.Fatal("no error")
			} else {
				t.Log(err)
			}
			if s1.Pos() != 0 {
				t.Fatalf("a refused step moved the sequence to %d", s1.Pos())
			}
		})
	}
}

// overlapCPU is a CPU backend that records how many of its group compute
// at once: each RMSNorm counts itself active for a moment.
type overlapCPU struct {
	*tensor.CPU
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
	time.Sleep(200 * time.Microsecond)
	return o.CPU.RMSNorm(out, x, w, eps)
}

// runTicks is runBatch through Tick: each beat starts a step of the
// sequences that have none in flight (decode rows first, then prompt
// chunks, rows tokens at most), and takes the logits of the step that
// left the pipeline.
func runTicks(t *testing.T, b *Batch, seqs []*batchSeq, rows int) {
	t.Helper()
	ctx := context.Background()
	for beat := 0; ; beat++ {
		var works []Work
		budget, left := rows, 0
		for _, s := range seqs {
			if s.seq != nil && !b.InFlight(s.seq) && s.fed == len(s.prompt) && len(s.logits) < s.steps && budget > 0 {
				works = append(works, Work{Seq: s.seq, IDs: []int32{s.next}, Logits: true})
				budget--
			}
		}
		for _, s := range seqs {
			if s.join <= beat && s.seq == nil {
				s.seq = b.NewSeq()
				if err := s.seq.Reserve(len(s.prompt) + s.steps); err != nil {
					t.Fatal(err)
				}
			}
			if s.seq != nil && !b.InFlight(s.seq) && s.fed < len(s.prompt) && budget > 0 {
				n := min(budget, len(s.prompt)-s.fed)
				works = append(works, Work{Seq: s.seq, IDs: s.prompt[s.fed : s.fed+n], Logits: s.fed+n == len(s.prompt)})
				budget -= n
			}
			if len(s.logits) < s.steps {
				left++
			}
		}
		if left == 0 {
			if b.Flying() != 0 {
				t.Fatalf("%d steps in flight with every sequence done", b.Flying())
			}
			return
		}
		done, out, err := b.Tick(ctx, works)
		if err != nil {
			t.Fatal(err)
		}
		for i, w := range done {
			var s *batchSeq
			for _, c := range seqs {
				if c.seq == w.Seq {
					s = c
				}
			}
			if !w.Logits {
				s.fed += len(w.IDs)
				continue
			}
			s.fed = len(s.prompt)
			s.logits = append(s.logits, append([]float32(nil), out[i]...))
			s.next = int32(Argmax(out[i]))
			if len(s.logits) == s.steps {
				s.seq.Close()
			}
		}
	}
}

// TestBatchTick: a batch over a pipeline of two and three devices run beat
// by beat (Tick), each beat starting a step of the sequences with none in
// flight while the earlier steps move on, gives every sequence the logits
// Step gives it, bit for bit; the stages compute at once (two or more
// devices active together); Step refuses while steps are in flight, and a
// batch whose stages share a device refuses Tick.
func TestBatchTick(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	for _, cuts := range [][]int{{2}, {1, 3}} {
		t.Run(fmt.Sprintf("%d devices", len(cuts)+1), func(t *testing.T) {
			var active, most atomic.Int32
			var stages []Stage
			bounds := append(append([]int{0}, cuts...), cfg.NumLayers)
			for k := range len(bounds) - 1 {
				dev := overlapCPU{CPU: tensor.NewCPU(1), active: &active, most: &most}
				defer dev.Close()
				hw, err := LoadWeights(context.Background(), lm, dev, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer hw.Close()
				stages = append(stages, Stage{Backend: dev, Weights: hw, FirstBlock: bounds[k], EndBlock: bounds[k+1]})
			}
			p, err := NewPipeline(cfg, stages)
			if err != nil {
				t.Fatal(err)
			}
			mk := func() []*batchSeq {
				r := rand.New(rand.NewPCG(5, 9))
				var seqs []*batchSeq
				for i := range 6 {
					prompt := make([]int32, 1+r.IntN(9))
					for j := range prompt {
						prompt[j] = int32(r.IntN(cfg.VocabSize))
					}
					seqs = append(seqs, &batchSeq{prompt: prompt, join: i / 2, steps: 3 + r.IntN(3)})
				}
				return seqs
			}
			want, got := mk(), mk()
			for _, run := range []struct {
				seqs []*batchSeq
				f    func(*testing.T, *Batch, []*batchSeq, int)
			}{{want, func(t *testing.T, b *Batch, seqs []*batchSeq, rows int) { runBatch(t, b, seqs, rows) }}, {got, runTicks}} {
				b, err := p.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 6, BlockSize: 4, Blocks: 64})
				if err != nil {
					t.Fatal(err)
				}
				if !b.Pipelined() {
					t.Fatal("a batch over devices of their own is not pipelined")
				}
				run.f(t, b, run.seqs, 6)
				b.Close()
			}
			for i := range want {
				for s := range want[i].logits {
					for j, v := range want[i].logits[s] {
						if got[i].logits[s][j] != v {
							t.Fatalf("sequence %d step %d logit %d: %v by beats, %v by steps", i, s, j, got[i].logits[s][j], v)
						}
					}
				}
			}
			if most.Load() < 2 {
				t.Errorf("at most %d devices computed at once: the beats did not overlap the stages", most.Load())
			}
			b, err := p.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 6, BlockSize: 4, Blocks: 8})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			s := b.NewSeq()
			if err := s.Reserve(8); err != nil {
				t.Fatal(err)
			}
			if _, _, err := b.Tick(context.Background(), []Work{{Seq: s, IDs: []int32{1, 2}, Logits: true}}); err != nil {
				t.Fatal(err)
			}
			if _, err := b.Step(context.Background(), []Work{{Seq: s, IDs: []int32{3}}}); err == nil {
				t.Error("Step with a step in flight: no error")
			}
			if _, _, err := b.Tick(context.Background(), []Work{{Seq: s, IDs: []int32{3}}}); err == nil || !strings.Contains(err.Error(), "in flight") {
				t.Errorf("a sequence in flight given to Tick: %v", err)
			}
		})
	}
	// Two stages on one device share its buffers: no beats.
	dev := tensor.NewCPU(1)
	defer dev.Close()
	hw, err := LoadWeights(context.Background(), lm, dev, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	p, err := NewPipeline(cfg, []Stage{{Backend: dev, Weights: hw, FirstBlock: 0, EndBlock: 2}, {Backend: dev, Weights: hw, FirstBlock: 2, EndBlock: cfg.NumLayers}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 6, BlockSize: 4, Blocks: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, _, err := b.Tick(context.Background(), nil); b.Pipelined() || err == nil {
		t.Errorf("stages sharing a device: pipelined %v, Tick %v", b.Pipelined(), err)
	}
}

// timedCPU is a CPU that times its compute queue as a device does
// (tensor.ComputeTimer: every stretch takes device) and counts its
// RMSNorms as its launches (tensor.LaunchCounter).
type timedCPU struct {
	tensor.Backend
	device        time.Duration
	starts, stops *int
	norms         *atomic.Int64
}

func (c timedCPU) RMSNorm(out, x, w *tensor.Tensor, eps float32) error {
	c.norms.Add(1)
	return c.Backend.RMSNorm(out, x, w, eps)
}

func (c timedCPU) StartCompute() (func() (time.Duration, error), error) {
	*c.starts++
	return func() (time.Duration, error) { *c.stops++; return c.device, nil }, nil
}

func (c timedCPU) Launches() tensor.Launches { return tensor.Launches{Kernels: c.norms.Load()} }

// TestBatchStepTimes: Step splits its time: on the CPU, which computes as
// it is called, the device time is the forward's wall time (Launch) and
// nothing is waited for; on a backend that times its compute queue, one
// pair of marks a step with logits (also when the step fails) gives the
// device time, and its launches are counted; a step without logits is not
// waited for; only a step with logits downloads.
func TestBatchStepTimes(t *testing.T) {
	lm, cpu, hw := fixtureOnCPU(t, fixtures.TinyLlamaF16Sharded)
	var starts, stops int
	var norms atomic.Int64
	timed := timedCPU{Backend: cpu, device: 123 * time.Millisecond, starts: &starts, stops: &stops, norms: &norms}
	for _, tc := range []struct {
		name  string
		b     tensor.Backend
		timed bool
	}{{"cpu", cpu, false}, {"timed", timed, true}} {
		t.Run(tc.name, func(t *testing.T) {
			starts, stops = 0, 0
			m, err := New(lm.Config, tc.b, nil, hw)
			if err != nil {
				t.Fatal(err)
			}
			b, err := m.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 8, BlockSize: 4, Blocks: 8})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			s := b.NewSeq()
			if err := s.Reserve(16); err != nil {
				t.Fatal(err)
			}
			for _, step := range []struct {
				ids    []int32
				logits bool
			}{{[]int32{1, 5, 9, 3}, false}, {[]int32{7}, true}} {
				n0 := norms.Load()
				if _, err := b.Step(context.Background(), []Work{{Seq: s, IDs: step.ids, Logits: step.logits}}); err != nil {
					t.Fatal(err)
				}
				tm := b.Times()
				t.Logf("%d rows, logits %v: %+v", len(step.ids), step.logits, tm)
				if tm.Prepare <= 0 || tm.Launch <= 0 || (tm.Download > 0) != step.logits {
					t.Errorf("%+v: want Prepare and Launch, and Download only with logits", tm)
				}
				switch {
				case !tc.timed && (tm.Device != tm.Launch || tm.Wait != 0 || tm.Launches != 0):
					t.Errorf("%+v: on the CPU the device time is Launch's, no wait, no launches counted", tm)
				case tc.timed && step.logits && (tm.Device != timed.device || tm.Launches != norms.Load()-n0 || tm.Launches == 0):
					t.Errorf("%+v: want the compute queue's %v and the %d launches of the step", tm, timed.device, norms.Load()-n0)
				case tc.timed && !step.logits && (tm.Device != tm.Launch || tm.Wait != 0):
					t.Errorf("%+v: a step without logits is not waited for: its device time is Launch's", tm)
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if _, err := b.Step(ctx, []Work{{Seq: s, IDs: []int32{2}, Logits: true}}); err == nil {
				t.Fatal("a step with its context cancelled ran")
			}
			if tm := b.Times(); tm != (StepTimes{}) {
				t.Errorf("a failed step's times %+v, want none", tm)
			}
			if want := map[bool]int{true: 2}[tc.timed]; starts != want || stops != want {
				t.Errorf("%d marks started, %d stopped, want %d each (one a step with logits, failed or not)", starts, stops, want)
			}
		})
	}
}

// ropeCounter counts the rotary calls a batch makes of its CPU: Rope's,
// and RopeRows' (which it takes, as a RowRoper, and passes on).
type ropeCounter struct {
	tensor.Backend
	rope, ropeRows *atomic.Int64
}

func (c ropeCounter) Rope(x *tensor.Tensor, r tensor.Rotary) error {
	c.rope.Add(1)
	return c.Backend.Rope(x, r)
}

func (c ropeCounter) RopeRows(x *tensor.Tensor, r tensor.Rotary, pos []int32) error {
	c.ropeRows.Add(1)
	return tensor.RopeRows(c.Backend, x, r, pos)
}

func (c ropeCounter) Unwrap() tensor.Backend { return c.Backend }

// TestBatchRopeCalls: a batched step rotates its rows, every sequence's at
// its own positions, in two calls a layer (q and k), however many
// sequences it holds: not two a sequence a layer (a GPU's launches every
// step, 4,096 a step for 64 sequences of a 32-layer model).
func TestBatchRopeCalls(t *testing.T) {
	lm, cpu, hw := fixtureOnCPU(t, fixtures.TinyLlamaF16Sharded)
	var rope, ropeRows atomic.Int64
	m, err := New(lm.Config, ropeCounter{Backend: cpu, rope: &rope, ropeRows: &ropeRows}, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	layers := int64(lm.Config.NumLayers)
	for _, n := range []int{1, 5, 16} {
		t.Run(fmt.Sprintf("seqs=%d", n), func(t *testing.T) {
			b, err := m.NewBatch(BatchOptions{MaxPos: 32, MaxRows: 64, BlockSize: 4, Blocks: 8 * n})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			// A prompt of its own length for each sequence, then one
			// decode step of a row each: every row at another position.
			var decode []Work
			for i := range n {
				s := b.NewSeq()
				if err := s.Reserve(32); err != nil {
					t.Fatal(err)
				}
				prompt := make([]int32, 1+i%7)
				for j := range prompt {
					prompt[j] = int32(1 + j)
				}
				if _, err := b.Step(context.Background(), []Work{{Seq: s, IDs: prompt}}); err != nil {
					t.Fatal(err)
				}
				decode = append(decode, Work{Seq: s, IDs: []int32{3}, Logits: true})
			}
			rope.Store(0)
			ropeRows.Store(0)
			if _, err := b.Step(context.Background(), decode); err != nil {
				t.Fatal(err)
			}
			t.Logf("a decode step of %d sequences over %d layers: %d Rope calls, %d RopeRows calls", n, layers, rope.Load(), ropeRows.Load())
			if rope.Load() != 0 || ropeRows.Load() != 2*layers {
				t.Errorf("%d Rope and %d RopeRows calls, want 0 and %d (q and k a layer)", rope.Load(), ropeRows.Load(), 2*layers)
			}
		})
	}
}

// pinnedCPU is a CPU whose page-locked allocations are counted
// (tensor.PinnedAllocator): what is held, and what was freed that it did
// not hand out.
type pinnedCPU struct {
	tensor.Backend
	held  map[*byte]int
	bogus *int
}

func (c pinnedCPU) AllocPinned(n int64) ([]byte, error) {
	b := make([]byte, n)
	c.held[&b[0]] = len(b)
	return b, nil
}

func (c pinnedCPU) FreePinned(b []byte) error {
	if _, ok := c.held[&b[0]]; !ok {
		*c.bogus++
		return errors.New("not pinned here")
	}
	delete(c.held, &b[0])
	return nil
}

func (c pinnedCPU) Unwrap() tensor.Backend { return c.Backend }

// TestBatchPinnedLogits: a batch downloads its logits into page-locked
// memory where its backend has some: the logits those of a pageable
// download, one buffer held (a larger step's replaces the smaller one's),
// and none left after Close.
func TestBatchPinnedLogits(t *testing.T) {
	lm, cpu, hw := fixtureOnCPU(t, fixtures.TinyLlamaF16Sharded)
	var bogus int
	pc := pinnedCPU{Backend: cpu, held: map[*byte]int{}, bogus: &bogus}
	vocab := lm.Config.VocabSize
	steps := [][]int32{{1, 5, 9}, {7, 2}} // two sequences: one row of logits, then two
	run := func(b tensor.Backend, check func(step int)) [][]float32 {
		m, err := New(lm.Config, b, nil, hw)
		if err != nil {
			t.Fatal(err)
		}
		bt, err := m.NewBatch(BatchOptions{MaxPos: 16, MaxRows: 8, BlockSize: 4, Blocks: 8})
		if err != nil {
			t.Fatal(err)
		}
		defer bt.Close()
		s1, s2 := bt.NewSeq(), bt.NewSeq()
		for _, s := range []*Seq{s1, s2} {
			if err := s.Reserve(8); err != nil {
				t.Fatal(err)
			}
		}
		var got [][]float32
		for i, ids := range steps {
			works := []Work{{Seq: s1, IDs: ids, Logits: true}}
			if i > 0 {
				works = append(works, Work{Seq: s2, IDs: []int32{3}, Logits: true})
			}
			out, err := bt.Step(context.Background(), works)
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range out {
				got = append(got, slices.Clone(l))
			}
			if check != nil {
				check(i)
			}
		}
		return got
	}
	want := run(cpu, nil)
	got := run(pc, func(step int) {
		if n := 4 * vocab * (step + 1); len(pc.held) != 1 || slices.Collect(maps.Values(pc.held))[0] != n {
			t.Errorf("after step %d: pinned buffers %v, want one of %d bytes", step, slices.Collect(maps.Values(pc.held)), n)
		}
	})
	if len(pc.held) != 0 || bogus != 0 {
		t.Errorf("after Close: %d pinned buffers held, %d frees of memory not pinned", len(pc.held), bogus)
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Errorf("logits %d differ from the pageable download's", i)
		}
	}
}

// TestStepScoresPinned: a sparse block's router scores of a decode step go
// to page-locked memory where the backend has some: the logits those of a
// pageable run, one step buffer (the scores, and the rows of the experts
// on the CPU) held while the session decodes, none after Close.
func TestStepScoresPinned(t *testing.T) {
	lm, cpu, hw := fixtureOnCPU(t, fixtures.TinyQwen3MoEF16)
	var bogus int
	pc := pinnedCPU{Backend: cpu, held: map[*byte]int{}, bogus: &bogus}
	plain, err := New(lm.Config, cpu, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := generateIDs(t, plain, expertPrompt, 4, 32, 8)
	m, err := New(lm.Config, pc, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.NewSession(32, 8)
	if err != nil {
		t.Fatal(err)
	}
	logits, err := s.Forward(context.Background(), expertPrompt, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(pc.held) != 0 {
		t.Errorf("the prompt's chunks hold %d page-locked buffers, want none (their scores are more than a step's)", len(pc.held))
	}
	got, _ := greedy(t, s, logits, lm.Config.VocabSize, 4)
	sameLogits(t, "page-locked scores", got, want)
	held := 0
	for _, n := range pc.held {
		held += n
		c := lm.Config
		if want := 4 * (c.MoE.Experts + c.HiddenSize + c.MoE.ExpertsPerToken*c.HiddenSize); n != want {
			t.Errorf("a page-locked buffer of %d bytes, want %d (a step's scores, row of h and k rows of experts' outputs)", n, want)
		}
	}
	if len(pc.held) != 1 {
		t.Errorf("decoding holds %d page-locked buffers (%d bytes), want 1", len(pc.held), held)
	}
	s.Close()
	if len(pc.held) != 0 || bogus != 0 {
		t.Errorf("after Close %d page-locked buffers held, %d freed that were not handed out", len(pc.held), bogus)
	}
}
