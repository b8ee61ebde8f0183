package engine

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// rateBytes is the size the copies and the GPU's product are measured
// over: large enough to leave the caches far behind, small enough that all
// of MeasureRates takes about a second. (Variables so that tests on a
// slow CPU can measure less.)
var rateBytes = 256 << 20

// cpuRateMinBytes is the least the CPU's measurement reads per pass: the
// block's matrices are allocated again up to it, so that a pass reads more
// than a host's last-level cache holds (hosts with 256 MB and more of it
// exist; a 7B block alone, 405 MB, measured 112-129 GB/s where the model ran
// at 88). A small model's blocks are read from the caches when it runs, and
// are measured so.
var cpuRateMinBytes int64 = 1 << 30

// rateRows are the rows of x that Rates.CPURows is measured over: a
// prefill chunk's tokens for one expert, a few dozen.
const rateRows = 32

// MeasureRates measures what the hybrid planner needs, on the machine as it
// is now: pinned copies from host memory to gpu; the CPU's products, on
// cpu at its threads, over weights shaped as block's matrices (one decoder
// block of the model, as the CPU computes it: from pinned host memory, one
// product per matrix); both at once; the GPU's product over weights of
// dtype dt in its own memory; the CPU's products over a chunk of rows
// (Rates.CPURows), and two at once (Rates.CPUExperts); and the hand-over of a hidden state of hidden floats
// between them (Rates.Handoff: half of a download and an upload). A first version measured the CPU over one
// large matrix and read 120 GB/s where the model's blocks ran at 85: the
// products' shapes and count matter. The device memory it takes is freed
// (and the allocator's cache trimmed) before it returns, so a budget made
// afterwards finds the device as it was.
func MeasureRates(ctx context.Context, gpu, cpu tensor.Backend, dt tensor.DType, hidden int, block []paging.TensorSpec) (r paging.Rates, err error) {
	return measureRates(ctx, gpu, cpu, dt, hidden, block, nil)
}

// MeasureCalibratedRates is MeasureRates, then CalibrateCPU for the
// model cfg (its KV cache in kv, up to maxPos positions) over the same
// host copies of the block, which MeasureRates has made and filled
// already, and again while copies to gpu run (r.CPUShared,
// r.CPULayerShared: the CPU's rate and a block's fixed cost as decode
// sees them while the copy engine streams), and calibrateDevice on gpu
// (r.DeviceStage). The calibration's medians replace MeasureRates' best
// CPU rates (calibrator.run says why).
func MeasureCalibratedRates(ctx context.Context, gpu, cpu tensor.Backend, dt tensor.DType, cfg *arch.Config, kv tensor.DType, maxPos int, block []paging.TensorSpec) (paging.Rates, error) {
	return measureRates(ctx, gpu, cpu, dt, cfg.HiddenSize, block, &calibration{cfg: cfg, kv: kv, maxPos: maxPos})
}

// calibration is what CalibrateCPU needs besides the rates and the block.
type calibration struct {
	cfg    *arch.Config
	kv     tensor.DType
	maxPos int
}

