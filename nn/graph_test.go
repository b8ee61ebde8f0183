package nn

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// replayer is the CPU backend with a tensor.Grapher whose graphs run the
// captured function again on Replay: the graph logic of this package
// (when to capture, what a graph is keyed on, the position read through
// PosAt) without a GPU. Like a CUDA capture, Capture runs nothing; in a
// replay, a copy from or to the host is an error, as it cannot be
// captured.
type replayer struct {
	tensor.Backend
	mu        sync.Mutex
	captures  int
	failAt    int   // the capture that fails (1-based), 0 for none
	replayErr error // returned by every replay when set
	live      int   // graphs not closed
	inReplay  bool
}

func (r *replayer) Unwrap() tensor.Backend { return r.Backend }

func (r *replayer) Capture(f func() error) (tensor.Graph, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.captures++
	if r.captures == r.failAt {
		return nil, errors.New("replayer: capture refused")
	}
	r.live++
	return &replayGraph{r: r, f: f}, nil
}

func (r *replayer) host(op string) error {
	if r.inReplay {
		return fmt.Errorf("replayer: %s in a graph", op)
	}
	return nil
}

func (r *replayer) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	if err := r.host("Upload"); err != nil {
		return err
	}
	return r.Backend.Upload(dst, off, src)
}

func (r *replayer) Download(dst []byte, src *tensor.Tensor) error {
	if err := r.host("Download"); err != nil {
		return err
	}
	return r.Backend.Download(dst, src)
}

func (r *replayer) Embed(out, table *tensor.Tensor, ids []int32) error {
	if err := r.host("Embed"); err != nil {
		return err
	}
	return r.Backend.Embed(out, table, ids)
}

// positionSetter is a replayer with a tensor.PositionSetter, which
// counts the positions it sets and the uploads of one I32 element.
type positionSetter struct {
	*replayer
	sets, uploads int
}

func (p *positionSetter) SetPosition(at *tensor.Tensor, pos int) error {
	if at.DType() != tensor.I32 || !at.OnHost() {
		return fmt.Errorf("positionSetter: at is %v", at)
	}
	p.sets++
	at.I32()[0] = int32(pos)
	return nil
}

func (p *positionSetter) Upload(dst *tensor.Tensor, off int64, src []byte) error {
	if dst.DType() == tensor.I32 && dst.Len() == 1 {
		p.uploads++
	}
	return p.replayer.Upload(dst, off, src)
}

// notResident hides a Weights' Resident: its blocks are graphed one by
// one.
type notResident struct{ Weights }

type replayGraph struct {
	r      *replayer
	f      func() error
	closed bool
}

func (g *replayGraph) Replay() error {
	if g.closed {
		return errors.New("replayer: replay of a closed graph")
	}
	if g.r.replayErr != nil {
		return g.r.replayErr
	}
	g.r.inReplay = true
	defer func() { g.r.inReplay = false }()
	return g.f()
}

func (g *replayGraph) Close() error {
	if !g.closed {
		g.closed = true
		g.r.mu.Lock()
		g.r.live--
		g.r.mu.Unlock()
	}
	return nil
}

