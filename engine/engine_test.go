package engine

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/strata-llm/strata/internal/fixturetest"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

func openFixture(t *testing.T, name string) *loader.Model {
	t.Helper()
	lm, err := loader.Open(fixtures.Dir(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lm.Close() })
	return lm
}

func cpus(n int) []tensor.Backend {
	var bs []tensor.Backend
	for range n {
		bs = append(bs, tensor.NewCPU(1))
	}
	return bs
}

// reference runs the prompt and a few greedy steps on the CPU with every
// weight loaded, without the engine.
func reference(t *testing.T, lm *loader.Model, prompt []int32, steps int) [][]float32 {
	t.Helper()
	b := tensor.NewCPU(1)
	defer b.Close()
	hw, err := nn.LoadWeights(context.Background(), lm, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer hw.Close()
	m, err := nn.New(lm.Config, b, nil, hw)
	if err != nil {
		t.Fatal(err)
	}
	s, err := m.NewSession(len(prompt)+steps, 8)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	return decode(t, s, prompt, steps)
}

type forwarder interface {
	Forward(ctx context.Context, ids []int32, all bool, hook nn.Hook) ([]float32, error)
}

func decode(t *testing.T, s forwarder, prompt []int32, steps int) [][]float32 {
	t.Helper()
	var out [][]float32
	logits, err := s.Forward(context.Background(), prompt, false, nil)
	for i := 0; ; i++ {
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, append([]float32(nil), logits...))
		if i == steps {
			return out
		}
		logits, err = s.Forward(context.Background(), []int32{int32(nn.Argmax(logits))}, false, nil)
	}
}

// TestOpenMatchesDirect: on one and two CPU devices, with and without
// budgets small enough to stream, for every strategy, the engine's logits
// are bit-identical to the model run directly, and Close leaves nothing
// allocated.
func TestOpenMatchesDirect(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	prompt := []int32{1, 5, 9, 200, 3, 77}
	const steps = 5
	want := reference(t, lm, prompt, steps)
	for _, tc := range []struct {
		name    string
		devices int
		budget  int64
		st      paging.Strategy
	}{
		{"one device, no budget", 1, 0, ""},
		{"one device, minimal", 1, 400 << 10, paging.StrategyMinimal},
		{"one device, balanced", 1, 400 << 10, paging.StrategyBalanced},
		{"one device, aggressive", 1, 400 << 10, paging.StrategyAggressive},
		{"two devices, no budget", 2, 0, ""},
		{"two devices, balanced", 2, 300 << 10, paging.StrategyBalanced},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := Options{Backends: cpus(tc.devices), Context: len(prompt) + steps, Chunk: 4,
				Memory: Memory{Strategy: tc.st}}
			if tc.budget > 0 {
				o.Memory.Budgets = []int64{tc.budget}
			}
			e, err := Open(context.Background(), lm, o)
			if err != nil {
				t.Fatal(err)
			}
			s, err := e.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			got := decode(t, s, prompt, steps)
			for i := range want {
				for j := range want[i] {
					if got[i][j] != want[i][j] {
						t.Fatalf("step %d logit %d: %v, direct %v", i, j, got[i][j], want[i][j])
					}
				}
			}
			devs := e.Devices()
			if len(devs) != tc.devices {
				t.Fatalf("%d devices described, want %d", len(devs), tc.devices)
			}
			for _, d := range devs {
				if tc.budget > 0 && (d.BudgetBytes != tc.budget || d.DefaultBudget || d.PeakDeviceBytes > tc.budget) {
					t.Errorf("%s: budget %d (default %v), peak %d; given %d", d.Name, d.BudgetBytes, d.DefaultBudget, d.PeakDeviceBytes, tc.budget)
				}
				if tc.budget == 0 && !d.DefaultBudget {
					t.Errorf("%s: no budget given, yet not the default", d.Name)
				}
			}
			if tc.budget > 0 && tc.devices == 1 && e.Stats().BytesHostToDevice == 0 {
				t.Error("nothing was streamed under the budget")
			}
			wantStrategy := tc.st
			if wantStrategy == "" {
				wantStrategy = paging.StrategyNone
			}
			if e.Strategy() != wantStrategy {
				t.Errorf("strategy %s, want %s", e.Strategy(), wantStrategy)
			}
			// The session is left open: Close closes it, then everything
			// else, and finds nothing leaked.
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			if err := e.Close(); err != nil {
				t.Fatalf("second Close: %v", err)
			}
			if _, err := e.NewSession(); err == nil {
				t.Error("NewSession after Close succeeded")
			}
		})
	}
}

