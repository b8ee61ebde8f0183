package paging

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/strata-llm/strata/tensor"
)

// ExpertCPUPolicy says when an expert missing from the expert cache is
// computed on the CPU from host memory instead of uploaded to the device
// (ExpertsOnCPU, HostExpert).
type ExpertCPUPolicy string

// The policies of ExpertsOnCPU.
const (
	// ExpertCPUAuto computes on the CPU those of a layer's missing
	// experts whose product there the rates (Options.Rates) predict ends
	// before their upload would (SplitMisses): in decode (one token an
	// expert) all of them where the CPU reads host memory faster than the
	// link copies it, none where it is slower (the H200's host); in a
	// long prefill (many tokens for each expert, whose arithmetic the CPU
	// is slow at) few or none. Without rates it never does.
	ExpertCPUAuto ExpertCPUPolicy = "auto"
	// ExpertCPUNever uploads every missing expert.
	ExpertCPUNever ExpertCPUPolicy = "never"
	// ExpertCPUAlways computes every missing expert on the CPU.
	ExpertCPUAlways ExpertCPUPolicy = "always"
)

// ParseExpertCPUPolicy accepts "auto", "never" and "always",
// case-insensitive; empty is ExpertCPUAuto.
func ParseExpertCPUPolicy(s string) (ExpertCPUPolicy, error) {
	switch p := ExpertCPUPolicy(strings.ToLower(strings.TrimSpace(s))); p {
	case "":
		return ExpertCPUAuto, nil
	case ExpertCPUAuto, ExpertCPUNever, ExpertCPUAlways:
		return p, nil
	}
	return "", fmt.Errorf("paging: unknown policy %q for experts on the CPU (want auto, never or always)", s)
}

// ExpertCPUServer is an ExpertServer that can hand a missing expert's
// weights in host memory to the CPU instead of uploading it (a Pager).
type ExpertCPUServer interface {
	// ExpertsOnCPU chooses which of the layer's experts that a chunk
	// chose (experts, expert i chosen by tokens[i] of its tokens) are
	// computed on the CPU, setting onCPU[i]: some of those neither in the
	// expert cache nor on their way there, as the policy says.
	ExpertsOnCPU(layer int, experts, tokens []int, onCPU []bool)
	// HostExpert returns the expert's tensors in host memory by name,
	// for tokens tokens: its host copy, read from the source when the
	// host cache has none (and kept there when it has room). The
	// tensors stay valid until release is called.
	HostExpert(ctx context.Context, layer, expert, tokens int) (ts map[string]*tensor.Tensor, release func(), err error)
}

var _ ExpertCPUServer = (*Pager)(nil)

// ExpertMiss is one of a layer's experts that a chunk chose and the
// expert cache lacks: its weight bytes, and the tokens that chose it.
type ExpertMiss struct {
	Bytes  int64
	Tokens int
}

// expertCPU is the CPU's product of an expert of bytes weight bytes for
// tokens rows at the CPU rate cpu: the weights read once from host memory
// with the first row's arithmetic (bytes/cpu, one row's product as the CPU
// rate is measured), then the other rows' arithmetic, (tokens-1)·bytes/
// CPURows, added rather than overlapped: CPURows is measured over weights
// the caches hold, and on the H200 the CPU took a prefill chunk's experts
// (8 tokens each) several times slower than the longer of the two
// predicted. Without CPURows each row counts as a read of the weights
// (the rows' arithmetic unknown, the bound of a row at a time).
func (r Rates) expertCPU(bytes int64, tokens int, cpu float64) float64 {
	t := float64(max(tokens, 1))
	if r.CPURows <= 0 {
		return t * float64(bytes) / cpu
	}
	return float64(bytes)/cpu + (t-1)*float64(bytes)/r.CPURows
}

func durationOf(x float64) time.Duration { return time.Duration(x * float64(time.Second)) }

