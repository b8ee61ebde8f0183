package nn

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/loader"
	"github.com/strata-llm/strata/loader/fixtures"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Fault injection on the whole path a service runs: loader shards on disk,
// the pager under a budget, the forward pass and the user's streaming hook.
// Faults strike the backend's allocations (out of memory) and operations
// (a panic), the source's reads (an error, a cancelled context), the files
// themselves (truncated or replaced after Open), and the hook (an error, a
// panic, a cancellation) at every point a clean request passes through.
// After each, no layer may stay pinned, no session buffer may stay charged,
// the backend must hold exactly what the budget accounts for, and the next
// request on the same model, pager and budget must give the clean logits
// bit for bit. At the end everything is freed.

var errFault = errors.New("injected fault")

// counter fires at the at-th call counted through it: it fails the call, or
// cancels the request's context when cancel is set, or panics when panics
// is set.
type counter struct {
	mu     sync.Mutex
	calls  int
	at     int
	cancel context.CancelFunc
	panics bool
	fired  int
}

func (c *counter) arm(at int, cancel context.CancelFunc, panics bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls, c.at, c.cancel, c.panics, c.fired = 0, at, cancel, panics, 0
}

// hit counts a call and reports whether it must fail; it panics itself
// when armed to.
func (c *counter) hit(what string) bool {
	c.mu.Lock()
	c.calls++
	fire := c.at > 0 && c.calls == c.at
	if fire {
		c.fired++
	}
	cancel, panics := c.cancel, c.panics
	c.mu.Unlock()
	switch {
	case !fire:
		return false
	case panics:
		panic(fmt.Sprintf("injected panic in %s", what))
	case cancel != nil:
		cancel()
		return false
	}
	return true
}

func (c *counter) state() (calls, fired int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls, c.fired
}

// faultCPU is the CPU backend with a fault counter on Alloc and one on
// MatMul, a pinned host allocator (so the pager's pinned host cache is
// exercised) and accounts of what is live.
type faultCPU struct {
	*tensor.CPU
	alloc, op counter

	mu          sync.Mutex
	live        map[*tensor.Tensor]int64
	liveBytes   int64
	pinned      map[*byte]int64
	pinnedBytes int64
}

func newFaultCPU() *faultCPU {
	return &faultCPU{CPU: tensor.NewCPU(1), live: map[*tensor.Tensor]int64{}, pinned: map[*byte]int64{}}
}

func (b *faultCPU) Alloc(dt tensor.DType, shape tensor.Shape) (*tensor.Tensor, error) {
	if b.alloc.hit("Alloc") {
		return nil, fmt.Errorf("fault backend: %w (%w)", tensor.ErrOutOfMemory, errFault)
	}
	t, err := b.CPU.Alloc(dt, shape)
	if err == nil {
		b.mu.Lock()
		b.live[t] = t.NumBytes()
		b.liveBytes += t.NumBytes()
		b.mu.Unlock()
	}
	return t, err
}

func (b *faultCPU) Free(t *tensor.Tensor) {
	if t == nil {
		return
	}
	b.mu.Lock()
	n, ok := b.live[t]
	delete(b.live, t)
	b.liveBytes -= n
	b.mu.Unlock()
	if !ok {
		panic("fault backend: free of a tensor that is not live")
	}
	b.CPU.Free(t)
}

func (b *faultCPU) MatMul(out, x, w, bias *tensor.Tensor) error {
	if b.op.hit("MatMul") {
		return fmt.Errorf("fault backend: matmul: %w", errFault)
	}
	return b.CPU.MatMul(out, x, w, bias)
}

func (b *faultCPU) AllocPinned(n int64) ([]byte, error) {
	p := make([]byte, n)
	if n > 0 {
		b.mu.Lock()
		b.pinned[&p[0]] = n
		b.pinnedBytes += n
		b.mu.Unlock()
	}
	return p, nil
}

func (b *faultCPU) FreePinned(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	n, ok := b.pinned[&p[0]]
	if !ok {
		return errors.New("fault backend: FreePinned of memory it did not allocate")
	}
	delete(b.pinned, &p[0])
	b.pinnedBytes -= n
	return nil
}

func (b *faultCPU) outstanding() (tensors int, bytes, pinned int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.live), b.liveBytes, b.pinnedBytes
}

// faultReads counts the source's reads.
type faultReads struct {
	paging.Source
	c counter
}