// decode runs a prompt and steps greedy decode steps on m and returns the
// logits of every step.
func decode(t *testing.T, m *Model, prompt []int32, steps, maxPos int) ([][]float32, GraphStats) {
	t.Helper()
	s, err := m.NewSession(maxPos, 8)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	logits, err := s.Forward(ctx, prompt, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var all [][]float32
	for range steps {
		all = append(all, append([]float32(nil), logits...))
		if logits, err = s.Forward(ctx, []int32{int32(Argmax(logits))}, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	return append(all, append([]float32(nil), logits...)), s.GraphStats()
}

func sameSteps(t *testing.T, what string, got, want [][]float32) {
	t.Helper()
	for i := range want {
		for j := range want[i] {
			if got[i][j] != want[i][j] {
				t.Fatalf("%s: step %d logit %d is %v, eager %v", what, i, j, got[i][j], want[i][j])
			}
		}
	}
}

// TestDecodeGraphs runs the F16 fixture's decode steps as graphs (on the
// replaying CPU backend) and eagerly, and checks the logits are the same
// bit for bit: with every weight resident over 200 steps, which cross the
// buckets of 64 and 128 positions (re-captures of every block); under the
// smallest budget, which streams the blocks through the ring; with a
// capture that fails (that block stays eager); with graphs turned off;
// and that a replay's error fails the step, which can then be retried.
func TestDecodeGraphs(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14}
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	hw, err := LoadWeights(context.Background(), lm, cpu, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	layers := cfg.NumLayers

	t.Run("resident", func(t *testing.T) {
		const steps, maxPos = 200, 256
		eagerM, err := New(cfg, cpu, nil, hw)
		if err != nil {
			t.Fatal(err)
		}
		want, st := decode(t, eagerM, prompt, steps, maxPos)
		if st != (GraphStats{}) {
			t.Fatalf("the CPU backend ran graphs: %+v", st)
		}
		r := &replayer{Backend: cpu}
		m, err := New(cfg, r, nil, hw)
		if err != nil {
			t.Fatal(err)
		}
		got, st := decode(t, m, prompt, steps, maxPos)
		sameSteps(t, "graphs", got, want)
		// Positions 6..205, every layer resident: the blocks are one run.
		// Eager at 6, captured at 7 for positions up to 63; eager at 64,
		// captured at 65 for up to 127; eager at 128, captured at 129
		// for up to 255: one replay a step.
		if st.Captures != 3 || st.Eager != int64(3*layers) || st.Replays != steps-3 || st.RunReplays != st.Replays || st.RunBlocks != int64((steps-3)*layers) {
			t.Errorf("graph stats %+v, want 3 captures of the run of %d blocks, %d eager blocks and a replay in each of the other %d steps", st, layers, 3*layers, steps-3)
		}
		if r.live != 0 {
			t.Errorf("%d graphs left open after the session closed", r.live)
		}
		m.SetGraphs(false)
		got, st = decode(t, m, prompt, 20, maxPos)
		sameSteps(t, "graphs off", got, want[:21])
		if st.Replays != 0 || r.captures != 3 {
			t.Errorf("graphs off: %+v, %d captures in all", st, r.captures)
		}
	})

	t.Run("per-block", func(t *testing.T) {
		// Weights that do not say they are resident: a graph per block.
		const steps, maxPos = 200, 256
		eagerM, _ := New(cfg, cpu, nil, hw)
		want, _ := decode(t, eagerM, prompt, steps, maxPos)
		r := &replayer{Backend: cpu}
		m, _ := New(cfg, r, nil, notResident{hw})
		got, st := decode(t, m, prompt, steps, maxPos)
		sameSteps(t, "graphs per block", got, want)
		if st.Captures != int64(3*layers) || st.Eager != int64(3*layers) || st.Replays != int64(steps*layers)-st.Eager || st.RunReplays != 0 {
			t.Errorf("graph stats %+v, want %d captures, %d eager blocks and the rest of %d replayed, no runs", st, 3*layers, 3*layers, steps*layers)
		}
		if r.live != 0 {
			t.Errorf("%d graphs left open after the session closed", r.live)
		}
	})

	t.Run("failed-run", func(t *testing.T) {
		// The run's capture fails: its blocks run eagerly in that step and
		// take graphs of their own from the next, eager in their first.
		const steps, maxPos = 12, 32
		eagerM, _ := New(cfg, cpu, nil, hw)
		want, _ := decode(t, eagerM, prompt, steps, maxPos)
		r := &replayer{Backend: cpu, failAt: 1}
		m, _ := New(cfg, r, nil, hw)
		got, st := decode(t, m, prompt, steps, maxPos)
		sameSteps(t, "a failed run", got, want)
		if st.Captures != int64(layers) || st.Eager != int64(3*layers) || st.Replays != int64((steps-3)*layers) || st.RunReplays != 0 {
			t.Errorf("graph stats %+v, want %d captures of blocks, %d eager blocks, %d replays, no runs", st, layers, 3*layers, (steps-3)*layers)
		}
	})

	t.Run("set-position", func(t *testing.T) {
		const steps, maxPos = 20, 64
		eagerM, _ := New(cfg, cpu, nil, hw)
		want, _ := decode(t, eagerM, prompt, steps, maxPos)
		ps := &positionSetter{replayer: &replayer{Backend: cpu}}
		m, _ := New(cfg, ps, nil, hw)
		got, _ := decode(t, m, prompt, steps, maxPos)
		sameSteps(t, "positions set by the backend", got, want)
		if ps.sets != steps || ps.uploads != 0 {
			t.Errorf("%d positions set and %d uploaded in %d decode steps, want every one set", ps.sets, ps.uploads, steps)
		}
	})

	t.Run("failed-capture", func(t *testing.T) {
		const steps, maxPos = 12, 32
		eagerM, _ := New(cfg, cpu, nil, hw)
		want, _ := decode(t, eagerM, prompt, steps, maxPos)
		r := &replayer{Backend: cpu, failAt: 2}
		m, _ := New(cfg, r, nil, notResident{hw})
		got, st := decode(t, m, prompt, steps, maxPos)
		sameSteps(t, "a failed capture", got, want)
		if st.Captures != int64(layers-1) || st.Eager != int64(layers+steps-1) {
			t.Errorf("graph stats %+v, want %d captures and the failed block eager from then on", st, layers-1)
		}
	})

	t.Run("replay-error", func(t *testing.T) {
		boom := errors.New("boom")
		r := &replayer{Backend: cpu}
		m, _ := New(cfg, r, nil, hw)
		s, err := m.NewSession(32, 8)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ctx := context.Background()
		for _, id := range prompt {
			if _, err := s.Forward(ctx, []int32{id}, false, nil); err != nil {
				t.Fatal(err)
			}
		}
		r.replayErr = boom
		pos := s.Pos()
		if _, err := s.Forward(ctx, []int32{5}, false, nil); !errors.Is(err, boom) {
			t.Fatalf("a replay's error: %v", err)
		}
		if s.Pos() != pos {
			t.Errorf("a failed step moved the session from %d to %d", pos, s.Pos())
		}
		r.replayErr = nil
		if _, err := s.Forward(ctx, []int32{5}, false, nil); err != nil {
			t.Fatalf("the step again: %v", err)
		}
	})

	t.Run("hook", func(t *testing.T) {
		r := &replayer{Backend: cpu}
		m, _ := New(cfg, r, nil, hw)
		s, err := m.NewSession(32, 8)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		seen := 0
		hook := func(int, *tensor.Tensor) error { seen++; return nil }
		for _, id := range prompt {
			if _, err := s.Forward(context.Background(), []int32{id}, false, hook); err != nil {
				t.Fatal(err)
			}
		}
		if st := s.GraphStats(); st.Replays != 0 || r.captures != 0 || seen == 0 {
			t.Errorf("steps with a hook: %+v, %d captures, hook called %d times", st, r.captures, seen)
		}
	})

	t.Run("streamed", func(t *testing.T) {
		const steps, maxPos, chunk = 12, 32, 8
		eagerM, _ := New(cfg, cpu, nil, hw)
		want, _ := decode(t, eagerM, prompt, steps, maxPos)
		info, err := ModelInfo(lm, cfg)
		if err != nil {
			t.Fatal(err)
		}
		_, err = paging.Plan(info, 1, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
		var be *paging.BudgetError
		if !errors.As(err, &be) {
			t.Fatalf("a 1-byte budget planned: %v", err)
		}
		plan, err := paging.Plan(info, be.Needed, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
		if err != nil {
			t.Fatal(err)
		}
		r := &replayer{Backend: cpu}
		bud := newBudget(t, r, be.Needed, "cpu")
		defer bud.Close()
		pager, err := paging.NewPager(Source(lm), bud, plan, paging.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer pager.Close()
		m, err := New(cfg, r, bud, pager)
		if err != nil {
			t.Fatal(err)
		}
		got, st := decode(t, m, prompt, steps, maxPos)
		sameSteps(t, "streamed through the ring", got, want)
		moved := pager.Stats().BytesHostToDevice
		t.Logf("streamed at the smallest budget (%d bytes moved for %d of weights): %+v", moved, lm.WeightBytes(), st)
		if moved <= 2*lm.WeightBytes() || st.Replays == 0 || st.RunReplays != 0 {
			t.Errorf("%d bytes moved for %d of weights, %+v: want the blocks streamed every step and graphs replayed, no runs", moved, lm.WeightBytes(), st)
		}

		// Larger budgets: the first that keeps a block resident and
		// streams another (graphs per block for both: the resident
		// blocks do not make a run of two), and the first that keeps
		// every layer resident (the blocks one run, Pager.Resident).
		var mixedDone, allDone bool
		for k := int64(1); k < 40 && !allDone; k++ {
			budget := be.Needed + lm.WeightBytes()*k/10
			plan, err := paging.Plan(info, budget, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
			if err != nil {
				t.Fatal(err)
			}
			blocks := 0
			for _, l := range plan.ResidentLayers {
				if l >= 1 && l <= layers {
					blocks++
				}
			}
			all := blocks == layers
			if blocks == 0 || !all && mixedDone {
				continue
			}
			bud := newBudget(t, r, budget, "cpu")
			pager, err := paging.NewPager(Source(lm), bud, plan, paging.Options{})
			if err != nil {
				t.Fatal(err)
			}
			m, err := New(cfg, r, bud, pager)
			if err != nil {
				t.Fatal(err)
			}
			got, st := decode(t, m, prompt, steps, maxPos)
			sameSteps(t, fmt.Sprintf("budget %d", budget), got, want)
			t.Logf("budget %d (resident layers %v): %+v", budget, plan.ResidentLayers, st)
			if all && (st.RunReplays != steps-1 || st.Replays != st.RunReplays) || !all && st.Replays == 0 {
				t.Errorf("budget %d, resident layers %v: %+v; want one run replayed each step but the first when all are resident", budget, plan.ResidentLayers, st)
			}
			mixedDone, allDone = mixedDone || !all, all
			pager.Close()
			bud.Close()
		}
		if !mixedDone || !allDone {
			t.Errorf("no budget kept some blocks resident (%v) or all (%v)", mixedDone, allDone)
		}
	})
}

// TestDecodeGraphsEveryBudget decodes the F16 fixture as graphs on the
// replaying backend at every budget from the smallest to all resident, in
// steps of a tenth of the weights, and checks each against the eager run
// bit for bit. Between whole layers the plans keep parts of layers
// resident and stream the rest through a ring slot, where a streamed part
// may land at another offset from step to step: a graph must not replay
// over the addresses it was captured with then (the fingerprint is of
// host addresses on a host backend; it was of Ptr, always 0 there, and
// the replays read stale parts from the first replayed step).
func TestDecodeGraphsEveryBudget(t *testing.T) {
	lm, err := loader.Open(fixtures.Dir(fixtures.TinyLlamaF16Sharded))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	cfg := lm.Config
	prompt := []int32{1, 42, 71, 345, 81, 14}
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	const steps, maxPos, chunk = 12, 32, 8
	info, err := ModelInfo(lm, cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = paging.Plan(info, 1, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("a 1-byte budget planned: %v", err)
	}
	for k := int64(0); ; k++ {
		budget := be.Needed + lm.WeightBytes()*k/10
		plan, err := paging.Plan(info, budget, paging.StrategyMinimal, maxPos, 1, paging.WithChunkTokens(chunk))
		if err != nil {
			t.Fatal(err)
		}
		run := func(b tensor.Backend) ([][]float32, GraphStats) {
			bud := newBudget(t, b, budget, "cpu")
			defer bud.Close()
			pager, err := paging.NewPager(Source(lm), bud, plan, paging.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer pager.Close()
			m, err := New(cfg, b, bud, pager)
			if err != nil {
				t.Fatal(err)
			}
			return decode(t, m, prompt, steps, maxPos)
		}
		want, _ := run(cpu)
		got, st := run(&replayer{Backend: cpu})
		sameSteps(t, fmt.Sprintf("budget %d (%s)", budget, plan), got, want)
		t.Logf("budget %d, resident layers %v, %d streamed bytes: %+v", budget, plan.ResidentLayers, plan.StreamedBytes, st)
		if plan.StreamedBytes == 0 {
			break
		}
	}
}
