package engine

import (
	"testing"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// fakePinned hands out plain Go memory as if pinned, counting it.
type fakePinned struct{ live int64 }

func (f *fakePinned) AllocPinned(n int64) ([]byte, error) {
	f.live += n
	return make([]byte, n), nil
}

func (f *fakePinned) FreePinned(b []byte) error {
	f.live -= int64(len(b))
	return nil
}

// TestPinnedHostKVDTypes allocates a hybrid placement's host KV cache in
// each cache dtype: the pinned bytes are the dtype's stored bytes (a Q8_0
// row is whole blocks of 34 bytes, where Size is 0), the CPU computes on
// them (CopyRows appends, Attention reads), and Free gives them back.
func TestPinnedHostKVDTypes(t *testing.T) {
	cpu := tensor.NewCPU(1)
	defer cpu.Close()
	for _, c := range []struct {
		dt    tensor.DType
		bytes int64
	}{{tensor.F32, 8 * 64 * 4}, {tensor.F16, 8 * 64 * 2}, {tensor.BF16, 8 * 64 * 2}, {tensor.Q8_0, 8 * 2 * 34}} {
		fp := &fakePinned{}
		p := &pinnedHost{pa: fp, cpu: cpu, live: map[*tensor.Tensor][]byte{}}
		kc, err := p.Alloc(paging.KVCache, c.dt, tensor.Shape{8, 64})
		if err != nil {
			t.Fatalf("%v: %v", c.dt, err)
		}
		if kc.NumBytes() != c.bytes || fp.live != c.bytes || p.held != c.bytes {
			t.Errorf("%v: tensor of %d bytes, %d pinned, %d held; want %d", c.dt, kc.NumBytes(), fp.live, p.held, c.bytes)
		}
		rows, _ := tensor.FromF32(tensor.Shape{8, 64}, make([]float32, 8*64))
		if err := tensor.Checked(cpu).CopyRows(kc, 0, rows, 0, 8); err != nil {
			t.Errorf("%v: appending to the pinned cache: %v", c.dt, err)
		}
		q, _ := tensor.FromF32(tensor.Shape{1, 128}, make([]float32, 128))
		out := tensor.New(tensor.F32, tensor.Shape{1, 128})
		if err := tensor.Checked(cpu).Attention(out, tensor.Attn{Q: q, K: kc, V: kc, Heads: 2, KVHeads: 1, HeadDim: 64, Pos0: 7, Scale: 0.125}); err != nil {
			t.Errorf("%v: attention over the pinned cache: %v", c.dt, err)
		}
		p.Free(kc)
		if fp.live != 0 || p.held != 0 {
			t.Errorf("%v: after Free %d pinned, %d held", c.dt, fp.live, p.held)
		}
	}
}
