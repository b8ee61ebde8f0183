package tensor_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// counting is the CPU backend with a count of the kernel calls that reach
// it.
type counting struct {
	*tensor.CPU
	calls int
}

func (c *counting) MatMul(out, x, w, bias *tensor.Tensor) error {
	c.calls++
	return c.CPU.MatMul(out, x, w, bias)
}

func (c *counting) Attention(out *tensor.Tensor, a tensor.Attn) error {
	c.calls++
	return c.CPU.Attention(out, a)
}

func (c *counting) AttentionBlocks(out *tensor.Tensor, a tensor.AttnBlocks) error {
	c.calls++
	return c.CPU.AttentionBlocks(out, a)
}

func (c *counting) MatMulGradX(dx, dy, w *tensor.Tensor) error {
	c.calls++
	return c.CPU.MatMulGradX(dx, dy, w)
}

// TestCheckedStopsMalformedCalls checks that the front returns a malformed
// call's error without calling the backend, and passes a well-formed one
// through once.
func TestCheckedStopsMalformedCalls(t *testing.T) {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	f32 := func(shape ...int) *tensor.Tensor { return tensor.New(tensor.F32, tensor.Shape(shape)) }
	x, w, out := f32(2, 4), f32(3, 4), f32(2, 3)
	q, kc, attn := f32(2, 16), f32(8, 8), f32(2, 16)
	dy, dx := f32(2, 3), f32(2, 4)
	for _, c := range []struct {
		name      string
		call      func(b tensor.Backend, g tensor.GradOps) error
		malformed bool
	}{
		{"MatMul", func(b tensor.Backend, _ tensor.GradOps) error { return b.MatMul(out, x, w, nil) }, false},
		{"MatMul/K mismatch", func(b tensor.Backend, _ tensor.GradOps) error { return b.MatMul(out, x, f32(3, 5), nil) }, true},
		{"MatMul/out is x", func(b tensor.Backend, _ tensor.GradOps) error { return b.MatMul(x, x, f32(4, 4), nil) }, true},
		{"Attention", func(b tensor.Backend, _ tensor.GradOps) error {
			return b.Attention(attn, tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 4, Scale: 1})
		}, false},
		{"Attention/past the cache", func(b tensor.Backend, _ tensor.GradOps) error {
			return b.Attention(attn, tensor.Attn{Q: q, K: kc, V: kc, Heads: 4, KVHeads: 2, HeadDim: 4, Pos0: 7, Scale: 1})
		}, true},
		{"MatMulGradX", func(_ tensor.Backend, g tensor.GradOps) error { return g.MatMulGradX(dx, dy, w) }, false},
		{"MatMulGradX/dx is w", func(_ tensor.Backend, g tensor.GradOps) error {
			sq := f32(3, 3)
			return g.MatMulGradX(sq, f32(3, 3), sq)
		}, true},
		{"MatMul/quantized w", func(b tensor.Backend, _ tensor.GradOps) error {
			return b.MatMul(f32(2, 3), f32(2, 32), tensor.New(tensor.Q8_0, tensor.Shape{3, 32}), nil)
		}, false},
		{"MatMul/Q8_K w", func(b tensor.Backend, _ tensor.GradOps) error {
			return b.MatMul(f32(2, 3), f32(2, 256), tensor.New(tensor.Q8_K, tensor.Shape{3, 256}), nil)
		}, true},
		{"MatMul/quantized x", func(b tensor.Backend, _ tensor.GradOps) error {
			return b.MatMul(f32(2, 3), tensor.New(tensor.Q8_0, tensor.Shape{2, 32}), f32(3, 32), nil)
		}, true},
		{"MatMulGradX/quantized w", func(_ tensor.Backend, g tensor.GradOps) error {
			return g.MatMulGradX(f32(2, 32), dy, tensor.New(tensor.Q8_0, tensor.Shape{3, 32}))
		}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			k := &counting{CPU: cpu}
			b := tensor.Checked(k)
			g, ok := tensor.CheckedGrad(b)
			if !ok {
				t.Fatal("the front of a backend with GradOps has none")
			}
			err := c.call(b, g)
			switch {
			case c.malformed && err == nil:
				t.Fatal("no error")
			case c.malformed && k.calls != 0:
				t.Fatalf("error %v, but the backend was called %d times", err, k.calls)
			case !c.malformed && (err != nil || k.calls != 1):
				t.Fatalf("error %v after %d calls of the backend, want none after 1", err, k.calls)
			}
		})
	}
}

