package paging

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

func TestBudgetRefusesOverLimit(t *testing.T) {
	fb := newFake()
	bg := newBudget(t, fb, 1000, "fake:0")
	a, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{200}) // 800 bytes
	if err != nil {
		t.Fatal(err)
	}
	_, err = bg.Alloc(Activations, tensor.F32, tensor.Shape{51}) // 204 bytes: 4 too many
	if !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Fatalf("over budget: %v, want ErrOutOfMemory", err)
	}
	b, err := bg.Alloc(Activations, tensor.F16, tensor.Shape{100}) // exactly fills it
	if err != nil {
		t.Fatal(err)
	}
	if bg.Used() != 1000 || bg.Peak() != 1000 || bg.UsedBy(KVCache) != 800 || bg.UsedBy(Activations) != 200 {
		t.Errorf("used %d peak %d kv %d act %d", bg.Used(), bg.Peak(), bg.UsedBy(KVCache), bg.UsedBy(Activations))
	}
	bg.Free(a)
	bg.Free(a) // twice: ignored
	if bg.Used() != 200 || bg.Peak() != 1000 {
		t.Errorf("after free: used %d peak %d", bg.Used(), bg.Peak())
	}
	if _, err := bg.Alloc(Workspace, tensor.Invalid, tensor.Shape{1}); err == nil {
		t.Error("invalid dtype allocated")
	}
	// b is leaked on purpose: Close reports and frees it
	_ = b
	err = bg.Close()
	if !errors.Is(err, ErrLeak) || !strings.Contains(err.Error(), "activations") {
		t.Errorf("Close with a live tensor: %v", err)
	}
	if nt, live, _ := fb.outstanding(); nt != 0 || live != 0 {
		t.Errorf("after Close: %d tensors, %d bytes", nt, live)
	}
	if err := bg.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := bg.Alloc(KVCache, tensor.F32, tensor.Shape{1}); err == nil {
		t.Error("allocation after Close succeeded")
	}
}

func TestBudgetConcurrentNeverExceeds(t *testing.T) {
	fb := newFake()
	const limit = 10000
	bg := newBudget(t, fb, limit, "")
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var held []*tensor.Tensor
			for i := range 300 {
				// every category a tensor can be charged to: all but Cached
				if tt, err := bg.Alloc(Category(i%int(Cached)), tensor.F32, tensor.Shape{1 + (i*7+w)%300}); err == nil {
					held = append(held, tt)
				} else if !errors.Is(err, tensor.ErrOutOfMemory) {
					t.Error(err)
					return
				}
				if len(held) > 3 {
					bg.Free(held[0])
					held = held[1:]
				}
			}
			for _, tt := range held {
				bg.Free(tt)
			}
		}()
	}
	wg.Wait()
	if bg.Peak() > limit || fb.peakBytes > limit || bg.Used() != 0 {
		t.Errorf("peak %d (backend %d), used %d, limit %d", bg.Peak(), fb.peakBytes, bg.Used(), limit)
	}
	var allocs, frees int64
	for _, c := range bg.Categories() {
		allocs += c.Allocs
		frees += c.Frees
		if c.Allocated != 0 || c.Reserved != 0 || c.PeakReserved > limit {
			t.Errorf("%+v", c)
		}
	}
	if allocs != frees || allocs == 0 {
		t.Errorf("allocs %d, frees %d", allocs, frees)
	}
	if err := bg.Close(); err != nil {
		t.Error(err)
	}
}

