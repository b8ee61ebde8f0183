package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/strata-llm/strata/arch"
	"github.com/strata-llm/strata/nn"
	"github.com/strata-llm/strata/paging"
	"github.com/strata-llm/strata/tensor"
)

// The positions CalibrateCPU times a block at: a few, where the attention
// costs next to nothing, and many (at most the context), where its reads
// of the KV cache show.
const (
	calibrateShortPos = 16
	calibrateLongPos  = 4096
	// calibrateMaxCopies bounds the copies of the block CalibrateCPU
	// cycles through (cpuRateMinBytes of them, for blocks that small).
	calibrateMaxCopies = 32
	// calibrateMinReps and calibrateMaxReps bound the repetitions of
	// each phase (alone, beside copies); between them, calibrateBudget
	// does.
	calibrateMinReps = 3
	calibrateMaxReps = 15
	// calibrateBudget is the wall time the repetitions may take, all
	// phases together, once each phase has its calibrateMinReps: about
	// 10 repetitions of a 7B block with 16 threads (a pass over the
	// products of 1 GiB, the block at two positions: 25 ms).
	calibrateBudget = 300 * time.Millisecond
)

// CalibrateCPU measures what the rates' bytes leave out of a decoder
// block computed on the CPU in decode, on a synthetic block of the model's
// shape (block's tensors, block 0's names, random values): the CPU's fixed
// cost for each block (r.CPULayer: its norms, rope, the worker pool's fork
// and join around each op, what the fused products gain or lose against
// the separate products the CPU's rate is measured over) and the rate its
// attention reads a KV cache of dtype kv at (r.CPUAttention). It times the
// block over copies of it that together take at least cpuRateMinBytes (so
// that they are read from memory, as the model's blocks are), at a few
// positions and at up to maxPos (when the KV reads there weigh an eighth
// of the block's bytes at least), and beside each time a pass of the
// separate products over the same copies, several times (calibrator.run
// says how, and why medians). It sets r.CPU to the products' median rate,
// so that a block's bytes at r.CPU and r.CPULayer add up to its median
// time. A sparse block (a mixture of experts) is not timed: r is left as
// it is.
func CalibrateCPU(ctx context.Context, cpu tensor.Backend, cfg *arch.Config, block []paging.TensorSpec, kv tensor.DType, maxPos int, r *paging.Rates) error {
	var blockBytes int64
	for _, ts := range block {
		blockBytes += ts.Bytes
	}
	if blockBytes <= 0 {
		return fmt.Errorf("engine: calibrating the CPU: the block has no tensors")
	}
	n := int(min(max((cpuRateMinBytes+blockBytes-1)/blockBytes, 1), calibrateMaxCopies))
	return calibrateWith(ctx, cpu, cfg, block, kv, maxPos, r, make([]nn.LayerWeights, n))
}

// calibrateWith is CalibrateCPU over the given copies of the block: the
// tensors they lack are allocated on cpu and filled, a copy's own for the
// matrices and one shared by every copy for the others (norms, biases).
func calibrateWith(ctx context.Context, cpu tensor.Backend, cfg *arch.Config, block []paging.TensorSpec, kv tensor.DType, maxPos int, r *paging.Rates, copies []nn.LayerWeights) error {
	return calibrator{cpu: cpu, cfg: cfg, block: block, kv: kv, maxPos: maxPos, copies: copies}.run(ctx, r)
}

// calibrator is one calibration of the CPU's block.
type calibrator struct {
	cpu    tensor.Backend
	cfg    *arch.Config
	block  []paging.TensorSpec
	kv     tensor.DType
	maxPos int
	copies []nn.LayerWeights
	// copyOnce, when set, is one pinned copy to the device: the block
	// and the products are timed again while it runs without a pause, as
	// decode computes the CPU's layers while the copy engine streams
	// (r.CPUShared, r.CPULayerShared).
	copyOnce func() error
	// sw times the runs; the zero one, the wall clock.
	sw stopwatch
}

// stopwatch times the calibration's runs and tells the time its budget
// is counted on. The zero stopwatch is the wall clock; tests give one
// that makes the times up.
type stopwatch struct {
	now  func() time.Time
	time func(what string, f func() error) (time.Duration, error)
}

func (sw stopwatch) elapsed(since time.Time) time.Duration {
	if sw.now == nil {
		return time.Since(since)
	}
	return sw.now().Sub(since)
}

func (sw stopwatch) start() time.Time {
	if sw.now == nil {
		return time.Now()
	}
	return sw.now()
}

