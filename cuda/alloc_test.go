package cuda

import (
	"errors"
	"fmt"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// fakeDriver hands out addresses from a counter under a byte limit.
type fakeDriver struct {
	next, limit, used int64
	sizes             map[uintptr]int64
	allocs, frees     int
	syncs             int
}

func newFake(limit int64) *fakeDriver {
	return &fakeDriver{next: 1 << 20, limit: limit, sizes: map[uintptr]int64{}}
}

func (f *fakeDriver) malloc(n int64) (uintptr, error) {
	if f.used+n > f.limit {
		return 0, fmt.Errorf("fake: %d bytes: %w", n, tensor.ErrOutOfMemory)
	}
	p := uintptr(f.next)
	f.next += n + 4096
	f.used += n
	f.sizes[p] = n
	f.allocs++
	return p, nil
}

func (f *fakeDriver) mfree(p uintptr) error {
	n, ok := f.sizes[p]
	if !ok {
		return errors.New("fake: double free")
	}
	delete(f.sizes, p)
	f.used -= n
	f.frees++
	return nil
}

func (f *fakeDriver) allocator() *allocator {
	return newAllocator(f.malloc, f.mfree, func() error { f.syncs++; return nil })
}

func TestRoundSize(t *testing.T) {
	for _, c := range []struct{ n, want int64 }{
		{1, 512}, {512, 512}, {513, 1024}, {4096, 4096}, {4097, 4608},
		{32 << 20, 32 << 20}, {4096 * 11008 * 2, 4096 * 11008 * 2}, {(32 << 20) + 1, (32 << 20) + 512<<10},
	} {
		if got := roundSize(c.n); got != c.want {
			t.Errorf("roundSize(%d) = %d, want %d", c.n, got, c.want)
		}
	}
	for n := int64(1); n < 1<<26; n = n*3/2 + 1 {
		r := roundSize(n)
		if r < n || float64(r-n) > float64(n)/64+512 {
			t.Errorf("roundSize(%d) = %d wastes too much", n, r)
		}
	}
}

// TestAllocSize checks that allocSize, what Backend.AllocSize reports to a
// budget, is exactly what a request takes from the driver and what its
// block adds to the cache once freed, for sizes on and off the block
// boundaries.
func TestAllocSize(t *testing.T) {
	if allocSize(0) != 0 {
		t.Errorf("allocSize(0) = %d, want 0", allocSize(0))
	}
	for _, n := range []int64{1, 511, 512, 513, 4095, 4096, 4097, 11008 * 4, 1<<20 + 1, 3<<30 + 7} {
		f := newFake(1 << 40)
		a := f.allocator()
		before, used := a.snapshot(), f.used
		p, err := a.get(n)
		if err != nil {
			t.Fatal(err)
		}
		mid := a.snapshot()
		if d := mid.InUse - before.InUse; d != allocSize(n) || f.used-used != allocSize(n) {
			t.Errorf("a request of %d bytes took %d in use and %d from the driver; allocSize says %d", n, d, f.used-used, allocSize(n))
		}
		a.put(p)
		if d := a.snapshot().Cached - mid.Cached; d != allocSize(n) {
			t.Errorf("freeing %d bytes cached %d; allocSize says %d", n, d, allocSize(n))
		}
	}
}

func TestAllocatorReuse(t *testing.T) {
	f := newFake(1 << 30)
	a := f.allocator()
	// A decode step: the same shapes every step.
	sizes := []int64{4096 * 4, 11008 * 4, 32000 * 4, 4096 * 4}
	for step := 0; step < 10; step++ {
		var ps []uintptr
		for _, n := range sizes {
			p, err := a.get(n)
			if err != nil {
				t.Fatal(err)
			}
			ps = append(ps, p)
		}
		for _, p := range ps {
			if _, ok := a.put(p); !ok {
				t.Fatalf("put(%#x) not live", p)
			}
		}
	}
	if f.allocs != len(sizes) {
		t.Errorf("driver allocations = %d over 10 steps, want %d (first step only)", f.allocs, len(sizes))
	}
	s := a.snapshot()
	if s.DriverAllocs != int64(len(sizes)) || s.CacheHits != int64(9*len(sizes)) {
		t.Errorf("stats %+v: want %d driver allocs and %d hits", s, len(sizes), 9*len(sizes))
	}
	if s.InUse != 0 || s.Cached != s.Reserved || s.Reserved != f.used {
		t.Errorf("stats %+v, driver holds %d: want nothing in use, everything cached", s, f.used)
	}
	if s.PeakInUse != s.Reserved {
		t.Errorf("peak %d, want %d", s.PeakInUse, s.Reserved)
	}
	released, err := a.trim()
	if err != nil || released != s.Reserved || f.used != 0 || f.syncs == 0 {
		t.Errorf("trim = %d, %v; driver still holds %d; syncs %d", released, err, f.used, f.syncs)
	}
	if s := a.snapshot(); s.Reserved != 0 || s.Cached != 0 {
		t.Errorf("after trim: %+v", s)
	}
}

func TestAllocatorFindAndDoubleFree(t *testing.T) {
	f := newFake(1 << 30)
	a := f.allocator()
	p, _ := a.get(1000)
	q, _ := a.get(3000)
	if base, b, ok := a.find(p+10, 990); !ok || base != p || b.size != 1000 {
		t.Errorf("find inside p = %#x %+v %v", base, b, ok)
	}
	if _, _, ok := a.find(p+10, 991); ok {
		t.Error("find past the end of p succeeded")
	}
	if _, _, ok := a.find(q+3000, 1); ok {
		t.Error("find past q succeeded")
	}
	if _, _, ok := a.find(p-1, 1); ok {
		t.Error("find before p succeeded")
	}
	a.put(p)
	if _, ok := a.put(p); ok {
		t.Error("second put of p succeeded")
	}
	if _, _, ok := a.find(p, 1); ok {
		t.Error("find of a freed block succeeded")
	}
	if err := a.releaseAll(f.mfree); err != nil || f.used != 0 {
		t.Errorf("releaseAll: %v, driver holds %d", err, f.used)
	}
}

func TestAllocatorTrimsOnOOM(t *testing.T) {
	f := newFake(8 << 20)
	a := f.allocator()
	p, err := a.get(6 << 20)
	if err != nil {
		t.Fatal(err)
	}
	a.put(p) // cached: the driver still holds 6 MiB
	q, err := a.get(4 << 20)
	if err != nil {
		t.Fatalf("allocation that fits after trimming the cache: %v", err)
	}
	if s := a.snapshot(); s.Cached != 0 || s.InUse != 4<<20 || s.Reserved != 4<<20 {
		t.Errorf("after trim-and-retry: %+v", s)
	}
	a.put(q)
	_, err = a.get(16 << 20)
	if !errors.Is(err, tensor.ErrOutOfMemory) {
		t.Errorf("allocation beyond the device: %v, want ErrOutOfMemory", err)
	}
}

func TestAllocatorManaged(t *testing.T) {
	f := newFake(1 << 30)
	a := f.allocator()
	a.addManaged(0x10000000, 1<<20)
	if _, b, ok := a.find(0x10000000+100, 100); !ok || !b.managed {
		t.Errorf("managed block not found: %+v %v", b, ok)
	}
	if s := a.snapshot(); s.Managed != 1<<20 || s.InUse != 0 {
		t.Errorf("stats %+v", s)
	}
	b, ok := a.put(0x10000000)
	if !ok || !b.managed {
		t.Errorf("put managed = %+v %v", b, ok)
	}
	if s := a.snapshot(); s.Managed != 0 || s.Cached != 0 {
		t.Errorf("managed block cached: %+v", s)
	}
}
