package main

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/strata-llm/strata/engine"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// Ceilings are the machine's own limits, measured in the same run as the
// models: host-to-device copies of layer-sized buffers from pinned and
// pageable memory, and device memory bandwidth (bytes read plus written by
// a device-to-device copy).
type Ceilings struct {
	Kind         string  `json:"kind"` // "ceilings"
	Device       string  `json:"device"`
	CopyBytes    int64   `json:"copy_bytes"`
	PinnedGBps   float64 `json:"pinned_GBps"`
	PageableGBps float64 `json:"pageable_GBps"`
	DeviceGBps   float64 `json:"device_GBps"`
	// The hybrid strategy's rates (engine.MeasureRates): the CPU's product
	// over F16 weights in host memory at Threads, alone and while pinned
	// copies run, and the copies' rate while the CPU computes.
	CPUGBps       float64 `json:"cpu_GBps,omitempty"`
	CPUSharedGBps float64 `json:"cpu_shared_GBps,omitempty"`
	H2DSharedGBps float64 `json:"h2d_shared_GBps,omitempty"`
	Threads       int     `json:"threads,omitempty"`
}

// llama7BBlock is the matrices of a Llama-2-7B decoder block in F16, the
// shapes the CPU's rate is measured over for the ceilings.
func llama7BBlock() []paging.TensorSpec {
	var out []paging.TensorSpec
	for _, s := range [][2]int{{4096, 4096}, {4096, 4096}, {4096, 4096}, {4096, 4096}, {11008, 4096}, {11008, 4096}, {4096, 11008}} {
		out = append(out, paging.TensorSpec{DType: tensor.F16, Shape: tensor.Shape{s[0], s[1]}, Bytes: 2 * int64(s[0]) * int64(s[1])})
	}
	return out
}

// median of n timings of f.
func median(n int, f func() error) (time.Duration, error) {
	var ts []time.Duration
	for range n {
		t0 := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		ts = append(ts, time.Since(t0))
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
	return ts[len(ts)/2], nil
}

func measureCeilings(b tensor.Backend, threads int) (*Ceilings, error) {
	const size = 256 << 20 // about one 7B-shape decoder layer (405 MB) in two
	c := &Ceilings{Kind: "ceilings", Device: b.Name(), CopyBytes: size}
	dst, err := b.Alloc(tensor.F32, tensor.Shape{size / 4})
	if err != nil {
		return nil, err
	}
	defer b.Free(dst)
	sync := func() error {
		if s, ok := b.(tensor.Syncer); ok {
			return s.Sync()
		}
		return nil
	}

	pageable := make([]byte, size)
	for i := range pageable {
		pageable[i] = byte(i)
	}
	d, err := median(5, func() error {
		if err := b.Upload(dst, 0, pageable); err != nil {
			return err
		}
		return sync()
	})
	if err != nil {
		return nil, err
	}
	c.PageableGBps = float64(size) / d.Seconds() / 1e9

	pa, ok1 := b.(tensor.PinnedAllocator)
	au, ok2 := b.(tensor.AsyncUploader)
	if ok1 && ok2 {
		pinned, err := pa.AllocPinned(size)
		if err != nil {
			return nil, err
		}
		copy(pinned, pageable)
		d, err := median(7, func() error {
			ready, err := au.UploadAsync(context.Background(), dst, 0, pinned)
			if err != nil {
				return err
			}
			if err := ready(); err != nil {
				return err
			}
			return sync()
		})
		pa.FreePinned(pinned)
		if err != nil {
			return nil, err
		}
		c.PinnedGBps = float64(size) / d.Seconds() / 1e9
	}

	// Device memory: CopyRows of 1 GiB reads and writes it.
	const dev = 1 << 30
	src, err := b.Alloc(tensor.F32, tensor.Shape{dev / 4 / 1024, 1024})
	if err != nil {
		return nil, fmt.Errorf("device bandwidth buffer: %w", err)
	}
	defer b.Free(src)
	out, err := b.Alloc(tensor.F32, tensor.Shape{dev / 4 / 1024, 1024})
	if err != nil {
		return nil, fmt.Errorf("device bandwidth buffer: %w", err)
	}
	defer b.Free(out)
	rows := dev / 4 / 1024
	k := tensor.Checked(b)
	if err := k.CopyRows(out, 0, src, 0, rows); err != nil { // warm
		return nil, err
	}
	d, err = median(9, func() error {
		if err := k.CopyRows(out, 0, src, 0, rows); err != nil {
			return err
		}
		return sync()
	})
	if err != nil {
		return nil, err
	}
	c.DeviceGBps = 2 * float64(dev) / d.Seconds() / 1e9

	// The CPU beside the device, for the hybrid bounds.
	if _, ok := tensor.AsyncUpload(b); ok {
		cpu, err := tensor.OpenDevice("cpu", tensor.DeviceOptions{Threads: threads})
		if err != nil {
			return nil, err
		}
		defer cpu.Close()
		r, err := engine.MeasureRates(context.Background(), b, cpu, tensor.F16, 4096, llama7BBlock())
		if err != nil {
			return nil, fmt.Errorf("hybrid rates: %w", err)
		}
		c.CPUGBps, c.CPUSharedGBps, c.H2DSharedGBps = r.CPU/1e9, r.CPUShared/1e9, r.H2DShared/1e9
		if t, ok := cpu.(interface{ Threads() int }); ok {
			c.Threads = t.Threads()
		}
	}
	return c, nil
}