// run times f as what (products, block, long block; with " shared"
// beside copies).
func (sw stopwatch) run(what string, f func() error) (time.Duration, error) {
	if sw.time != nil {
		return sw.time(what, f)
	}
	t0 := time.Now()
	err := f()
	return time.Since(t0), err
}

// run calibrates r. Each repetition times a pass of the separate products
// over the copies (the CPU's rate), then the block at the short position,
// then at the long one; the block's fixed cost of a repetition is its time
// less its bytes at that repetition's rate, so that a machine that slows
// for a while (a neighbour, the clock) slows both and the difference
// holds. Of the repetitions it keeps the medians: of the rates, the
// attention's rates and the fixed costs. The median, not the minimum
// (which MeasureRates takes of a single rate, whose noise only ever adds
// time): the fixed cost is a difference of two noisy times, whose
// minimum picks the repetition where the block was lucky and its
// products not, and the planner predicts decode, which runs at the
// machine's usual rate, not its best. The repetitions stop after
// calibrateMaxReps, or once calibrateBudget is spent and each phase has
// calibrateMinReps. r.CPU must be set (MeasureRates' measure, kept when
// no repetition runs).
func (c calibrator) run(ctx context.Context, r *paging.Rates) error {
	if r.CPU <= 0 {
		return fmt.Errorf("engine: calibrating the CPU: %w: the CPU rate is %v", paging.ErrBadRates, r.CPU)
	}
	cfg := c.cfg
	if cfg.Sparse(0) {
		return nil
	}
	kv := c.kv
	if kv == tensor.Invalid {
		kv = tensor.F32
	}
	var blockBytes int64
	for _, ts := range c.block {
		blockBytes += ts.Bytes
	}
	copies, cpu := c.copies, c.cpu
	var owned []*tensor.Tensor
	defer func() {
		for _, t := range owned {
			cpu.Free(t)
		}
	}()
	alloc := func(ts paging.TensorSpec) (*tensor.Tensor, error) {
		t, err := cpu.Alloc(ts.DType, ts.Shape)
		if err != nil {
			return nil, fmt.Errorf("engine: calibrating the CPU: %w", err)
		}
		owned = append(owned, t)
		fillRandom(t.Bytes(), ts.DType)
		return t, nil
	}
	shared := map[string]*tensor.Tensor{}
	type product struct{ w, x, y *tensor.Tensor }
	var products []product
	var productBytes int64
	for i := range copies {
		if copies[i] == nil {
			copies[i] = nn.LayerWeights{}
		}
		for _, ts := range c.block {
			if copies[i][ts.Name] == nil {
				if len(ts.Shape) < 2 {
					if shared[ts.Name] == nil {
						t, err := alloc(ts)
						if err != nil {
							return err
						}
						shared[ts.Name] = t
					}
					copies[i][ts.Name] = shared[ts.Name]
					continue
				}
				t, err := alloc(ts)
				if err != nil {
					return err
				}
				copies[i][ts.Name] = t
			}
			if len(ts.Shape) == 2 && (ts.DType.IsFloat() || ts.DType.IsQuantized()) {
				w := copies[i][ts.Name]
				products = append(products, product{w, tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[1]}), tensor.New(tensor.F32, tensor.Shape{1, ts.Shape[0]})})
				productBytes += w.NumBytes()
			}
		}
	}
	if len(products) == 0 {
		return errors.New("engine: calibrating the CPU: the block has no matrix")
	}
	ck := tensor.Checked(cpu)
	pass := func() error {
		for _, p := range products {
			if err := ck.MatMul(p.y, p.x, p.w, nil); err != nil {
				return err
			}
		}
		return nil
	}

	limit := min(c.maxPos, cfg.ContextLength()) - 1
	p0 := min(calibrateShortPos, max(limit, 0))
	p1 := min(calibrateLongPos, limit)
	kvPerPos := nn.KVCacheBytes(cfg, 1, kv) / int64(max(cfg.NumLayers, 1))
	// The attention's rate shows only over KV reads that weigh against
	// the block's bytes: an eighth of them at least.
	if int64(p1-p0)*kvPerPos < blockBytes/8 {
		p1 = p0
	}
	o := nn.SessionOptions{KVDType: kv}
	short, err := nn.NewBlockTimer(ctx, cfg, cpu, copies, 0, p0, o)
	if err != nil {
		return fmt.Errorf("engine: calibrating the CPU: %w", err)
	}
	defer short.Close()
	var long *nn.BlockTimer
	if p1 > p0 {
		if long, err = nn.NewBlockTimer(ctx, cfg, cpu, copies, 0, p1, o); err != nil {
			return fmt.Errorf("engine: calibrating the CPU: %w", err)
		}
		defer long.Close()
	}
	if err := pass(); err != nil { // untimed, as the blocks' first steps
		return fmt.Errorf("engine: calibrating the CPU: %w", err)
	}

	// One phase: repetitions of a pass and the block (and the long block
	// when alone), until its share of the budget is spent.
	type rep struct{ pass, t0, t1 time.Duration }
	begin := c.sw.start()
	phases := 1
	if c.copyOnce != nil {
		phases = 2
	}
	phase := func(k int, suffix string, withLong bool) ([]rep, error) {
		var reps []rep
		for len(reps) < calibrateMinReps || len(reps) < calibrateMaxReps && c.sw.elapsed(begin) < calibrateBudget*time.Duration(k+1)/time.Duration(phases) {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			var x rep
			var err error
			if x.pass, err = c.sw.run("products"+suffix, pass); err != nil {
				return nil, err
			}
			if x.t0, err = c.sw.run("block"+suffix, func() error { return short.Step(ctx) }); err != nil {
				return nil, err
			}
			if withLong && long != nil {
				if x.t1, err = c.sw.run("long block"+suffix, func() error { return long.Step(ctx) }); err != nil {
					return nil, err
				}
			}
			reps = append(reps, x)
		}
		return reps, nil
	}
	alone, err := phase(0, "", true)
	if err != nil {
		return fmt.Errorf("engine: calibrating the CPU: %w", err)
	}
	var beside []rep
	if c.copyOnce != nil {
		err := whileRunning(c.copyOnce, func() (err error) {
			beside, err = phase(1, " shared", false)
			return err
		})
		if err != nil {
			return fmt.Errorf("engine: calibrating the CPU: %w", err)
		}
	}

	rate := func(d time.Duration) float64 { return float64(productBytes) / max(d, time.Nanosecond).Seconds() }
	var attentions []float64
	for _, x := range alone {
		if _, a := cpuCosts(x.t0, x.t1, p0, p1, kvPerPos, blockBytes, rate(x.pass)); a > 0 {
			attentions = append(attentions, a)
		}
	}
	var attention float64
	if len(attentions) > 0 {
		slices.Sort(attentions)
		n := len(attentions)
		attention = (attentions[(n-1)/2] + attentions[n/2]) / 2
	}
	// fixed is each repetition's fixed cost, at its own rate, with the
	// short position's KV reads at the attention's rate (the CPU's when
	// none was measured), slower beside copies as the CPU is.
	fixed := func(reps []rep, slow float64) ([]time.Duration, float64) {
		var ds, passes []time.Duration
		for _, x := range reps {
			cr := rate(x.pass)
			at := attention * slow
			if at <= 0 {
				at = cr
			}
			ds = append(ds, blockFixed(x.t0, int64(p0)*kvPerPos, blockBytes, cr, at))
			passes = append(passes, x.pass)
		}
		return ds, rate(paging.SpreadOf(passes).Median)
	}
	ds, cpuRate := fixed(alone, 1)
	r.CPU, r.CPUAttention = cpuRate, attention
	r.CPULayerSpread = paging.SpreadOf(ds)
	r.CPULayer = max(r.CPULayerSpread.Median, 0)
	if len(beside) > 0 {
		ds, sharedRate := fixed(beside, 1)
		ds, sharedRate = fixed(beside, sharedRate/cpuRate)
		r.CPUShared = sharedRate
		r.CPULayerSharedSpread = paging.SpreadOf(ds)
		r.CPULayerShared = max(r.CPULayerSharedSpread.Median, 0)
	}
	return ctx.Err()
}

