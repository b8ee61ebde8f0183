package paging

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// KVPlacement says where the planner puts the KV cache of each decoder
// block: in device memory, or in host memory, where the CPU attends over
// it in decode and a prefill chunk uploads it into a device scratch.
type KVPlacement string

// The KV placements.
const (
	// KVAuto keeps every block's KV cache on the device while the plan
	// fits with it (the weights streaming through at least a one-layer
	// ring), and moves the fewest blocks' caches to host memory that
	// make it fit. With rates (WithKVRates) it instead picks the count
	// with the least predicted decode time: see PlanResult.KVPredicted.
	KVAuto KVPlacement = "auto"
	// KVDevice keeps every block's KV cache on the device; a budget that
	// cannot hold it is refused.
	KVDevice KVPlacement = "device"
	// KVHost keeps every block's KV cache in host memory.
	KVHost KVPlacement = "host"
)

// ParseKVPlacement parses auto, device or host; "" is KVDevice.
func ParseKVPlacement(s string) (KVPlacement, error) {
	switch p := KVPlacement(strings.ToLower(strings.TrimSpace(s))); p {
	case "":
		return KVDevice, nil
	case KVAuto, KVDevice, KVHost:
		return p, nil
	}
	return "", fmt.Errorf("paging: unknown KV cache placement %q (want auto, device or host)", s)
}

// KVScratchBuffers is how many blocks' worth of device KV cache a plan
// with host KV sets aside: a prefill chunk attends on the device over a
// copy of a host block's cache, and two scratch buffers alternate so that
// the next host block's rows upload while this one computes.
const KVScratchBuffers = 2

// WithKVPlacement places the KV cache (default KVDevice).
func WithKVPlacement(p KVPlacement) PlanOption { return func(o *planOptions) { o.kv = p } }

// WithKVRates gives KVAuto the rates to predict decode with: it then
// compares, for each count of blocks with host KV, the time a token
// streams the weights that do not fit (StreamedBytes / H2D) plus the time
// the CPU attends over the host blocks at a full context (their KV bytes
// / CPU rate, and two hand-overs each), and keeps the least.
func WithKVRates(r Rates) PlanOption { return func(o *planOptions) { o.kvRates = &r } }

// hostKVBlocks is the decoder blocks whose KV cache is in host memory
// when n of them are: the last n.
func hostKVBlocks(numLayers, n int) []int {
	out := []int{}
	for i := numLayers - n; i < numLayers; i++ {
		out = append(out, i)
	}
	return out
}

// kvDeviceBlocks is how many blocks' KV cache the device holds when n of
// numLayers are in host memory: the others, and the scratch.
func kvDeviceBlocks(numLayers, n int) int {
	return numLayers - n + min(n, KVScratchBuffers)
}

// planKV plans with the KV cache placed as o.kv says.
func planKV(model ModelInfo, budget int64, strategy Strategy, contextLen, batch int, o planOptions, run func(planOptions) (*PlanResult, error)) (*PlanResult, error) {
	at := func(n int) (*PlanResult, error) {
		o := o
		o.hostKV = n
		return run(o)
	}
	L := model.NumLayers
	switch o.kv {
	case "", KVDevice:
		return at(0)
	case KVHost:
		return at(L)
	case KVAuto:
	default:
		return nil, fmt.Errorf("paging: plan: unknown KV cache placement %q (want auto, device or host)", o.kv)
	}
	if o.kvRates != nil {
		return planKVPredicted(model, contextLen, batch, o, at)
	}
	p, err := at(0)
	if err == nil || !errors.Is(err, ErrBudgetTooSmall) || L == 0 {
		return p, err
	}
	if _, err := at(L); err != nil {
		return nil, err // not even with every block's KV on the host
	}
	// The fewest host blocks that fit: fitting is monotone in the count,
	// since each one more takes no more device memory.
	lo, hi := 0, L // at(lo) fails, at(hi) fits
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if _, err := at(mid); err == nil {
			hi = mid
		} else if errors.Is(err, ErrBudgetTooSmall) {
			lo = mid
		} else {
			return nil, err
		}
	}
	return at(hi)
}

// planKVPredicted is KVAuto with rates: every count of host blocks that
// fits, the least predicted decode time at a full context.
func planKVPredicted(model ModelInfo, contextLen, batch int, o planOptions, at func(int) (*PlanResult, error)) (*PlanResult, error) {
	r := *o.kvRates
	if err := r.check(true, true); err != nil {
		return nil, fmt.Errorf("paging: plan: KV placement: %w", err)
	}
	var best *PlanResult
	var firstErr error
	for n := 0; n <= model.NumLayers; n++ {
		p, err := at(n)
		if err != nil {
			if !errors.Is(err, ErrBudgetTooSmall) {
				return nil, err
			}
			if firstErr == nil || n == model.NumLayers {
				firstErr = err
			}
			continue
		}
		p.KVPredicted = predictKV(p, r)
		if best == nil || p.KVPredicted < best.KVPredicted {
			best = p
		}
	}
	if best == nil {
		return nil, firstErr
	}
	return best, nil
}

// predictKV is a decoded token's time at a full context for the plan's
// streamed weights and host KV: the copies at the shared H2D rate, plus
// the CPU reading the host blocks' caches at its shared rate (its
// attention's, Rates.CPUAttention, when measured), plus two
// hand-overs (the query down, the output up) per host block. The CPU's
// attention waits for nothing the copies do, so this bounds the time from
// above: the copy engine keeps streaming while the CPU attends.
func predictKV(p *PlanResult, r Rates) time.Duration {
	h2d := r.H2DShared
	if h2d == 0 {
		h2d = r.H2D
	}
	s := float64(p.StreamedBytes) / h2d
	if n := len(p.KVHostBlocks); n > 0 {
		s += float64(p.KVHostBytes)/r.cpuAttention(true) + float64(2*n)*r.Handoff.Seconds()
	}
	return time.Duration(s * 1e9)
}

// KVUploadMaxPos is the longest context at which a decode step of a block
// whose KV cache is in host memory is predicted faster uploading the
// cache's rows to the device and attending there than attending on the
// CPU: rowBytes per position (keys and values) cross the link at the
// shared H2D rate instead of being read by the CPU at its shared rate and
// paying two hand-overs (the query down, the output up). Uploading wins
// at short contexts, where the hand-overs dominate; with a CPU no faster
// than the link it always wins (math.MaxInt); 0 when it never does. It
// compares with the CPU's product rate, not its attention's
// (Rates.CPUAttention), which is slower: with it the uploads would win at
// every context on the H200 host, a change of what decode runs that
// PlanHybrid's prediction (attention on the CPU) does not model yet.
func KVUploadMaxPos(r Rates, rowBytes int64) int {
	h2d, cpu := r.H2DShared, r.CPUShared
	if h2d == 0 {
		h2d = r.H2D
	}
	if cpu == 0 {
		cpu = r.CPU
	}
	if h2d <= 0 || rowBytes <= 0 {
		return 0
	}
	if cpu <= 0 || cpu <= h2d {
		return math.MaxInt
	}
	perPos := float64(rowBytes) * (1/h2d - 1/cpu) // seconds more per position uploaded
	return int(2 * r.Handoff.Seconds() / perPos)
}