func measureRates(ctx context.Context, gpu, cpu tensor.Backend, dt tensor.DType, hidden int, block []paging.TensorSpec, calib *calibration) (r paging.Rates, err error) {
	pa, ok1 := tensor.Pinned(gpu)
	au, ok2 := tensor.AsyncUpload(gpu)
	if !ok1 || !ok2 {
		return r, fmt.Errorf("engine: measuring rates: %s cannot copy from pinned memory", gpu.Name())
	}
	if !dt.IsFloat() {
		dt = tensor.F16
	}
	const k = 4096
	n := rateBytes / k / dt.Size()
	shape := tensor.Shape{n, k}

	// The device side: a weight matrix that the copies land in and the
	// GPU's product reads.
	gk := tensor.Checked(gpu)
	wDev, err := gpu.Alloc(dt, shape)
	if err != nil {
		return r, fmt.Errorf("engine: measuring rates: %w", err)
	}
	xDev, err1 := gpu.Alloc(tensor.F32, tensor.Shape{1, k})
	yDev, err2 := gpu.Alloc(tensor.F32, tensor.Shape{1, n})
	defer func() {
		gpu.Free(wDev)
		gpu.Free(xDev)
		gpu.Free(yDev)
		if ca, ok := tensor.Caching(gpu); ok {
			ca.Trim()
		}
	}()
	if err := errors.Join(err1, err2); err != nil {
		return r, fmt.Errorf("engine: measuring rates: %w", err)
	}
	pinned, err := pa.AllocPinned(wDev.NumBytes())
	if err != nil {
		return r, fmt.Errorf("engine: measuring rates: %w", err)
	}
	defer pa.FreePinned(pinned)
	fillRandom(pinned, dt)

	// The host side: the block's matrices in pinned host memory, each with
	// its input and output, repeated to cpuRateMinBytes, all in one pinned
	// allocation: a small block (one expert of a small model) repeated to
	// 1 GiB was tens of thousands of allocations, and the CUDA backend
	// looks a copy's source up among its pinned allocations, so that each
	// upload of the hand-over below took 0.9 ms among them where decode's
	// take 20 us.
	ck := tensor.Checked(cpu)
	var mats []paging.TensorSpec
	var passBytes, passAligned int64
	for _, ts := range block {
		if len(ts.Shape) != 2 || !ts.DType.IsFloat() && !ts.DType.IsQuantized() {
			continue
		}
		mats = append(mats, ts)
		passBytes += ts.Bytes
		passAligned += alignPinned(ts.Bytes)
	}
	if len(mats) == 0 {
		return r, errors.New("engine: measuring rates: the block has no matrix")
	}
	passes := max(1, (cpuRateMinBytes+passBytes-1)/passBytes)
	hostW, err := pa.AllocPinned(passes * passAligned)
	if err != nil {
		return r, fmt.Errorf("engine: measuring rates: %w", err)
	}
	defer pa.FreePinned(hostW)
	type product struct{ w, x, y *tensor.Tensor }
	var products []product
	var copies []nn.LayerWeights // the block's matrices, by name, in each pass
	cpuBytes := float64(passes * passBytes)
	var off int64
	for range passes {
		copies = append(copies, nn.LayerWeights{})
		for _, ts := range mats {
			b := hostW[off : off+ts.Bytes]
			off += alignPinned(ts.Bytes)
			fillRandom(b, ts.DType)
			w, err := tensor.FromBytes(ts.DType, ts.Shape, b)
			if err != nil {
				return r, err
			}
			products = append(products, product{w, tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[1]}), tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[0]})})
			copies[len(copies)-1][ts.Name] = w
		}
	}
	hbuf := make([]byte, 4*hidden)
	hDev, err := gpu.Alloc(tensor.F32, tensor.Shape{1, hidden})
	if err != nil {
		return r, fmt.Errorf("engine: measuring rates: %w", err)
	}
	defer gpu.Free(hDev)

	copyOnce := func() error {
		ready, err := au.UploadAsync(ctx, wDev, 0, pinned)
		if err != nil {
			return err
		}
		if err := ready(); err != nil {
			return err
		}
		return tensor.Sync(gpu)
	}
	cpuOnce := func() error {
		for _, p := range products {
			if err := ck.MatMul(p.y, p.x, p.w, nil); err != nil {
				return err
			}
		}
		return nil
	}
	// Two products at once, each over its own weights (a sparse block's
	// experts on the CPU, several at once): the products split between two
	// goroutines, each spread over the CPU's threads with the other's.
	pairOnce := func() error {
		var errs [2]error
		var wg sync.WaitGroup
		for g := range 2 {
			wg.Go(func() {
				for i := g; i < len(products) && errs[g] == nil; i += 2 {
					p := products[i]
					errs[g] = ck.MatMul(p.y, p.x, p.w, nil)
				}
			})
		}
		wg.Wait()
		return errors.Join(errs[:]...)
	}
	// The rows' arithmetic: one pass's products over a chunk of rateRows
	// rows (the weights read once, each row multiplied with them).
	var chunk []product
	for _, p := range products[:len(mats)] {
		chunk = append(chunk, product{p.w, tensor.New(tensor.F32, tensor.Shape{rateRows, p.w.Shape()[1]}), tensor.New(tensor.F32, tensor.Shape{rateRows, p.w.Shape()[0]})})
	}
	rowsOnce := func() error {
		for _, p := range chunk {
			if err := ck.MatMul(p.y, p.x, p.w, nil); err != nil {
				return err
			}
		}
		return nil
	}
	gpuOnce := func() error {
		if err := gk.MatMul(yDev, xDev, wDev, nil); err != nil {
			return err
		}
		return tensor.Sync(gpu)
	}
	// A hand-over as decode makes one: the hidden state down once the
	// compute queued before it is done (copies may go on), and a row up
	// from ordinary memory.
	handOnce := func() error {
		if err := tensor.DownloadComputed(gpu, hbuf, hDev); err != nil {
			return err
		}
		return gpu.Upload(hDev, 0, hbuf)
	}
	bytes := float64(wDev.NumBytes())
	rate := func(d time.Duration) float64 { return bytes / d.Seconds() }
	cpuRate := func(d time.Duration) float64 { return cpuBytes / d.Seconds() }
	var d time.Duration
	if d, err = best(3, copyOnce); err != nil {
		return r, err
	}
	r.H2D = rate(d)
	if d, err = best(3, cpuOnce); err != nil {
		return r, err
	}
	r.CPU = cpuRate(d)
	if d, err = best(3, pairOnce); err != nil {
		return r, err
	}
	r.CPUExperts = cpuRate(d)
	if d, err = best(3, rowsOnce); err != nil {
		return r, err
	}
	r.CPURows = float64(rateRows*passBytes) / d.Seconds()
	if d, err = best(5, gpuOnce); err != nil {
		return r, err
	}
	r.Device = rate(d)
	if d, err = median(15, handOnce); err != nil {
		return r, err
	}
	r.Handoff = d / 2 // one way of the round trip
	// Both at once: each path is timed while the other runs without a
	// pause (timing both loops side by side measured mostly the CPU alone:
	// its passes outlast the copies').
	while := func(background, timed func() error, n int) (d time.Duration, err error) {
		err = whileRunning(background, func() (err error) {
			d, err = best(n, timed)
			return err
		})
		return d, err
	}
	dc, err := while(copyOnce, cpuOnce, 3)
	if err != nil {
		return r, err
	}
	dh, err := while(cpuOnce, copyOnce, 5)
	if err != nil {
		return r, err
	}
	r.H2DShared, r.CPUShared = rate(dh), cpuRate(dc)
	if calib != nil {
		c := calibrator{cpu: cpu, cfg: calib.cfg, block: block, kv: calib.kv, maxPos: calib.maxPos,
			copies: copies[:min(len(copies), calibrateMaxCopies)], copyOnce: copyOnce}
		if err := c.run(ctx, &r); err != nil {
			return r, err
		}
		if err := calibrateDevice(ctx, gpu, calib.cfg, block, calib.kv, &r, stopwatch{}, c.copies[0]); err != nil {
			return r, err
		}
	}
	return r, ctx.Err()
}