// whileRunning runs timed while background runs again and again, without
// a pause (its first run started before timed starts), and returns once
// both have stopped.
func whileRunning(background func() error, timed func() error) error {
	stop := make(chan struct{})
	started := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		close(started)
		for {
			select {
			case <-stop:
				errc <- nil
				return
			default:
			}
			if err := background(); err != nil {
				errc <- err
				return
			}
		}
	}()
	<-started
	err := timed()
	close(stop)
	return errors.Join(err, <-errc)
}

// blockFixed is a block's fixed cost on the CPU: its time t less its
// bytes at cpuRate and kvBytes of KV reads at attention (may be < 0).
func blockFixed(t time.Duration, kvBytes, blockBytes int64, cpuRate, attention float64) time.Duration {
	return t - time.Duration((float64(blockBytes)/cpuRate+float64(kvBytes)/attention)*1e9)
}

// cpuCosts derives a block's fixed cost on the CPU and its attention's
// rate from the block's times t0 at p0 positions and t1 at p1 (p1 = p0
// when only t0 was measured): the rate is the KV bytes between the two
// over the time between them (0, the CPU's rate, when the time did not
// grow); the fixed cost is t0 less blockBytes at cpuRate and p0 rows of KV
// at the attention's rate, or 0 when that is less.
func cpuCosts(t0, t1 time.Duration, p0, p1 int, kvPerPos, blockBytes int64, cpuRate float64) (time.Duration, float64) {
	var attention float64
	if p1 > p0 && t1 > t0 {
		attention = float64(kvPerPos) * float64(p1-p0) / (t1 - t0).Seconds()
	}
	at := attention
	if at <= 0 {
		at = cpuRate
	}
	return max(blockFixed(t0, int64(p0)*kvPerPos, blockBytes, cpuRate, at), 0), attention
}

