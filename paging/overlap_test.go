package paging

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// timedGPU is a fake device whose copies and compute take time, as a GPU's
// two streams do, on a virtual clock: UploadAsync queues a copy on the copy
// stream, which starts once the copies before it and the compute queued
// before the call are done, and lasts its bytes at h2d; compute queued by
// run lasts its bytes at device, after the compute before it and the
// copies a ready ordered it after. The host's clock moves only where the
// host would wait: for the CPU's layers (cpu), a hand-over (handoff), and
// a download, which waits for the compute queued (DownloadComputed) or for
// that and every copy queued (Download), as the CUDA backend's do. The
// pager's decisions are its own: the driver lets its prefetches queue
// their copies after each call, as they would within microseconds.
type timedGPU struct {
	*fakeBackend
	h2d, device float64 // bytes a second

	mu          sync.Mutex
	host        time.Duration // the host's clock
	copyFree    time.Duration // when the copy stream runs dry
	computeFree time.Duration // when the compute stream runs dry
	copyBusy    time.Duration // the copy stream's busy time so far
}

func seconds(bytes int64, rate float64) time.Duration {
	return time.Duration(float64(bytes) / rate * 1e9)
}

func (g *timedGPU) UploadAsync(ctx context.Context, dst *tensor.Tensor, off int64, src []byte) (func() error, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	copy(dst.Bytes()[off:], src) // the bytes land at once; their time is the stream's
	g.mu.Lock()
	start := max(g.host, g.copyFree, g.computeFree)
	d := seconds(int64(len(src)), g.h2d)
	end := start + d
	g.copyFree, g.copyBusy = end, g.copyBusy+d
	g.mu.Unlock()
	return func() error {
		g.mu.Lock()
		g.computeFree = max(g.computeFree, end)
		g.mu.Unlock()
		return nil
	}, nil
}

// run queues the compute of a layer that reads bytes.
func (g *timedGPU) run(bytes int64) {
	g.mu.Lock()
	g.computeFree = max(g.host, g.computeFree) + seconds(bytes, g.device)
	g.mu.Unlock()
}

// cpu passes d on the host.
func (g *timedGPU) cpu(d time.Duration) {
	g.mu.Lock()
	g.host += d
	g.mu.Unlock()
}

func (g *timedGPU) now() time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.host
}

func (g *timedGPU) Download(dst []byte, src *tensor.Tensor) error {
	g.mu.Lock()
	g.host = max(g.host, g.computeFree, g.copyFree)
	g.mu.Unlock()
	return g.fakeBackend.Download(dst, src)
}

func (g *timedGPU) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	g.mu.Lock()
	g.host = max(g.host, g.computeFree)
	g.mu.Unlock()
	return g.fakeBackend.Download(dst, src)
}

// overlapRun is one decode of a hybrid plan on a timedGPU: a token's time
// and the copy stream's busy time in it.
type overlapRun struct {
	perToken, copyBusy time.Duration
}