// TestOpenRefusesContext: a context past the model's (here a sliding
// window of 8) is refused with nn.ErrContextTooLong before anything is
// built, on one and two devices.
func TestOpenRefusesContext(t *testing.T) {
	lm, err := loader.Open(fixturetest.Mistral(t, 8))
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Close()
	for _, devices := range []int{1, 2} {
		e, err := Open(context.Background(), lm, Options{Backends: cpus(devices), Context: 20})
		if !errors.Is(err, nn.ErrContextTooLong) || e != nil {
			t.Errorf("%d devices: engine %v, error %v; want nn.ErrContextTooLong", devices, e, err)
		}
	}
	// The model's own context is taken when none is given.
	e, err := Open(context.Background(), lm, Options{Backends: cpus(1)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if e.Context() != 8 {
		t.Errorf("context %d, want the window's 8", e.Context())
	}
}

// TestOpenErrors: bad options fail with one line, and what was built is
// taken down (a budget too small for any plan fails after the devices are
// open).
func TestOpenErrors(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaBF16)
	for _, tc := range []struct {
		name string
		o    Options
		want string
	}{
		{"no such driver", Options{Devices: []string{"tpu"}}, "tpu"},
		{"budgets and fractions", Options{Backends: cpus(1), Memory: Memory{Budgets: []int64{1 << 20}, Fractions: []float64{0.5}}}, "not both"},
		{"three budgets for two devices", Options{Backends: cpus(2), Memory: Memory{Budgets: []int64{1, 2, 3}}}, "3 budgets for 2 devices"},
		{"budget too small", Options{Backends: cpus(1), Memory: Memory{Budgets: []int64{1000}}}, "budget too small"},
		{"unified on the CPU", Options{Backends: cpus(1), Memory: Memory{Mode: paging.ModeUnified}}, "unified memory"},
		{"negative context", Options{Backends: cpus(1), Context: -1}, "context"},
	} {
		e, err := Open(context.Background(), lm, tc.o)
		if err == nil || e != nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: engine %v, error %v; want one line naming %q", tc.name, e, err, tc.want)
		}
	}
	var none *Engine
	if err := none.Close(); err != nil {
		t.Error(err)
	}
}

// memoryFake is a CPU backend that reports a device's memory.
type memoryFake struct {
	*tensor.CPU
	free, total int64
}

func (m memoryFake) MemInfo() (free, total int64, err error) { return m.free, m.total, nil }

// TestDefaultBudget is the documented policy: free memory less 1/32 of it,
// at least 256 MiB; no limit on a device that cannot report its memory.
func TestDefaultBudget(t *testing.T) {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	for _, tc := range []struct {
		free, want int64
	}{
		{64 << 30, 64<<30 - 2<<30},
		{4 << 30, 4<<30 - 256<<20},
		{100 << 20, 0},
	} {
		if got := DefaultBudget(memoryFake{cpu, tc.free, 80 << 30}); got != tc.want {
			t.Errorf("free %d: budget %d, want %d", tc.free, got, tc.want)
		}
	}
	if got := DefaultBudget(cpu); got != math.MaxInt64/4 {
		t.Errorf("CPU: budget %d, want no limit", got)
	}
}

// TestDevicesUsed: Devices reports what each budget holds now: the
// weights, then a session's cache and buffers too, then the weights again
// once the session is closed.
func TestDevicesUsed(t *testing.T) {
	lm := openFixture(t, fixtures.TinyLlamaF16Sharded)
	e, err := Open(context.Background(), lm, Options{Backends: cpus(2), Context: 32, Chunk: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	used := func() (n []int64) {
		for _, d := range e.Devices() {
			n = append(n, d.UsedBytes)
		}
		return n
	}
	before := used()
	s, err := e.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Forward(context.Background(), []int32{1, 2, 3}, false, nil); err != nil {
		t.Fatal(err)
	}
	during := used()
	s.Close()
	after := used()
	for d := range before {
		if before[d] <= 0 || during[d] <= before[d] || after[d] != before[d] {
			t.Errorf("device %d: %d bytes used before the session, %d with it, %d after", d, before[d], during[d], after[d])
		}
	}
}
