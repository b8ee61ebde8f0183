//go:build cuda

package cuda

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// fileModel is hostModel's tensors written one after the other into a
// file (in /dev/shm when there is one, as the H200 runs keep their
// models): a paging.RangeSource whose reads come from the page cache, as
// the aggressive strategy's do, by pread (os.File.ReadAt, the loader's
// way) or, with mmap, by a copy from a mapping of the file (no system
// call, no page lookup per 4 KiB).
type fileModel struct {
	*hostModel
	f    *os.File
	off  map[string]int64
	size int64
	mm   []byte // the mapping; nil: reads by pread
}

// newFileModel writes m into a file removed at the end of the test.
func newFileModel(tb testing.TB, m *hostModel) *fileModel {
	tb.Helper()
	dir := tb.TempDir()
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "strata-staging-")
		if err == nil {
			dir = d
			tb.Cleanup(func() { os.RemoveAll(d) })
		}
	}
	f, err := os.Create(dir + "/model.bin")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { f.Close() })
	fm := &fileModel{hostModel: m, f: f, off: map[string]int64{}}
	for _, specs := range m.layers {
		for _, s := range specs {
			if _, err := f.WriteAt(m.data[s.Name], fm.size); err != nil {
				tb.Fatal(err)
			}
			fm.off[s.Name] = fm.size
			fm.size += s.Bytes
		}
	}
	tb.Logf("model file %s: %s", f.Name(), paging.FormatSize(fm.size))
	return fm
}

// mapped returns the model read from a mapping of its file, populated
// at once.
func (m *fileModel) mapped(tb testing.TB) *fileModel {
	tb.Helper()
	mm, err := unix.Mmap(int(m.f.Fd()), 0, int(m.size), unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		tb.Fatalf("mmap: %v", err)
	}
	tb.Cleanup(func() { unix.Munmap(mm) })
	c := *m
	c.mm = mm
	return &c
}

func (m *fileModel) ReadTensor(ctx context.Context, layer int, name string, dst []byte) error {
	if b, ok := m.data[name]; !ok || len(b) != len(dst) {
		return fmt.Errorf("file model: layer %d: no tensor %s of %d bytes", layer, name, len(dst))
	}
	return m.ReadTensorRange(ctx, layer, name, 0, dst)
}

func (m *fileModel) ReadTensorRange(ctx context.Context, layer int, name string, off int64, dst []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b, ok := m.data[name]
	if !ok || off < 0 || off+int64(len(dst)) > int64(len(b)) {
		return fmt.Errorf("file model: layer %d: tensor %s has no %d bytes at %d", layer, name, len(dst), off)
	}
	return m.readAt(dst, m.off[name]+off)
}

func (m *fileModel) readAt(dst []byte, at int64) error {
	if m.mm != nil {
		copy(dst, m.mm[at:])
		return nil
	}
	_, err := m.f.ReadAt(dst, at)
	return err
}