// SplitMisses chooses which of a layer's missing experts the CPU computes
// instead of uploading them, so that the layer's experts are done soonest,
// and sets onCPU[i] for misses[i]. With k of them on the CPU, the CPU's
// path is the hand-over of the chunk's rows down (Rates.Handoff), then
// the k products (expertCPU; several at once at Rates.CPUExperts when k
// is 2 or more, slowed as beside copies when the link uploads others:
// cpuExperts), each output handed up (Rates.Handoff); the link's is the
// other uploads one after another,
// each path at its shared rate (H2DShared, CPUShared) when both have
// work. The layer is charged the two paths' sum, not the longer of them:
// on the H200 (the Qwen3-30B-A3B shape at 8 GiB, 114 of 229 misses a
// token on the CPU) a split whose two paths were to run side by side made
// decode slower than uploading every miss, the CPU's products running
// mostly in series with the copies. So an expert goes to the CPU only
// when its product and hand-over there are shorter than its upload:
// SplitMisses tries the misses in order of their CPU time over their
// upload time (the fewest tokens first) and keeps the k whose sum is
// shortest, the smallest such k (none on the CPU when it gains nothing),
// never more than uploading them all. cpu and link are the two paths'
// predicted times. Without the CPU's or the link's rate it puts nothing
// on the CPU and ok is false.
func SplitMisses(r Rates, misses []ExpertMiss, onCPU []bool) (cpu, link time.Duration, ok bool) {
	clear(onCPU[:len(misses)])
	if r.CPU <= 0 || r.H2D <= 0 {
		for _, m := range misses {
			if r.H2D > 0 {
				link += durationOf(float64(m.Bytes) / r.H2D)
			}
		}
		return 0, link, false
	}
	n := len(misses)
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	ratio := func(m ExpertMiss) float64 {
		return r.expertCPU(m.Bytes, m.Tokens, r.CPU) * r.H2D / float64(max(m.Bytes, 1))
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(ratio(misses[a]), ratio(misses[b])) })
	// times returns the two paths' times with the first k of order on
	// the CPU.
	times := func(k int) (cpu, link float64) {
		both := k > 0 && k < n
		cr, lr := r.cpuExperts(k, both), r.h2d(both)
		for j, i := range order {
			m := misses[i]
			if j < k {
				cpu += r.expertCPU(m.Bytes, m.Tokens, cr) + r.Handoff.Seconds()
			} else {
				link += float64(m.Bytes) / lr
			}
		}
		if k > 0 {
			cpu += r.Handoff.Seconds() // the rows down
		}
		return cpu, link
	}
	charge := func(c, l float64) float64 { return c + l }
	if splitParallel {
		charge = math.Max
	}
	best := 0
	bc, bl := times(0)
	for k := 1; k <= n; k++ {
		c, l := times(k)
		if charge(c, l) < charge(bc, bl) {
			best, bc, bl = k, c, l
		}
	}
	for _, i := range order[:best] {
		onCPU[i] = true
	}
	return durationOf(bc), durationOf(bl), true
}

// SplitEnv names the environment variable that, set to "parallel", has
// SplitMisses charge a layer the longer of its two paths (the CPU's
// products and the link's uploads side by side) rather than their sum, to
// measure which of the two a device holds to. The sum held again on the
// H200 once the hand-over was mended (session 6, the Qwen3-30B-A3B shape
// at 8 GiB, same run): charged side by side, 165 of 349 misses a token
// went to the CPU and decode ran at 12.72 tok/s, against 13.78 with every
// miss on the CPU (the sum's choice there).
const SplitEnv = "STRATA_EXPERTS_SPLIT"

var splitParallel = os.Getenv(SplitEnv) == "parallel"

// cpuExperts is the CPU's rate over k experts' products, computed
// several at once when k is 2 or more (CPUExperts), while a copy runs or
// not (one product's rate). Several at once beside the block's uploads
// count at CPUExperts slowed by CPUShared/CPU; when the CPU takes all of
// a block's misses nothing of the block uploads, and the next block's
// prefetches skip the experts last computed on the CPU, so they count at
// CPUExperts: on the H200 (Qwen3-30B-A3B shape at 8 GiB, host CPU 83.3
// GB/s, CPUExperts 64.2, link 54.6) every expert on the CPU decoded at
// 13.13 tok/s where uploading every miss made 10.99 (issue #16), while
// the slowed rate (51.2) kept every miss on the link. Never below the
// rate of one product at a time.
func (r Rates) cpuExperts(k int, copyBusy bool) float64 {
	one := r.cpu(copyBusy)
	if k < 2 || r.CPUExperts <= 0 || r.CPU <= 0 {
		return one
	}
	if !copyBusy {
		return max(one, r.CPUExperts)
	}
	return max(one, r.CPUExperts*r.cpu(true)/r.CPU)
}