// best runs f n times and returns the shortest time (the machine's rate
// with the least interference), after one untimed run.
func best(n int, f func() error) (time.Duration, error) {
	ts, err := timings(n, f)
	if err != nil {
		return 0, err
	}
	return ts[0], nil
}

// median runs f n times and returns the median time, after one untimed
// run: for a short operation that decode repeats, what a step pays rather
// than the luckiest run.
func median(n int, f func() error) (time.Duration, error) {
	ts, err := timings(n, f)
	if err != nil {
		return 0, err
	}
	return ts[n/2], nil
}

// timings runs f once untimed, then n times (n > 0), and returns the n
// times in increasing order.
func timings(n int, f func() error) ([]time.Duration, error) {
	if err := f(); err != nil {
		return nil, err
	}
	ts := make([]time.Duration, 0, n)
	for range n {
		t0 := time.Now()
		if err := f(); err != nil {
			return nil, err
		}
		ts = append(ts, time.Since(t0))
	}
	slices.Sort(ts)
	return ts, nil
}

// alignPinned rounds a matrix's bytes up to the offset of the next one in
// a shared pinned allocation.
func alignPinned(n int64) int64 { return (n + 63) &^ 63 }

// fillRandom writes small finite values of dtype dt, so that the pages are
// real (not the zero page) and the products run on ordinary numbers: a
// random 64 KiB pattern, repeated.
func fillRandom(b []byte, dt tensor.DType) {
	rng := rand.New(rand.NewPCG(1, 2))
	if qt, ok := dt.Quant(); ok && dt.IsQuantized() {
		// Whole blocks of the format, quantized from values of about
		// 0.1 .. 0.2 in size, so that their scales are ordinary numbers.
		per := max(1, (64<<10)/dt.BlockBytes())
		vals := make([]float32, per*dt.BlockSize())
		for i := range vals {
			vals[i] = (0.1 + 0.1*rng.Float32()) * float32(1-2*rng.IntN(2))
		}
		pat := make([]byte, per*dt.BlockBytes())
		if err := qt.Quantize(pat, vals); err == nil {
			for off := 0; off < len(b); off += len(pat) {
				copy(b[off:], pat)
			}
			return
		}
	}
	pat := make([]byte, min(len(b), 64<<10))
	switch dt.Size() {
	case 2:
		for i := 0; i+1 < len(pat); i += 2 {
			v := uint16(0x3000 | rng.IntN(0x0400)) // about 0.1 .. 0.2 in F16
			if dt == tensor.BF16 {
				v = uint16(0x3d00 | rng.IntN(0x80))
			}
			pat[i], pat[i+1] = byte(v), byte(v>>8)
		}
	default:
		for i := 0; i+3 < len(pat); i += 4 {
			pat[i], pat[i+1], pat[i+2], pat[i+3] = 0, byte(rng.IntN(256)), 0x80|byte(rng.IntN(64)), 0x3d
		}
	}
	for off := 0; off < len(b); off += len(pat) {
		copy(b[off:], pat)
	}
}