// readFile reads the whole file once on g goroutines in pieces of piece
// bytes, each goroutine into its own piece of dst (at least g*piece
// bytes), and returns the time it took.
func (m *fileModel) readFile(dst []byte, g int, piece int64) (time.Duration, error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, g)
	start := time.Now()
	for i := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			own := dst[int64(i)*piece : int64(i+1)*piece]
			for {
				at := next.Add(piece) - piece
				if at >= m.size {
					return
				}
				n := min(piece, m.size-at)
				if err := m.readAt(own[:n], at); err != nil {
					errs[i] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	for _, err := range errs {
		if err != nil {
			return el, err
		}
	}
	return el, nil
}

// copyPinned copies src (pinned) to dst in pieces of piece bytes, all
// queued at once, and waits for them to land.
func copyPinned(b *Backend, dst *tensor.Tensor, src []byte, piece int64) error {
	var lands []func() error
	for off := int64(0); off < int64(len(src)); off += piece {
		n := min(piece, int64(len(src))-off)
		ready, landed, err := b.UploadStaged(context.Background(), dst, off, src[off:off+n])
		if err != nil {
			return err
		}
		lands = append(lands, landed, ready)
	}
	for _, w := range lands {
		if err := w(); err != nil {
			return err
		}
	}
	return nil
}

// BenchmarkStagingCeiling measures what bounds the aggressive strategy's
// streaming on this machine, over a 7B-shaped F16 model of 6 blocks in a
// file in the page cache (2.8 GiB, more than 6 staging buffers, so that
// the host cache never keeps it; fileModel), each part alone and then
// together:
//
//   - h2d/piece=P: copies from pinned memory to the device alone, in
//     pieces of P (the bound the bench's "stream bound" assumes);
//   - read/{pread,mmap}/g=G/piece=P: the whole file read into pinned
//     memory on G goroutines in pieces of P, by pread (the loader's way)
//     or by copies from a mapping of the file; nothing copied to the
//     device;
//   - both/{pread,mmap}/g=G/piece=P: the same reads while copies of
//     another pinned buffer to the device run back to back: readGB/s and
//     h2dGB/s are each part's rate over the same time, with no dependency
//     between them (the memory system's ceiling for the two at once);
//   - pager/{pread,mmap}/g=G/piece=P/buffers=B: the pager's staging ring
//     over the file (aggressive, prefetch depth B-1, B staging buffers, G
//     readers, pieces of P: paging.Options), one pass over the layers an
//     iteration, acquire and release, no compute: GB/s is the pipeline's
//     rate, readGB/s the rate its reads ran at while they ran
//     (Stats.StagedReadGBps), %pinned its share of the h2d rate;
//   - pager/inplace/...: the same over the mapped file as a
//     paging.MappedSource: the ring page-locks the mapping and copies
//     every tensor in place (no read; readGB/s is 0), prefetch depth B-1.
//
// The aggressive strategy can reach min(h2d, both's readGB/s) at best;
// the pager's GB/s against that is the runtime's loss. Run it with
// -test.benchtime 3x (about a minute on the H200).
func BenchmarkStagingCeiling(b *testing.B) {
	g := openGPU(b)
	hm := newHostModel(6)
	files := map[string]*fileModel{"pread": newFileModel(b, hm)}
	files["mmap"] = files["pread"].mapped(b)
	var layerBytes int64
	for _, specs := range hm.layers {
		var n int64
		for _, s := range specs {
			n += s.Bytes
		}
		layerBytes = max(layerBytes, n)
	}
	const most = 1 << 30 // the readers' pinned memory: 16 goroutines of 64 MiB
	readBuf, err := g.AllocPinned(most)
	if err != nil {
		b.Fatal(err)
	}
	defer g.FreePinned(readBuf)
	h2dBuf, err := g.AllocPinned(512 << 20)
	if err != nil {
		b.Fatal(err)
	}
	defer g.FreePinned(h2dBuf)
	dst, err := g.Alloc(tensor.F16, tensor.Shape{512 << 19})
	if err != nil {
		b.Fatal(err)
	}
	defer g.Free(dst)
	goroutines := []int{4, 8, 12, 16}
	pieces := []int64{4 << 20, 16 << 20, 64 << 20}
	gbps := func(n int64, d time.Duration) float64 { return float64(n) / d.Seconds() / 1e9 }
	ms := func(p int64) string { return fmt.Sprintf("%dMiB", p>>20) }

	var pinned float64 // h2d at 16 MiB, for the pager's %pinned
	for _, p := range pieces {
		b.Run("h2d/piece="+ms(p), func(b *testing.B) {
			var moved int64
			for b.Loop() {
				if err := copyPinned(g, dst, h2dBuf, p); err != nil {
					b.Fatal(err)
				}
				moved += int64(len(h2dBuf))
			}
			r := gbps(moved, b.Elapsed())
			b.ReportMetric(r, "GB/s")
			if p == 16<<20 {
				pinned = r
			}
		})
	}
	for _, how := range []string{"pread", "mmap"} {
		fm := files[how]
		for _, gr := range goroutines {
			for _, p := range pieces {
				b.Run(fmt.Sprintf("read/%s/g=%d/piece=%s", how, gr, ms(p)), func(b *testing.B) {
					var moved int64
					for b.Loop() {
						if _, err := fm.readFile(readBuf, gr, p); err != nil {
							b.Fatal(err)
						}
						moved += fm.size
					}
					b.ReportMetric(gbps(moved, b.Elapsed()), "GB/s")
				})
			}
		}
	}
	for _, how := range []string{"pread", "mmap"} {
		fm := files[how]
		for _, gr := range goroutines {
			for _, p := range pieces {
				b.Run(fmt.Sprintf("both/%s/g=%d/piece=%s", how, gr, ms(p)), func(b *testing.B) {
					var readTime, h2dTime time.Duration
					var read, copied int64
					for b.Loop() {
						stop := make(chan struct{})
						done := make(chan error, 1)
						go func() {
							var n int64
							start := time.Now()
							for {
								select {
								case <-stop:
									h2dTime += time.Since(start)
									copied += n
									done <- nil
									return
								default:
								}
								if err := copyPinned(g, dst, h2dBuf, 16<<20); err != nil {
									done <- err
									return
								}
								n += int64(len(h2dBuf))
							}
						}()
						el, err := fm.readFile(readBuf, gr, p)
						close(stop)
						if err2 := <-done; err == nil {
							err = err2
						}
						if err != nil {
							b.Fatal(err)
						}
						readTime += el
						read += fm.size
					}
					r, c := gbps(read, readTime), gbps(copied, h2dTime)
					b.ReportMetric(r, "readGB/s")
					b.ReportMetric(c, "h2dGB/s")
					b.ReportMetric(r+c, "sumGB/s")
				})
			}
		}
	}

	// The pager's pipeline.
	info, err := paging.DescribeSource(hm)
	if err != nil {
		b.Fatal(err)
	}
	model := paging.ModelInfo{Layers: info, NumLayers: len(info) - 2}
	type pagerCase struct {
		how     string
		readers int
		piece   int64
		buffers int
	}
	var cases []pagerCase
	for _, gr := range goroutines {
		for _, p := range pieces {
			cases = append(cases, pagerCase{"pread", gr, p, 3})
		}
	}
	for _, gr := range []int{8, 16} {
		for _, bufs := range []int{4, 6} {
			cases = append(cases, pagerCase{"pread", gr, 16 << 20, bufs})
		}
		for _, bufs := range []int{3, 4, 6} {
			cases = append(cases, pagerCase{"mmap", gr, 16 << 20, bufs})
		}
	}
	for _, bufs := range []int{2, 3, 4} {
		cases = append(cases, pagerCase{"inplace", 8, 16 << 20, bufs})
	}
	for _, c := range cases {
		b.Run(fmt.Sprintf("pager/%s/g=%d/piece=%s/buffers=%d", c.how, c.readers, ms(c.piece), c.buffers), func(b *testing.B) {
			depth := c.buffers - 1
			probe, err := paging.Plan(model, 1<<40, paging.StrategyAggressive, 16, 1, paging.WithDevice(g), paging.WithMaxPrefetch(depth))
			if err != nil {
				b.Fatal(err)
			}
			budget := probe.MinBudgetBytes + int64(c.buffers)*layerBytes
			plan, err := paging.Plan(model, budget, paging.StrategyAggressive, 16, 1, paging.WithDevice(g), paging.WithMaxPrefetch(depth))
			if err != nil {
				b.Fatal(err)
			}
			if plan.PrefetchDepth != depth {
				b.Fatalf("plan's prefetch depth %d, want %d: %s", plan.PrefetchDepth, depth, plan)
			}
			bud, err := paging.NewBudget(g, budget, g.Name())
			if err != nil {
				b.Fatal(err)
			}
			defer bud.Close()
			src := files[c.how]
			if c.how == "inplace" {
				src = files["mmap"]
			}
			p, err := paging.NewPager(src, bud, plan, paging.Options{
				StagingSlots: c.buffers, StagingReaders: c.readers, StagingPiece: c.piece,
				HostCacheBytes:  int64(c.buffers) * (layerBytes + 64<<10),
				NoMappedUploads: c.how != "inplace",
			})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			want := c.buffers
			if c.how == "inplace" {
				want = 0 // pinned at the first load that needs one: none does
			}
			if st := p.Stats(); st.StagingSlots != want || st.StagingReaders != c.readers {
				b.Fatalf("staging ring of %d buffers and %d readers, want %d and %d", st.StagingSlots, st.StagingReaders, want, c.readers)
			}
			ctx := context.Background()
			pass := func() {
				for l := range hm.NumLayers() {
					if _, err := p.Acquire(ctx, l); err != nil {
						b.Fatal(err)
					}
					p.Release(l)
				}
			}
			pass() // warm the ring
			st0 := p.Stats()
			for b.Loop() {
				pass()
			}
			if err := g.Sync(); err != nil {
				b.Fatal(err)
			}
			st := p.Stats()
			r := gbps(st.BytesHostToDevice-st0.BytesHostToDevice, b.Elapsed())
			staged := st.BytesStaged - st0.BytesStaged
			b.ReportMetric(r, "GB/s")
			if rt := st.StagingReadTime - st0.StagingReadTime; rt > 0 {
				b.ReportMetric(gbps(staged, rt), "readGB/s")
			}
			if pinned > 0 {
				b.ReportMetric(100*r/pinned, "%pinned")
			}
			if c.how == "inplace" {
				staged = st.BytesMapped - st0.BytesMapped
			}
			if staged != st.BytesHostToDevice-st0.BytesHostToDevice {
				b.Errorf("%d bytes staged (or copied in place) of %d uploaded", staged, st.BytesHostToDevice-st0.BytesHostToDevice)
			}
		})
	}
}

// MappedRegions makes a mapped fileModel a paging.MappedSource: the
// staging ring page-locks the file's mapping and copies each tensor in
// place. Without a mapping it gives none.
func (m *fileModel) MappedRegions() [][]byte {
	if m.mm == nil {
		return nil
	}
	return [][]byte{m.mm}
}

func (m *fileModel) MappedTensor(layer int, name string) ([]byte, bool, error) {
	off, ok := m.off[name]
	if !ok {
		return nil, false, fmt.Errorf("file model: layer %d: no tensor %s", layer, name)
	}
	if m.mm == nil {
		return nil, false, nil
	}
	n := int64(len(m.data[name]))
	return m.mm[off : off+n : off+n], true, nil
}

// TestRegisterHostGPU page-locks a read-only mapping of a file
// (RegisterHost), copies from it to the device asynchronously in pieces,
// and checks the bytes; it logs the copy rate against the rate from
// AllocPinned memory. Unregistering twice is an error; a region left
// registered is undone by Close (openGPU's cleanup checks nothing is
// left). It skips without a CUDA device.
func TestRegisterHostGPU(t *testing.T) {
	// Memory left registered for the backend's Close: it must outlive it
	// (cleanups run last first).
	left := make([]byte, 1<<20)
	t.Cleanup(func() { runtime.KeepAlive(left) })
	g := openGPU(t)
	hm := newHostModel(1)
	fm := newFileModel(t, hm).mapped(t)
	const n = 386 << 20
	start := time.Now()
	unregister, err := g.RegisterHost(fm.mm)
	if err != nil {
		t.Fatalf("RegisterHost of a %s read-only file mapping: %v", paging.FormatSize(fm.size), err)
	}
	t.Logf("registered %s of mapped file in %v", paging.FormatSize(fm.size), time.Since(start).Round(time.Millisecond))
	src := fm.mm[fm.size-n:]
	dst, err := g.Alloc(tensor.F16, tensor.Shape{n / 2})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free(dst)
	best := time.Duration(1 << 62)
	for range 5 {
		start := time.Now()
		if err := copyPinned(g, dst, src, 16<<20); err != nil {
			t.Fatal(err)
		}
		best = min(best, time.Since(start))
	}
	got := make([]byte, n)
	if err := g.Download(got, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, src) {
		t.Fatal("the bytes copied from the registered mapping differ from the file's")
	}
	mapped := float64(n) / best.Seconds() / 1e9
	pinned := pinnedRate(t, g, n)
	t.Logf("copies from the registered file mapping: %.1f GB/s (%.0f%% of the pinned rate %.1f GB/s), best of 5 in pieces of 16 MiB", mapped, 100*mapped/pinned, pinned)
	if mapped < pinned/2 {
		t.Errorf("copies from the registered mapping at %.1f GB/s, under half the pinned rate %.1f GB/s", mapped, pinned)
	}
	if err := unregister(); err != nil {
		t.Errorf("unregister: %v", err)
	}
	if err := unregister(); err == nil {
		t.Error("a second unregister succeeded")
	}
	if _, err := g.RegisterHost(left); err != nil { // left for Close
		t.Errorf("RegisterHost of Go memory: %v", err)
	}
}

// TestPagerMappedGPU streams a 7B-shaped model of 4 blocks from a mapped
// file (fileModel: a paging.MappedSource) with the aggressive strategy:
// the staging ring page-locks the mapping and copies every tensor in
// place, with no read. It checks every byte of every layer before and
// after the timed passes, that every byte moved was copied in place, and
// that nothing stays registered or pinned after Close; it logs the rate
// against the pinned copy rate and against the same file read through the
// staging ring (NoMappedUploads). It skips without a CUDA device.
func TestPagerMappedGPU(t *testing.T) {
	began := time.Now()
	phase := func(what string) { t.Logf("[+%.1fs] %s", time.Since(began).Seconds(), what) }
	g := openGPU(t)
	hm := newHostModel(4)
	fm := newFileModel(t, hm).mapped(t)
	phase("model file written and mapped")
	info, err := paging.DescribeSource(fm)
	if err != nil {
		t.Fatal(err)
	}
	var layerBytes int64
	for _, li := range info {
		layerBytes = max(layerBytes, li.Bytes)
	}
	model := paging.ModelInfo{Layers: info, NumLayers: len(info) - 2}
	probe, err := paging.Plan(model, 1<<40, paging.StrategyAggressive, 16, 1, paging.WithDevice(g))
	if err != nil {
		t.Fatal(err)
	}
	budget := probe.MinBudgetBytes + 3*layerBytes
	plan, err := paging.Plan(model, budget, paging.StrategyAggressive, 16, 1, paging.WithDevice(g))
	if err != nil {
		t.Fatal(err)
	}
	pinned := pinnedRate(t, g, layerBytes)
	ctx := context.Background()
	run := func(name string, opts paging.Options) float64 {
		bud, err := paging.NewBudget(g, budget, g.Name())
		if err != nil {
			t.Fatal(err)
		}
		defer bud.Close()
		start := time.Now()
		p, err := paging.NewPager(fm, bud, plan, opts)
		if err != nil {
			t.Fatal(err)
		}
		phase(fmt.Sprintf("%s: pager made in %v", name, time.Since(start).Round(time.Millisecond)))
		verify := func(what string) {
			for l := range fm.NumLayers() {
				ws, err := p.Acquire(ctx, l)
				if err != nil {
					t.Fatalf("%s: %s: acquire %d: %v", name, what, l, err)
				}
				for _, s := range fm.layers[l] {
					got := make([]byte, s.Bytes)
					if err := g.Download(got, ws[s.Name]); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, hm.data[s.Name]) {
						t.Fatalf("%s: %s: layer %d tensor %s differs from the file's bytes", name, what, l, s.Name)
					}
				}
				p.Release(l)
			}
		}
		verify("first check")
		const passes = 3
		st0 := p.Stats()
		start = time.Now()
		for range passes {
			for l := range fm.NumLayers() {
				if _, err := p.Acquire(ctx, l); err != nil {
					t.Fatal(err)
				}
				p.Release(l)
			}
		}
		if err := g.Sync(); err != nil {
			t.Fatal(err)
		}
		el := time.Since(start)
		st := p.Stats()
		moved := st.BytesHostToDevice - st0.BytesHostToDevice
		inPlace := st.BytesMapped - st0.BytesMapped
		gbps := float64(moved) / el.Seconds() / 1e9
		t.Logf("%s: %d passes: %s in %v, %.1f GB/s (%.0f%% of the pinned rate %.1f); %s copied in place from %s page-locked, %s staged",
			name, passes, paging.FormatSize(moved), el.Round(time.Millisecond), gbps, 100*gbps/pinned, pinned,
			paging.FormatSize(inPlace), paging.FormatSize(st.MappedBytes), paging.FormatSize(st.BytesStaged-st0.BytesStaged))
		verify("second check")
		if !opts.NoMappedUploads && (inPlace != moved || st.MappedBytes != fm.size) {
			t.Errorf("%s: %d of %d bytes copied in place, %d bytes page-locked of the file's %d", name, inPlace, moved, st.MappedBytes, fm.size)
		}
		if !opts.NoMappedUploads && (st.StagingSlots != 0 || g.Stats().Pinned != 0) {
			t.Errorf("%s: %d staging buffers, %d bytes pinned: every tensor in place needs none", name, st.StagingSlots, g.Stats().Pinned)
		}
		if opts.NoMappedUploads && (st.BytesMapped != 0 || st.MappedBytes != 0) {
			t.Errorf("%s: %d bytes copied in place with NoMappedUploads", name, st.BytesMapped)
		}
		t.Logf("%s: %s", name, paging.Summary(bud))
		if err := p.Close(); err != nil {
			t.Errorf("%s: pager Close: %v", name, err)
		}
		if pinned := g.Stats().Pinned; pinned != 0 {
			t.Errorf("%s: %d pinned bytes after Close", name, pinned)
		}
		phase(name + ": closed")
		return gbps
	}
	inPlace := run("in place", paging.Options{})
	staged := run("read into the ring", paging.Options{NoMappedUploads: true})
	t.Logf("in place %.1f GB/s, read into the ring %.1f GB/s, pinned %.1f GB/s: in place at %.0f%% of the pinned rate", inPlace, staged, pinned, 100*inPlace/pinned)
	if inPlace < 0.8*pinned {
		t.Errorf("copies in place at %.1f GB/s, under 80%% of the pinned rate %.1f GB/s", inPlace, pinned)
	}
}