// decodeTimed decodes tokens tokens of hp on a timedGPU at rates, the way
// nn's pipeline does: a device layer is acquired, its compute queued and
// released (the host does not wait); a CPU layer is read from the pager's
// host copy and takes its bytes at the CPU's rate on the host; a change
// from the device to the CPU, and the logits of a token whose head is on
// the device, wait for the device (by DownloadComputed with computeOnly,
// else by Download), and each change of side takes rates.Handoff. fill
// sets Options.PrefetchFill. It returns the mean of the tokens after the
// first settle ones.
func decodeTimed(t *testing.T, src *synthSource, hp *HybridPlan, rates Rates, fill, computeOnly bool, settle, tokens int) overlapRun {
	t.Helper()
	ctx := context.Background()
	g := &timedGPU{fakeBackend: newFake(), h2d: rates.H2D, device: rates.Device}
	bg := newBudget(t, g, hp.GPU.Budget, "timed:0")
	free := nnReserve(t, bg, hp.GPU)
	pg, err := NewPager(src, bg, hp.GPU, Options{HostCacheBytes: 1 << 40, HostLayers: hp.CPULayers, PrefetchFill: fill})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		free()
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
	}()
	n := len(hp.Places)
	onCPU := make([]bool, n)
	for _, l := range hp.CPULayers {
		onCPU[l] = true
	}
	for l := range n { // warm up as the engine does
		if onCPU[l] {
			if _, err := pg.HostLayer(ctx, l); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if _, err := pg.Acquire(ctx, l); err != nil {
			t.Fatal(err)
		}
		pg.Release(l)
	}
	waitIdle(pg)
	if err := pg.SetSequence(hp.Sequence); err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 4)
	x, _ := g.fakeBackend.Alloc(tensor.F32, tensor.Shape{1}) // the hidden state
	defer g.fakeBackend.Free(x)
	toHost := func() {
		var err error
		if computeOnly {
			err = tensor.DownloadComputed(g, out, x)
		} else {
			err = g.Download(out, x)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	var t0, busy0 time.Duration
	for tok := range settle + tokens {
		if tok == settle {
			g.mu.Lock()
			t0, busy0 = g.host, g.copyBusy
			g.mu.Unlock()
		}
		for l, lp := range hp.Places {
			prev := onCPU[(l+n-1)%n]
			if onCPU[l] {
				if !prev {
					toHost()
					g.cpu(rates.Handoff)
				}
				if _, err := pg.HostLayer(ctx, l); err != nil {
					t.Fatal(err)
				}
				g.cpu(seconds(lp.ReadBytes, rates.CPU))
				continue
			}
			if prev {
				g.cpu(rates.Handoff)
			}
			if _, err := pg.Acquire(ctx, l); err != nil {
				t.Fatal(err)
			}
			pg.pf.Wait() // the prefetches it started queue their copies now
			g.run(lp.ReadBytes)
			pg.Release(l)
			pg.pf.Wait()
		}
		if !onCPU[n-1] {
			toHost() // the logits
		}
	}
	g.mu.Lock()
	el, busy := g.host-t0, g.copyBusy-busy0
	g.mu.Unlock()
	return overlapRun{perToken: el / time.Duration(tokens), copyBusy: busy / time.Duration(tokens)}
}

// TestHybridOverlapTimed runs the real pager on a fake GPU whose copies and
// compute take time on a virtual clock, with the host's time passing for
// the CPU's layers, at plans like those the 7B shape gets at 8, 4 and 2 GiB
// on an H200 (the model and the rates scaled down 1024 times: a token takes
// what it would take there). With the pager filling its ring and the
// hand-overs waiting for the compute only, a token takes what
// SimulateDecodeWith predicts for the plan, within 10%. The runtime as it
// was (prefetch by depth, hand-overs that wait for every copy queued)
// takes far longer than its own prediction: the copy engine idles while
// the CPU computes, and the CPU waits for copies at each hand-over.
func TestHybridOverlapTimed(t *testing.T) {
	const scale = 1024
	src := llamaSynth(32, 128, 344, 128, 1000) // a 7B block / 1024
	info := smallDims(src, 32)
	W, _ := totalAndMax(info)
	rates := Rates{H2D: 54.8e9 / scale, CPU: 85e9 / scale, Device: 3.35e12 / scale, Handoff: 20 * time.Microsecond}
	for _, tc := range []struct {
		name  string
		share float64 // of the weights the budget holds
	}{
		{"8GiB", 8.0 / 12.55},
		{"4GiB", 4.0 / 12.55},
		{"2GiB", 2.0 / 12.55},
	} {
		budget := int64(tc.share * float64(W))
		hp, err := PlanHybrid(info, budget, 16, 1, rates, HybridOptions{})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		t.Logf("%s: %s", tc.name, hp)
		fixed := decodeTimed(t, src, hp, rates, true, true, 3, 6)
		old := decodeTimed(t, src, hp, rates, false, false, 3, 6)
		oldPred, _, err := SimulateDecode(hp.Places, rates, hp.GPU.PrefetchDepth)
		if err != nil {
			t.Fatal(err)
		}
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/1e6) }
		t.Logf("%s: predicted %s a token (copy %s); measured %s (copy busy %s); as it was: %s, predicted by depth alone %s",
			tc.name, ms(hp.Predicted), ms(hp.Breakdown.Copy), ms(fixed.perToken), ms(fixed.copyBusy), ms(old.perToken), ms(oldPred))
		if e := float64(fixed.perToken)/float64(hp.Predicted) - 1; math.Abs(e) > 0.10 {
			t.Errorf("%s: measured %s a token, predicted %s: off by %.0f%%", tc.name, ms(fixed.perToken), ms(hp.Predicted), 100*e)
		}
		if float64(old.perToken) < 1.2*float64(fixed.perToken) {
			t.Errorf("%s: the runtime as it was takes %s a token, the fixed one %s: the fixes should matter", tc.name, ms(old.perToken), ms(fixed.perToken))
		}
	}
}