func TestSnapshotRoundTrip(t *testing.T) {
	src := llamaSynth(4, 32, 64, 16, 64)
	info := smallDims(src, 4)
	W, _ := totalAndMax(info)
	p0, _ := Plan(info, 1<<40, StrategyBalanced, 4, 1)
	budget := p0.KVCacheBytes + p0.ActivationBytes + p0.WorkspaceBytes + W*6/10
	plan, err := Plan(info, budget, StrategyBalanced, 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	bg := newBudget(t, newFake(), budget, "fake:0")
	bg.RecordHistory(100000)
	free := nnReserve(t, bg, plan)
	pg, err := NewPager(src, bg, plan, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		sweep(t, pg, src, forward(src.NumLayers()))
		pg.MarkStep()
	}
	sweep(t, pg, src, []int{1, 1}) // the second is a hit
	waitIdle(pg)
	var buf bytes.Buffer
	if err := bg.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	snap, err := ReadSnapshot(&buf)
	if err != nil {
		t.Fatal(err)
	}
	want := bg.Snapshot()
	if snap.Device != "fake:0" || snap.Limit != budget || snap.Peak != want.Peak || len(snap.Events) != len(want.Events) || len(snap.Pagers) != 1 {
		t.Fatalf("round trip: device %q limit %d peak %d events %d/%d pagers %d", snap.Device, snap.Limit, snap.Peak, len(snap.Events), len(want.Events), len(snap.Pagers))
	}
	kinds := map[string]int{}
	var charged, peak int64
	for i, ev := range snap.Events {
		if ev != want.Events[i] {
			t.Fatalf("event %d: %+v, want %+v", i, ev, want.Events[i])
		}
		kinds[ev.Kind]++
		charged += ev.Charged
		peak = max(peak, charged)
	}
	// Streamed parts pass through views of the ring: nothing is freed
	// before Close.
	for _, k := range []string{EventAlloc, EventLoadStart, EventLoadEnd, EventEvict, EventHit, EventMiss} {
		if kinds[k] == 0 {
			t.Errorf("no %s event in %v", k, kinds)
		}
	}
	if peak != snap.Peak || charged != snap.Used {
		t.Errorf("replayed peak %d, used %d; snapshot says %d, %d", peak, charged, snap.Peak, snap.Used)
	}
	free()
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
	if err := bg.Close(); err != nil {
		t.Fatal(err)
	}
	// the full history comes back to zero: no leak
	var total int64
	for _, ev := range bg.Snapshot().Events {
		total += ev.Charged
	}
	if total != 0 {
		t.Errorf("after Close the history leaves %d bytes charged", total)
	}
	if _, err := ReadSnapshot(strings.NewReader(`{"x": 1}`)); err == nil {
		t.Error("a JSON file that is not a snapshot was accepted")
	}
}

func TestLoadConfigFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good.yaml", `
# strata settings
memory:
  offload_strategy: balanced
  max_gpu_memory: 3.5
  max_host_memory: 16GiB
  memory_mode: unified-noprefetch
  expert_policy: lfu
  experts_cpu: always
  kv_cache: auto
  kv_dtype: q8_0
`)
	fc, err := LoadConfigFile(good)
	if err != nil {
		t.Fatal(err)
	}
	m := fc.Memory
	if m.OffloadStrategy != "balanced" || m.MaxHostMemory != "16GiB" || m.MemoryMode != "unified-noprefetch" || m.ExpertPolicy != "lfu" || m.ExpertsCPU != "always" || m.KVCache != "auto" || m.KVDType != "q8_0" {
		t.Errorf("%+v", m)
	}
	if n, err := ParseSize(m.MaxGPUMemory); err != nil || n != 3758096384 {
		t.Errorf("max_gpu_memory %q = %d, %v", m.MaxGPUMemory, n, err)
	}
	if _, err := LoadConfigFile(filepath.Join(dir, "missing.yaml")); err == nil {
		t.Error("missing file accepted")
	}
}

// TestLoadConfigFileErrors reads bad config files: each is an error of one
// line naming the file and the problem, with the file's line number where
// there is one. A misspelt or unknown section, an empty file and an empty
// memory section are errors, not a budget silently dropped.
func TestLoadConfigFileErrors(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		name, body string
		want       []string
	}{
		{"strategy", "memory:\n  offload_strategy: lazy\n", []string{"offload_strategy", "lazy"}},
		{"size", "memory:\n  max_gpu_memory: lots\n", []string{"max_gpu_memory", "lots"}},
		{"mode", "memory:\n  memory_mode: magic\n", []string{"memory_mode", "magic"}},
		{"expert policy", "memory:\n  expert_policy: fifo\n", []string{"expert_policy", "fifo"}},
		{"experts cpu", "memory:\n  experts_cpu: sometimes\n", []string{"experts_cpu", "sometimes"}},
		{"kv cache", "memory:\n  kv_cache: disk\n", []string{"kv_cache", "disk"}},
		{"kv dtype", "memory:\n  kv_dtype: q4_0\n", []string{"kv_dtype", "q4_0"}},
		{"key", "memory:\n  offload_strategy: none\n  max_gpu_mem: 3GiB\n", []string{"line 3", `unknown key "max_gpu_mem"`}},
		{"fraction", "memory:\n  gpu_memory_fraction: 2\n", []string{"gpu_memory_fraction"}},
		{"syntax", "memory: [\n", []string{"yaml"}},
		{"misspelt section", "memroy:\n  max_gpu_memory: 3GiB\n", []string{"line 1", `unknown section "memroy"`}},
		{"extra section", "memory:\n  max_gpu_memory: 3GiB\nmodel: llama\n", []string{"line 3", `unknown section "model"`}},
		{"two memory sections", "memory:\n  max_gpu_memory: 3GiB\nmemory:\n  max_gpu_memory: 4GiB\n", []string{"line 3"}},
		{"empty", "", []string{"empty"}},
		{"only comments", "# memory:\n#   max_gpu_memory: 3GiB\n", []string{"empty"}},
		{"empty memory", "memory:\n", []string{"memory: section is empty"}},
		{"memory not a mapping", "memory: 3GiB\n", []string{"line 1", "mapping"}},
		{"not a mapping", "- memory\n- 3GiB\n", []string{"line 1", "mapping"}},
		{"list value", "memory:\n  max_gpu_memory: [1,\n    2]\n", []string{"memory:", "line 2"}},
		{"multi-line value", "memory:\n  offload_strategy: |\n    balanced\n    minimal\n", []string{"offload_strategy"}},
		{"duplicate key", "memory:\n  max_gpu_memory: 3GiB\n  max_gpu_memory: 4GiB\n", []string{"max_gpu_memory"}},
		{"bad indentation", "memory:\n  max_gpu_memory: 3GiB\n   max_host_memory: 1GiB\n x\n", []string{"yaml"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".yaml")
			if err := os.WriteFile(path, []byte(c.body), 0o644); err != nil {
				t.Fatal(err)
			}
			fc, err := LoadConfigFile(path)
			if err == nil {
				t.Fatalf("accepted: %+v", fc.Memory)
			}
			msg := err.Error()
			if strings.ContainsAny(msg, "\r\n") {
				t.Errorf("error of more than one line: %q", msg)
			}
			for _, w := range append(c.want, path) {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not mention %q", msg, w)
				}
			}
		})
	}
}