// ExpertsOnCPU chooses which of the layer's experts a chunk chose
// (experts, each chosen by tokens[i] of its tokens) are computed on the
// CPU, setting onCPU[i]: never one cached or loading, nor any without an
// expert cache for the layer or out of range; of the others, as
// Options.ExpertsCPU says: all (always), none (never), or for
// ExpertCPUAuto those SplitMisses puts on the CPU with the pager's rates,
// whose products there end before their uploads would (none without
// rates), the least used of alike misses on
// the CPU (their uses counted as an acquire's, HostExpert) so that those
// used most are uploaded and cached.
func (p *Pager) ExpertsOnCPU(layer int, experts, tokens []int, onCPU []bool) {
	clear(onCPU[:len(experts)])
	if !p.PagesExperts(layer) || p.expertsCPU == ExpertCPUNever || p.expertsCPU == "" {
		return
	}
	all := p.ex.layers[layer]
	missing := make([]int, 0, len(experts))
	count := make([]float64, len(experts))
	p.mu.Lock()
	for i, x := range experts {
		if x >= 0 && x < len(all) && !all[x].loaded && !all[x].loading {
			missing = append(missing, i)
			count[i] = p.ex.agedCount(all[x])
		}
	}
	p.mu.Unlock()
	// The coldest first: among misses alike, SplitMisses puts the first
	// on the CPU, and the link brings the ones used most into the cache.
	slices.SortStableFunc(missing, func(a, b int) int { return cmp.Compare(count[a], count[b]) })
	switch {
	case len(missing) == 0:
		return
	case p.expertsCPU == ExpertCPUAlways:
		for _, i := range missing {
			onCPU[i] = true
		}
		return
	case p.rates == nil:
		return
	}
	misses := make([]ExpertMiss, len(missing))
	for j, i := range missing {
		misses[j] = ExpertMiss{Bytes: all[experts[i]].bytes, Tokens: tokens[i]}
	}
	split := make([]bool, len(misses))
	SplitMisses(*p.rates, misses, split)
	for j, i := range missing {
		onCPU[i] = split[j]
	}
}