// prefillTimed is decodeTimed's prefill after settle tokens of decode:
// the pipeline's OnTwins sets the sequence of every layer, and a chunk
// runs every layer on the device (the CPU's on their twins, whose keys and
// values then go back to the host), its compute taking compute times a
// decode step's. It returns the time of each of passes chunks, and the
// pager's counters over them.
func prefillTimed(t *testing.T, src *synthSource, hp *HybridPlan, rates Rates, fill, computeOnly bool, settle, passes int, compute float64) ([]time.Duration, Stats) {
	t.Helper()
	ctx := context.Background()
	g := &timedGPU{fakeBackend: newFake(), h2d: rates.H2D, device: rates.Device}
	bg := newBudget(t, g, hp.GPU.Budget, "timed:0")
	free := nnReserve(t, bg, hp.GPU)
	pg, err := NewPager(src, bg, hp.GPU, Options{HostCacheBytes: 1 << 40, HostLayers: hp.CPULayers, PrefetchFill: fill})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		free()
		if err := pg.Close(); err != nil {
			t.Error(err)
		}
		if err := bg.Close(); err != nil {
			t.Error(err)
		}
	}()
	n := len(hp.Places)
	onCPU := make([]bool, n)
	for _, l := range hp.CPULayers {
		onCPU[l] = true
		if _, err := pg.HostLayer(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	if err := pg.SetSequence(hp.Sequence); err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 4)
	x, _ := g.fakeBackend.Alloc(tensor.F32, tensor.Shape{1})
	defer g.fakeBackend.Free(x)
	toHost := func() {
		var err error
		if computeOnly {
			err = tensor.DownloadComputed(g, out, x)
		} else {
			err = g.Download(out, x)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	acquire := func(l int, bytes int64) {
		if _, err := pg.Acquire(ctx, l); err != nil {
			t.Fatal(err)
		}
		pg.pf.Wait()
		g.run(bytes)
		pg.Release(l)
		pg.pf.Wait()
	}
	for range settle { // decode, as the bench's warm-up does
		for l, lp := range hp.Places {
			if onCPU[l] {
				if !onCPU[(l+n-1)%n] {
					toHost()
				}
				g.cpu(seconds(lp.ReadBytes, rates.CPU))
				continue
			}
			acquire(l, lp.ReadBytes)
		}
		toHost()
	}
	if err := pg.SetSequence(nil); err != nil { // OnTwins(true)
		t.Fatal(err)
	}
	st0 := pg.Stats()
	var times []time.Duration
	for range passes {
		t0 := g.now()
		for l := range n {
			acquire(l, int64(compute*float64(hp.Places[l].ReadBytes)))
			if onCPU[l] {
				toHost() // the twin's keys and values
			}
		}
		toHost() // the logits
		times = append(times, g.now()-t0)
	}
	st := pg.Stats()
	return times, Stats{Misses: st.Misses - st0.Misses, PrefetchNoRoom: st.PrefetchNoRoom - st0.PrefetchNoRoom,
		OutsideRing: st.OutsideRing - st0.OutsideRing, Evictions: st.Evictions - st0.Evictions}
}

// TestHybridPrefillTimed: a prompt's chunk after decode, every layer on the
// device, at the 7B-like plans of TestHybridOverlapTimed. The chunks are
// bound by the link: every byte not resident crosses it once a chunk. With
// the pager filling its ring and the twins' keys and values leaving by
// DownloadComputed, each chunk takes the link's time within 10%, the first
// one after decode too. It logs the runtime as it was beside.
func TestHybridPrefillTimed(t *testing.T) {
	const scale = 1024
	src := llamaSynth(32, 128, 344, 128, 1000)
	info := smallDims(src, 32)
	W, _ := totalAndMax(info)
	rates := Rates{H2D: 54.8e9 / scale, CPU: 85e9 / scale, Device: 3.35e12 / scale, Handoff: 20 * time.Microsecond}
	ms := func(ds []time.Duration) string {
		s := ""
		for _, d := range ds {
			s += fmt.Sprintf(" %.1f", float64(d)/1e6)
		}
		return s + " ms"
	}
	for _, tc := range []struct {
		name  string
		share float64
	}{{"8GiB", 8.0 / 12.55}, {"4GiB", 4.0 / 12.55}, {"2GiB", 2.0 / 12.55}} {
		hp, err := PlanHybrid(info, int64(tc.share*float64(W)), 16, 1, rates, HybridOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var streamed int64
		for _, lp := range hp.GPU.Layers {
			streamed += lp.StreamedBytes
		}
		bound := seconds(streamed, rates.H2D)
		fixed, fst := prefillTimed(t, src, hp, rates, true, true, 3, 3, 4)
		old, ost := prefillTimed(t, src, hp, rates, false, false, 3, 3, 4)
		t.Logf("%s: prefill chunks after decode: %s (the link's bound %.1f ms; %d misses, %d prefetches without room, %d parts outside the ring); as it was:%s (%d misses, %d without room, %d outside)",
			tc.name, ms(fixed), float64(bound)/1e6, fst.Misses, fst.PrefetchNoRoom, fst.OutsideRing, ms(old), ost.Misses, ost.PrefetchNoRoom, ost.OutsideRing)
		for i, d := range fixed {
			if float64(d) > 1.1*float64(bound) {
				t.Errorf("%s: chunk %d took %.1f ms, the link's bound is %.1f ms", tc.name, i, float64(d)/1e6, float64(bound)/1e6)
			}
		}
	}
}
