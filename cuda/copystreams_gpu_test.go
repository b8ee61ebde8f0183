//go:build cuda

package cuda

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/strata-llm/strata/tensor"
)

// BenchmarkExpertCopies times the copies a sparse block's misses make: n
// pieces of one expert's size (9 MiB, the Qwen3-30B-A3B shape's 9,437,184
// bytes) to n places on the device, from page-locked memory (AllocPinned)
// and from a file in /dev/shm page-locked in place (RegisterHost, as the
// expert cache copies from the model's mapping). Each way reports the bytes
// a second of the whole batch:
//
//   - one: one stream, the copies back to back;
//   - one+events: one stream, with the events UploadAsync records around
//     each copy (a wait for the compute stream, a timing pair, done and
//     the tail), and each of those alone (one+wait, one+timing,
//     one+records);
//   - two: the copies alternate between two streams;
//   - whole: one copy of all n pieces (the link's rate for a large copy).
func BenchmarkExpertCopies(b *testing.B) {
	const piece, n = 9437184, 32
	be := openGPU(b)
	dst, err := be.Alloc(tensor.F16, tensor.Shape{piece * n / 2})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { be.Free(dst) })
	pinned, err := be.AllocPinned(piece * n)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { be.FreePinned(pinned) })
	for i := range pinned {
		pinned[i] = byte(i)
	}
	srcs := map[string][]byte{"pinned": pinned}
	if f, err := os.CreateTemp("/dev/shm", "strata-copies-*"); err == nil {
		name := f.Name()
		b.Cleanup(func() { os.Remove(name) })
		if err := f.Truncate(piece * n); err != nil {
			b.Fatal(err)
		}
		m, err := syscall.Mmap(int(f.Fd()), 0, piece*n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		f.Close()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { syscall.Munmap(m) })
		copy(m, pinned)
		unregister, err := be.RegisterHost(m)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { unregister() })
		srcs["mapped"] = m
	} else {
		b.Logf("no /dev/shm file: %v", err)
	}
	// The driver's calls below run on the thread holding the backend's
	// context: each sub-benchmark's goroutine enters it.
	if err := be.enter("BenchmarkExpertCopies"); err != nil {
		b.Fatal(err)
	}
	var streams [2]cu.Stream
	for i := range streams {
		if streams[i], err = cu.MakeStream(cu.NonBlocking); err != nil {
			b.Fatal(err)
		}
	}
	var evs [5]cu.Event
	for i := range evs {
		flags := cu.DisableTiming
		if i == 1 || i == 2 {
			flags = cu.DefaultEvent
		}
		if evs[i], err = cu.MakeEvent(flags); err != nil {
			b.Fatal(err)
		}
	}
	be.leave()
	b.Cleanup(func() {
		if be.enter("BenchmarkExpertCopies") != nil {
			return
		}
		defer be.leave()
		for i := range evs {
			cu.DestroyEvent(&evs[i])
		}
		for _, s := range streams {
			s.Destroy()
		}
	})
	check := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	for _, from := range []string{"pinned", "mapped"} {
		src := srcs[from]
		if src == nil {
			continue
		}
		ways := map[string]func(){
			"one": func() {
				for i := range n {
					check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(i*piece)), unsafe.Pointer(&src[i*piece]), piece, streams[0]))
				}
			},
			"one+events": func() {
				s := streams[0]
				for i := range n {
					check(evs[0].Record(be.compute))
					check(s.Wait(evs[0], 0))
					check(evs[1].Record(s))
					check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(i*piece)), unsafe.Pointer(&src[i*piece]), piece, s))
					check(evs[2].Record(s))
					check(evs[3].Record(s))
					check(evs[4].Record(s))
				}
			},
			"one+wait": func() {
				s := streams[0]
				for i := range n {
					check(evs[0].Record(be.compute))
					check(s.Wait(evs[0], 0))
					check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(i*piece)), unsafe.Pointer(&src[i*piece]), piece, s))
				}
			},
			"one+timing": func() {
				s := streams[0]
				for i := range n {
					check(evs[1].Record(s))
					check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(i*piece)), unsafe.Pointer(&src[i*piece]), piece, s))
					check(evs[2].Record(s))
				}
			},
			"one+records": func() {
				s := streams[0]
				for i := range n {
					check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(i*piece)), unsafe.Pointer(&src[i*piece]), piece, s))
					check(evs[3].Record(s))
					check(evs[4].Record(s))
				}
			},
			"two": func() {
				for i := range n {
					check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()+uintptr(i*piece)), unsafe.Pointer(&src[i*piece]), piece, streams[i%2]))
				}
			},
			"whole": func() {
				check(cu.MemcpyHtoDAsync(cu.DevicePtr(dst.Ptr()), unsafe.Pointer(&src[0]), piece*n, streams[0]))
			},
		}
		for _, way := range []string{"one", "one+events", "one+wait", "one+timing", "one+records", "two", "whole"} {
			b.Run(fmt.Sprintf("%s/%s", from, way), func(b *testing.B) {
				if err := be.enter("BenchmarkExpertCopies"); err != nil {
					b.Fatal(err)
				}
				defer be.leave()
				b.SetBytes(piece * n)
				for b.Loop() {
					ways[way]()
					check(streams[0].Synchronize())
					check(streams[1].Synchronize())
				}
			})
		}
	}
}
