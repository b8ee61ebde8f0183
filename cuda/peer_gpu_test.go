//go:build cuda

package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// openTwoGPUs opens devices 0 and 1, skipping with fewer than two GPUs,
// and closes them when the test ends.
func openTwoGPUs(t testing.TB) (*Backend, *Backend) {
	t.Helper()
	n, err := DeviceCount()
	if errors.Is(err, ErrNoDevice) || err == nil && n < 2 {
		t.Skipf("peer copies need two CUDA devices (have %d: %v)", n, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	var bs [2]*Backend
	for d := range bs {
		b, err := Open(d)
		if err != nil {
			t.Fatalf("Open(%d): %v", d, err)
		}
		t.Cleanup(func() {
			if err := b.Close(); err != nil {
				t.Errorf("Close %s: %v", b.Name(), err)
			}
		})
		bs[d] = b
	}
	return bs[0], bs[1]
}

// handoverSizes are the hidden states a pipeline hands over: one decode
// row of the 7B shape (4096 F32), a prefill chunk of 512 rows of it, and a
// chunk of 4096 rows.
var handoverSizes = []struct {
	name string
	rows int
}{{"1 row", 1}, {"512 rows", 512}, {"4096 rows", 4096}}

// TestPeerCopy: on two GPUs, CanCopyToPeer says whether the devices copy to
// each other directly (and PeerAccess why not, logged); when they do,
// CopyToPeer copies hidden states of every handover size both ways bit for
// bit, ordered after a write the receiver queued on the destination before
// it and before a read queued after it (no Sync in between), and a view (a
// row range) copies only its rows. It logs the time of one hand-over of
// each size device to device and through host memory (Download, Upload:
// what the pipeline does without peer access). It skips with fewer than
// two GPUs.
func TestPeerCopy(t *testing.T) {
	g0, g1 := openTwoGPUs(t)
	perr := g0.PeerAccess(g1)
	can := g0.CanCopyToPeer(g1)
	t.Logf("%s (%s) and %s (%s): peer access %v (%v)", g0.Name(), g0.Info().Name, g1.Name(), g1.Info().Name, can, perr)
	if can != (perr == nil) || can != g1.CanCopyToPeer(g0) {
		t.Fatalf("CanCopyToPeer %v and %v, PeerAccess %v: they disagree", can, g1.CanCopyToPeer(g0), perr)
	}
	if g0.CanCopyToPeer(g0) || g0.CanCopyToPeer(tensor.NewCPU(1)) {
		t.Fatal("CanCopyToPeer accepts the device itself or the CPU")
	}
	if !can {
		t.Skipf("these devices cannot access each other; the pipeline hands over through host memory: %v", perr)
	}
	r := newRand(t)
	const hidden = 4096
	for _, sz := range handoverSizes {
		n := sz.rows * hidden
		for _, dir := range [][2]*Backend{{g0, g1}, {g1, g0}} {
			from, to := dir[0], dir[1]
			t.Run(fmt.Sprintf("%s/%s to %s", sz.name, from.Name(), to.Name()), func(t *testing.T) {
				want := f32Bytes(uniform(r, n, -4, 4))
				src, err := from.Alloc(tensor.F32, tensor.Shape{sz.rows, hidden})
				if err != nil {
					t.Fatal(err)
				}
				defer from.Free(src)
				dst, err := to.Alloc(tensor.F32, tensor.Shape{sz.rows, hidden})
				if err != nil {
					t.Fatal(err)
				}
				defer to.Free(dst)
				if err := from.Upload(src, 0, want); err != nil {
					t.Fatal(err)
				}
				// A write queued on the receiver before the copy: the copy
				// must land after it.
				poison := f32Bytes(slices.Repeat([]float32{7}, n))
				if err := to.Upload(dst, 0, poison); err != nil {
					t.Fatal(err)
				}
				if err := from.CopyToPeer(to, dst, src); err != nil {
					t.Fatal(err)
				}
				got := make([]byte, len(want))
				if err := to.DownloadComputed(got, dst); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("peer copy of %d bytes differs", len(want))
				}
				if sz.rows > 1 {
					// The first row alone, into a buffer of poison.
					if err := to.Upload(dst, 0, poison); err != nil {
						t.Fatal(err)
					}
					if err := from.CopyToPeer(to, rowsOf(t, dst, 1), rowsOf(t, src, 1)); err != nil {
						t.Fatal(err)
					}
					if err := to.Download(got, dst); err != nil {
						t.Fatal(err)
					}
					seven := f32Bytes([]float32{7})
					if !bytes.Equal(got[:4*hidden], want[:4*hidden]) || !bytes.Equal(got[4*hidden:4*hidden+4], seven) {
						t.Fatal("a one-row view copied the wrong rows")
					}
				}
				peer, host := timeHandover(t, from, to, dst, src, true), timeHandover(t, from, to, dst, src, false)
				t.Logf("%s, %d bytes, %s to %s: peer %v (%.1f GB/s), through host memory %v (%.1f GB/s), %.2fx",
					sz.name, len(want), from.Name(), to.Name(), peer, gbps(len(want), peer), host, gbps(len(want), host), float64(host)/float64(peer))
			})
		}
	}
	if err := g0.CopyToPeer(tensor.NewCPU(1), nil, nil); err == nil {
		t.Error("CopyToPeer into the CPU: no error")
	}
}

// rowsOf is t's first n rows, a view.
func rowsOf(tb testing.TB, t *tensor.Tensor, n int) *tensor.Tensor {
	tb.Helper()
	v, err := t.Rows(0, n)
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

func gbps(n int, d time.Duration) float64 { return float64(n) / d.Seconds() / 1e9 }

// timeHandover is the mean time of one hand-over of src into dst, landed
// on the receiver: a peer copy, or a download into host memory and an
// upload, as the pipeline makes them, over enough rounds for a stable
// mean.
func timeHandover(tb testing.TB, from, to *Backend, dst, src *tensor.Tensor, peer bool) time.Duration {
	tb.Helper()
	buf := make([]byte, src.NumBytes())
	once := func() {
		if peer {
			if err := from.CopyToPeer(to, dst, src); err != nil {
				tb.Fatal(err)
			}
		} else {
			if err := from.DownloadComputed(buf, src); err != nil {
				tb.Fatal(err)
			}
			if err := to.Upload(dst, 0, buf); err != nil {
				tb.Fatal(err)
			}
		}
		if err := to.Sync(); err != nil {
			tb.Fatal(err)
		}
	}
	once() // warm
	rounds := 0
	t0 := time.Now()
	for rounds < 20 || time.Since(t0) < 200*time.Millisecond && rounds < 2000 {
		once()
		rounds++
	}
	return time.Since(t0) / time.Duration(rounds)
}

// BenchmarkHandover is one hand-over of the hidden state between two GPUs,
// device to device (peer) and through host memory (host), for the handover
// sizes, landed on the receiver: GB/s and the time of one. It skips with
// fewer than two GPUs, and the peer case without peer access.
func BenchmarkHandover(b *testing.B) {
	g0, g1 := openTwoGPUs(b)
	const hidden = 4096
	for _, sz := range handoverSizes {
		for _, path := range []string{"peer", "host"} {
			b.Run(sz.name+"/"+path, func(b *testing.B) {
				if path == "peer" && !g0.CanCopyToPeer(g1) {
					b.Skipf("no peer access: %v", g0.PeerAccess(g1))
				}
				src, err := g0.Alloc(tensor.F32, tensor.Shape{sz.rows, hidden})
				if err != nil {
					b.Fatal(err)
				}
				defer g0.Free(src)
				dst, err := g1.Alloc(tensor.F32, tensor.Shape{sz.rows, hidden})
				if err != nil {
					b.Fatal(err)
				}
				defer g1.Free(dst)
				buf := make([]byte, src.NumBytes())
				for b.Loop() {
					if path == "peer" {
						err = g0.CopyToPeer(g1, dst, src)
					} else if err = g0.DownloadComputed(buf, src); err == nil {
						err = g1.Upload(dst, 0, buf)
					}
					if err == nil {
						err = g1.Sync()
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				per := b.Elapsed() / time.Duration(b.N)
				b.ReportMetric(gbps(int(src.NumBytes()), per), "GB/s")
				b.ReportMetric(float64(per.Nanoseconds())/1e3, "us/handover")
			})
		}
	}
}