func (s *faultReads) ReadTensor(ctx context.Context, layer int, name string, dst []byte) error {
	if s.c.hit("ReadTensor") {
		return fmt.Errorf("fault source: layer %d %s: %w", layer, name, errFault)
	}
	return s.Source.ReadTensor(ctx, layer, name, dst)
}

// rig is one model served the way a service would: a loader model, a
// source with faults, a pager under a budget, and nn on a backend with
// faults.
type rig struct {
	t      testing.TB
	dir    string
	lm     *loader.Model
	cfg    *arch.Config
	b      *faultCPU
	src    *faultReads
	budget *paging.Budget
	pager  *paging.Pager
	m      *Model
	limit  int64
}

const (
	rigMaxPos = 32
	rigChunk  = 4
)

// rigPrompt and rigSteps make a request: a prefill in three chunks and
// greedy decode steps.
var rigPrompt = []int32{1, 42, 71, 345, 81, 14, 289, 265, 78, 70, 3}

const rigSteps = 4

// newRig extracts the sharded F16 fixture into a temporary directory (so
// its files can be damaged) and serves it under the smallest budget the
// planner accepts for strategy, plus extra bytes.
func newRig(t testing.TB, strategy paging.Strategy, extra int64, opts paging.Options) *rig {
	t.Helper()
	dir, err := fixtures.Extract(fixtures.TinyLlamaF16Sharded, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, dir: dir, b: newFaultCPU()}
	if r.lm, err = loader.Open(dir); err != nil {
		t.Fatal(err)
	}
	r.cfg = r.lm.Config
	info, err := ModelInfo(r.lm, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = paging.Plan(info, 1, strategy, rigMaxPos, 1, paging.WithChunkTokens(rigChunk))
	var be *paging.BudgetError
	if !errors.As(err, &be) {
		t.Fatalf("a 1-byte budget planned: %v", err)
	}
	r.limit = be.Needed + extra
	plan, err := paging.Plan(info, r.limit, strategy, rigMaxPos, 1, paging.WithChunkTokens(rigChunk))
	if err != nil {
		t.Fatal(err)
	}
	r.src = &faultReads{Source: Source(r.lm)}
	r.budget = newBudget(t, r.b, r.limit, "cpu")
	if r.pager, err = paging.NewPager(r.src, r.budget, plan, opts); err != nil {
		t.Fatal(err)
	}
	if r.m, err = New(r.cfg, r.b, r.budget, r.pager); err != nil {
		t.Fatal(err)
	}
	return r
}

// request runs the prompt and greedy steps in a new session and returns
// every logit it saw. A panic (from the hook or the backend) is returned
// as an error, as a service's recover would see it.
func (r *rig) request(ctx context.Context, hook Hook) (out []float32, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("recovered panic: %v", p)
		}
	}()
	s, err := r.m.NewSession(rigMaxPos, rigChunk)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return r.generate(ctx, s, hook)
}

func (r *rig) generate(ctx context.Context, s *Session, hook Hook) ([]float32, error) {
	logits, err := s.Forward(ctx, rigPrompt, false, hook)
	if err != nil {
		return nil, err
	}
	out := append([]float32(nil), logits...)
	for range rigSteps {
		id := int32(Argmax(logits))
		if logits, err = s.Forward(ctx, []int32{id}, false, hook); err != nil {
			return nil, err
		}
		out = append(out, logits...)
	}
	return out, nil
}