// HostExpert returns the tensors of the layer's expert in host memory, for
// the CPU to compute with (ExpertsOnCPU), counting it in Stats.ExpertsOnCPU
// and its tokens in ExpertCPUTokens, and as a use of the expert (LFU's
// count, which ExpertsOnCPU orders by); PrefetchExperts leaves it to the
// CPU until an acquire. The tensors are its host copy when
// the host cache holds one; else it is read from the source, into a host
// copy the host cache keeps when it has room (pinned where the device
// has pinned memory, as a load would keep it), or into a buffer of its
// own that release lets go. The host copy stays until the pager closes.
// On error nothing is kept and nothing counted.
func (p *Pager) HostExpert(ctx context.Context, layer, expert, tokens int) (map[string]*tensor.Tensor, func(), error) {
	es, err := p.expertEntries("compute on the CPU", layer, []int{expert})
	if err != nil {
		return nil, nil, err
	}
	e := es[0]
	fail := func(err error) error {
		return fmt.Errorf("paging: expert %d of layer %d on the CPU: %w", expert, layer, err)
	}
	if ts, err := p.mappedHostExpert(e, tokens); ts != nil || err != nil {
		if err != nil {
			return nil, nil, fail(err)
		}
		return ts, func() {}, nil
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, nil, fail(errClosed)
	}
	buf := e.host
	admitted := false
	if buf == nil && p.hostUsed+p.hostReserved+e.hostSize <= p.hostCap {
		p.hostUsed += e.hostSize // given back if the read fails
		admitted = true
	}
	p.inflight++ // Close waits for the read
	p.mu.Unlock()
	done := func() {
		p.mu.Lock()
		p.inflight--
		p.changedLocked()
		p.mu.Unlock()
	}
	var read int64
	pinned, fromArena := false, false
	// drop gives back a buffer read here that the host cache does not
	// keep (an arena's piece stays with the arena until Close).
	drop := func() {
		if !admitted {
			return
		}
		p.expertHostFree(buf, pinned, fromArena)
		p.mu.Lock()
		p.hostUsed -= e.hostSize
		p.mu.Unlock()
	}
	if buf == nil {
		switch {
		case admitted:
			// Pinned where the device has it, as a load would keep it: the
			// expert may be uploaded from this copy later.
			buf, pinned, fromArena = p.expertHostAlloc(e.hostSize)
		default:
			buf = make([]byte, e.hostSize)
		}
		for k, s := range e.specs {
			err := ctx.Err()
			if err == nil {
				err = p.src.ReadTensor(ctx, e.layer, s.Name, buf[e.hostOffs[k]:e.hostOffs[k]+s.Bytes])
			}
			if err != nil {
				drop()
				done()
				return nil, nil, fail(fmt.Errorf("tensor %s: reading: %w", s.Name, err))
			}
			read += s.Bytes
		}
	}
	ts := make(map[string]*tensor.Tensor, len(e.specs))
	for k, s := range e.specs {
		t, err := tensor.FromBytes(s.DType, s.Shape, buf[e.hostOffs[k]:e.hostOffs[k]+s.Bytes])
		if err != nil {
			drop()
			done()
			return nil, nil, fail(err)
		}
		ts[s.Name] = t
	}
	p.mu.Lock()
	release := func() {}
	if admitted {
		if e.host == nil {
			e.host, e.hostPinned, e.hostArena = buf, pinned, fromArena // the host cache keeps it
			if pinned && !fromArena {
				p.pinnedBytes += int64(len(buf))
			}
		} else {
			// Another read kept its copy first: this one goes once the
			// caller is done with it.
			p.hostUsed -= e.hostSize
			if pinned && !fromArena {
				b := buf
				release = func() { _ = p.hostFree(b, true) }
			}
		}
	}
	p.st.BytesDiskToHost += read
	p.countOnCPULocked(e, tokens)
	p.mu.Unlock()
	done()
	return ts, release, nil
}

// countOnCPULocked counts expert e computed on the CPU for tokens tokens.
func (p *Pager) countOnCPULocked(e *expertEntry, tokens int) {
	p.ex.touchLocked(e) // a use, as an acquire counts it: ExpertsOnCPU uploads the most used
	e.onCPU = true      // not prefetched (PrefetchExperts) until acquired
	p.st.ExpertsOnCPU++
	p.st.ExpertCPUTokens += int64(tokens)
	p.st.ExpertCPUBytes += e.bytes
}

// mappedHostExpert returns e's tensors as views of the source's mapping,
// where the expert cache copies in place (mapExperts) and e has no host
// copy: the CPU reads them where they lie, with nothing read or kept. It
// returns nil tensors when e is not in place.
func (p *Pager) mappedHostExpert(e *expertEntry, tokens int) (map[string]*tensor.Tensor, error) {
	p.mu.Lock()
	closed, hosted := p.closed, e.host != nil
	p.mu.Unlock()
	if closed || hosted {
		return nil, nil
	}
	srcs, err := p.mappedExpert(e)
	if srcs == nil || err != nil {
		return nil, err
	}
	ts := make(map[string]*tensor.Tensor, len(e.specs))
	for k, s := range e.specs {
		t, err := tensor.FromBytes(s.DType, s.Shape, srcs[k])
		if err != nil {
			return nil, nil // not as the CPU takes it (alignment): read as any other
		}
		ts[s.Name] = t
	}
	p.mu.Lock()
	p.countOnCPULocked(e, tokens)
	p.mu.Unlock()
	return ts, nil
}