// memoryOnly hides every method of a backend but those of the interface,
// GradOps and the capabilities included.
type memoryOnly struct{ tensor.Backend }

// syncer is a backend whose Sync is counted.
type syncer struct {
	memoryOnly
	syncs int
}

func (s *syncer) Sync() error { s.syncs++; return nil }

// copyTimer is a backend that reports copy statistics.
type copyTimer struct{ memoryOnly }

func (copyTimer) CopyStats() (int64, time.Duration, time.Duration) {
	return 42, time.Second, time.Millisecond
}

// computeDownloader is a backend whose DownloadComputed writes a mark, so
// that a test tells it from Download.
type computeDownloader struct{ memoryOnly }

func (computeDownloader) DownloadComputed(dst []byte, src *tensor.Tensor) error {
	for i := range dst {
		dst[i] = 0x5A
	}
	return nil
}

// TestDownloadComputed: the helper finds DownloadComputed behind a front,
// and falls back to Download on a backend without it.
func TestDownloadComputed(t *testing.T) {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	src, err := tensor.FromF32(tensor.Shape{2}, []float32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		m    tensor.Memory
		want []byte // dst after the call
	}{
		{"capability behind a front", tensor.Checked(computeDownloader{memoryOnly{cpu}}), bytes.Repeat([]byte{0x5A}, 8)},
		{"fallback to Download", tensor.Checked(memoryOnly{cpu}), src.Bytes()},
	} {
		dst := make([]byte, src.NumBytes())
		if err := tensor.DownloadComputed(tc.m, dst, src); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !bytes.Equal(dst, tc.want) {
			t.Errorf("%s: dst = %x, want %x", tc.name, dst, tc.want)
		}
	}
}

// TestCheckedFront checks how fronts compose and what they expose: Checked
// is idempotent, GradOps follow the backend's, and the capability helpers
// find what is behind a front.
func TestCheckedFront(t *testing.T) {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	b := tensor.Checked(cpu)
	if tensor.Checked(b) != b {
		t.Error("Checked of a front is a new front")
	}
	if tensor.Checked(nil) != nil {
		t.Error("Checked(nil) is not nil")
	}
	if b.Name() != "cpu" {
		t.Errorf("front's name %q, want the backend's", b.Name())
	}
	if _, ok := tensor.CheckedGrad(memoryOnly{cpu}); ok {
		t.Error("CheckedGrad found backward operations in a backend without them")
	}
	if _, ok := tensor.Checked(memoryOnly{cpu}).(tensor.GradOps); ok {
		t.Error("the front of a backend without GradOps implements them")
	}
	s := &syncer{memoryOnly: memoryOnly{cpu}}
	if err := tensor.Sync(tensor.Checked(s)); err != nil || s.syncs != 1 {
		t.Errorf("Sync through the front: %v after %d syncs, want 1", err, s.syncs)
	}
	if n, busy, stall, ok := tensor.CopyStats(tensor.Checked(copyTimer{memoryOnly{cpu}})); !ok || n != 42 || busy != time.Second || stall != time.Millisecond {
		t.Errorf("CopyStats through the front = %d, %v, %v, %v", n, busy, stall, ok)
	}
	if _, _, _, ok := tensor.CopyStats(b); ok {
		t.Error("the CPU backend times copies")
	}
	if _, ok := tensor.Caching(b); ok {
		t.Error("the CPU backend is a caching allocator")
	}
	if _, ok := tensor.Pinned(b); ok {
		t.Error("the CPU backend has pinned memory")
	}
	if _, _, err := tensor.FreeMemory(b); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("FreeMemory of the CPU backend: %v, want errors.ErrUnsupported", err)
	}
}