// clean checks the state between requests: nothing pinned, no session
// buffers charged, the backend holding exactly the budget's tensors, the
// pinned host bytes those of the pager's host cache.
//
// Prefetches may still be loading when a request returns: the check is
// retried for a while, and only a state that lasts is reported.
func (r *rig) clean() error {
	var err error
	for range 100 {
		if err = r.cleanNow(); err == nil {
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return err
}

func (r *rig) cleanNow() error {
	st := r.pager.Stats()
	var problems []string
	if st.PinnedLayers != 0 {
		problems = append(problems, fmt.Sprintf("%d layers pinned", st.PinnedLayers))
	}
	var allocated int64
	for _, c := range r.budget.Categories() {
		allocated += c.Allocated
		switch c.Category {
		case paging.KVCache.String(), paging.Activations.String(), paging.Workspace.String():
			if c.Allocated != 0 || c.Reserved != 0 {
				problems = append(problems, fmt.Sprintf("%s: %d bytes allocated, %d charged with no session open", c.Category, c.Allocated, c.Reserved))
			}
		}
	}
	_, live, pinned := r.b.outstanding()
	if live != allocated {
		problems = append(problems, fmt.Sprintf("backend holds %d bytes, budget accounts for %d", live, allocated))
	}
	if pinned != st.PinnedHostBytes {
		problems = append(problems, fmt.Sprintf("backend holds %d pinned bytes, pager accounts for %d", pinned, st.PinnedHostBytes))
	}
	if st.HostCacheBytes > st.HostCacheLimit {
		problems = append(problems, fmt.Sprintf("host cache %d over its limit %d", st.HostCacheBytes, st.HostCacheLimit))
	}
	if r.budget.Peak() > r.limit {
		problems = append(problems, fmt.Sprintf("budget peak %d over the limit %d", r.budget.Peak(), r.limit))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// close frees everything and checks that nothing leaked.
func (r *rig) close() {
	t := r.t
	if err := r.pager.Close(); err != nil {
		t.Errorf("pager Close: %v", err)
	}
	if err := r.pager.Close(); err != nil {
		t.Errorf("second pager Close: %v", err)
	}
	if err := r.budget.Close(); err != nil {
		t.Errorf("budget Close: %v", err) // wraps paging.ErrLeak when a session leaked
	}
	if n, live, pinned := r.b.outstanding(); n != 0 || live != 0 || pinned != 0 {
		t.Errorf("after Close the backend holds %d tensors (%d bytes) and %d pinned bytes", n, live, pinned)
	}
	if err := r.lm.Close(); err != nil {
		t.Errorf("model Close: %v", err)
	}
	if err := r.lm.Close(); err != nil {
		t.Errorf("second model Close: %v", err)
	}
	r.b.Close()
}

// faultCase is a kind of fault and how to arm it at the at-th call.
type faultCase struct {
	name string
	// arm sets the fault for the next request and returns its hook (nil
	// for none) and the counter that fires.
	arm func(r *rig, at int, cancel context.CancelFunc) (Hook, *counter)
	// want says which errors the fault may cause.
	want func(err error) bool
}

func isFault(err error) bool { return errors.Is(err, errFault) }
func isCancel(err error) bool {
	return errors.Is(err, context.Canceled)
}
func isPanic(err error) bool {
	return strings.HasPrefix(err.Error(), "recovered panic: injected panic")
}

// hookCounter returns a hook that counts its calls on c.
func hookCounter(c *counter) Hook {
	return func(layer int, h *tensor.Tensor) error {
		if c.hit(fmt.Sprintf("hook at layer %d", layer)) {
			return fmt.Errorf("streaming callback at layer %d: %w", layer, errFault)
		}
		return nil
	}
}

var faultCases = []faultCase{
	{"alloc-oom", func(r *rig, at int, _ context.CancelFunc) (Hook, *counter) {
		r.b.alloc.arm(at, nil, false)
		return nil, &r.b.alloc
	}, func(err error) bool { return isFault(err) && errors.Is(err, tensor.ErrOutOfMemory) }},
	{"alloc-cancel", func(r *rig, at int, cancel context.CancelFunc) (Hook, *counter) {
		r.b.alloc.arm(at, cancel, false)
		return nil, &r.b.alloc
	}, isCancel},
	{"read-error", func(r *rig, at int, _ context.CancelFunc) (Hook, *counter) {
		r.src.c.arm(at, nil, false)
		return nil, &r.src.c
	}, isFault},
	{"read-cancel", func(r *rig, at int, cancel context.CancelFunc) (Hook, *counter) {
		r.src.c.arm(at, cancel, false)
		return nil, &r.src.c
	}, isCancel},
	{"op-error", func(r *rig, at int, _ context.CancelFunc) (Hook, *counter) {
		r.b.op.arm(at, nil, false)
		return nil, &r.b.op
	}, isFault},
	{"op-panic", func(r *rig, at int, _ context.CancelFunc) (Hook, *counter) {
		r.b.op.arm(at, nil, true)
		return nil, &r.b.op
	}, isPanic},
	{"hook-error", func(r *rig, at int, _ context.CancelFunc) (Hook, *counter) {
		c := &counter{}
		c.arm(at, nil, false)
		return hookCounter(c), c
	}, isFault},
	{"hook-panic", func(r *rig, at int, _ context.CancelFunc) (Hook, *counter) {
		c := &counter{}
		c.arm(at, nil, true)
		return hookCounter(c), c
	}, isPanic},
	{"hook-cancel", func(r *rig, at int, cancel context.CancelFunc) (Hook, *counter) {
		c := &counter{}
		c.arm(at, cancel, false)
		return hookCounter(c), c
	}, isCancel},
}

// disarm turns every fault of the rig off.
func (r *rig) disarm() {
	r.b.alloc.arm(0, nil, false)
	r.b.op.arm(0, nil, false)
	r.src.c.arm(0, nil, false)
}

// TestForwardFaults strikes once per request at every call a clean request
// makes through each seam, for three strategies, and checks the state after
// each fault and that the next request gives the clean logits.
func TestForwardFaults(t *testing.T) {
	var injected, failed, survived int
	for _, strategy := range []paging.Strategy{paging.StrategyMinimal, paging.StrategyBalanced, paging.StrategyAggressive} {
		t.Run(string(strategy), func(t *testing.T) {
			r := newRig(t, strategy, 0, paging.Options{})
			defer r.close()
			ctx := context.Background()
			want, err := r.request(ctx, nil)
			if err != nil {
				t.Fatalf("clean request: %v", err)
			}
			for _, fc := range faultCases {
				// Count the calls a clean request makes through the seam.
				hook, c := fc.arm(r, 1<<30, nil)
				if _, err := r.request(ctx, hook); err != nil {
					t.Fatalf("%s: counting request: %v", fc.name, err)
				}
				calls, _ := c.state()
				r.disarm()
				stride := 1
				if limit := faultLimit(); calls > limit {
					stride = calls / limit
				}
				for at := 1; at <= calls; at += stride {
					rctx, cancel := context.WithCancel(ctx)
					hook, c := fc.arm(r, at, cancel)
					_, err := r.request(rctx, hook)
					cancel()
					_, fired := c.state()
					r.disarm()
					if fired == 0 {
						// Allocations and reads of prefetches vary from run
						// to run: this request made fewer calls.
						if err != nil {
							t.Fatalf("%s at call %d of %d: no fault fired, yet the request failed: %v", fc.name, at, calls, err)
						}
						continue
					}
					injected++
					if err != nil {
						failed++
						if !fc.want(err) {
							t.Errorf("%s at call %d: unexpected error %v", fc.name, at, err)
						}
					}
					if cerr := r.clean(); cerr != nil {
						t.Fatalf("%s at call %d (request error: %v): %v", fc.name, at, err, cerr)
					}
					got, err := r.request(ctx, nil)
					if err != nil {
						t.Fatalf("%s at call %d: the next request failed: %v", fc.name, at, err)
					}
					if !bytes.Equal(f32Bytes(got), f32Bytes(want)) {
						t.Fatalf("%s at call %d: the next request's logits differ from the clean run's", fc.name, at)
					}
					if err := r.clean(); err != nil {
						t.Fatalf("%s at call %d, after the next request: %v", fc.name, at, err)
					}
					survived++
				}
			}
		})
	}
	t.Logf("faults injected %d, requests they failed %d, survived %d (state clean, next request bit-identical)", injected, failed, survived)
}

// raceEnabled is set under the race detector (race_fault_test.go).
var raceEnabled bool

// faultLimit bounds the fault points per seam: an even spread of them over
// the calls a clean request makes (fewer under -short or the race
// detector).
func faultLimit() int {
	switch {
	case raceEnabled:
		return 3
	case testing.Short():
		return 6
	}
	return 20
}

func f32Bytes(v []float32) []byte {
	t, _ := tensor.FromF32(tensor.Shape{len(v)}, v)
	return t.Bytes()
}

// TestForwardRetrySameSession: after a request fails part way (a read
// error in the third prefill chunk, a cancellation in a decode step), the
// same session retried gives the clean logits: a failed Forward adds no
// positions.
func TestForwardRetrySameSession(t *testing.T) {
	r := newRig(t, paging.StrategyMinimal, 0, paging.Options{})
	defer r.close()
	ctx := context.Background()
	want, err := r.request(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := r.m.NewSession(rigMaxPos, rigChunk)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Fail the prompt's last chunk: by then two chunks have run.
	c := &counter{}
	c.arm(2*(r.cfg.NumLayers+2)+3, nil, false)
	if _, err := s.Forward(ctx, rigPrompt, false, hookCounter(c)); !isFault(err) {
		t.Fatalf("faulted prefill: %v", err)
	}
	if s.Pos() != 0 {
		t.Errorf("a failed prefill left the session at position %d, want 0", s.Pos())
	}
	got, err := r.generate(ctx, s, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(f32Bytes(got), f32Bytes(want)) {
		t.Errorf("retried session's logits differ from a clean run's")
	}
	// A decode step cancelled between blocks, then one failed by the
	// streaming callback at the head layer, after every block ran.
	s.Reset()
	logits, err := s.Forward(ctx, rigPrompt, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	id := int32(Argmax(logits))
	pos := s.Pos()
	cctx, cancel := context.WithCancel(ctx)
	c.arm(r.cfg.NumLayers, cancel, false) // the hook after the next-to-last block
	if _, err := s.Forward(cctx, []int32{id}, false, hookCounter(c)); !isCancel(err) {
		t.Fatalf("cancelled decode step: %v", err)
	}
	if s.Pos() != pos {
		t.Errorf("a cancelled decode step moved the session from %d to %d", pos, s.Pos())
	}
	c.arm(r.cfg.NumLayers+2, nil, false) // the hook at the head
	if _, err := s.Forward(ctx, []int32{id}, false, hookCounter(c)); !isFault(err) {
		t.Fatalf("decode step failed at the head: %v", err)
	}
	if s.Pos() != pos {
		t.Errorf("a decode step failed at the head moved the session from %d to %d", pos, s.Pos())
	}
	logits, err = s.Forward(ctx, []int32{id}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	v := r.cfg.VocabSize
	if !bytes.Equal(f32Bytes(logits), f32Bytes(want[v:2*v])) {
		t.Errorf("retried decode step's logits differ from a clean run's")
	}
}

// TestShardDamagedAfterOpen truncates a shard holding a streamed layer after
// the model is open, then restores it; and replaces shards (rename over the
// path) with garbage and with a truncated copy while requests run.
func TestShardDamagedAfterOpen(t *testing.T) {
	// No host cache: every streamed layer is read from its shard each time.
	r := newRig(t, paging.StrategyAggressive, 0, paging.Options{HostCacheBytes: -1})
	defer r.close()
	ctx := context.Background()
	want, err := r.request(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	ti, ok := r.lm.Tensor("model.layers.2.mlp.up_proj.weight")
	if !ok {
		t.Fatal("fixture lacks block 2's up_proj")
	}
	shard := filepath.Join(r.dir, ti.File)
	orig, err := os.ReadFile(shard)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shard, 0o644); err != nil {
		t.Fatal(err)
	}

	// Truncated in place after open: a clear error naming the file and the
	// tensor, wrapping io.ErrUnexpectedEOF.
	if err := os.Truncate(shard, ti.Offset+ti.Size/2); err != nil {
		t.Fatal(err)
	}
	_, err = r.request(ctx, nil)
	if err == nil {
		t.Fatal("request over a truncated shard succeeded")
	}
	if !errors.Is(err, io.ErrUnexpectedEOF) || !strings.Contains(err.Error(), ti.File) || !strings.Contains(err.Error(), ti.Name) {
		t.Errorf("truncated shard: error %q does not wrap io.ErrUnexpectedEOF naming %s and %s", err, ti.File, ti.Name)
	}
	if err := r.clean(); err != nil {
		t.Fatalf("after the truncated read: %v", err)
	}
	// Restored in place: the next request works.
	if err := os.WriteFile(shard, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := r.request(ctx, nil)
	if err != nil {
		t.Fatalf("after restoring the shard: %v", err)
	}
	if !bytes.Equal(f32Bytes(got), f32Bytes(want)) {
		t.Error("logits after restoring the shard differ")
	}

	// Replaced by rename, as a download tool would: the open model keeps
	// reading the file it opened, so results do not change.
	for _, replacement := range [][]byte{bytes.Repeat([]byte{0x7f}, len(orig)), orig[:len(orig)/3]} {
		tmp := shard + ".new"
		if err := os.WriteFile(tmp, replacement, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, shard); err != nil {
			t.Fatal(err)
		}
		got, err := r.request(ctx, nil)
		if err != nil {
			t.Fatalf("after replacing the shard: %v", err)
		}
		if !bytes.Equal(f32Bytes(got), f32Bytes(want)) {
			t.Error("logits changed when the shard was replaced under the open model")
		}
		if err := r.clean(); err != nil {
			t.Fatal(err)
		}
	}
}
