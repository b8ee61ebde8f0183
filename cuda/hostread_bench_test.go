//go:build cuda

package cuda

import (
	"context"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/strata-llm/strata/tensor"
)

// BenchmarkHostMemoryRead times the CPU's one-row F16 products over a 7B
// decoder block's matrices (three copies, 1.2 GB: more than a host's last
// level cache) in host memory of four kinds, alone and while the copy
// engine streams a pinned buffer to the device without a pause (what a
// hybrid decode's CPU layers do): the driver's page-locked allocation
// (AllocPinned, the pager's host copies), the Go heap, an anonymous
// mapping advised to transparent huge pages, and that mapping page-locked
// (RegisterHost), from which copies run at the pinned rate too. It
// reports the CPU's GB/s, and the link's beside it. Threads: GOMAXPROCS.
func BenchmarkHostMemoryRead(b *testing.B) {
	be := openGPU(b)
	cpu := tensor.NewCPU(runtime.GOMAXPROCS(0))
	defer cpu.Close()
	if thp, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err == nil {
		b.Logf("transparent huge pages: %s", strings.TrimSpace(string(thp)))
	}
	shapes := [][2]int{{4096, 4096}, {4096, 4096}, {4096, 4096}, {4096, 4096}, {11008, 4096}, {11008, 4096}, {4096, 11008}}
	var block int64
	for _, s := range shapes {
		block += int64(s[0] * s[1] * 2)
	}
	const copies = 3
	size := block * copies
	// The link's load: 256 MiB from pinned memory to the device, again and again.
	const linkBytes = 256 << 20
	src, err := be.AllocPinned(linkBytes)
	if err != nil {
		b.Fatal(err)
	}
	defer be.FreePinned(src)
	dst, err := be.Alloc(tensor.F16, tensor.Shape{linkBytes / 2})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Free(dst)
	hugeMap := func(register bool) ([]byte, func(), error) {
		buf, err := syscall.Mmap(-1, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
		if err != nil {
			return nil, nil, err
		}
		if err := syscall.Madvise(buf, syscall.MADV_HUGEPAGE); err != nil {
			b.Logf("madvise: %v", err)
		}
		for i := range buf {
			buf[i] = byte(i)
		}
		free := func() { _ = syscall.Munmap(buf) }
		if register {
			unreg, err := be.RegisterHost(buf)
			if err != nil {
				free()
				return nil, nil, err
			}
			free = func() { _ = unreg(); _ = syscall.Munmap(buf) }
		}
		return buf, free, nil
	}
	kinds := []struct {
		name  string
		alloc func() ([]byte, func(), error)
	}{
		{"pinned", func() ([]byte, func(), error) {
			buf, err := be.AllocPinned(size)
			return buf, func() { _ = be.FreePinned(buf) }, err
		}},
		{"heap", func() ([]byte, func(), error) { return make([]byte, size), func() {}, nil }},
		{"hugepage", func() ([]byte, func(), error) { return hugeMap(false) }},
		{"hugepage-registered", func() ([]byte, func(), error) { return hugeMap(true) }},
	}
	for _, k := range kinds {
		buf, free, err := k.alloc()
		if err != nil {
			b.Fatalf("%s: %v", k.name, err)
		}
		logHugePages(b, k.name)
		type product struct{ w, x, y *tensor.Tensor }
		var ps []product
		var off int64
		for range copies {
			for _, s := range shapes {
				n := int64(s[0] * s[1] * 2)
				for i := off; i < off+n; i += 2 {
					buf[i], buf[i+1] = byte(i>>3), 0x2c // small F16 values
				}
				w, err := tensor.FromBytes(tensor.F16, tensor.Shape{s[0], s[1]}, buf[off:off+n])
				if err != nil {
					b.Fatal(err)
				}
				ps = append(ps, product{w, tensor.New(tensor.F32, tensor.Shape{1, s[1]}), tensor.New(tensor.F32, tensor.Shape{1, s[0]})})
				off += n
			}
		}
		pass := func() {
			for _, p := range ps {
				if err := cpu.MatMul(p.y, p.x, p.w, nil); err != nil {
					b.Fatal(err)
				}
			}
		}
		for _, beside := range []bool{false, true} {
			name := k.name + "/alone"
			if beside {
				name = k.name + "/beside-copies"
			}
			b.Run(name, func(b *testing.B) {
				pass() // untimed
				stop, done := make(chan struct{}), make(chan int64)
				if beside {
					go func() {
						var n int64
						for {
							select {
							case <-stop:
								done <- n
								return
							default:
							}
							ready, err := be.UploadAsync(context.Background(), dst, 0, src)
							if err == nil {
								err = ready()
							}
							if err == nil {
								err = be.Sync()
							}
							if err != nil {
								b.Error(err)
								done <- n
								return
							}
							n += linkBytes
						}
					}()
				}
				b.ResetTimer()
				for b.Loop() {
					pass()
				}
				b.StopTimer()
				sec := b.Elapsed().Seconds()
				b.ReportMetric(float64(size)*float64(b.N)/sec/1e9, "cpu-GB/s")
				if beside {
					close(stop)
					b.ReportMetric(float64(<-done)/sec/1e9, "link-GB/s")
				}
			})
		}
		free()
	}
}

// logHugePages logs the host's anonymous memory in huge pages now.
func logHugePages(b *testing.B, when string) {
	mi, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return
	}
	for _, l := range strings.Split(string(mi), "\n") {
		if strings.HasPrefix(l, "AnonHugePages") {
			b.Logf("%s: %s", when, l)
		}
	}
}