// calibrateDevice measures r.DeviceStage on gpu: a decoder block of cfg's
// shape (block's tensors, block 0's names) in gpu's memory,
// its KV cache of dtype kv, computed for one token at a few positions as
// a stage of a hybrid decode computes it between two hand-overs: the
// hidden state's upload, the block's launches, the wait for the device's
// queue (nn.BlockTimer.Step). A stage's fixed cost is a step less the
// block's bytes at r.Device and one hand-over (r.Handoff: the simulator
// counts the hand-overs apart); the median of calibrateMinReps to
// calibrateMaxReps steps, within calibrateBudget/4. The block's values
// are those of host's tensors of the same names where it has them (a
// filled copy in pinned host memory uploads faster), else random. A block
// the device has no room for (tensor.ErrOutOfMemory) leaves r as it is,
// as does a sparse block; r.Device must be set.
func calibrateDevice(ctx context.Context, gpu tensor.Backend, cfg *arch.Config, block []paging.TensorSpec, kv tensor.DType, r *paging.Rates, sw stopwatch, host nn.LayerWeights) error {
	if r.Device <= 0 {
		return fmt.Errorf("engine: calibrating the device: %w: the device rate is %v", paging.ErrBadRates, r.Device)
	}
	if cfg.Sparse(0) {
		return nil
	}
	if kv == tensor.Invalid {
		kv = tensor.F32
	}
	var owned []*tensor.Tensor
	defer func() {
		for _, t := range owned {
			gpu.Free(t)
		}
		if ca, ok := tensor.Caching(gpu); ok {
			ca.Trim()
		}
	}()
	lw := nn.LayerWeights{}
	var blockBytes int64
	for _, ts := range block {
		t, err := gpu.Alloc(ts.DType, ts.Shape)
		if errors.Is(err, tensor.ErrOutOfMemory) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("engine: calibrating the device: %w", err)
		}
		owned = append(owned, t)
		var b []byte
		if h := host[ts.Name]; h != nil && h.OnHost() && int64(len(h.Bytes())) == t.NumBytes() { // not one freed since
			b = h.Bytes()
		} else {
			b = make([]byte, t.NumBytes())
			fillRandom(b, ts.DType)
		}
		if err := gpu.Upload(t, 0, b); err != nil {
			return fmt.Errorf("engine: calibrating the device: %w", err)
		}
		lw[ts.Name] = t
		blockBytes += ts.Bytes
	}
	pos := min(calibrateShortPos, max(cfg.ContextLength()-1, 0))
	bt, err := nn.NewBlockTimer(ctx, cfg, gpu, []nn.LayerWeights{lw}, 0, pos, nn.SessionOptions{KVDType: kv})
	if errors.Is(err, tensor.ErrOutOfMemory) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("engine: calibrating the device: %w", err)
	}
	defer bt.Close()
	begin := sw.start()
	bytesTime := time.Duration(float64(blockBytes) / r.Device * 1e9)
	var ds []time.Duration
	for len(ds) < calibrateMinReps || len(ds) < calibrateMaxReps && sw.elapsed(begin) < calibrateBudget/4 {
		d, err := sw.run("device block", func() error { return bt.Step(ctx) })
		if err != nil {
			return fmt.Errorf("engine: calibrating the device: %w", err)
		}
		ds = append(ds, d-bytesTime-r.Handoff)
	}
	r.DeviceStageSpread = paging.SpreadOf(ds)
	r.DeviceStage = max(r.DeviceStageSpread.Median, 0)
	return ctx.Err()
}
