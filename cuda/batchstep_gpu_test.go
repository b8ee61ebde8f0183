//go:build cuda

package cuda

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// TestStartCompute: the device time between two marks of the compute
// queue (tensor.ComputeTimer) is positive, within the host's wall time
// from the first mark to the stop's return, and about doubles with twice
// the work queued; a stop called twice answers the same; the marks' events
// are reused, not made anew at each step. It logs what it measures.
func TestStartCompute(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const m, k, n = 64, 4096, 4096
	x, _ := put(t, b, tensor.F32, tensor.Shape{m, k}, uniform(r, m*k, -1, 1))
	w, _ := put(t, b, tensor.F16, tensor.Shape{n, k}, uniform(r, n*k, -1, 1))
	out, _ := put(t, b, tensor.F32, tensor.Shape{m, n}, make([]float32, m*n))
	timed := func(products int) (device, wall, queued time.Duration) {
		t.Helper()
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		stop, ok, err := tensor.StartCompute(b)
		if !ok || err != nil {
			t.Fatalf("StartCompute: ok %v, %v", ok, err)
		}
		for range products {
			if err := b.MatMul(out, x, w, nil); err != nil {
				t.Fatal(err)
			}
		}
		queued = time.Since(t0)
		device, err = stop()
		wall = time.Since(t0)
		if err != nil {
			t.Fatal(err)
		}
		if again, err := stop(); again != device || err != nil {
			t.Errorf("a second stop: %v, %v; the first %v", again, err, device)
		}
		return device, wall, queued
	}
	timed(4) // warm
	d1, w1, q1 := timed(20)
	d2, w2, q2 := timed(40)
	t.Logf("20 products of %dx%dx%d F16: device %v, host queued them in %v, wall %v; 40: device %v, queued %v, wall %v; ratio %.2f",
		m, k, n, d1, q1, w1, d2, q2, w2, float64(d2)/float64(d1))
	if d1 <= 0 || d1 > w1 || d2 > w2 {
		t.Errorf("device times %v and %v against walls %v and %v", d1, d2, w1, w2)
	}
	if ratio := float64(d2) / float64(d1); ratio < 1.5 || ratio > 2.6 {
		t.Errorf("twice the work took %.2f times the device time", ratio)
	}
	b.evMu.Lock()
	before := len(b.evAll)
	b.evMu.Unlock()
	for range 50 {
		timed(1)
	}
	b.evMu.Lock()
	after := len(b.evAll)
	b.evMu.Unlock()
	if after > before+2 {
		t.Errorf("50 timed stretches made %d events: the marks' events are not reused", after-before)
	}
}

// TestStepTables: AttentionBlocks and RopeRows upload their tables only
// when they change (the layers of a batched step share them): a call
// repeated copies nothing and gives the same bits, another table is
// uploaded, and the first again is uploaded again and gives its bits.
// It logs the copies counted.
func TestStepTables(t *testing.T) {
	b := openGPU(t)
	r := newRand(t)
	const heads, kvHeads, hd, bs, blocks = 4, 2, 64, 4, 16
	qw, kw := heads*hd, kvHeads*hd
	pool := func() *tensor.Tensor {
		p, _ := put(t, b, tensor.F32, tensor.Shape{blocks * bs, kw}, make([]float32, blocks*bs*kw))
		return p
	}
	kp, vp := pool(), pool()
	const rows = 3
	q, _ := put(t, b, tensor.F32, tensor.Shape{rows, qw}, uniform(r, rows*qw, -1, 1))
	k, _ := put(t, b, tensor.F32, tensor.Shape{rows, kw}, uniform(r, rows*kw, -1, 1))
	v, _ := put(t, b, tensor.F32, tensor.Shape{rows, kw}, uniform(r, rows*kw, -1, 1))
	out, _ := put(t, b, tensor.F32, tensor.Shape{rows, qw}, make([]float32, rows*qw))
	seqsA := []tensor.SeqBlocks{{Rows: 1, Pos0: 5, Blocks: []int32{3, 7}}, {Rows: 2, Pos0: 0, Blocks: []int32{1}}}
	seqsB := []tensor.SeqBlocks{{Rows: 1, Pos0: 5, Blocks: []int32{9, 2}}, {Rows: 2, Pos0: 0, Blocks: []int32{4}}}
	copies := func() int64 { l, _ := tensor.CountLaunches(b); return l.Copies }
	attend := func(seqs []tensor.SeqBlocks) ([]float32, int64) {
		t.Helper()
		c0 := copies()
		at := tensor.AttnBlocks{Q: q, K: k, V: v, KPool: kp, VPool: vp, Seqs: seqs, Heads: heads, KVHeads: kvHeads, HeadDim: hd, BlockSize: bs, Scale: 0.125}
		if err := b.AttentionBlocks(out, at); err != nil {
			t.Fatal(err)
		}
		c := copies() - c0
		return get(t, b, out), c
	}
	a1, c1 := attend(seqsA)
	a2, c2 := attend(seqsA)
	_, c3 := attend(seqsB)
	a4, c4 := attend(seqsA)
	t.Logf("AttentionBlocks' table copies: %d, repeated %d, another table %d, the first again %d (the downloads of the outputs not counted)", c1, c2, c3, c4)
	if c1 != 1 || c2 != 0 || c3 != 1 || c4 != 1 {
		t.Errorf("table copies %d, %d, %d, %d; want 1, 0, 1, 1", c1, c2, c3, c4)
	}
	if !slices.Equal(a1, a2) || !slices.Equal(a1, a4) {
		t.Error("the same call gave other bits after its table was kept or uploaded again")
	}

	const maxPos = 32
	cosv, sinv := make([]float32, maxPos*hd/2), make([]float32, maxPos*hd/2)
	for i := range cosv {
		cosv[i], sinv[i] = float32(math.Cos(float64(i)*0.01)), float32(math.Sin(float64(i)*0.01))
	}
	cos, _ := put(t, b, tensor.F32, tensor.Shape{maxPos, hd / 2}, cosv)
	sin, _ := put(t, b, tensor.F32, tensor.Shape{maxPos, hd / 2}, sinv)
	xs := uniform(r, rows*qw, -1, 1)
	rope := func(pos []int32) ([]float32, int64) {
		t.Helper()
		x, _ := put(t, b, tensor.F32, tensor.Shape{rows, qw}, xs)
		c0 := copies()
		if err := tensor.RopeRows(b, x, tensor.Rotary{Cos: cos, Sin: sin, Heads: heads, HeadDim: hd}, pos); err != nil {
			t.Fatal(err)
		}
		c := copies() - c0
		return get(t, b, x), c
	}
	r1, d1 := rope([]int32{4, 0, 1})
	r2, d2 := rope([]int32{4, 0, 1})
	_, d3 := rope([]int32{9, 30, 2})
	r4, d4 := rope([]int32{4, 0, 1})
	t.Logf("RopeRows' position copies: %d, repeated %d, other positions %d, the first again %d", d1, d2, d3, d4)
	if d1 != 1 || d2 != 0 || d3 != 1 || d4 != 1 {
		t.Errorf("position copies %d, %d, %d, %d; want 1, 0, 1, 1", d1, d2, d3, d4)
	}
	if !slices.Equal(r1, r2) || !slices.Equal(r1, r4) {
		t.Error("the same rotation gave other bits after its positions were kept or uploaded again")
	}
}
