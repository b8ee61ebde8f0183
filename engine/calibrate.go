package engine

import (
	"context"
	"fmt"
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
	calibrateSteps     = 4
)

// CalibrateCPU measures what the rates' bytes leave out of a decoder
// block computed on the CPU in decode, on a synthetic block of the model's
// shape (block's tensors, block 0's names, random values): the CPU's fixed
// cost for each block (r.CPULayer: its norms, rope, the worker pool's fork
// and join around each op, what the fused products gain or lose against
// the rate r.CPU measured over separate products) and the rate its
// attention reads a KV cache of dtype kv at (r.CPUAttention). It times the
// block with nn.TimeBlock over copies of it that together take at least
// cpuRateMinBytes (so that they are read from memory, as the model's
// blocks are), at a few positions and at up to maxPos (when the KV reads
// there weigh an eighth of the block's bytes at least); the fixed cost is
// the short time less the block's bytes at r.CPU and its few KV rows at
// the attention's rate, and the attention's rate the KV bytes between the
// two over the time between them. r.CPU must be set. A sparse block (a
// mixture of experts) is not timed: r is left as it is.
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
	if r.CPU <= 0 {
		return fmt.Errorf("engine: calibrating the CPU: %w: the CPU rate is %v", paging.ErrBadRates, r.CPU)
	}
	if cfg.Sparse(0) {
		return nil
	}
	if kv == tensor.Invalid {
		kv = tensor.F32
	}
	var blockBytes int64
	for _, ts := range block {
		blockBytes += ts.Bytes
	}
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
	for c := range copies {
		if copies[c] == nil {
			copies[c] = nn.LayerWeights{}
		}
		for _, ts := range block {
			if copies[c][ts.Name] != nil {
				continue
			}
			if len(ts.Shape) < 2 {
				if shared[ts.Name] == nil {
					t, err := alloc(ts)
					if err != nil {
						return err
					}
					shared[ts.Name] = t
				}
				copies[c][ts.Name] = shared[ts.Name]
				continue
			}
			t, err := alloc(ts)
			if err != nil {
				return err
			}
			copies[c][ts.Name] = t
		}
	}
	limit := min(maxPos, cfg.ContextLength()) - 1
	p0 := min(calibrateShortPos, max(limit, 0))
	p1 := min(calibrateLongPos, limit)
	kvPerPos := nn.KVCacheBytes(cfg, 1, kv) / int64(max(cfg.NumLayers, 1))
	// The attention's rate shows only over KV reads that weigh against
	// the block's bytes: an eighth of them at least.
	if int64(p1-p0)*kvPerPos < blockBytes/8 {
		p1 = p0
	}
	o := nn.SessionOptions{KVDType: kv}
	t0, err := nn.TimeBlock(ctx, cfg, cpu, copies, 0, p0, calibrateSteps, o)
	if err != nil {
		return fmt.Errorf("engine: calibrating the CPU: %w", err)
	}
	var t1 time.Duration
	if p1 > p0 {
		if t1, err = nn.TimeBlock(ctx, cfg, cpu, copies, 0, p1, calibrateSteps, o); err != nil {
			return fmt.Errorf("engine: calibrating the CPU: %w", err)
		}
	}
	r.CPULayer, r.CPUAttention = cpuCosts(t0, t1, p0, p1, kvPerPos, blockBytes, r.CPU)
	return ctx.Err()
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
	rest := t0.Seconds() - float64(blockBytes)/cpuRate - float64(kvPerPos)*float64(p0)/at
	if rest <= 0 {
		return 0, attention
	}
	return time.Duration(rest * 1e9), attention
}
