//go:build cuda

package cuda

import (
	"fmt"
	"testing"
)

// BenchmarkAllocPinned times page-locked host allocations of several sizes
// (AllocPinned, a write to every page, FreePinned) and reports GB/s of
// memory made ready: the cost a host cache pays the first time it pins what
// it keeps. Small allocations show the per-call cost (the pager's expert
// cache pinned one expert at a time), large ones the per-byte cost.
func BenchmarkAllocPinned(b *testing.B) {
	be := openGPU(b)
	for _, size := range []int64{8 << 20, 64 << 20, 512 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				buf, err := be.AllocPinned(size)
				if err != nil {
					b.Fatal(err)
				}
				for i := 0; i < len(buf); i += 4096 {
					buf[i] = byte(i)
				}
				if err := be.FreePinned(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	// Without the free: what a cache that keeps its buffers pays.
	b.Run("keep/8MiB", func(b *testing.B) {
		const size = 8 << 20
		b.SetBytes(size)
		var kept [][]byte
		defer func() {
			for _, k := range kept {
				_ = be.FreePinned(k)
			}
		}()
		for b.Loop() {
			buf, err := be.AllocPinned(size)
			if err != nil {
				b.Fatal(err)
			}
			buf[0] = 1
			kept = append(kept, buf)
		}
	})
}
